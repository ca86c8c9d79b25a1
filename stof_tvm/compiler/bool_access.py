"""Keep boolean buffers out of vectorised loops of the CUDA kernels TVM schedules for us.

TVM 0.27's CUDA code generator prints a vector of two ``bool`` as ``ushort2``, so a vectorised load of two
one-byte booleans becomes ``*(ushort2*)(mask + i)``: a 4-byte load that reads each mask entry together with its
neighbour (wrong values) and faults with ``cudaErrorMisalignedAddress`` wherever the byte offset ``i`` is 2 mod 4.
Vectorised ``uint8``/``int8``/float accesses print correctly (``uchar2``, ``char2``, ``half2``): only bool is
affected. The case that hit us: a model's boolean mask ``where(keep, scores, fill)`` right after ``matmul(Q, K^T)``
(the canonical attention form, and GPT-2's own causal mask) is fused by ``FuseOps`` into the matmul's epilogue,
which dlight's GEMM schedule vectorises by two, so every dense attention layer read its mask that way.

:func:`scalar_bool_access` runs after the schedules (dlight, tuning records) and turns each vectorised loop
around a block that reads or writes a bool buffer into an unrolled loop: the same elements in the same order,
now one scalar access each, so the values are exact and the generated code has no vector access to a bool buffer.
Only the kernels touching bool buffers change; those lose the vector width of their other accesses in that loop
(two floats per store in a GEMM epilogue), nothing else.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

BOOL = "bool"


def _blocks(sch: s_tir.Schedule) -> list:
    """Every block below the root of the scheduled function, parents first."""
    out, pending = [], list(sch.get_child_blocks(sch.get_sblock("root")))
    while pending:
        block = pending.pop(0)
        out.append(block)
        pending.extend(sch.get_child_blocks(block))
    return out


def _touches_bool(block) -> bool:
    return any(str(region.source.dtype) == BOOL for region in list(block.reads) + list(block.writes))


def scalar_bool_primfunc(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """``func`` with no vectorised loop around a block accessing a bool buffer; None when it had none."""
    if not func.attrs or not func.attrs.get("s_tir", False):     # thread-level kernels: no blocks, no bool
        return None
    sch = s_tir.Schedule(func)
    changed = False
    for block in _blocks(sch):
        if not _touches_bool(sch.get(block)):
            continue
        for loop in sch.get_loops(block):
            if sch.get(loop).kind == tirx.ForKind.VECTORIZED:
                sch.unroll(loop)
                changed = True
    return sch.mod["main"] if changed else None


def scalar_bool_access(mod: tvm.IRModule) -> tvm.IRModule:
    """Every PrimFunc of ``mod`` through :func:`scalar_bool_primfunc` (the CUDA build's last step before codegen)."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            fixed = scalar_bool_primfunc(func)
            if fixed is not None:
                mod[gv] = fixed
    return mod
