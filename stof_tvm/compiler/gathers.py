"""Let ``FuseOps`` fuse gathers (``take``, ``gather_elements``) with the elementwise work around them.

TVM's ``AnnotateTIROpPattern`` marks a legalized gather opaque: its reads are indexed by another buffer's values,
which its analysis does not classify. So every embedding lookup of a transformer runs as a kernel of its own,
and the index arithmetic before it (clamping ids into the table, RoBERTa's position ids) and the sum after it
run as further kernels: RoBERTa-base spent 10 of its 17 kernels outside the layers there (launch-bound at 1x128).
A gather is injective all the same (each output element is one read of the table), so :func:`gathers_injective`
marks such functions injective: a PrimFunc, unscheduled, whose whole computation is one block with only spatial
iterators writing one buffer. ``FuseOps`` then fuses the ids' arithmetic, the lookups and their sum into one
kernel, scheduled by dlight like any injective function.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .kernel_grids import child_statements
from .op_patterns import INJECTIVE, OPAQUE

_DATA_PARALLEL = 0                # IterVar kDataPar


def _blocks(func: tirx.PrimFunc) -> list:
    found, stack = [], [func.body]
    while stack:
        stmt = stack.pop()
        if isinstance(stmt, s_tir.SBlock) and stmt.name_hint != "root":
            found.append(stmt)
        stack.extend(child_statements(stmt))
    return found


def is_spatial_gather(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` is an opaque, unscheduled PrimFunc whose computation is one spatial block with one output."""
    attrs = func.attrs
    if attrs is None or int(attrs.get("op_pattern", -1)) != OPAQUE or attrs.get("tirx.is_scheduled"):
        return False
    blocks = _blocks(func)
    if len(blocks) != 1:
        return False
    block = blocks[0]
    return (block.init is None and len(block.writes) == 1
            and all(int(var.iter_type) == _DATA_PARALLEL for var in block.iter_vars))


@tvm.transform.module_pass(opt_level=0, name="GathersInjective")
def gathers_injective(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Mark every :func:`is_spatial_gather` PrimFunc injective (run after ``AnnotateTIROpPattern``)."""
    updates = {gv: func.with_attr("op_pattern", INJECTIVE) for gv, func in mod.functions_items()
               if isinstance(func, tirx.PrimFunc) and is_spatial_gather(func)}
    for gv, func in updates.items():
        mod[gv] = func
    return mod
