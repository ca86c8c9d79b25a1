"""Injective kernels that read one of their own intermediates transposed: that intermediate computed in its own
order into shared memory, tile by tile, and read back transposed.

HF DeBERTa-v3 adds two relative-position terms to every layer's scores, ``c2p[n, i, t1[i, j]]`` and the transpose of
a second gather, ``p2c[n, j, t2[j, i]]`` (:mod:`stof_tvm.compiler.gather_index` makes both a ``take`` by one flat
int32 table); ``FuseOps`` puts the two gathers, the transpose, their sum and the reshape onto [B, H, S, S] into one
kernel. Inlined into its output, the second term makes consecutive threads (consecutive ``j``) read the table
column ``t2[:, i]`` and rows of ``p2c`` a whole row apart wherever the relative position is exact (position
``i - j + buckets`` where |i - j| is below half the bucket count): one 32-byte sector per element. That term is
coalesced along ``i`` instead: for fixed ``j``, consecutive ``i`` read consecutive entries of the table row
``t2[j, :]`` and consecutive (or, in the log buckets, repeated) elements of the row ``p2c[n, j, :]``. Gathering from
the transposed product (``p2cT[n, t2[j, i], j]``, a matmul with swapped operands) did not help: its exact region
moves a row per ``j`` too (H100, 8 x 512: 168 us a layer for 100 MB of float32 output, ~25 us at the memory's speed;
BENCHMARKS.md, session 26). At that shape a warp's load of the term touched 22 sectors on average (32 in the exact
region), 2.3 in the row's order.

:class:`StagedTranspose` (a dlight rule: ``apply`` returns a schedule or None) takes an all-spatial function in
which one block's result is read by another with its last two axes swapped. That block (the *staged* one) keeps
its own iteration order; every other block is inlined, into the staged block or into the output. Each CUDA block
of ``tile`` x ``rows`` threads then owns a ``tile`` x ``tile`` tile of the output's last two axes: its threads
compute the staged block's matching tile with ``threadIdx.x`` along the staged block's last axis into shared
memory, synchronise, and compute the output with ``threadIdx.x`` along the output's last axis, reading the shared
tile transposed. Shared rows are padded by one 4-byte word so that a warp reading a column touches 32 different
banks. Exact: every element is computed by the same expression, only in another order.

It stages only where the staged block's loads are read strided (a sector per thread) by fewer of them with threads
along its own last axis than along the axis before it, the order the output would compute it in. A load's stride
along an axis is its address's (constant coefficient); a gather's is its index's, which in these kernels is a load
of a flat table (:mod:`stof_tvm.compiler.gather_index`) whose rows each hold offsets into one row of the gathered
tensor: along a table row the gather stays in one source row, across rows it moves a row per step. The tables'
values are constants of the Relax module, passed as arguments, which a schedule rule does not see; DeBERTa's rows
are contiguous or repeated offsets (above). A transposed intermediate that is cheaper in the output's order (HF
BLOOM's keys, transposed twice from its fused QKV projection back to a copy that reads rows) is left to the rules
after this one, as is anything else: a reduction, no transposed intermediate, a block that cannot be inlined, a
transposed read that is not at the output's own last two iterators, shapes that are not static.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import ir, s_tir, sym, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.tirx.analysis import undefined_vars

__all__ = ["StagedTranspose"]

SHARED_BANKS = 32       # of 4 bytes each: shared rows an odd number of words long keep a column's reads conflict-free


def _uses(expr, variables) -> bool:
    """Whether ``expr`` reads any of ``variables``."""
    return any(used.same_as(var) for used in undefined_vars(expr) for var in variables)


def _reads_transposed(block: s_tir.SBlock, buffer) -> bool:
    """Whether ``block`` reads ``buffer`` only at its own last two iterators swapped: ``buffer[..., v_j, v_i]`` in a
    block over ``[..., v_i, v_j]``, the leading indices free of both (one element of them per tile)."""
    iterators = [iv.var for iv in block.iter_vars]
    regions = [r for r in block.reads if r.source.same_as(buffer)]
    if len(iterators) < 2 or not regions:
        return False
    last_two = iterators[-2:]
    return all(len(r.region) >= 2 and r.region[-1].min.same_as(last_two[0]) and r.region[-2].min.same_as(last_two[1])
               and all(int(axis.extent) == 1 for axis in r.region)
               and not any(_uses(axis.min, last_two) for axis in r.region[:-2])
               for r in regions)


def _transposed_producer(sch: s_tir.Schedule, infos) -> int | None:
    """Index in ``infos`` of the first block whose result a later block reads with its last two axes swapped."""
    for index, info in enumerate(infos[:-1]):
        written = sch.get(info.block_rv).writes
        if len(written) != 1:
            continue
        if any(_reads_transposed(sch.get(later.block_rv), written[0].source) for later in infos[index + 1:]):
            return index
    return None


def _loads(expr) -> list:
    """Every buffer load in ``expr``, those inside another load's indices (a gather's table) included."""
    found = []
    tvm_ffi.structural_walk(expr, [(ir.TensorLoad, found.append)], order="post")
    return found


def _element_stride(load, thread) -> tirx.Expr | None:
    """How many elements apart (in its dense, row-major buffer) ``load`` reads for consecutive values of ``thread``;
    None where an index is not linear in it."""
    stride, size = tirx.const(0, "int64"), tirx.const(1, "int64")
    for index, extent in reversed(list(zip(load.indices, load.source.shape))):
        linear = sym.detect_linear_equation(index, [thread])
        if len(linear) != 2:
            return None
        stride = stride + tirx.Cast("int64", linear[0]) * size
        size = size * tirx.Cast("int64", extent)
    return sym.Analyzer().simplify(stride)


def _strided(load, thread) -> bool:
    """Whether consecutive values of ``thread`` make ``load`` read elements more than one apart (a 32-byte sector
    per thread, where a warp of neighbouring elements shares a few). A gather counts as its index's loads: a flat
    table of :mod:`stof_tvm.compiler.gather_index` holds, in each of its rows, offsets into one row of the gathered
    tensor, so along a table row the gather stays in one source row and across rows it moves a row per step."""
    nested = [inner for index in load.indices for inner in _loads(index)]
    if nested:
        return any(_strided(inner, thread) for inner in nested)
    stride = _element_stride(load, thread)
    return not (isinstance(stride, tirx.IntImm) and abs(int(stride)) <= 1)


def _staging_helps(block: s_tir.SBlock) -> bool:
    """Whether ``block`` (the staged one) reads fewer of its loads strided with threads along its own last axis
    than along the one before it (the order the output would compute it in)."""
    if not isinstance(block.body, tirx.BufferStore):
        return False
    loads = _loads(block.body.value)
    own, transposed = block.iter_vars[-1].var, block.iter_vars[-2].var
    return sum(_strided(load, own) for load in loads) < sum(_strided(load, transposed) for load in loads)


def _inline_all_but(sch: s_tir.Schedule, infos, keep: int) -> bool:
    """Inline every block of ``infos`` except ``infos[keep]`` and the last (the output) into the blocks that read
    it; False where one cannot be (the schedule is then discarded)."""
    for index, info in enumerate(infos[:-1]):
        if index == keep:
            continue
        try:
            sch.compute_inline(info.block_rv)
        except s_tir.ScheduleError:
            return False
    return True


def _static_extents(block: s_tir.SBlock) -> bool:
    """Whether every iterator of ``block`` has a constant extent (the tiles and the grid are fixed at compile time)."""
    return all(isinstance(iv.dom.extent, tirx.IntImm) for iv in block.iter_vars)


class StagedTranspose(GPUScheduleRule):
    """A transposed intermediate staged through shared memory by tiles (module docstring).

    ``tile``: the side of an output tile (and of the staged one); ``rows``: ``threadIdx.y`` extent, so a block runs
    ``tile`` x ``rows`` threads, each computing ``tile / rows`` elements of either tile."""

    def __init__(self, tile: int = 32, rows: int = 8):
        if tile % rows:
            raise ValueError(f"tile {tile} must be a multiple of rows {rows}")
        self.tile = tile
        self.rows = rows

    def apply(self, func, target, _tunable):  # noqa: D102 (dlight's ScheduleRule.apply)
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not all(info.is_injective() for info in infos):
            return None
        staged = _transposed_producer(sch, infos)
        if staged is None or not _inline_all_but(sch, infos, staged):
            return None
        staged_rv, output_rv = infos[staged].block_rv, infos[-1].block_rv
        staged_block, output = sch.get(staged_rv), sch.get(output_rv)
        staged_buffer = staged_block.writes[0].source
        inlined = len(sch.get_child_blocks(sch.get_sblock("root"))) == 2
        if not inlined or any(param.same_as(staged_buffer) for param in func.params):
            return None
        if not (_static_extents(output) and _static_extents(staged_block) and _reads_transposed(output, staged_buffer)
                and _staging_helps(staged_block)):
            return None
        try:
            self._tile_output(sch, output_rv)
            self._stage(sch, staged_rv, sch.get_loops(output_rv)[0])
        except s_tir.ScheduleError:         # a shape the tiles do not fit: the rules after this one schedule it
            return None
        return sch

    def _tile_output(self, sch: s_tir.Schedule, block_rv) -> None:
        """One CUDA block per ``tile`` x ``tile`` tile of the output's last two axes (and per index of the leading
        ones); threads along its last axis, so that loads along it and the store are coalesced."""
        *leading, rows, cols = sch.get_loops(block_rv)
        row_tiles, row = sch.split(rows, [None, self.tile])
        col_tiles, col = sch.split(cols, [None, self.tile])
        row_steps, thread_y = sch.split(row, [None, self.rows])
        sch.reorder(*leading, row_tiles, col_tiles, thread_y, row_steps, col)
        sch.bind(sch.fuse(*leading, row_tiles, col_tiles), "blockIdx.x")
        sch.bind(thread_y, "threadIdx.y")
        sch.bind(col, "threadIdx.x")

    def _stage(self, sch: s_tir.Schedule, block_rv, tile_loop) -> None:
        """The staged block's tile in shared memory, computed per CUDA block before the output reads it, threads
        along its own last axis; rows padded by one 4-byte word (:data:`SHARED_BANKS`)."""
        sch.set_scope(block_rv, 0, "shared")
        sch.compute_at(block_rv, tile_loop)
        rows, cols = sch.get_loops(block_rv)[-2:]
        row_steps, thread_y = sch.split(rows, [None, self.rows])
        sch.reorder(thread_y, row_steps, cols)
        sch.bind(thread_y, "threadIdx.y")
        sch.bind(cols, "threadIdx.x")
        written = sch.get(block_rv).writes[0]
        per_word = max(1, 4 * 8 // tvm.DataType(written.source.dtype).bits)
        sch.storage_align(block_rv, 0, axis=len(written.region) - 2, factor=SHARED_BANKS * per_word, offset=per_word)
