"""A relative-position score bias computed tile by tile from its two products, which are never written.

HF DeBERTa-v3 adds two terms to every layer's scores: ``c2p[n, i, t1(i, j)]``, a gather from the product
``c2p = Q K_pos^T`` ([N, S, K] for ``N = B * H`` and ``K`` relative positions), and ``p2c[n, j, t2(j, i)]``, a
gather from ``p2c = K Q_pos^T`` read transposed, each product rounded to 16 bits, cast up, divided by a scale and
summed (:mod:`stof_tvm.compiler.relative_bias_match` finds the form). Computed as the graph says, a layer writes
both products (50 MB each at 8 x 512 tokens) and then reads them back to write the [N, S, S] bias: on an H100 the
two product kernels and the bias kernel took 118 us of every layer's 262 (BENCHMARKS.md, session 29).

Every ``BM x BN`` tile of the bias reads the first product only at the tile's rows and at positions ``t1`` within a
short window (a relative position changes by one per row or column, so a tile's positions span at most
``BM + BN - 1`` of them), and the second only at the tile's columns, in a window of its own. This kernel computes
each tile's two windows of the products on tensor cores, keeps them in shared memory and gathers the tile from
them, so the products never reach global memory:

- a block of 4 warps owns one 64 x 64 tile of one ``n``; it copies the 64 query rows ``A1[n, i0:i0+64, :]`` and
  the ``WIN`` rows of the first position table ``W1[g, base1:base1+WIN, :]`` (``g = n % G``: the graph repeats the
  position projection over the batch) as one group of 16-byte ``cp.async``, the 64 key rows ``A2[n, j0:j0+64, :]``
  and the window of ``W2`` as a second, into chunk-swizzled rows (:func:`.mma.chunk_offset`), and each thread asks
  for its 16 words of ``offsets`` (below) while they land;
- each warp computes its 16 rows (a strip) of both products with ``ldmatrix`` + ``mma.sync.m16n8k16`` (float32
  accumulation over the head dim, as the graph's matmul) at only the ``strip_window`` positions those rows read
  (16 + 63 of them where every position is exact: 80 columns, not the tile's 128), the first while the second's
  operands land, and rounds them to 16-bit pairs as the graph's cast does; once every warp is done with the
  operands it stores them over the operands as two ``64 x strip_window`` 16-bit tables
  (:func:`table_row_words`: row strides free of bank conflicts for the stores and the reads below);
- each thread then forms outputs ``j0 + lane`` and ``j0 + lane + 32`` of 16 rows: their four strip offsets come as
  the four bytes of one word of ``offsets`` (a constant table built with ``bases``: each tile's window start and
  its strips' starts in it), and ``float32(P1[i, l1]) / scale1 + float32(P2[j, l2]) / scale2`` is rounded to the
  output's dtype: the graph's own arithmetic on the same 16-bit products, so the tile equals the graph's bias up to
  the products' float32 summation order.

A tile that the attention reading the bias never visits is not computed: ``visited`` (built once a forward from the
runtime mask's tiled format by :func:`visited_tiles_primfunc`) marks the tiles to compute; at DeBERTa-v3-base's 8 x
512 tokens with BigBird that is 34 of 64.

Per tile the kernel computes ``2 * 64 * strip_window * D * 2`` FLOPs (2.5 times the products' own at 8 x 512) and
moves 48 KB from L2, but writes only the bias. Its bound is shared memory traffic (ncu on an H100, session 31: the
L1/shared pipe 90% busy with tiles of 128 columns): each warp reads its window of W from shared memory, and the
strips cut those reads, the mma work and the table stores by 37%. :func:`relative_bias_reference` computes the same
function from the same inputs with plain loops (the CPU twin, also the llvm kernel).
"""
from __future__ import annotations

import tvm
from tvm import te
from tvm.script import tirx as T

from .mma import (CP_ASYNC_16, LDMATRIX_X4, a_fragment_offset, b_fragments_offset, chunk_offset, chunk_stride,
                  mma_m16n8k16, pack_f32x2)

