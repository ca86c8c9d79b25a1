"""(bias +) (residual +) LayerNorm as a thread-level CUDA kernel: one warp per row, the next row's loads in flight.

The scheduled TE form (:mod:`.layernorm`, ``registers`` 1) already keeps a row in registers, but each warp takes
one row: it loads, then waits through two shuffle reductions, the normalisation and the stores with nothing in
flight, and a block's warps leave together. Here each warp takes ``rows_per_warp`` rows in turn (row ``r``, then
``r + stride``, ...) and issues the loads of its next row as soon as the current one's sum ``y`` is in float32
registers, so its HBM requests stay in flight through the reductions and the stores of the row before.

Per row of ``n`` elements (``n`` a multiple of 256): each of the 32 lanes holds ``n / 256`` 16-byte chunks of
each input (chunk ``c`` of lane ``l`` is columns ``(c * 32 + l) * 8 ..``: a warp's 16-byte loads cover whole
512-byte lines), ``y = x + bias + residual`` in float32, the mean and then the sum of squared deviations from the
registers (two XOR-butterfly reductions; every lane ends with both), and 16-byte stores of the normalised row.
The float32 statistics are the TE form's, two passes over ``y`` held in registers. A warp whose row is past ``m``
skips it whole (rows are warp-uniform), so any row count works. ``gamma``, ``beta`` and ``bias`` are read 16 bytes
at a time where they are used: nvcc hoists those loads out of a warp's row loop into registers, or with ``reload``
(``ld.global.nc``, which it keeps in place) they are read again, from L1, for every row.
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .epilogue import LN_EPS

WARP = 32
VEC = 8                 # 16-bit elements per 16-byte access
CHUNK = WARP * VEC      # columns one warp covers per 16-byte access of each lane
MAX_CHUNKS = 6          # n / CHUNK above which the row (and the next one's loads) would crowd the registers
_FULL_MASK = 0xFFFFFFFF


def supports(n: int) -> bool:
    """Whether a row of ``n`` elements fits this kernel (a multiple of 256, at most ``MAX_CHUNKS`` chunks)."""
    return n % CHUNK == 0 and 0 < n // CHUNK <= MAX_CHUNKS


def grid(m: int, warps: int, rows_per_warp: int) -> int:
    """Thread blocks launched: enough for every row, ``warps * rows_per_warp`` rows each."""
    return -(-m // (warps * rows_per_warp))


def warp_layernorm_primfunc(m: int, n: int, dtype: str, *, bias: bool, residual: bool, warps: int,
                            rows_per_warp: int, warps_per_sm: int = 0, reload: bool = False,
                            eps: float = LN_EPS) -> tvm.tirx.PrimFunc:
    """The kernel's PrimFunc, parameters as :class:`.layernorm.LayerNormTemplate`'s: ``x [m, n]``, ``bias [n]``
    (``bias``), ``residual [m, n]`` (``residual``), ``gamma [n]``, ``beta [n]``, ``out [m, n]``.

    ``warps`` warps per thread block; ``rows_per_warp`` rows each warp takes in turn, ``stride`` = every warp of
    the grid apart (consecutive warps take consecutive rows, so a block's loads stay close together);
    ``warps_per_sm`` (0: no bound) the occupancy ``__launch_bounds__`` asks registers for; ``reload``: read the
    ``gamma`` / ``beta`` / ``bias`` chunks again for every row (``ld.global.nc``, which the compiler keeps in the
    loop) instead of letting it hoist them into registers for all of a warp's rows (~``3 n / 64`` registers)."""
    if not supports(n):
        raise ValueError(f"warp LayerNorm: n must be a multiple of {CHUNK} up to {MAX_CHUNKS * CHUNK}, got {n}")
    if warps < 1 or rows_per_warp < 1 or warps * WARP > 1024:
        raise ValueError(f"warp LayerNorm: bad warps {warps} / rows_per_warp {rows_per_warp}")
    chunks, blocks = n // CHUNK, grid(m, warps, rows_per_warp)
    min_blocks = warps_per_sm // warps   # __launch_bounds__' second figure where above 1
    stride = blocks * warps
    per_lane = chunks * VEC
    inv_n = 1.0 / n
    inputs = 2 if residual else 1
    load_words = T.ptx["ld.global.nc.v4.b32"]

    def shuffle(value, lane_mask):
        return T.tvm_warp_shuffle_xor(T.uint32(_FULL_MASK), value, lane_mask, WARP, WARP)

    def vector_value(vec, words, which, v):
        """Element ``v`` of the chunk of vector ``which`` (0 gamma or bias, 1 beta) loaded by :func:`load_vector`,
        as float32."""
        if not reload:
            return T.Cast("float32", vec[which, v])
        # little-endian words: element v is the low half of word v // 2 where v is even
        bits = T.shift_right(words[which, v // 2], T.Cast("uint32", 16 * (v % 2)))
        return T.Cast("float32", T.reinterpret(dtype, T.Cast("uint16", T.bitwise_and(bits, T.uint32(0xFFFF)))))

    @T.macro
    def load_vector(vec, words, which, src, col):
        """Columns ``col ..`` (16 bytes) of the vector ``src`` into slot ``which``."""
        if reload:
            load_words(words[which, 0], words[which, 1], words[which, 2], words[which, 3], T.address_of(src[col]))
        else:
            vec[which, T.ramp(0, 1, VEC)] = src[T.ramp(col, 1, VEC)]

    @T.macro
    def load_row(x, res, raw, row, lane):
        """The 16-byte chunks of row ``row`` of ``x`` (and ``residual``) into ``raw`` [inputs, per_lane]."""
        for c in T.unroll(chunks):
            col: T.let = (c * WARP + lane) * VEC
            raw[0, T.ramp(c * VEC, 1, VEC)] = x[row, T.ramp(col, 1, VEC)]
            if residual:
                raw[1, T.ramp(c * VEC, 1, VEC)] = res[row, T.ramp(col, 1, VEC)]

    def summed(raw, vec, words, i, v):
        """Element ``i`` of the lane's columns (``v`` within its chunk) of x (+ bias) (+ residual), float32."""
        value = T.Cast("float32", raw[0, i])
        if bias:
            value = value + vector_value(vec, words, 0, v)
        if residual:
            value = value + T.Cast("float32", raw[1, i])
        return value

    @T.macro
    def row_sum(raw, y, bias_buf, vec, words, lane):
        """``y`` = float32 x (+ bias) (+ residual) of the lane's columns."""
        for c in T.unroll(chunks):
            if bias:
                load_vector(vec, words, 0, bias_buf, (c * WARP + lane) * VEC)
            for v in T.unroll(VEC):
                y[c * VEC + v] = summed(raw, vec, words, c * VEC + v, v)

    @T.macro
    def normalise(y, stat, gamma, beta, out, vec, words, row, lane):
        """Mean, then the sum of squared deviations (both over the warp), then the normalised row stored 16
        bytes at a time."""
        stat[0] = T.float32(0)
        for i in T.unroll(per_lane):
            stat[0] = stat[0] + y[i]
        for s in T.unroll(5):
            stat[0] = stat[0] + shuffle(stat[0], 16 >> s)
        stat[0] = stat[0] * T.float32(inv_n)
        stat[1] = T.float32(0)
        for i in T.unroll(per_lane):
            stat[1] = stat[1] + (y[i] - stat[0]) * (y[i] - stat[0])
        for s in T.unroll(5):
            stat[1] = stat[1] + shuffle(stat[1], 16 >> s)
        stat[1] = T.rsqrt(stat[1] * T.float32(inv_n) + T.float32(eps))
        for c in T.unroll(chunks):
            col: T.let = (c * WARP + lane) * VEC
            load_vector(vec, words, 0, gamma, col)
            load_vector(vec, words, 1, beta, col)
            for v in T.unroll(VEC):
                vec[2, v] = T.Cast(dtype, (y[c * VEC + v] - stat[0]) * stat[1] * vector_value(vec, words, 0, v)
                                   + vector_value(vec, words, 1, v))
            out[row, T.ramp(col, 1, VEC)] = vec[2, T.ramp(0, 1, VEC)]

    @T.macro
    def body(x, bias_buf, res, gamma, beta, out):
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for lane in T.thread_binding(WARP, thread="threadIdx.x"):
                    if min_blocks > 1:
                        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", min_blocks)
                    raw = T.alloc_buffer((inputs, per_lane), dtype, scope="local")
                    y = T.alloc_buffer((per_lane,), "float32", scope="local")
                    stat = T.alloc_buffer((2,), "float32", scope="local")
                    vec = T.alloc_buffer((3, VEC), dtype, scope="local")   # gamma or bias / beta, output
                    words = T.alloc_buffer((2, 4), "uint32", scope="local")   # the same, ``reload``
                    first: T.let = bx * warps + ty
                    if first < m:
                        load_row(x, res, raw, first, lane)
                    for it in range(rows_per_warp):
                        row: T.let = first + it * stride
                        if row < m:
                            row_sum(raw, y, bias_buf, vec, words, lane)
                            if it + 1 < rows_per_warp and row + stride < m:
                                load_row(x, res, raw, row + stride, lane)
                            normalise(y, stat, gamma, beta, out, vec, words, row, lane)

    if bias and residual:
        @T.prim_func
        def main(x_h: T.handle, bias_h: T.handle, res_h: T.handle, gamma_h: T.handle, beta_h: T.handle,
                 out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "global_symbol": "main"})
            x = T.match_buffer(x_h, (m, n), dtype)
            bias_buf = T.match_buffer(bias_h, (n,), dtype)
            res = T.match_buffer(res_h, (m, n), dtype)
            gamma = T.match_buffer(gamma_h, (n,), dtype)
            beta = T.match_buffer(beta_h, (n,), dtype)
            out = T.match_buffer(out_h, (m, n), dtype)
            body(x, bias_buf, res, gamma, beta, out)
    elif not bias and not residual:
        @T.prim_func
        def main(x_h: T.handle, gamma_h: T.handle, beta_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "global_symbol": "main"})
            x = T.match_buffer(x_h, (m, n), dtype)
            gamma = T.match_buffer(gamma_h, (n,), dtype)
            beta = T.match_buffer(beta_h, (n,), dtype)
            out = T.match_buffer(out_h, (m, n), dtype)
            body(x, None, None, gamma, beta, out)
    else:
        raise ValueError("warp LayerNorm: bias and residual come together or not at all (the registered forms)")
    return main
