"""Targets and the build pipeline that turns the rewritten Relax module into an executable.

Everything that is not attention goes through TVM's own Relax pipeline: legalization, operator fusion
(``FuseOps``/``FuseTIR``; gathers count as injective there, :mod:`.gathers`), tuning records from a MetaSchedule
database where given, then dlight's default GPU schedules for the functions no record covered, with
:class:`stof_tvm.schedules.small_k_matmul.SmallKTensorCoreMatmul` ahead of its matmul rule (tensor cores for
k <= 64), :class:`stof_tvm.schedules.staged_transpose.StagedTranspose` (an injective function reading one of its
intermediates transposed computes it through shared memory by tiles) and
:class:`stof_tvm.schedules.elementwise.VectorizedElementwise` ahead of its one-thread-per-element fallback (CUDA only;
on the CPU TVM's default lowering is used), then no vectorised access to a bool buffer
(:mod:`.bool_access`: TVM's CUDA codegen gets them wrong). Our attention kernels arrive already scheduled
(``tirx.is_scheduled``), so dlight leaves them alone.
"""
from __future__ import annotations

import contextlib

import tvm
from tvm import relax

from stof_tvm.schedules import dependent_launch as launch_overlap
from stof_tvm.schedules.elementwise import VectorizedElementwise
from stof_tvm.schedules.small_k_matmul import SmallKTensorCoreMatmul
from stof_tvm.schedules.staged_transpose import StagedTranspose

from .bool_access import scalar_bool_access
from .gathers import gathers_injective
from .numpy_fold import fold_numpy

CUDA_DEFAULTS = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
                 "max_shared_memory_per_block": 232448}


def target_dict(target) -> dict:
    """Normalise ``"cuda"``, ``"llvm"`` or a TVM target dict into a plain dict (kept in the manifest)."""
    if isinstance(target, str):
        if target == "cuda":
            return dict(CUDA_DEFAULTS)
        if target == "llvm":
            return {"kind": "llvm"}
        raise ValueError(f"target: expected 'cuda', 'llvm' or a TVM target dict, got {target!r}")
    if isinstance(target, dict):
        if target.get("kind") not in ("cuda", "llvm"):
            raise ValueError(f"target: the dict's 'kind' must be 'cuda' or 'llvm', got {target.get('kind')!r}")
        merged = {**CUDA_DEFAULTS, **target} if target["kind"] == "cuda" else dict(target)
        return {k: v for k, v in merged.items() if k != "host"}
    raise TypeError(f"target: expected a string or a dict, got {type(target).__name__}")


def make_target(spec: dict) -> tvm.target.Target:
    if spec["kind"] == "cuda":
        return tvm.target.Target(spec, host={"kind": "llvm"})
    return tvm.target.Target(spec)


def fold_constant_casts(mod: tvm.IRModule) -> tvm.IRModule:
    """Cast constant tensors in numpy (``astype(const)`` -> const): mixed precision leaves one cast per weight,
    and folding them with ``FoldConstant`` after legalization would build and run one CPU kernel each."""
    from tvm.relax.dpl import is_const, is_op, rewrite_call

    const = is_const()
    pattern = is_op("relax.astype")(const)

    def cast(expr, matches):
        value = matches[const].value.numpy()
        return relax.const(value.astype(str(expr.attrs.dtype)), str(expr.attrs.dtype))

    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gv] = rewrite_call(pattern, cast, func)
    return mod


def optimize(mod: tvm.IRModule, target: tvm.target.Target, database: str | None) -> tvm.IRModule:
    """Legalize and fuse; apply MetaSchedule records from ``database``; dlight for the rest on CUDA (transposed
    intermediates staged in shared memory and vectorised elementwise kernels before its fallback).

    The records are the database the rest of the compile read (:func:`stof_tvm.records.open_database`: loaded
    once, with every intrinsic a record names registered), handed to the pass as the current database."""
    records = contextlib.nullcontext()
    if database is not None:
        from stof_tvm.records import open_database

        records = open_database(database).ms
    mod = fold_numpy(mod)           # the constant calls the rewrites left, without a CPU kernel each
    with target, tvm.transform.PassContext(opt_level=3), records:   # MetaScheduleApplyDatabase reads both here
        passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), gathers_injective,
                  relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR(),
                  relax.transform.DeadCodeElimination()]
        if database is not None:
            passes.append(relax.transform.MetaScheduleApplyDatabase())
        if target.kind.name == "cuda":
            from tvm.s_tir import dlight as dl

            passes.append(dl.ApplyDefaultSchedule(SmallKTensorCoreMatmul(), dl.gpu.Matmul(), dl.gpu.GEMV(),
                                                  dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
                                                  StagedTranspose(), VectorizedElementwise(), dl.gpu.Fallback()))
        mod = tvm.transform.Sequential(passes)(mod)
    # TVM's CUDA codegen gets vector accesses to bool buffers wrong (bool_access); they become scalar ones.
    return scalar_bool_access(mod) if target.kind.name == "cuda" else mod


def build(mod: tvm.IRModule, target: tvm.target.Target, templates: bool = False, cuda_graph: bool = False,
          dependent_launch: bool = False):
    """Compile the optimised module into a Relax VM executable; CUDA builds must contain device code.

    CUDA modules calling fusion templates build under the templates' pass configuration (``cp.async``).
    ``cuda_graph``: Relax's ``relax.backend.use_cuda_graph`` option, under which the build runs
    ``RewriteCUDAGraph``: each region of kernel launches whose arguments are all statically planned buffers,
    weights or constants is captured into a CUDA graph on its first run and replayed after; launches that read
    the model's inputs stay outside the graphs (:func:`stof_tvm.compiler.lower` first makes the forward pass one
    static region: :mod:`.graph_inputs`).
    ``dependent_launch``: lower with :data:`stof_tvm.schedules.dependent_launch.PIPELINE`, which makes every kernel a
    programmatic dependent launch (its start overlaps the end of the kernel before it; sm_90+)."""
    config = {}
    if templates and target.kind.name == "cuda":
        from stof_tvm.schedules.templates.build import BUILD_CONFIG

        config = dict(BUILD_CONFIG)
    if cuda_graph:
        config["relax.backend.use_cuda_graph"] = True
    with tvm.transform.PassContext(opt_level=3, config=config):
        executable = tvm.compile(mod, target=target,
                                 tir_pipeline=launch_overlap.PIPELINE if dependent_launch else "default")
    if target.kind.name == "cuda" and "cuda" not in _import_kinds(executable.mod):
        raise RuntimeError("build produced no CUDA device code (a kernel without thread bindings?)")
    return executable


def _import_kinds(module) -> set[str]:
    kinds, stack = set(), [module]
    while stack:
        current = stack.pop()
        kinds.add(current.kind)
        stack.extend(current.imports)
    return kinds