__all__ = ["TILE", "STRIP", "WARPS", "MAX_WINDOW", "THREADS", "window_size", "fits", "table_row_words",
           "relative_bias_primfunc", "visited_tiles_primfunc", "relative_bias_reference"]

TILE = 64                    # rows and columns of a block's output tile
MAX_WINDOW = 128             # product columns a tile may read (a byte of `offsets` each; 2 * TILE covers any
                             # relative position, whose span over a tile is 2 * TILE - 1)
WARPS = 4                    # each 16 rows of both products and of the output
STRIP = TILE // WARPS        # a warp's rows of a product: its m16 tile
THREADS = 32 * WARPS
VIEW_ALIGN = 8               # A1 and A2 may be views starting at any multiple of 8 elements (the QKV projection's
                             # Q and K parts): 16 bytes, the copies' width
BLOCKS_PER_SM = 4            # launch bounds: at most 128 registers a thread, 4 x 48 KB of shared memory


def window_size(positions: int) -> int:
    """Product columns each tile copies: :data:`MAX_WINDOW`, or every position where there are fewer."""
    return min(MAX_WINDOW, positions)


def fits(seq: int, positions: int, head_dim: int, strip_window: int | None = None) -> bool:
    """Whether the kernel takes ``seq`` x ``seq`` outputs from products over ``head_dim`` with ``positions``
    relative positions (and, where given, strips of ``strip_window`` product columns): whole tiles, a reduction of
    16 to 64 in steps of 16, a window of whole n16 steps whose rows the block copies in whole rounds."""
    window = window_size(positions)
    strip_ok = strip_window is None or (strip_window % 16 == 0 and 16 <= strip_window <= window)
    return (seq % TILE == 0 and head_dim % 16 == 0 and 16 <= head_dim <= 64 and window % 16 == 0
            and window * (head_dim // 8) % THREADS == 0 and strip_ok)


def table_row_words(strip_window: int, transposed: bool) -> int:
    """32-bit words between rows of a product table in shared memory (``strip_window`` 16-bit columns, padded).

    A warp stores its m16n8 fragments as pairs: lanes ``4 r + c`` write word ``c`` of row ``r`` (r < 8), so a row
    stride of 4 (mod 8) words puts the 32 stores in 32 banks. The first term is read a row at a time (one row,
    neighbouring words: no conflict whatever the stride), so it takes that stride. The second is read a column at a
    time (lane ``l`` at row ``l``), which needs an odd stride (rows one bank apart); it takes the least odd one."""
    words = strip_window // 2
    if transposed:
        return words + 1 if words % 2 == 0 else words
    return words + (4 - words % 8) % 8


def _decode(word, which: int, half):
    """Byte ``which * 2 + half`` of ``word``: the offset in its strip of term ``which`` (0: first, 1: second) for
    output ``lane + 32 * half`` of a thread's row."""
    return T.Cast("int32", T.bitwise_and(T.shift_right(word, T.Cast("uint32", 16 * which + 8 * half)),
                                         T.uint32(255)))


def relative_bias_primfunc(*, batch: int, seq: int, positions: int, head_dim: int, groups: int, strip_window: int,
                           scales: tuple[float, float], dtype: str = "float16", out_dtype: str = "float16",
                           visits: tuple[int, int, int] | None = None) -> tvm.tirx.PrimFunc:
    """The CUDA PrimFunc ``(A1[batch, seq, D], W1[groups, positions, D], A2[batch, seq, D], W2[groups, positions,
    D], offsets[seq, seq / 2] uint32, bases[seq / 64, seq / 64, 2, 1 + WARPS] int32, visited[G, seq / 64, seq / 64]
    int32, out[batch, seq, seq])``
    computing ``out[n, i, j] = round(float32(round16(A1[n, i] . W1[g, p1])) / scales[0]
    + float32(round16(A2[n, j] . W2[g, p2])) / scales[1])`` with ``g = n % groups`` and each term's position
    ``p = bases[ti, tj, term, 0] + bases[ti, tj, term, 1 + strip] + offset``: the tile's window, the strip's start
    in it (the strip of ``i`` for the first term, of ``j`` for the second) and the output's byte of ``offsets``
    (module docstring; :func:`offset_words` in the matcher builds both).

    The input after ``bases``, ``visited[G, seq / 64, seq / 64] int32``, says which tiles to compute: a tile whose
    entry is 0 is not computed (the attention that reads the bias never visits it) and its outputs are left as they
    were. Without ``visits`` it is one all-ones map (``G = 1``); ``visits = (heads, mask_batch, mask_heads)`` reads
    the attention mask's map (:func:`visited_tiles_primfunc`, ``G = mask_batch * mask_heads``), row ``n`` being batch
    ``n // heads``, head ``n % heads``, mask group ``(batch if mask_batch > 1) * mask_heads + (head if mask_heads >
    1)``."""
    if not fits(seq, positions, head_dim, strip_window):
        raise ValueError(f"relative_bias: seq must be a multiple of {TILE}, head_dim a multiple of 16 from 16 to 64, "
                         f"the windows multiples of 16 the block copies whole; got seq {seq}, head_dim {head_dim}, "
                         f"{positions} positions, strips of {strip_window}")
    if batch % groups:
        raise ValueError(f"relative_bias: the position tables' {groups} groups must divide the batch {batch}")
    window = window_size(positions)
    cpr = head_dim // 8                          # 16-byte chunks of an operand row
    row_bytes = chunk_stride(cpr) * 16
    a_bytes, w_bytes = TILE * row_bytes, window * row_bytes
    row_words = [table_row_words(strip_window, transposed) for transposed in (False, True)]
    second_table = TILE * row_words[0]           # word where the second term's table starts
    smem_words = max(2 * (a_bytes + w_bytes) // 4, second_table + TILE * row_words[1])
    a_iters, w_iters = TILE * cpr // THREADS, window * cpr // THREADS
    nt8 = strip_window // 8                      # n8 fragments of a warp's strip
    k_steps = head_dim // 16
    tiles = seq // TILE
    scale1, scale2 = (float(s) for s in scales)
    mma, pack = mma_m16n8k16(dtype), pack_f32x2(dtype)

    heads, mask_batch, mask_heads = visits if visits is not None else (1, 1, 1)
    if batch % heads:
        raise ValueError(f"relative_bias: heads {heads} must divide the batch {batch}")
    mask_groups = mask_batch * mask_heads

    def mask_group(n):
        head_part = n % heads if mask_heads > 1 else 0
        return (n // heads if mask_batch > 1 else 0) * mask_heads + head_part

    @T.macro
    def copy_rows(src, lead, row0, iters, dst, tx):
        # cp.async of rows [row0, row0 + iters * THREADS / cpr) of src[lead] into chunk-swizzled rows at dst
        for it in T.unroll(iters):
            r: T.let = (it * THREADS + tx) // cpr
            c: T.let = (it * THREADS + tx) % cpr
            CP_ASYNC_16(dst + T.Cast("uint32", chunk_offset(r, c, cpr)), T.address_of(src[lead, row0 + r, c * 8]), 16,
                        T.uint32(16))

    @T.prim_func(private=True)
    def main(a1_handle: T.handle, w1_handle: T.handle, a2_handle: T.handle, w2_handle: T.handle,
             offsets_handle: T.handle, bases_handle: T.handle, visited_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.noalias": True})
        A1 = T.match_buffer(a1_handle, (batch, seq, head_dim), dtype, offset_factor=VIEW_ALIGN)
        W1 = T.match_buffer(w1_handle, (groups, positions, head_dim), dtype)
        A2 = T.match_buffer(a2_handle, (batch, seq, head_dim), dtype, offset_factor=VIEW_ALIGN)
        W2 = T.match_buffer(w2_handle, (groups, positions, head_dim), dtype)
        offsets = T.match_buffer(offsets_handle, (seq, seq // 2), "uint32")
        bases = T.match_buffer(bases_handle, (tiles, tiles, 2, 1 + WARPS), "int32")
        visited = T.match_buffer(visited_handle, (mask_groups, tiles, tiles), "int32")
        out = T.match_buffer(out_handle, (batch, seq, seq), out_dtype)
        for tj in T.thread_binding(tiles, thread="blockIdx.x"):
            for ti in T.thread_binding(tiles, thread="blockIdx.y"):
                for n in T.thread_binding(batch, thread="blockIdx.z"):
                    for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", BLOCKS_PER_SM)
                        smem = T.alloc_buffer((smem_words,), "uint32", scope="shared.dyn")
                        a_frag = T.alloc_buffer((4,), "uint32", scope="local")
                        b_frag = T.alloc_buffer((4,), "uint32", scope="local")
                        acc = T.alloc_buffer((nt8 * 4,), "float32", scope="local")
                        packed = T.alloc_buffer((2, nt8 * 2), "uint32", scope="local")
                        words = T.alloc_buffer((STRIP,), "uint32", scope="local")
                        warp: T.let = tx // 32
                        lane: T.let = tx % 32
                        g: T.let = n % groups
                        base1: T.let = bases[ti, tj, 0, 0]
                        base2: T.let = bases[ti, tj, 1, 0]
                        s_base: T.let = T.cuda.cvta_generic_to_shared(T.address_of(smem[0]))
                        if visited[mask_group(n), ti, tj] != 0:      # else the attention never reads the tile
                            # operands: A1 tile and W1 window (one copy group), A2 tile and W2 window (a second), so
                            # that the first product runs while the second's operands land
                            copy_rows(A1, n, ti * TILE, a_iters, s_base, tx)
                            copy_rows(W1, g, base1, w_iters, s_base + T.uint32(a_bytes), tx)
                            T.ptx.cp.async_.commit_group()
                            copy_rows(A2, n, tj * TILE, a_iters, s_base + T.uint32(a_bytes + w_bytes), tx)
                            copy_rows(W2, g, base2, w_iters, s_base + T.uint32(2 * a_bytes + w_bytes), tx)
                            T.ptx.cp.async_.commit_group()
                            # the gather's offset words, asked for now so that they arrive under the copies
                            for rr in T.unroll(STRIP):
                                words[rr] = offsets[ti * TILE + warp * STRIP + rr, tj * (TILE // 2) + lane]
                            # each warp: its 16 rows of a product, at the strip_window columns its rows read
                            for term in T.unroll(2):
                                T.ptx.cp.async_.wait_group(1 - term)
                                T.tvm_storage_sync("shared")
                                a_base: T.let = s_base + T.Cast("uint32", term * (a_bytes + w_bytes))
                                w_base: T.let = a_base + T.uint32(a_bytes)
                                strip: T.let = bases[ti, tj, term, 1 + warp]
                                for e in T.unroll(nt8 * 4):
                                    acc[e] = T.float32(0)
                                for kk in T.unroll(k_steps):
                                    LDMATRIX_X4(a_frag[0], a_frag[1], a_frag[2], a_frag[3],
                                                a_base + T.Cast("uint32", a_fragment_offset(warp * STRIP, kk, lane,
                                                                                            cpr)))
                                    for jp in T.unroll(nt8 // 2):
                                        # n8 fragments 2jp and 2jp+1: window rows strip + [16 jp, 16 jp + 16)
                                        LDMATRIX_X4(b_frag[0], b_frag[1], b_frag[2], b_frag[3],
                                                    w_base + T.Cast("uint32", b_fragments_offset(strip + jp * 16, kk,
                                                                                                 lane, cpr)))
                                        for half in T.unroll(2):
                                            f: T.let = (2 * jp + half) * 4
                                            mma(acc[f], acc[f + 1], acc[f + 2], acc[f + 3],
                                                a_frag[0], a_frag[1], a_frag[2], a_frag[3],
                                                b_frag[half * 2], b_frag[half * 2 + 1],
                                                acc[f], acc[f + 1], acc[f + 2], acc[f + 3])
                                for nt in T.unroll(nt8):
                                    for hh in T.unroll(2):      # the fragment's rows lane // 4 and lane // 4 + 8
                                        pack(packed[term, nt * 2 + hh], acc[nt * 4 + hh * 2 + 1], acc[nt * 4 + hh * 2])
                            T.tvm_storage_sync("shared")        # every warp is done with the operands
                            for term in T.unroll(2):
                                for nt in T.unroll(nt8):
                                    for hh in T.unroll(2):
                                        smem[term * second_table
                                             + (warp * STRIP + hh * 8 + lane // 4) * (row_words[0] + term * (
                                                 row_words[1] - row_words[0]))
                                             + nt * 4 + lane % 4] = packed[term, nt * 2 + hh]
                            T.tvm_storage_sync("shared")
                            for rr in T.unroll(STRIP):
                                row: T.let = warp * STRIP + rr
                                for half in T.unroll(2):
                                    col: T.let = lane + 32 * half
                                    l1: T.let = _decode(words[rr], 0, half)
                                    l2: T.let = _decode(words[rr], 1, half)
                                    w1v: T.let = smem[row * row_words[0] + l1 // 2]
                                    w2v: T.let = smem[second_table + col * row_words[1] + l2 // 2]
                                    p1: T.let = T.Cast("float32", T.reinterpret(dtype, T.Cast("uint16", T.shift_right(
                                        w1v, T.Cast("uint32", 16 * (l1 % 2))))))
                                    p2: T.let = T.Cast("float32", T.reinterpret(dtype, T.Cast("uint16", T.shift_right(
                                        w2v, T.Cast("uint32", 16 * (l2 % 2))))))
                                    out[n, ti * TILE + row, tj * TILE + col] = T.Cast(
                                        out_dtype, p1 / T.float32(scale1) + p2 / T.float32(scale2))

    return main


def visited_tiles_primfunc(*, mask_groups: int, seq: int, block_m: int, block_n: int) -> tvm.tirx.PrimFunc:
    """The CUDA PrimFunc ``(full_indptr, full_indices, part_indptr, part_indices, visited[mask_groups, seq / 64,
    seq / 64] int32)``: 1 where the tiled attention format of a mask (``block_m`` x ``block_n`` tiles, the CSR
    lists of full and partial tiles by tile row, ``mask_groups`` groups; :mod:`stof_tvm.sparse_formats.tiled`)
    lists a tile that overlaps the 64 x 64 bias tile, else 0. One thread an entry scans the lists of the tile rows
    its 64 rows cross: built once a forward from the runtime mask's format, read by every layer's bias kernel."""
    tiles = seq // TILE
    tile_rows = -(-seq // block_m)
    span = (TILE - 1) // block_m + 2         # tile rows a 64-row band may cross (the last one checked in the loop)
    entries = mask_groups * tiles * tiles
    per_block = 64

    @T.prim_func(private=True)
    def main(full_indptr_h: T.handle, full_indices_h: T.handle, part_indptr_h: T.handle, part_indices_h: T.handle,
             visited_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n_full = T.int32()
        n_part = T.int32()
        full_indptr = T.match_buffer(full_indptr_h, (mask_groups * tile_rows + 1,), "int32")
        full_indices = T.match_buffer(full_indices_h, (n_full,), "int32")
        part_indptr = T.match_buffer(part_indptr_h, (mask_groups * tile_rows + 1,), "int32")
        part_indices = T.match_buffer(part_indices_h, (n_part,), "int32")
        visited = T.match_buffer(visited_h, (mask_groups, tiles, tiles), "int32")
        for bx in T.thread_binding(-(-entries // per_block), thread="blockIdx.x"):
            for tx in T.thread_binding(per_block, thread="threadIdx.x"):
                found = T.alloc_buffer((1,), "int32", scope="local")
                e: T.let = bx * per_block + tx
                if e < entries:
                    g: T.let = e // (tiles * tiles)
                    ti: T.let = e // tiles % tiles
                    tj: T.let = e % tiles
                    found[0] = 0
                    for rr in T.serial(span):
                        r: T.let = ti * TILE // block_m + rr
                        if r * block_m < (ti + 1) * TILE and r < tile_rows:
                            row: T.let = g * tile_rows + r
                            for i in T.serial(full_indptr[row + 1] - full_indptr[row]):
                                c: T.let = full_indices[full_indptr[row] + i]
                                if c * block_n < (tj + 1) * TILE and (c + 1) * block_n > tj * TILE:
                                    found[0] = 1
                            for i in T.serial(part_indptr[row + 1] - part_indptr[row]):
                                c: T.let = part_indices[part_indptr[row] + i]
                                if c * block_n < (tj + 1) * TILE and (c + 1) * block_n > tj * TILE:
                                    found[0] = 1
                    visited[g, ti, tj] = found[0]

    return main


def relative_bias_reference(*, batch: int, seq: int, positions: int, head_dim: int, groups: int, strip_window: int,
                            scales: tuple[float, float], dtype: str = "float16", out_dtype: str = "float16",
                            visits: tuple[int, int, int] | None = None) -> tvm.tirx.PrimFunc:
    """The same function with the same parameters as a plain loop nest (any target; the llvm kernel and the CPU
    twin of :func:`relative_bias_primfunc`): each output's two products summed over the head dim in float32, every
    tile computed (``strip_window`` only shapes the CUDA kernel's work, ``visited`` only spares it some)."""
    tiles = seq // TILE
    a1 = te.placeholder((batch, seq, head_dim), dtype, name="A1")
    w1 = te.placeholder((groups, positions, head_dim), dtype, name="W1")
    a2 = te.placeholder((batch, seq, head_dim), dtype, name="A2")
    w2 = te.placeholder((groups, positions, head_dim), dtype, name="W2")
    offsets = te.placeholder((seq, seq // 2), "uint32", name="offsets")
    bases = te.placeholder((tiles, tiles, 2, 1 + WARPS), "int32", name="bases")
    mask_groups = 1 if visits is None else visits[1] * visits[2]
    visited = te.placeholder((mask_groups, tiles, tiles), "int32", name="visited")
    d1 = te.reduce_axis((0, head_dim), name="d1")
    d2 = te.reduce_axis((0, head_dim), name="d2")

    def window_offset(i, j, which):
        word = offsets[i, j // TILE * (TILE // 2) + j % 32]
        shift = (16 * which + 8 * (j % TILE // 32)).astype("uint32")
        return tvm.tirx.bitwise_and(tvm.tirx.shift_right(word, shift), tvm.tirx.const(255, "uint32")).astype("int32")

    def position(i, j, which):
        strip = (i if which == 0 else j) % TILE // STRIP
        return bases[i // TILE, j // TILE, which, 0] + bases[i // TILE, j // TILE, which, 1 + strip] \
            + window_offset(i, j, which)

    term1 = te.compute((batch, seq, seq), lambda n, i, j: te.sum(
        a1[n, i, d1].astype("float32") * w1[n % groups, position(i, j, 0), d1].astype("float32"), axis=d1),
        name="term1")
    term2 = te.compute((batch, seq, seq), lambda n, i, j: te.sum(
        a2[n, j, d2].astype("float32") * w2[n % groups, position(i, j, 1), d2].astype("float32"), axis=d2),
        name="term2")
    out = te.compute((batch, seq, seq), lambda n, i, j: (
        term1[n, i, j].astype(dtype).astype("float32") / tvm.tirx.const(float(scales[0]), "float32")
        + term2[n, i, j].astype(dtype).astype("float32") / tvm.tirx.const(float(scales[1]), "float32")
    ).astype(out_dtype), name="out")
    return te.create_prim_func([a1, w1, a2, w2, offsets, bases, visited, out])
