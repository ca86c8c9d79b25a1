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
count, and the software-pipeline annotations, which depend on ``stages``) are recorded as block/loop
annotations and carried out by :func:`finalize`, which a fixed schedule calls at once and a MetaSchedule
search runs as a postprocessor on each candidate.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir
from tvm.runtime import DataType

from .intrin import TILE, WARP, WARP_MAPS, intrin_names

PAD = 8  # elements of padding per shared row of A/B (16 bytes)
ACC_PAD = 8  # float32 elements of padding per row of the accumulator staging tile
COPY_BYTES = 16  # cp.async width

COOP_KEY = "stof.cooperative_vec"  # block annotation: split the fused copy loop over all threads, this vector width
STAGE_IO_KEY = "stof.stage_io"  # block annotation (with COOP_KEY): vector loads/stores through registers
STAGES_KEY = "stof.pipeline_stages"  # k-outer loop annotation: software pipeline depth
INNER_KEY = "stof.pipeline_inner"  # k-inner loop annotation: double-buffer the ldmatrix fragments


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
    names = intrin_names(dtype, b_layout)
    blk = sch.get_sblock(block) if isinstance(block, str) else block
    i, j, k = sch.get_loops(blk)
    i, it = sch.split(i, [None, TILE])
    j, jt = sch.split(j, [None, TILE])
    k, kt = sch.split(k, [None, TILE])
    sch.reorder(i, j, k, it, jt, kt)
    inner = blk
    outer = sch.blockize(it)

    i0, i1, i2 = sch.split(i, [None, warps_m, frag_m])
    j0, j1, j2 = sch.split(j, [None, warps_n, frag_n])
    k0, k1 = sch.split(k, [None, k_frags])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    bx = sch.fuse(i0, j0)
    sch.bind(bx, "blockIdx.x")
    ty = sch.fuse(i1, j1)
    sch.bind(ty, "threadIdx.y")

    vec = COPY_BYTES * 8 // _bits(dtype)
    for index in (0, 1):
        shared = sch.cache_read(outer, index, "shared.dyn")
        sch.compute_at(shared, k0)
        sch.storage_align(shared, 0, axis=-2, factor=32, offset=PAD)
        sch.annotate(shared, COOP_KEY, vec)

    a_warp = sch.cache_read(outer, 0, "warp")
    sch.compute_at(a_warp, k1)
    b_warp = sch.cache_read(outer, 1, "warp")
    sch.compute_at(b_warp, k1)
    acc_warp_store = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(acc_warp_store, ty)
    sch.set_scope(acc_warp_store, 0, "shared.dyn")
    for name in consumers:
        sch.reverse_compute_at(sch.get_sblock(name), bx)
    _tile16(sch, acc_warp_store)
    sch.decompose_reduction(outer, k0)
    init_inner = sch.get_sblock(sch.get(inner).name_hint + "_init")

    la = _tile16(sch, a_warp)
    lb = _tile16(sch, b_warp)
    sch.transform_layout(a_warp, ("write", 0), WARP_MAPS["a"])
    sch.transform_layout(b_warp, ("write", 0), WARP_MAPS["b_" + b_layout])
    sch.transform_layout(acc_warp_store, ("read", 0), WARP_MAPS["c"])
    sch.tensorize(la, names["load_a"])
    sch.tensorize(lb, names["load_b"])
    sch.tensorize(sch.get_loops(inner)[-3], names["compute"])
    sch.tensorize(sch.get_loops(init_inner)[-2], names["init"])
    store_name = sch.get(acc_warp_store).name_hint
    sch.tensorize(sch.get_loops(acc_warp_store)[-2], names["store"])
    # the padding annotation must sit on the block that writes the staging tile, which tensorize replaced
    acc_warp_store = sch.get_sblock(store_name + "_o")
    sch.storage_align(acc_warp_store, 0, axis=-2, factor=32, offset=ACC_PAD)

    sch.annotate(k0, STAGES_KEY, stages)
    sch.annotate(k1, INNER_KEY, 1)
    return MainLoop(block_loop=bx, warp_loop=ty, k_outer=k0, acc_store=acc_warp_store)


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


def cooperative(sch: s_tir.Schedule, block, vec, stage_io: bool = False) -> None:
    """Mark a block whose last two loops (rows, columns) are to be spread over every thread of the block,
    ``vec`` consecutive columns per thread; ``stage_io`` for elementwise epilogues (see :func:`finalize`)."""
    sch.annotate(block, COOP_KEY, vec)
    if stage_io:
        sch.annotate(block, STAGE_IO_KEY, 1)


