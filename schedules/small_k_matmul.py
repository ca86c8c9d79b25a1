"""Tensor cores for the batched float16 matmuls whose reduction is short (k <= 64), which dlight runs on CUDA cores.

dlight's ``Matmul`` rule hands a float16 matmul to its tensor-core form (``MatmulTensorization``: wmma 16x16x16,
128 x 128 tiles, k in steps of 64) only when every fixed extent of i, j and k is above 64; otherwise it schedules
float32 FMAs on the CUDA cores. Attention-shaped products left to TVM's default pipeline have k = the head dim (64):
HF DeBERTa-v3's content-to-position and position-to-content scores (``[B*H, S, 64] x [B*H, 64, 2 * buckets]``, two
a layer) ran there at ~27 TFLOP/s, 120 us each at 8 x 512 on an H100 (BENCHMARKS.md, session 26), a third of the
forward.

:class:`SmallKTensorCoreMatmul` (a dlight rule, tried before ``Matmul``) gives those matmuls the tensor-core form:
float16 operands, float16 or float32 accumulation, i and j of at least 64 each, k a multiple of 16 up to 64
(padded to one 64-step). Anything else returns None and goes on to the rules after it.

Where the matmul is exactly the batched ``C[s, i, j] = float16(sum_k A[s, i, k] * B[s, j, k])`` of float16 tensors that
DeBERTa's products are, in whole 64 x 128 (or 128 x 128) tiles, the rule returns stof-tvm's own kernel for it instead
(:mod:`.batched_nt_matmul`: several small blocks an SM, so loads, MMAs and stores overlap; the wmma form stages float32
tiles of 64 KB and runs them in turn).
"""
from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import (MatmulTensorization, get_in_out_dtypes, get_index_map,
                                         get_reduction_blocks)

from .batched_nt_matmul import ROW_CHOICES, batched_nt_matmul, fits

__all__ = ["SmallKTensorCoreMatmul"]

MAX_K = 64            # dlight's own tensor-core form takes k above this
MIN_SPATIAL = 64      # each of i and j: smaller products stay on the CUDA cores (a 128 x 128 tile would be mostly pad)


def _extents(func: tirx.PrimFunc) -> tuple[tirx.SBlock, list[int]] | None:
    """The main reduction block of ``func`` normalised to ``C[S, I, J] += A[S, I, K] * B[S, J, K]`` and its static
    extents ``[s, i, j, k]``; None where ``func`` is not one matmul of static shape."""
    sch = s_tir.Schedule(func)
    blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
    if not blocks:
        return None
    block = sch.get(blocks[0])
    maps = get_index_map(block)
    if maps is None:
        return None
    domain = [iv.dom.extent for iv in block.iter_vars]
    if not all(isinstance(e, tirx.IntImm) for e in domain):
        return None
    extents = [int(e) for e in maps[0].map_shape([int(e) for e in domain])]
    return block, extents


def nt_product(func: tirx.PrimFunc) -> tuple[int, int, int, int] | None:
    """``(batch, rows, cols, depth)`` where ``func`` is exactly ``C[s, i, j] = float16(sum_k float32(A[s, i, k]) *
    float32(B[s, j, k]))`` over its three float16 parameters (A, B, C) of static shape, as TVM fuses a ``matmul`` by a
    transposed operand with its cast; None for any other function."""
    if len(func.params) != 3:
        return None
    a, b, c = func.params
    if any(buf.dtype != "float16" or len(buf.shape) != 3 or not all(isinstance(e, tirx.IntImm) for e in buf.shape)
           for buf in (a, b, c)):
        return None
    (batch, rows, depth), (batch_b, cols, depth_b), out_shape = ([int(e) for e in buf.shape] for buf in (a, b, c))
    if (batch_b, depth_b) != (batch, depth) or out_shape != [batch, rows, cols]:
        return None
    sch = s_tir.Schedule(func)
    blocks = [sch.get(block) for block in sch.get_child_blocks(get_root_block(sch))]
    if len(blocks) != 2:
        return None
    product, cast = blocks
    kinds = [iv.iter_type for iv in product.iter_vars]
    if kinds != [tirx.IterVar.DataPar] * 3 + [tirx.IterVar.CommReduce] or any(
            int(iv.dom.extent) != extent for iv, extent in zip(product.iter_vars, (batch, rows, cols, depth))):
        return None
    s, i, j, k = (iv.var for iv in product.iter_vars)
    acc = product.body.buffer if isinstance(product.body, tirx.BufferStore) else None
    if acc is None or acc.dtype != "float32" or product.init is None:
        return None
    expected = tirx.BufferStore(acc, tirx.BufferLoad(acc, [s, i, j]) + tirx.Cast(
        "float32", tirx.BufferLoad(a, [s, i, k])) * tirx.Cast("float32", tirx.BufferLoad(b, [s, j, k])), [s, i, j])
    if not (tvm_ffi.structural_equal(product.body, expected)
            and tvm_ffi.structural_equal(product.init, tirx.BufferStore(acc, tirx.FloatImm("float32", 0), [s, i, j]))):
        return None
    if len(cast.iter_vars) != 3 or any(iv.iter_type != tirx.IterVar.DataPar for iv in cast.iter_vars):
        return None
    u, v, w = (iv.var for iv in cast.iter_vars)
    rounded = tirx.BufferStore(c, tirx.Cast("float16", tirx.BufferLoad(acc, [u, v, w])), [u, v, w])
    if not tvm_ffi.structural_equal(cast.body, rounded):
        return None
    return batch, rows, cols, depth


class SmallKTensorCoreMatmul(GPUScheduleRule):
    """dlight's tensor-core matmul form for float16 matmuls with 16 <= k <= 64 (module docstring)."""

    def apply(self, func, target, _) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        if target.kind.name != "cuda" or "dlight.do_not_tensorize" in func.attrs.keys():
            return None
        product = nt_product(func)
        if product is not None:
            for rows in ROW_CHOICES:            # 64-row tiles first: 1.17x the 128-row ones at DeBERTa-v3-base 8x512
                if fits(*product[1:], block_rows=rows):
                    return s_tir.Schedule(batched_nt_matmul(*product, block_rows=rows))
        found = _extents(func)
        if found is None:
            return None
        block, (_, rows, cols, depth) = found
        if depth > MAX_K or depth % 16 or min(rows, cols) < MIN_SPATIAL:
            return None
        in_dtype, out_dtype = get_in_out_dtypes(block)
        if in_dtype != "float16" or out_dtype not in ("float16", "float32"):
            return None
        return MatmulTensorization().apply(func, target, _)
