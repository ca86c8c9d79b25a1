"""``stof_tvm.tune``: both stages for a model, one template call or one attention problem."""
from __future__ import annotations

import sys

from ..cost_model import AttentionProblem, Calibration, DEFAULT_CALIBRATION
from ..hardware import H200, HardwareProfile, detect, get_profile, profile_for_target
from .build_pool import BuildPool
from .plan import TuningPlan, plan_attention, plan_model, plan_template
from .tuner import TuningReport, tune_tasks, tuning_target

__all__ = ["tune", "plan", "resolve_hardware"]


def resolve_hardware(hardware, target) -> HardwareProfile:
    """``None`` (the target's: the local GPU, or the profile its arch names; H200 for llvm), ``"detect"``, a
    built-in name (``h200``, ``h100``, ``a100``, ``rtx4090``) or a :class:`HardwareProfile`."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware is None:
        return profile_for_target(target) if target.kind.name == "cuda" else H200
    if hardware == "detect":
        return detect()
    return get_profile(hardware)


def plan(model=None, *, template=None, shape=None, mask="causal", batch: int = 1, seq_len: int = 128,
         heads: int = 12, head_dim: int = 64, dtype: str = "float16", target="cuda", top_k: int = 8,
         hardware=None, calibration: Calibration | str | None = None, kinds=("block", "row"),
         kernel: str = "auto", templates: bool | None = None, gemm: str = "auto", database: str | None = None,
         explain: bool = False, gated_epilogue: bool = False) -> TuningPlan:
    """Stage 1 only: the tasks ``tune`` would measure (see :func:`tune` for the arguments)."""
    target = tuning_target(target)
    hw = resolve_hardware(hardware, target)
    cal = Calibration.load(calibration) if isinstance(calibration, str) else (calibration or DEFAULT_CALIBRATION)
    if sum(x is not None for x in (model, template)) > 1:
        raise ValueError("give one of model= or template= (or neither, for one attention problem)")
    if model is not None:
        return plan_model(model, batch=batch, seq_len=seq_len, mask=mask, target=target, dtype=dtype, top_k=top_k,
                          hw=hw, cal=cal, kinds=kinds, kernel=kernel, templates=templates, gemm=gemm,
                          database=database, explain=explain, gated_epilogue=gated_epilogue)
    if template is not None:
        from ..schedules.templates import get_template

        if shape is None:
            raise ValueError("template= needs shape= (e.g. {'m': 4096, 'n': 3072, 'k': 768})")
        tmpl = get_template(template) if isinstance(template, str) else template
        return plan_template(tmpl, shape, target, dtype=dtype, top_k=top_k, hw=hw, cal=cal, explain=explain)
    problem = AttentionProblem.build(mask, batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, dtype=dtype)
    return plan_attention(problem, target, top_k=top_k, hw=hw, cal=cal, kinds=kinds, explain=explain)


def tune(model=None, *, template=None, shape=None, mask="causal", batch: int = 1, seq_len: int = 128,
         heads: int = 12, head_dim: int = 64, dtype: str = "float16", target="cuda", database: str = "stof-tuning",
         trials: int | None = None, top_k: int = 8, time_budget_s: float | None = None,
         rpc_tracker: str | None = None, rpc_key: str | None = None, hardware=None,
         calibration: Calibration | str | None = None, kinds=("block", "row"), build_workers: int | None = None,
         kernel: str = "auto", templates: bool | None = None, gemm: str = "auto",
         progress: bool = True, gated_epilogue: bool = False) -> TuningReport:
    """Tune ``model`` (built-in name, ONNX path or proto), or one ``template`` call at ``shape``, or (neither)
    one attention problem, and record the results in the ``database`` work directory.

    Stage 1 keeps the ``top_k`` best-predicted candidates of every job; stage 2 measures them (at most
    ``trials`` per task) locally or on ``rpc_tracker``'s devices, within ``time_budget_s``. Tasks the database
    already holds complete are not measured again; a stopped run resumes where it stopped. The report's
    ``plan`` attribute is the stage-1 plan.

    For a model, ``dtype``, ``kernel``, ``templates``, ``gemm`` and ``gated_epilogue`` are :func:`stof_tvm.compile`'s:
    the tasks are exactly the calls that compile makes (its front end decides them), measured on the target it
    builds for, so that compiling with the same arguments and ``database`` uses every record.
    """
    target = tuning_target(target)
    builder = BuildPool(build_workers)
    builder.warm_up()                # the build workers start while stage 1 runs here
    try:
        stage1 = plan(model, template=template, shape=shape, mask=mask, batch=batch, seq_len=seq_len, heads=heads,
                      head_dim=head_dim, dtype=dtype, target=target, top_k=top_k, hardware=hardware,
                      calibration=calibration, kinds=kinds, kernel=kernel, templates=templates, gemm=gemm,
                      database=database, gated_epilogue=gated_epilogue)
        if stage1.target is not None:
            target = tuning_target(stage1.target)
        report = tune_tasks(stage1.tasks, target, database, trials=trials, time_budget_s=time_budget_s,
                            rpc_tracker=rpc_tracker, rpc_key=rpc_key, builder=builder,
                            progress_stream=sys.stderr if progress else None)
    finally:
        builder.close()
    report.plan = stage1
    return report