def finalize(sch: s_tir.Schedule) -> None:
    """Carry out the deferred steps recorded as annotations (needs concrete knob values).

    - blocks annotated with ``COOP_KEY`` = v: their last two loops (rows, columns) become
      [rest, threadIdx.y, threadIdx.x] x v (columns split by v, the rest fused and spread over the threads,
      whose extents are read off the kernel's bound loops). Plain copies vectorize the v loop;
      blocks also annotated with ``STAGE_IO_KEY`` (epilogues) read their inputs into registers with v-wide
      loads, compute the v outputs in an unrolled loop, and store them with one v-wide store;
    - loops annotated with ``STAGES_KEY`` = s: software_pipeline_stage [0, 0, s-1, s-1, s-1] over the
      statements (A copy, B copy, fragment prologue, fragment loop, fragment epilogue), copies asynchronous;
    - loops annotated with ``INNER_KEY``: fragment double buffering, stages [0, 0, 1].
    """
    warps = _thread_extent(sch, "threadIdx.y")
    lanes = _thread_extent(sch, "threadIdx.x") or WARP
    for block in _all_blocks(sch):
        ann = sch.get(block).annotations
        if COOP_KEY in ann:
            _spread(sch, block, int(ann[COOP_KEY]), STAGE_IO_KEY in ann, warps, lanes)
        for loop in sch.get_loops(block):
            lann = sch.get(loop).annotations
            if STAGES_KEY in lann:
                stages = int(lann[STAGES_KEY])
                sch.unannotate(loop, STAGES_KEY)
                last = stages - 1
                sch.annotate(loop, "software_pipeline_stage", [0, 0, last, last, last])
                sch.annotate(loop, "software_pipeline_order", [0, 1, 2, 3, 4])
                sch.annotate(loop, "software_pipeline_async_stages", [0])
            if INNER_KEY in lann:
                sch.unannotate(loop, INNER_KEY)
                sch.annotate(loop, "software_pipeline_stage", [0, 0, 1])
                sch.annotate(loop, "software_pipeline_order", [0, 1, 2])


def _spread(sch: s_tir.Schedule, block, vec: int, stage_io: bool, warps: int | None, lanes: int) -> None:
    """Split a block's fused last loop over all threads with ``vec`` elements each (see :func:`finalize`)."""
    name = sch.get(block).name_hint
    sch.unannotate(block, COOP_KEY)
    if stage_io:
        sch.unannotate(block, STAGE_IO_KEY)
    rows, cols = sch.get_loops(block)[-2:]
    extent = int(sch.get(rows).extent) * int(sch.get(cols).extent)
    if int(sch.get(cols).extent) % vec or extent % (vec * lanes * (warps or 1)):
        raise ValueError(f"block {name}: {extent} elements do not split over {warps}x{lanes} threads x {vec}")
    cols, v = sch.split(cols, [None, vec])
    loop = sch.fuse(rows, cols)
    if warps:
        _, y, x = sch.split(loop, [None, warps, lanes])
        sch.bind(y, "threadIdx.y")
    else:
        _, x = sch.split(loop, [None, lanes])
    sch.bind(x, "threadIdx.x")
    if not stage_io:
        sch.vectorize(v)
        return
    sch.unroll(v)
    out = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(out, x)
    sch.vectorize(sch.get_loops(out)[-1])
    for buffer in [region.source for region in sch.get(block).reads]:
        if buffer.scope() == "local":
            continue
        index = [r.source.same_as(buffer) for r in sch.get(block).reads].index(True)
        cached = sch.cache_read(block, index, "local")
        sch.compute_at(cached, x)
        loops = sch.get_loops(cached)
        if len(loops) > len(sch.get_loops(out)) - 1:
            sch.vectorize(loops[-1])


def _all_blocks(sch: s_tir.Schedule) -> list:
    """Every block of the function below the root, parents before children."""
    out = []
    pending = list(sch.get_child_blocks(sch.get_sblock("root")))
    while pending:
        block = pending.pop(0)
        out.append(block)
        pending.extend(sch.get_child_blocks(block))
    return out


def _thread_extent(sch: s_tir.Schedule, tag: str) -> int | None:
    """Extent of the loops bound to ``tag`` (every loop bound to one tag in a kernel has the same extent)."""
    extents = [int(sch.get(loop).extent) for block in _all_blocks(sch) for loop in sch.get_loops(block)
               if sch.get(loop).thread_binding is not None and sch.get(loop).thread_binding.thread_tag == tag]
    return max(extents) if extents else None
