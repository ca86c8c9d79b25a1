"""A batched float16 matmul with a short reduction, ``C[s, i, j] = A[s, i, :] . B[s, j, :]`` (k <= 64), on mma.sync.

HF DeBERTa-v3 computes two such products a layer, its content-to-position and position-to-content scores
(``[B*H, S, 64] x [B*H, 2 * buckets, 64]``, float16 out). With k = 64 each output element costs 128 FLOPs, so the
product is a memory-bound *write*: at 8 x 512 tokens it stores 50 MB and reads 13 MB. TVM's tensor-core form
(dlight's wmma matmul) ran each at 45 us on an H100 (BENCHMARKS.md, session 27), about 3x the time its bytes need: a
float32 staging tile of 64 KB a block keeps two blocks on an SM, and every block loads, multiplies and stores in
turn, so nothing overlaps.

This kernel keeps a block small enough for several to share an SM, so one block's loads overlap another's stores:

- a block computes one ``block_rows`` x 128 output tile with 8 warps (4 along i x 2 along j): at 64 rows 16 x 64 outputs
  a warp (32 float32 accumulators a thread, 62 registers: four blocks an SM), at 128 rows 32 x 64 (64 accumulators,
  102 registers: two);
- the tile's whole reduction fits in shared memory: A's rows and B's 128 rows of k elements, copied with 16-byte
  ``cp.async`` into rows laid out by :func:`.mma.chunk_offset` (bank-conflict free for ``ldmatrix``), then ``k / 16``
  steps of ``ldmatrix.x4`` + ``mma.sync.m16n8k16`` with float32 accumulation;
- the float32 results are rounded to float16 pairs (the plain cast's rounding) into a float16 staging tile over the
  operands (256-byte rows, 16-byte chunks XOR-swizzled by row: conflict-free 4-byte writes), read back 16 bytes a
  thread and stored with ``st.global.v4``, eight threads a 128-byte line.

Shared memory: 24 KB a block at 64 rows, 32 KB at 128 (k = 64). The grid is (j tiles, i tiles, batch), j fastest, so
the blocks that share an A tile run together and read it from L2. Measured on an H100 (scripts/check_nt_matmul_gpu.py,
[96, 512, 64] x [96, 512, 64]^T): 28.4 us at 64 rows (2.2 TB/s), 33.2 at 128, the wmma form 46.5, cuBLAS 26.9.
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .mma import (CP_ASYNC_16, LD_SHARED_V4, LDMATRIX_X4, ST_GLOBAL_V4, a_fragment_offset, b_fragments_offset,
                  chunk_offset, chunk_stride, mma_m16n8k16, pack_f32x2, swizzle_offset)

__all__ = ["BLOCK", "ROW_CHOICES", "fits", "batched_nt_matmul"]

BLOCK = 128                  # output columns of a block's tile
# ... and its rows, in the order tried: 64 (32 accumulators a thread, 62 registers: 4 blocks an SM) ran
# DeBERTa-v3-base's 8 x 512 products in 28.4 us, 128 (102 registers, 2 blocks) in 33.2 (H100,
# scripts/check_nt_matmul_gpu.py)
ROW_CHOICES = (64, 128)
WARPS_M, WARPS_N = 4, 2      # warps along i and along j
THREADS = 32 * WARPS_M * WARPS_N
NT8 = BLOCK // WARPS_N // 8  # n8 fragments of a warp
MAX_K = 64                   # the whole reduction is one shared-memory tile
OUT_ROW_BYTES = BLOCK * 2    # a staged float16 output row
OUT_CHUNKS = OUT_ROW_BYTES // 16


def fits(rows: int, cols: int, depth: int, block_rows: int = 128) -> bool:
    """Whether the kernel takes a product of ``rows`` x ``cols`` outputs (per batch) over ``depth``: whole tiles, a
    reduction of 16 to 64 in steps of 16, and an A tile whose 16-byte chunks the block's threads copy in whole
    rounds."""
    return (block_rows in ROW_CHOICES and rows % block_rows == 0 and cols % BLOCK == 0 and depth % 16 == 0
            and 16 <= depth <= MAX_K and block_rows * (depth // 8) % THREADS == 0)


def batched_nt_matmul(batch: int, rows: int, cols: int, depth: int, dtype: str = "float16",
                      block_rows: int = 128) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``(A[batch, rows, depth], B[batch, cols, depth], C[batch, rows, cols])``, all ``dtype``, computing
    ``C = round(sum_k float32(A) * float32(B))`` for CUDA with ``block_rows`` x 128 tiles (module docstring)."""
    if not fits(rows, cols, depth, block_rows):
        raise ValueError(f"batched_nt_matmul: block_rows must be one of {ROW_CHOICES} and divide rows, cols a multiple "
                         f"of {BLOCK}, depth a multiple of 16 from 16 to {MAX_K} (of 32 with 64-row tiles); got "
                         f"{rows} x {cols} over {depth}, block_rows {block_rows!r}")
    MT = block_rows // WARPS_M // 16              # m16 fragments of a warp
    cpr = depth // 8                              # 16-byte chunks of an operand row
    a_bytes = block_rows * chunk_stride(cpr) * 16
    b_bytes = BLOCK * chunk_stride(cpr) * 16
    smem_words = max(a_bytes + b_bytes, block_rows * OUT_ROW_BYTES) // 4
    a_iters, b_iters = block_rows * cpr // THREADS, BLOCK * cpr // THREADS   # cpr is even: whole iterations
    store_iters = block_rows * OUT_CHUNKS // THREADS
    k_steps = depth // 16
    mma, pack = mma_m16n8k16(dtype), pack_f32x2(dtype)

    def acc_at(mt, nt, e):
        return (mt * NT8 + nt) * 4 + e

    @T.prim_func(private=True)
    def main(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle):
        T.func_attr({"tirx.noalias": True})
        A = T.match_buffer(a_handle, (batch, rows, depth), dtype)
        B = T.match_buffer(b_handle, (batch, cols, depth), dtype)
        C = T.match_buffer(c_handle, (batch, rows, cols), dtype)
        for bj in T.thread_binding(cols // BLOCK, thread="blockIdx.x"):
            for bi in T.thread_binding(rows // block_rows, thread="blockIdx.y"):
                for s in T.thread_binding(batch, thread="blockIdx.z"):
                    for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                        smem = T.alloc_buffer((smem_words,), "uint32", scope="shared.dyn")
                        a_frag = T.alloc_buffer((MT * 4,), "uint32", scope="local")
                        b_frag = T.alloc_buffer((4,), "uint32", scope="local")
                        acc = T.alloc_buffer((MT * NT8 * 4,), "float32", scope="local")
                        word = T.alloc_buffer((4,), "uint32", scope="local")
                        warp: T.let = tx // 32
                        lane: T.let = tx % 32
                        row0: T.let = (warp % WARPS_M) * (MT * 16)       # the warp's first row of the tile
                        col0: T.let = (warp // WARPS_M) * (NT8 * 8)      # ... and first column
                        a_base: T.let = T.cuda.cvta_generic_to_shared(T.address_of(smem[0]))
                        b_base: T.let = a_base + T.uint32(a_bytes)
                        for it in T.unroll(a_iters):
                            ar: T.let = (it * THREADS + tx) // cpr
                            ac: T.let = (it * THREADS + tx) % cpr
                            CP_ASYNC_16(a_base + T.Cast("uint32", chunk_offset(ar, ac, cpr)),
                                        T.address_of(A[s, bi * block_rows + ar, ac * 8]), 16, T.uint32(16))
                        for it in T.unroll(b_iters):
                            br: T.let = (it * THREADS + tx) // cpr
                            bc: T.let = (it * THREADS + tx) % cpr
                            CP_ASYNC_16(b_base + T.Cast("uint32", chunk_offset(br, bc, cpr)),
                                        T.address_of(B[s, bj * BLOCK + br, bc * 8]), 16, T.uint32(16))
                        T.ptx.cp.async_.commit_group()
                        for e in T.unroll(MT * NT8 * 4):
                            acc[e] = T.float32(0)
                        T.ptx.cp.async_.wait_group(0)
                        T.tvm_storage_sync("shared")
                        for kk in T.unroll(k_steps):
                            for mt in T.unroll(MT):
                                LDMATRIX_X4(a_frag[mt * 4], a_frag[mt * 4 + 1], a_frag[mt * 4 + 2], a_frag[mt * 4 + 3],
                                            a_base + T.Cast("uint32", a_fragment_offset(row0 + mt * 16, kk, lane,
                                                                                        cpr)))
                            for jp in T.unroll(NT8 // 2):
                                # n8 fragments 2jp and 2jp+1: B's rows [16 jp, 16 jp + 16) of the warp's columns
                                LDMATRIX_X4(b_frag[0], b_frag[1], b_frag[2], b_frag[3],
                                            b_base + T.Cast("uint32", b_fragments_offset(col0 + jp * 16, kk, lane,
                                                                                         cpr)))
                                for mt in T.unroll(MT):
                                    for half in T.unroll(2):
                                        mma(acc[acc_at(mt, 2 * jp + half, 0)], acc[acc_at(mt, 2 * jp + half, 1)],
                                            acc[acc_at(mt, 2 * jp + half, 2)], acc[acc_at(mt, 2 * jp + half, 3)],
                                            a_frag[mt * 4], a_frag[mt * 4 + 1], a_frag[mt * 4 + 2], a_frag[mt * 4 + 3],
                                            b_frag[half * 2], b_frag[half * 2 + 1],
                                            acc[acc_at(mt, 2 * jp + half, 0)], acc[acc_at(mt, 2 * jp + half, 1)],
                                            acc[acc_at(mt, 2 * jp + half, 2)], acc[acc_at(mt, 2 * jp + half, 3)])
                        T.tvm_storage_sync("shared")        # every warp is done with the operands: stage over them
                        for mt in T.unroll(MT):
                            for nt in T.unroll(NT8):
                                for hh in T.unroll(2):      # the fragment's rows g and g + 8
                                    pack(word[0], acc[acc_at(mt, nt, hh * 2 + 1)], acc[acc_at(mt, nt, hh * 2)])
                                    smem[(swizzle_offset(row0 + mt * 16 + hh * 8 + lane // 4, (col0 + nt * 8) // 8,
                                                         OUT_ROW_BYTES) + (lane % 4) * 4) // 4] = word[0]
                        T.tvm_storage_sync("shared")
                        for it in T.unroll(store_iters):
                            orow: T.let = (it * THREADS + tx) // OUT_CHUNKS
                            och: T.let = (it * THREADS + tx) % OUT_CHUNKS
                            LD_SHARED_V4(word[0], word[1], word[2], word[3],
                                         a_base + T.Cast("uint32", swizzle_offset(orow, och, OUT_ROW_BYTES)))
                            ST_GLOBAL_V4(T.address_of(C[s, bi * block_rows + orow, bj * BLOCK + och * 8]),
                                         word[0], word[1], word[2], word[3])

    return main
