"""The tensor-core GEMM main loop shared by every GEMM-based template.

:func:`schedule_mainloop` turns one TensorIR reduction block ``acc[i, j] += A[i, k] * B[j, k]`` (or
``B[k, j]``) into the structure below, and returns the loops and blocks the template needs to attach its
epilogue:

- grid: one thread block per (block_m x block_n) output tile, ``blockIdx.x`` over the tiles, row-major;
- warps: ``warps_m x warps_n`` warps on ``threadIdx.y``, each owning a (16*frag_m) x (16*frag_n) warp tile
  of float32 accumulators in registers (``warp`` scope, mma.sync m16n8k16 fragment layout);
- k loop: ``block_k = 16 * k_frags`` columns of A and B per step, copied global -> shared with 16-byte
  cp.async into padded rows (8 extra elements, so ldmatrix row addresses fall in distinct banks), in a
  ``stages``-deep software pipeline; inside a step, ldmatrix fragments are double buffered against the mma;
- the accumulators leave through a float32 staging tile in shared memory (the block's output buffer is
  re-scoped to ``shared.dyn``), from which the template's epilogue reads with wide, coalesced accesses.

Knob values may be Python ints (fixed schedule) or MetaSchedule ``ExprRV`` s from ``sample_categorical``
(design space). The steps that need concrete numbers (the cooperative copies, which depend on the thread
count, and the software-pipeline annotations, which depend on ``stages``) are recorded as annotations and
carried out by :func:`.deferred.finalize`.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir
from tvm.runtime import DataType

from .deferred import INNER_KEY, STAGES_KEY, cooperative
from .intrin import TILE, WARP_MAPS, intrin_names

PAD = 8  # elements of padding per shared row of A/B (16 bytes)
ACC_PAD = 8  # float32 elements of padding per row of the accumulator staging tile
COPY_BYTES = 16  # cp.async width


@dataclass
class MainLoop:
    """Handles to the scheduled main loop."""

    block_loop: s_tir.schedule.LoopRV  # bound to blockIdx.x
    warp_loop: s_tir.schedule.LoopRV  # bound to threadIdx.y
    k_outer: s_tir.schedule.LoopRV
    acc_store: s_tir.schedule.SBlockRV  # writes the staging tile (the original output buffer, now shared.dyn)


def schedule_mainloop(sch: s_tir.Schedule, block: str | s_tir.schedule.SBlockRV, *, dtype: str, b_layout: str,
                      warps_m, frag_m, warps_n, frag_n, k_frags, stages, consumers=()) -> MainLoop:
    """Tile, cache, pipeline and tensorize a GEMM reduction block (see the module docstring).

    ``block`` must have exactly three loops (i, j, k) and read A first and B second. Tile sizes are
    block_m = 16*warps_m*frag_m, block_n = 16*warps_n*frag_n, block_k = 16*k_frags. ``consumers`` (block
    names, producers first) are the epilogue blocks reading the accumulator; they are moved under the
    thread-block loop, after the staging tile is written, and left for the caller to schedule.
    """
    blk = sch.get_sblock(block) if isinstance(block, str) else block
    outer, inner, i, j, k = _blockize16(sch, blk)
    i0, i1, i2 = sch.split(i, [None, warps_m, frag_m])
    j0, j1, j2 = sch.split(j, [None, warps_n, frag_n])
    k0, k1 = sch.split(k, [None, k_frags])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    bx = sch.fuse(i0, j0)
    sch.bind(bx, "blockIdx.x")
    ty = sch.fuse(i1, j1)
    sch.bind(ty, "threadIdx.y")
    for index in (0, 1):
        _copy_operand(sch, outer, index, k0, dtype)
    acc_store = _tensorize(sch, outer, inner, k0, k1, ty, bx, consumers, dtype, b_layout)
    sch.annotate(k0, STAGES_KEY, stages)
    sch.annotate(k1, INNER_KEY, 1)
    return MainLoop(block_loop=bx, warp_loop=ty, k_outer=k0, acc_store=acc_store)


def _blockize16(sch, blk):
    """Split (i, j, k) into 16x16x16 tiles and blockize one tile: returns (outer, inner, i, j, k) tile loops."""
    i, j, k = sch.get_loops(blk)[-3:]
    i, it = sch.split(i, [None, TILE])
    j, jt = sch.split(j, [None, TILE])
    k, kt = sch.split(k, [None, TILE])
    sch.reorder(i, j, k, it, jt, kt)
    return sch.blockize(it), blk, i, j, k


def _copy_operand(sch, outer, index, k_outer, dtype) -> None:
    """Global -> shared copy of operand ``index`` per k step: padded rows, 16-byte cp.async over all threads."""
    shared = sch.cache_read(outer, index, "shared.dyn")
    sch.compute_at(shared, k_outer)
    sch.storage_align(shared, 0, axis=-2, factor=32, offset=PAD)
    cooperative(sch, shared, COPY_BYTES * 8 // _bits(dtype))


def _tensorize(sch, outer, inner, k0, k1, ty, bx, consumers, dtype, b_layout):
    """Warp caches (ldmatrix), mma, zero-fill and the float32 staging store of a tiled GEMM block."""
    names = intrin_names(dtype, b_layout)
    a_warp = sch.cache_read(outer, 0, "warp")
    sch.compute_at(a_warp, k1)
    b_warp = sch.cache_read(outer, 1, "warp")
    sch.compute_at(b_warp, k1)
    acc_store = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(acc_store, ty)
    sch.set_scope(acc_store, 0, "shared.dyn")
    for name in consumers:
        sch.reverse_compute_at(sch.get_sblock(name), bx)
    _tile16(sch, acc_store)
    sch.decompose_reduction(outer, k0)
    init_inner = sch.get_sblock(sch.get(inner).name_hint + "_init")

    la = _tile16(sch, a_warp)
    lb = _tile16(sch, b_warp)
    sch.transform_layout(a_warp, ("write", 0), WARP_MAPS["a"])
    sch.transform_layout(b_warp, ("write", 0), WARP_MAPS["b_" + b_layout])
    sch.transform_layout(acc_store, ("read", 0), WARP_MAPS["c"])
    sch.tensorize(la, names["load_a"])
    sch.tensorize(lb, names["load_b"])
    sch.tensorize(sch.get_loops(inner)[-3], names["compute"])
    sch.tensorize(sch.get_loops(init_inner)[-2], names["init"])
    store_name = sch.get(acc_store).name_hint
    sch.tensorize(sch.get_loops(acc_store)[-2], names["store"])
    # the padding annotation must sit on the block that writes the staging tile, which tensorize replaced
    acc_store = sch.get_sblock(store_name + "_o")
    sch.storage_align(acc_store, 0, axis=-2, factor=32, offset=ACC_PAD)
    return acc_store


def _tile16(sch, block):
    """Split the last two loops of ``block`` into 16x16 tiles; returns the first intra-tile loop."""
    r, c = sch.get_loops(block)[-2:]
    r0, r1 = sch.split(r, [None, TILE])
    c0, c1 = sch.split(c, [None, TILE])
    sch.reorder(r0, c0, r1, c1)
    sch.unroll(r0)
    sch.unroll(c0)
    return r1


def _bits(dtype: str) -> int:
    return DataType(dtype).bits
