"""Building scheduled templates: the pass configuration they need, a CUDA target, a MetaSchedule builder.

The templates mark their global -> shared copies for ``cp.async`` (software-pipeline async stages);
TVM turns those copies into ``cp.async`` only under the pass option ``tirx.use_async_copy``, otherwise
it emits plain (synchronous) loads and stores, still correct but slower. Every build of a template
therefore goes through :data:`BUILD_CONFIG`: :func:`build` here, :func:`ms_builder` for MetaSchedule
tuning, and ``tvm.transform.PassContext(config=BUILD_CONFIG)`` around any other compile (a Relax module
that calls templates).
"""
from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

BUILD_CONFIG = {"tirx.use_async_copy": True}


def cuda_target(arch: str = "sm_90", max_shared_memory_per_block: int = 232448) -> tvm.target.Target:
    """A CUDA target with the limits MetaSchedule needs (H200 defaults), host llvm."""
    return tvm.target.Target({"kind": "cuda", "arch": arch, "max_threads_per_block": 1024,
                              "max_shared_memory_per_block": max_shared_memory_per_block},
                             host={"kind": "llvm"})


def build(sch_or_mod, target: tvm.target.Target | None = None):
    """Compile a scheduled template (Schedule, IRModule or PrimFunc) with :data:`BUILD_CONFIG`."""
    mod = sch_or_mod.mod if isinstance(sch_or_mod, s_tir.Schedule) else sch_or_mod
    with tvm.transform.PassContext(opt_level=3, config=BUILD_CONFIG):
        return tvm.compile(mod, target=target or cuda_target())


def cuda_source(executable) -> str:
    """The CUDA C++ source of a built template (searches the module's imports)."""
    pending = [executable.mod]
    while pending:
        module = pending.pop()
        if module.kind == "cuda":
            return module.inspect_source()
        pending.extend(module.imports)
    raise ValueError("the module has no CUDA import (was it built for a CUDA target?)")


def _build_with_config(mod, target, _params):
    """MetaSchedule ``f_build``: TVM's default build under :data:`BUILD_CONFIG`."""
    from tvm.s_tir.meta_schedule.builder.local_builder import default_build  # pylint: disable=import-outside-toplevel

    with tvm.transform.PassContext(opt_level=3, config=BUILD_CONFIG):
        return default_build(mod, target, _params)


def ms_builder(timeout_sec: float = 120.0, max_workers: int | None = None) -> ms.builder.LocalBuilder:
    """A MetaSchedule LocalBuilder that compiles candidates with :data:`BUILD_CONFIG`."""
    return ms.builder.LocalBuilder(f_build=_build_with_config, timeout_sec=timeout_sec, max_workers=max_workers)
