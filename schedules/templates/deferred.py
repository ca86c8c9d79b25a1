"""Scheduling steps that need concrete knob values, recorded as annotations and carried out by :func:`finalize`.

A template's schedule function runs with knob values that are either ints (``Template.apply``) or
MetaSchedule random variables (``Template.sample``). Splits and bindings whose factors are single knobs
take the random variables directly; steps whose numbers are products of knobs (threads per block), or
lists built from a knob (software-pipeline stage arrays), are written as annotations here and finished by
:func:`finalize`, which ``Template.apply`` calls at once and a MetaSchedule search runs as a postprocessor on
each sampled candidate (its primitives land in the trace, so database records replay them).
"""
from __future__ import annotations

from tvm import s_tir

WARP = 32

COOP_KEY = "stof.cooperative_vec"  # block: spread the last two loops over all threads, this many columns each
STAGE_IO_KEY = "stof.stage_io"  # block (with COOP_KEY): vector loads/stores through registers
STAGES_KEY = "stof.pipeline_stages"  # GEMM k-outer loop: software pipeline depth
INNER_KEY = "stof.pipeline_inner"  # GEMM k-inner loop: double-buffer the ldmatrix fragments
ROWS_KEY = "stof.row_vec"  # row-epilogue output block: columns per thread access
ROW_LANES_KEY = "stof.row_lanes"  # row-epilogue output block: threads per row (threadIdx.x extent)
ROW_PRODUCER_KEY = "stof.row_producer"  # blocks computed once per row before the output (reductions, y stage)
ROW_REGISTERS_KEY = "stof.row_registers"  # row-epilogue output block: 1 = staged rows in registers, 0 = shared memory


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
    - loops annotated with ``INNER_KEY``: fragment double buffering, stages [0, 0, 1];
    - a block annotated with ``ROWS_KEY`` = v and ``ROW_LANES_KEY`` = l (the output of a row epilogue such as
      LayerNorm, loops (rows, columns)): rows spread over threadIdx.y, each row over l lanes of threadIdx.x
      with v columns per access (without a threadIdx.y loop yet, every row of the block gets its own
      threadIdx.y); the blocks annotated ``ROW_PRODUCER_KEY`` (per-row reductions, a staged
      row) are computed once per row before it, reductions across the l lanes; a staged row goes to shared memory,
      or with ``ROW_REGISTERS_KEY`` = 1 to each thread's registers (its n / l values, :func:`_register_row`).
    """
    warps = _thread_extent(sch, "threadIdx.y")
    for block in _all_blocks(sch):
        if ROWS_KEY in sch.get(block).annotations:
            _rows(sch, block, warps)
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
    if int(sch.get(cols).extent) % vec or (extent // vec) % lanes:
        raise ValueError(f"block {name}: {extent} elements do not split over {lanes} lanes x {vec}")
    # fewer vectors than threads (or a remainder): the split adds a predicate, whole warps stay uniform
    cols, v = sch.split(cols, [None, vec])
    loop = sch.fuse(rows, cols)
    if warps:
        _, y, x = sch.split(loop, [None, warps, lanes])
        sch.bind(y, "threadIdx.y")
    else:
        _, x = sch.split(loop, [None, lanes])
    sch.bind(x, "threadIdx.x")
    if stage_io:
        _stage_io(sch, block, x, v)
    else:
        sch.vectorize(v)


def row_epilogue(sch: s_tir.Schedule, out, producers, vec, lanes, registers=0) -> None:
    """Mark ``out`` (loops rows x columns) as a row epilogue whose ``producers`` (block handles, each read by
    ``out`` or by a later producer, listed consumers first) are computed per row; ``registers`` (1) keeps a staged
    row (a producer that is not a reduction) in each thread's registers instead of shared memory; see
    :func:`finalize`."""
    sch.annotate(out, ROWS_KEY, vec)
    sch.annotate(out, ROW_LANES_KEY, lanes)
    sch.annotate(out, ROW_REGISTERS_KEY, registers)
    for block in producers:
        sch.annotate(block, ROW_PRODUCER_KEY, 1)


def _rows(sch: s_tir.Schedule, out, warps: int | None) -> None:
    ann = sch.get(out).annotations
    vec, lanes = int(ann[ROWS_KEY]), int(ann[ROW_LANES_KEY])
    registers = int(ann.get(ROW_REGISTERS_KEY, 0))
    for key in (ROWS_KEY, ROW_LANES_KEY) + ((ROW_REGISTERS_KEY,) if ROW_REGISTERS_KEY in ann else ()):
        sch.unannotate(out, key)
    name = sch.get(out).name_hint
    rows, cols = sch.get_loops(out)[-2:]
    n_rows, n_cols = int(sch.get(rows).extent), int(sch.get(cols).extent)
    warps = warps or n_rows  # standalone row kernels: one row per threadIdx.y
    if n_rows % warps or n_cols % (lanes * vec):
        raise ValueError(f"block {name}: {n_rows}x{n_cols} does not split over {warps} rows x {lanes} lanes x {vec}")
    row_outer, row_thread = sch.split(rows, [None, warps])
    sch.bind(row_thread, "threadIdx.y")
    # last producer first: compute_at needs every consumer of a block already under the row loop
    producers = [b for b in _all_blocks(sch) if ROW_PRODUCER_KEY in sch.get(b).annotations]
    for block in reversed(producers):
        sch.unannotate(block, ROW_PRODUCER_KEY)
        sch.compute_at(block, row_thread)
        _, x, v = sch.split(sch.get_loops(block)[-1], [None, lanes, vec])
        sch.bind(x, "threadIdx.x")
        if _is_reduction(sch, block):
            sch.set_scope(block, 0, "local")
        elif registers:
            _register_row(sch, block, lanes, vec)
            _stage_inputs(sch, block, x)
        else:
            sch.set_scope(block, 0, "shared")
            sch.vectorize(v)
    _, x, v = sch.split(cols, [None, lanes, vec])
    sch.bind(x, "threadIdx.x")
    _stage_io(sch, out, x, v)


def _register_row(sch: s_tir.Schedule, block, lanes: int, vec: int) -> None:
    """Keep the row ``block`` stages (buffer [rows, n]) in registers: each of the ``lanes`` threads of a row holds
    its ``n / lanes`` values, column ``j`` (lane ``(j // vec) % lanes``'s) at ``[j // (lanes * vec), j % vec]`` of
    a thread-local [rows, accesses, vec] buffer. The lane is left out of the layout on purpose: in local scope each
    thread has its own copy, every thread reads back only the columns it wrote (all consumers split the row the
    same way), and the per-row copy compacts to ``n / lanes`` registers with constant indices."""
    step = lanes * vec
    sch.transform_layout(block, ("write", 0), lambda i, j: (i, j // step, j % vec))
    sch.set_scope(block, 0, "local")


def _is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == 2 for iv in sch.get(block).iter_vars)  # 2 = CommReduce


def _stage_io(sch: s_tir.Schedule, block, thread_loop, vec_loop) -> None:
    """Read the block's non-local inputs into registers and write its outputs from registers, v wide."""
    sch.unroll(vec_loop)
    # one output, or several (residual_rmsnorm: sum and out); all cached before any moves under the thread loop
    outs = [sch.cache_write(block, index, "local") for index in range(len(sch.get(block).writes))]
    for out in outs:
        sch.reverse_compute_at(out, thread_loop)
        sch.vectorize(sch.get_loops(out)[-1])
    _stage_inputs(sch, block, thread_loop)


def _stage_inputs(sch: s_tir.Schedule, block, thread_loop) -> None:
    """Read the block's inputs that are not local yet into registers under ``thread_loop``, with vector loads where
    the copy has a loop of its own."""
    for buffer in [region.source for region in sch.get(block).reads]:
        if buffer.scope() == "local":
            continue
        index = [r.source.same_as(buffer) for r in sch.get(block).reads].index(True)
        cached = sch.cache_read(block, index, "local", consumer_blocks=[block])
        sch.compute_at(cached, thread_loop)
        loops = sch.get_loops(cached)
        if len(loops) > len(sch.get_loops(block)) - 1:
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
