"""The CUDA kernels each PrimFunc of a scheduled module launches, with their grid and block sizes.

A scheduled PrimFunc binds loops to ``blockIdx.*`` / ``threadIdx.*`` (``T.thread_binding`` loops or
``T.launch_thread`` attributes); each outermost such binding starts one kernel (a PrimFunc may hold several, e.g.
a scan's passes). Extents are the module's static shapes; a symbolic extent counts as unknown (``None``).

Used by the launch census (:mod:`stof_tvm.vm_census`, ``scripts/count_launches.py``): how many kernels a call
of each function launches, and how many of the GPU's SMs each kernel's grid can occupy (a 128 x 768 GEMM in 128 x
128 tiles is 6 blocks: 6 of the H200's 132 SMs).
"""
from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import s_tir, tirx

_TAGS = ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y", "threadIdx.z")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel launch: extents per thread tag (``blockIdx.x`` ...), None where not a constant."""

    extents: tuple
    serial_steps: int = 1     # the most iterations of non-thread loops on one path of a thread (unknown extents: 1)

    @property
    def blocks(self) -> int | None:
        return _product(self.extents, "blockIdx")

    @property
    def threads(self) -> int | None:
        return _product(self.extents, "threadIdx")

    def to_json(self) -> dict:
        return {"blocks": self.blocks, "threads": self.threads, "extents": dict(self.extents),
                "serial_steps": self.serial_steps}


def _product(extents: tuple, prefix: str) -> int | None:
    values = [value for tag, value in extents if tag.startswith(prefix)]
    if any(value is None for value in values):
        return None
    return math.prod(values) if values else 1


def _binding(stmt):
    """(tag, extent) when ``stmt`` binds a thread axis, else None."""
    if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.THREAD_BINDING and stmt.thread_binding is not None:
        return str(stmt.thread_binding.thread_tag), stmt.extent
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent":
        return str(stmt.node.thread_tag), stmt.value
    return None


def child_statements(stmt) -> list:
    """The statements directly inside ``stmt`` (sequence items, branches, a block's body and init, a body)."""
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, tirx.IfThenElse):
        return [stmt.then_case] + ([stmt.else_case] if stmt.else_case is not None else [])
    if isinstance(stmt, s_tir.SBlockRealize):
        return [stmt.block]
    if isinstance(stmt, s_tir.SBlock):
        return [stmt.body] + ([stmt.init] if stmt.init is not None else [])
    body = getattr(stmt, "body", None)
    return [body] if isinstance(body, tirx.Stmt) else []


def _collect_tags(stmt, found: dict) -> None:
    binding = _binding(stmt)
    if binding is not None:
        tag, extent = binding
        if tag in _TAGS:
            value = int(extent) if isinstance(extent, tirx.IntImm) else None
            found[tag] = value if tag not in found or found[tag] == value else None
    for child in child_statements(stmt):
        _collect_tags(child, found)


def serial_steps(stmt) -> int:
    """The most iterations of loops not bound to threads that one path through ``stmt`` nests (serial, unrolled
    and vectorised loops alike; a loop of unknown extent counts once)."""
    inner = max([serial_steps(child) for child in child_statements(stmt)] or [1])
    if isinstance(stmt, tirx.For) and _binding(stmt) is None:
        return (int(stmt.extent) if isinstance(stmt.extent, tirx.IntImm) else 1) * inner
    return inner


def _kernels_in(stmt, out: list) -> None:
    """Append one :class:`Kernel` per outermost thread binding under ``stmt``."""
    binding = _binding(stmt)
    if binding is not None and binding[0] in _TAGS:
        found: dict = {}
        _collect_tags(stmt, found)
        out.append(Kernel(tuple((tag, found[tag]) for tag in _TAGS if tag in found), serial_steps(stmt)))
        return
    for child in child_statements(stmt):
        _kernels_in(child, out)


def primfunc_kernels(func: tirx.PrimFunc) -> list[Kernel]:
    """The kernels one call of ``func`` launches, in order (empty for a host-only function)."""
    out: list = []
    _kernels_in(func.body, out)
    return out


def kernel_grids(mod: tvm.IRModule) -> dict[str, list[Kernel]]:
    """{function name (its global symbol, as the VM calls it): kernels} for every PrimFunc of ``mod``."""
    grids = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            name = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else gv.name_hint
            grids[name] = primfunc_kernels(func)
    return grids


def sm_share(kernel: Kernel, sm_count: int) -> float | None:
    """The share of ``sm_count`` SMs the kernel's grid can occupy in its first wave (1.0 from one block per SM)."""
    return None if kernel.blocks is None else min(1.0, kernel.blocks / sm_count)
