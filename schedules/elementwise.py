"""Vectorised elementwise kernels: the injective functions dlight's fallback would give one thread per element.

After fusion a model keeps a few injective kernels that no template covers: the embeddings (three row gathers, their
sum and the position-id arithmetic in one function, :mod:`stof_tvm.compiler.gathers`) and the cast of the output to
float32. dlight's ``Fallback`` runs them with one thread per element, so each thread redoes the row's index
arithmetic (64-bit, with the clamps and wrap-arounds of ``take``) for a single value and moves 2-4 bytes. RoBERTa-base
at 16 x 2048 tokens (H100, in place): the embeddings took 267 us and the output cast 112 us, against ~50 us and ~45 us
for their bytes at the memory's speed; under this rule 72 and 53 us (BENCHMARKS.md, session 20).

:class:`VectorizedElementwise` (a dlight rule: ``apply`` returns a schedule or None, tried before ``Fallback``) gives
each thread ``lanes`` consecutive elements of the innermost axis instead, as one vectorised loop: loads and the store
become 8- or 16-byte accesses, and whatever does not depend on the innermost axis (the gathered row, its index
arithmetic) is computed once per thread. It applies only where that is safe for the vector accesses' alignment:
one spatial block after inlining, whose store writes the innermost axis itself, and whose every load either does not
depend on it or reads it at unit stride, at a provable multiple of ``lanes``, from a buffer whose rows are multiples
of ``lanes`` long (no strides, no element offset). Anything else is left to the rules after it. A tensor's data
starts 16-byte aligned: TVM allocates at 64 bytes, and the compiler's only views (Q, K and V into the QKV projection's
output, :mod:`stof_tvm.compiler.qkv_heads`) start at multiples of 32 bytes.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import ir, s_tir, sym, tirx
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize, normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

__all__ = ["VectorizedElementwise", "vector_lanes"]


def _loads(expr) -> list:
    """Every buffer load in ``expr`` (``tirx.BufferLoad`` builds an ``ir.TensorLoad``; its buffer is ``source``)."""
    found = []
    tvm_ffi.structural_walk(expr, [(ir.TensorLoad, found.append)], order="post")
    return found


def _plain(buffer) -> bool:
    """A dense row-major buffer of whole bytes (no strides, no element offset, not bool)."""
    offset, dtype = buffer.elem_offset, tvm.DataType(buffer.dtype)
    return (not buffer.strides and isinstance(offset, tirx.IntImm) and int(offset) == 0
            and buffer.dtype != "bool" and dtype.bits >= 8 and dtype.lanes == 1)


def _uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(ir.Var, lambda v: found.append(v) if v.same_as(var) else None)])
    return bool(found)


def _moving_float_bits(value, inner) -> list[int]:
    """Bit widths of the floating-point values in ``value`` that depend on ``inner`` (they become vectors of
    ``lanes``). They bound the lanes as the accesses do: TVM's CUDA code generator spells a vector of more than four
    32-bit floats as a ``ulonglong4`` and broadcasts a scalar into it with a ``make_ulonglong4`` of eight floats, which
    nvcc rejects (HF DeBERTa-v2's embeddings: a float16 row times its float32 attention-mask value)."""
    found = []
    tvm_ffi.structural_walk(value, [(ir.Expr, found.append)], order="post")
    types = [(tvm.DataType(str(e.ty)), e) for e in found if isinstance(getattr(e, "ty", None), ir.PrimType)]
    return [dtype.bits for dtype, e in types if dtype.is_float and _uses(e, inner)]


def vector_lanes(block: tirx.Stmt, inner, vector_bytes: int = 16) -> int | None:
    """Elements per thread for ``block`` vectorised along its block iterator ``inner``, or None where unsafe.

    The widest element type on the accesses that move with ``inner`` sets the lanes (``vector_bytes`` per access),
    or a wider floating-point value computed from them (:func:`_moving_float_bits`);
    the store must write ``inner`` as its last index, and each load must be invariant in ``inner`` or read it at unit
    stride from the start of a ``lanes``-aligned slot of a row of a multiple of ``lanes`` elements."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not _plain(store.buffer):
        return None
    if not store.indices or not store.indices[-1].same_as(inner) or any(_uses(i, inner) for i in store.indices[:-1]):
        return None
    moving = [(store.buffer, store.indices[-1])]
    for load in _loads(store.value):
        if not _plain(load.source) or any(_uses(i, inner) for i in load.indices[:-1]):
            return None
        if load.indices and _uses(load.indices[-1], inner):      # a 0-d load (a scalar tensor) is invariant
            moving.append((load.source, load.indices[-1]))
    widest = max([tvm.DataType(buffer.dtype).bits // 8 for buffer, _ in moving]
                 + [bits // 8 for bits in _moving_float_bits(store.value, inner)])
    lanes = vector_bytes // widest
    if lanes < 2:
        return None
    analyzer = sym.Analyzer()
    for buffer, index in moving:
        linear = sym.detect_linear_equation(index, [inner])
        if len(linear) != 2 or not analyzer.can_prove_equal(linear[0], 1):
            return None
        row = buffer.shape[-1]
        if not (analyzer.can_prove_equal(tirx.floormod(row, lanes), 0)
                and analyzer.can_prove_equal(tirx.floormod(linear[1], lanes), 0)):
            return None
    return lanes


def _bound_one_to_one(sch: s_tir.Schedule, block_rv, loops) -> bool:
    """Each block iterator is bound to its own loop, in order, and no loop is bound to a thread yet."""
    realize = get_sblockrealize(sch, block_rv)
    if len(loops) != len(realize.iter_values):
        return False
    for loop_rv, value in zip(loops, realize.iter_values):
        loop = sch.get(loop_rv)
        if loop.thread_binding is not None or not value.same_as(loop.loop_var):
            return False
    return True


class VectorizedElementwise(GPUScheduleRule):
    """One thread per ``lanes`` consecutive elements of an injective function's innermost axis (module docstring).

    ``threads`` per block; ``vector_bytes`` per vector access (16: one 128-bit load or store)."""

    def __init__(self, threads: int = 256, vector_bytes: int = 16):
        self.threads = threads
        self.vector_bytes = vector_bytes

    def apply(self, func, target, _tunable):  # noqa: D102 (dlight's ScheduleRule.apply)
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos:
            return None
        infos = try_inline(sch, infos)
        if len(infos) != 1 or not infos[0].is_injective():
            return None
        block_rv = infos[0].block_rv
        loops = sch.get_loops(block_rv)
        if not _bound_one_to_one(sch, block_rv, loops):
            return None
        block = sch.get(block_rv)
        lanes = vector_lanes(block, block.iter_vars[-1].var, self.vector_bytes)
        if lanes is None:
            return None
        rows, lane = sch.split(loops[-1], factors=[None, lanes])
        block_x, thread_x = sch.split(sch.fuse(*loops[:-1], rows), factors=[None, self.threads])
        sch.bind(block_x, "blockIdx.x")
        sch.bind(thread_x, "threadIdx.x")
        sch.vectorize(lane)
        return sch
