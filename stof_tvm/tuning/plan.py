"""Stage 1 for what a user asks to tune: a model, one template call, or one attention problem.

Each planner ranks the candidates with the analytical model (timed separately: that is the cost of stage 1),
keeps the top K per job as :class:`~stof_tvm.tuning.task.TuningTask` objects, and can explain the rankings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping

import tvm

from ..cost_model import (AttentionProblem, Calibration, DEFAULT_CALIBRATION, attention_candidates,
                          rank_attention)
from ..cost_model.explain import explain_ranking
from ..cost_model.templates import rank_template
from ..hardware import H200, HardwareProfile
from .attention_tasks import attention_tasks
from .onnx_scan import load_model, scan_onnx
from .task import TuningTask
from .template_tasks import template_task

__all__ = ["TuningPlan", "plan_model", "plan_template", "plan_attention"]


@dataclass
class TuningPlan:
    """Stage 1's result: the tasks, notes on calls left out, one explanation per ranked job, and the seconds
    spent in the analytical model (ranking only, not building the kernels' IR)."""

    tasks: list[TuningTask] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    explanations: list[str] = field(default_factory=list)
    model_seconds: float = 0.0

    def extend(self, other: "TuningPlan") -> "TuningPlan":
        self.tasks += other.tasks
        self.notes += other.notes
        self.explanations += other.explanations
        self.model_seconds += other.model_seconds
        return self


def _kind(target) -> str:
    if isinstance(target, tvm.target.Target):
        return target.kind.name
    if isinstance(target, dict):
        return str(target.get("kind"))
    return str(target)


def plan_attention(problem: AttentionProblem, target, *, top_k: int = 8, hw: HardwareProfile = H200,
                   cal: Calibration = DEFAULT_CALIBRATION, kinds=("block", "row"), weight: float = 1.0,
                   explain: bool = False) -> TuningPlan:
    """Tasks for one attention problem (its top ``top_k`` kernels)."""
    started = time.perf_counter()
    ranked = rank_attention(problem, hw, cal, attention_candidates(problem, hw, kinds))
    plan = TuningPlan(model_seconds=time.perf_counter() - started)
    plan.tasks = attention_tasks(problem, target, top_k=top_k, hw=hw, cal=cal, kinds=kinds, weight=weight,
                                 ranked=ranked)
    if explain:
        title = (f"attention B={problem.batch} H={problem.heads} S={problem.seq_q} D={problem.head_dim} "
                 f"{problem.dtype}, mask density {problem.mask.density:.2%}: {len(ranked)} feasible kernels")
        plan.explanations.append(explain_ranking(title, ranked))
    return plan


def plan_template(template, shape: Mapping[str, int], target, *, dtype: str = "float16", top_k: int = 8,
                  hw: HardwareProfile = H200, cal: Calibration = DEFAULT_CALIBRATION, weight: float = 1.0,
                  explain: bool = False) -> TuningPlan:
    """The task of one template call (its top ``top_k`` knob sets). Templates build for CUDA only."""
    if _kind(target) != "cuda":
        raise ValueError(f"template {template.name} uses tensor cores and builds for CUDA only, not {_kind(target)}")
    started = time.perf_counter()
    ranked = rank_template(template, shape, dtype, hw, cal)
    plan = TuningPlan(model_seconds=time.perf_counter() - started)
    plan.tasks = [template_task(template, shape, dtype, top_k=top_k, hw=hw, cal=cal, weight=weight, ranked=ranked)]
    if explain:
        plan.explanations.append(explain_ranking(f"{template.name} {dict(shape)} {dtype}: {len(ranked)} feasible "
                                                 "knob sets", ranked))
    return plan


def plan_model(model, *, batch: int, seq_len: int, mask, target, dtype: str = "float16", top_k: int = 8,
               hw: HardwareProfile = H200, cal: Calibration = DEFAULT_CALIBRATION, kinds=("block", "row"),
               explain: bool = False) -> TuningPlan:
    """Tasks for every distinct call of a model at ``batch x seq_len`` under ``mask``.

    GEMM calls need a registered template for their epilogue and a CUDA target; calls without one are listed
    in the notes (the compiler schedules them with its defaults).
    """
    from ..schedules.templates import TEMPLATES

    calls = scan_onnx(load_model(model))
    plan = TuningPlan()
    tokens = batch * seq_len
    for (name, n, k), count in sorted(calls.gemms.items()):
        shape = {"m": tokens, "n": n, "k": k}
        if _kind(target) != "cuda":
            plan.notes.append(f"{name} {shape} x{count}: templates build for CUDA only")
        elif name not in TEMPLATES:
            plan.notes.append(f"{name} {shape} x{count}: no template registered")
        else:
            try:
                plan.extend(plan_template(TEMPLATES[name], shape, target, dtype=dtype, top_k=top_k, hw=hw, cal=cal,
                                          weight=float(count), explain=explain))
            except ValueError as err:
                plan.notes.append(f"{name} {shape} x{count}: {err}")
    for (heads, head_dim), count in sorted(calls.attention.items()):
        problem = AttentionProblem.build(mask, batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim,
                                         dtype=dtype)
        plan.extend(plan_attention(problem, target, top_k=top_k, hw=hw, cal=cal, kinds=kinds, weight=float(count),
                                   explain=explain))
    if not plan.tasks:
        raise ValueError("model: nothing to tune" + (" (" + "; ".join(plan.notes) + ")" if plan.notes else ""))
    return plan
