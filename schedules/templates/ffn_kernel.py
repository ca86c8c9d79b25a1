"""The fused FFN ``out = act(x @ W1^T + b1) @ W2^T (+ b2)`` as one warp-specialized Hopper kernel (sm_90a).

x [m, hidden], W1 [ffn, hidden], b1 [ffn], W2 [hidden, ffn], b2 [hidden] (``torch.nn.Linear`` layouts) in
float16 or bfloat16, float32 accumulation, the output in the input dtype. The [m, ffn] intermediate never
leaves the SM: it lives in registers, ``chunk_f`` columns at a time.

It is built from the blocks of :mod:`.wgmma_kernel` (same threads, ring protocol, swizzle and descriptors):

- A block owns 128 rows of x; 3 warpgroups. The *producer* (warpgroup 0) copies the block's x tile to shared
  memory once (``hidden / 64`` swizzled 128 x 64 tiles), then streams chunk c = 0, 1, ... of the weights
  through a ``stages``-deep ring: ``W1[c*chunk_f : (c+1)*chunk_f, :]`` (``hidden / 64`` tiles of ``chunk_f``
  rows) and ``W2[:, c*chunk_f : (c+1)*chunk_f]`` (``chunk_f / 64`` tiles of ``hidden`` rows), all with 16-byte
  ``cp.async`` and one *full* mbarrier per slot. The x copies precede chunk 0's arrive, so slot 0's barrier
  covers them too.
- Each *consumer* warpgroup owns 64 rows. Per chunk: ``acc1 = x_rows @ W1_chunk^T`` (``wgmma m64n{chunk_f}k16``,
  both operands from shared memory); wait; bias + activation in registers, rounded to the input dtype and packed
  two per 32-bit register; then ``acc2 += act_chunk @ W2_chunk^T`` (``wgmma m64n{hidden}k16`` with the **A
  operand from registers**, the ``rs`` form). The wgmma D fragment of a warp is the mma.sync C layout, and
  packing its consecutive pairs gives exactly the A fragment of k16 step j (registers ``4j .. 4j+3`` from
  accumulators ``8j .. 8j+7``): no shared-memory round trip for the intermediate.
- The wait before the activation also retires the previous chunk's second GEMM, after which each consumer
  thread arrives on that chunk's *empty* barrier (256 arrivals) and the producer may refill its slot.
- Epilogue: ``acc2`` (+ b2) rounded and stored from registers, as the GEMM kernel does.

Registers per consumer thread: ``hidden/2`` (acc2) + ``chunk_f/2`` (acc1) + ``chunk_f/4`` (packed operand) plus
addressing must fit the 232 that ``setmaxnreg`` gives; shared memory: the x tile plus ``stages`` slots of both
weight chunks. Hence ``hidden <= 256`` (also wgmma's largest N), and ``hidden >= 128`` (below, the fragments
are too small for ptxas to honour ``setmaxnreg``): :func:`check_ffn_shape` refuses the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from .epilogue import activation, check_activation
from .wgmma_kernel import (ALIGN, BLOCK_K, BLOCK_M, CONSUMER_REGS, PRODUCER_REGS, PTX_TYPE, ROW_BYTES,
                           STAGE_CHOICES, THREADS, WG, descriptor, swizzled, wait_parity, whole_buffer)

CHUNK_F_CHOICES = (64, 128)
MIN_HIDDEN, MAX_HIDDEN = 128, 256   # below 128 ptxas drops setmaxnreg (C7508); 256: wgmma's largest N, and acc2
                                    # must stay in registers
ADDRESSING_REGS = 40           # what a consumer thread needs beside its fragments (pointers, indices, loop state)
MAX_SHARED = 232448            # the H200's opt-in shared memory per block
CHUNKS = ROW_BYTES // 16       # 16-byte chunks per 128-byte row


@dataclass(frozen=True)
class FfnConfig:
    """Knobs: ``chunk_f`` intermediate columns per step (wgmma N of the first GEMM, K of the second) and
    ``stages`` (ring depth)."""

    chunk_f: int = 64
    stages: int = 2

    def validate(self) -> None:
        if self.chunk_f not in CHUNK_F_CHOICES:
            raise ValueError(f"chunk_f must be one of {CHUNK_F_CHOICES}, got {self.chunk_f!r}")
        if self.stages not in STAGE_CHOICES:
            raise ValueError(f"stages must be one of {STAGE_CHOICES}, got {self.stages!r}")

    def x_bytes(self, hidden: int) -> int:
        return BLOCK_M * hidden * 2

    def stage_bytes(self, hidden: int) -> int:
        """One ring slot: the W1 chunk (chunk_f x hidden) and the W2 chunk (hidden x chunk_f), 16-bit."""
        return 2 * self.chunk_f * hidden * 2

    def shared_bytes(self, hidden: int) -> int:
        """x tile, ring, 2 mbarriers per slot, and slack to align the buffer to 1024 bytes at run time."""
        return self.x_bytes(hidden) + self.stages * self.stage_bytes(hidden) + 16 * self.stages + ALIGN

    def fragment_registers(self, hidden: int) -> tuple[int, int]:
        """(float32 accumulators, packed 16-bit operand registers) per consumer thread."""
        return hidden // 2 + self.chunk_f // 2, self.chunk_f // 4


def check_ffn_dims(m: int, hidden: int, ffn: int) -> None:
    """Raise ValueError unless some configuration can tile the problem (rows, hidden range, ffn in 64s)."""
    if m % BLOCK_M:
        raise ValueError(f"ffn_wgmma: shape['m'] = {m} must be a multiple of {BLOCK_M} (rows per block)")
    if hidden % BLOCK_K or not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise ValueError(f"ffn_wgmma: shape['hidden'] = {hidden} must be a multiple of {BLOCK_K} in "
                         f"[{MIN_HIDDEN}, {MAX_HIDDEN}] (the second GEMM's 128 x hidden float32 accumulator lives in "
                         "registers; other models use the unfused gemm_bias_<act> + gemm_bias pair)")
    if ffn % min(CHUNK_F_CHOICES):
        raise ValueError(f"ffn_wgmma: shape['ffn'] = {ffn} must be a multiple of {min(CHUNK_F_CHOICES)}")


def check_ffn_shape(m: int, hidden: int, ffn: int, config: FfnConfig, max_shared: int = MAX_SHARED) -> None:
    """Raise ValueError unless the tiles divide the problem and the block fits the registers and shared memory."""
    config.validate()
    check_ffn_dims(m, hidden, ffn)
    if ffn % config.chunk_f:
        raise ValueError(f"ffn_wgmma: shape['ffn'] = {ffn} must be a multiple of chunk_f = {config.chunk_f}")
    acc, operand = config.fragment_registers(hidden)
    if acc + operand + ADDRESSING_REGS > CONSUMER_REGS:
        raise ValueError(f"ffn_wgmma: hidden = {hidden} with chunk_f = {config.chunk_f} needs {acc} accumulator + "
                         f"{operand} operand registers per thread, over the {CONSUMER_REGS - ADDRESSING_REGS} a "
                         "consumer has for fragments; use a smaller chunk_f")
    if config.shared_bytes(hidden) > max_shared:
        raise ValueError(f"ffn_wgmma: hidden = {hidden}, chunk_f = {config.chunk_f}, stages = {config.stages} need "
                         f"{config.shared_bytes(hidden)} bytes of shared memory (limit {max_shared}); use fewer "
                         "stages or a smaller chunk_f")


def fragment_position(i: int, lane):
    """(row within the warp's 16 rows, column within the tile) of float32 accumulator ``i`` of a wgmma D fragment
    held by lane ``lane``: n8 tile ``i // 4``, row half ``(i // 2) % 2``, column parity ``i % 2``."""
    return lane // 4 + 8 * ((i // 2) % 2), (i // 4) * 8 + (lane % 4) * 2 + i % 2


def ffn_primfunc(m: int, hidden: int, ffn: int, dtype: str, *, act: str, bias2: bool,
                 config: FfnConfig) -> tvm.tirx.PrimFunc:
    """The thread-level CUDA PrimFunc, parameters ``x, W1, b1, W2[, b2], out`` (build for ``arch="sm_90a"``)."""
    if dtype not in PTX_TYPE:
        raise ValueError(f"dtype must be one of {sorted(PTX_TYPE)}, got {dtype!r}")
    check_activation(act)
    check_ffn_shape(m, hidden, ffn, config)
    H, CF, ST, DT = hidden, config.chunk_f, config.stages, dtype
    NACC1, NACC2, NA = CF // 2, H // 2, CF // 4
    NCHUNK = ffn // CF
    X_TILE = BLOCK_M * ROW_BYTES              # one 128-row x 64-column tile of x
    W1_TILE, W2_TILE = CF * ROW_BYTES, H * ROW_BYTES
    X_BYTES = config.x_bytes(H)
    W1_BYTES = (H // BLOCK_K) * W1_TILE
    STAGE = config.stage_bytes(H)
    BAR_OFF = X_BYTES + ST * STAGE            # full[s] at +8s, empty[s] at +8(ST+s)
    SMEM_WORDS = config.shared_bytes(H) // 8
    X_ITERS, W1_ITERS, W2_ITERS = BLOCK_M * H // 8 // WG, CF * H // 8 // WG, H * CF // 8 // WG
    ab = PTX_TYPE[DT]
    MMA1 = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{CF}k16.f32.{ab}.{ab}"]    # ss: both from shared memory
    MMA2 = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{H}k16.f32.{ab}.{ab}"]     # rs: A from registers
    PACK = T.ptx[f"cvt.rn.{ab}x2.f32"]       # d = {hi: a, lo: b}, each rounded to nearest
    CP_ASYNC_16 = T.ptx["cp.async.cg.shared.global"]
    FENCE_REG = T.ptx["add.rn.f32"]          # acc + (-0.0) as volatile asm: keeps reads after the wait (see
                                             # wgmma_kernel: otherwise nvcc hoists them and ptxas serializes)

    def full_bar(base, s):
        return base + T.uint32(BAR_OFF + 8 * s)

    def empty_bar(base, s):
        return base + T.uint32(BAR_OFF + 8 * (ST + s))

    def act_value(acc1, b1, f0, i, lane):
        col = fragment_position(i, lane)[1]
        return activation(act, acc1[i] + T.Cast("float32", b1[f0 + col]))

    @T.macro
    def copy_tile(dst, src, row0, col0, rows_per_tile_bytes, cols, iters, wt):
        # ``iters`` 16-byte chunks per thread of a [rows, cols] panel of ``src`` at (row0, col0) into 128-byte
        # swizzled tiles of 64 columns, ``rows_per_tile_bytes`` apart; consecutive threads take consecutive chunks
        for it in T.unroll(iters):
            row: T.let = (it * WG + wt) // (cols // 8)
            cg: T.let = (it * WG + wt) % (cols // 8)
            CP_ASYNC_16(dst + T.Cast("uint32", (cg // CHUNKS) * rows_per_tile_bytes + swizzled(row, cg % CHUNKS)),
                        T.address_of(src[row0 + row, col0 + cg * 8]), 16, T.uint32(16))

    @T.macro
    def store(acc2, out, b2, row0, lane):
        for i in T.unroll(NACC2):
            row: T.let = row0 + fragment_position(i, lane)[0]
            col: T.let = fragment_position(i, lane)[1]
            if bias2:
                out[row, col] = T.Cast(DT, acc2[i] + T.Cast("float32", b2[col]))
            else:
                out[row, col] = T.Cast(DT, acc2[i])

    @T.macro
    def body(X, W1, b1, W2, b2, out):
        for bx in T.thread_binding(m // BLOCK_M, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                ffn_smem = T.alloc_buffer((SMEM_WORDS,), "uint64", scope="shared.dyn")
                acc1 = T.alloc_buffer((NACC1,), "float32", scope="local")
                acc2 = T.alloc_buffer((NACC2,), "float32", scope="local")
                areg = T.alloc_buffer((NA,), "uint32", scope="local")
                flag = T.alloc_buffer((1,), "uint32", scope="local")
                raw: T.let = T.cuda.cvta_generic_to_shared(whole_buffer(ffn_smem, SMEM_WORDS))
                base: T.let = T.bitwise_and(raw + T.uint32(ALIGN - 1), T.uint32(0xFFFFFFFF - (ALIGN - 1)))
                wg: T.let = tx // WG
                wt: T.let = tx % WG
                m0: T.let = bx * BLOCK_M
                if tx == 0:
                    for s in T.unroll(ST):
                        T.ptx["mbarrier.init.shared::cta.b64"](full_bar(base, s), T.uint32(WG))
                        T.ptx["mbarrier.init.shared::cta.b64"](empty_bar(base, s), T.uint32(2 * WG))
                    T.ptx["fence.mbarrier_init.release.cluster"]()
                T.tvm_storage_sync("shared")
                if wg == 0:
                    T.ptx["setmaxnreg.dec.sync.aligned.u32"](PRODUCER_REGS)
                    copy_tile(base, X, m0, 0, X_TILE, H, X_ITERS, wt)
                    for c in range(NCHUNK):
                        if c >= ST:
                            wait_parity(flag, empty_bar(base, c % ST), T.Cast("uint32", (c // ST - 1) % 2))
                        slot: T.let = base + T.Cast("uint32", X_BYTES + (c % ST) * STAGE)
                        copy_tile(slot, W1, c * CF, 0, W1_TILE, H, W1_ITERS, wt)
                        copy_tile(slot + T.uint32(W1_BYTES), W2, 0, c * CF, W2_TILE, CF, W2_ITERS, wt)
                        T.ptx["cp.async.mbarrier.arrive.noinc.shared::cta.b64"](full_bar(base, c % ST))
                else:
                    T.ptx["setmaxnreg.inc.sync.aligned.u32"](CONSUMER_REGS)
                    for i in T.unroll(NACC2):
                        acc2[i] = T.float32(0)
                    x_rows: T.let = base + T.Cast("uint32", (wg - 1) * 64 * ROW_BYTES)
                    for c in range(NCHUNK):
                        wait_parity(flag, full_bar(base, c % ST), T.Cast("uint32", (c // ST) % 2))
                        T.ptx["fence.proxy.async.shared::cta"]()
                        w1: T.let = base + T.Cast("uint32", X_BYTES + (c % ST) * STAGE)
                        T.ptx["wgmma.fence.sync.aligned"]()
                        for kt in T.unroll(H // BLOCK_K):
                            for kk in T.unroll(BLOCK_K // 16):
                                MMA1(*[acc1[i] for i in range(NACC1)],
                                     descriptor(x_rows + T.uint32(kt * X_TILE + kk * 32)),
                                     descriptor(w1 + T.uint32(kt * W1_TILE + kk * 32)),
                                     kt + kk > 0, 1, 1, 0, 0)
                        T.ptx["wgmma.commit_group.sync.aligned"]()
                        # retires this chunk's first GEMM and the previous chunk's second GEMM
                        T.ptx["wgmma.wait_group.sync.aligned"](0)
                        if c > 0:
                            T.ptx["mbarrier.arrive.shared::cta.b64"](empty_bar(base, (c - 1) % ST))
                        for i in T.unroll(NACC1):
                            FENCE_REG(acc1[i], acc1[i], T.float32(-0.0))
                        for i in T.unroll(NA):
                            PACK(areg[i], act_value(acc1, b1, c * CF, 2 * i + 1, wt % 32),
                                 act_value(acc1, b1, c * CF, 2 * i, wt % 32))
                        T.ptx["wgmma.fence.sync.aligned"]()
                        for j in T.unroll(CF // 16):
                            MMA2(*[acc2[i] for i in range(NACC2)], *[areg[4 * j + q] for q in range(4)],
                                 descriptor(w1 + T.uint32(W1_BYTES + (j // 4) * W2_TILE + (j % 4) * 32)),
                                 True, 1, 1, 0)
                        T.ptx["wgmma.commit_group.sync.aligned"]()
                    T.ptx["wgmma.wait_group.sync.aligned"](0)
                    for i in T.unroll(NACC2):
                        FENCE_REG(acc2[i], acc2[i], T.float32(-0.0))
                    store(acc2, out, b2, m0 + (wg - 1) * 64 + (wt // 32) * 16, wt % 32)

    if bias2:
        @T.prim_func
        def kernel(x_h: T.handle, w1_h: T.handle, b1_h: T.handle, w2_h: T.handle, b2_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "global_symbol": "ffn_wgmma"})
            X = T.match_buffer(x_h, (m, H), DT)
            W1 = T.match_buffer(w1_h, (ffn, H), DT)
            b1 = T.match_buffer(b1_h, (ffn,), DT)
            W2 = T.match_buffer(w2_h, (H, ffn), DT)
            b2 = T.match_buffer(b2_h, (H,), DT)
            out = T.match_buffer(out_h, (m, H), DT)
            body(X, W1, b1, W2, b2, out)
    else:
        @T.prim_func
        def kernel(x_h: T.handle, w1_h: T.handle, b1_h: T.handle, w2_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "global_symbol": "ffn_wgmma"})
            X = T.match_buffer(x_h, (m, H), DT)
            W1 = T.match_buffer(w1_h, (ffn, H), DT)
            b1 = T.match_buffer(b1_h, (ffn,), DT)
            W2 = T.match_buffer(w2_h, (H, ffn), DT)
            out = T.match_buffer(out_h, (m, H), DT)
            body(X, W1, b1, W2, None, out)
    return kernel
