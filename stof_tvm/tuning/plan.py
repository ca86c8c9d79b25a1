"""Stage 1 for what a user asks to tune: a model, one template call, or one attention problem.

Each planner ranks the candidates with the analytical model (timed separately: that is the cost of stage 1),
keeps the top K per job as :class:`~stof_tvm.tuning.task.TuningTask` objects, and can explain the rankings.

A model's jobs are read from the compile path itself: :func:`plan_model` runs the compiler's front end
(:func:`stof_tvm.compiler.front_end`: import, attention rewrite, template rewrite) with the same arguments a
compile gets, and plans exactly the template calls it records and the attention problem it chose a kernel for.
There is no second scan of the graph, so a later compile with those arguments finds a record for every call.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Mapping

import tvm

from ..cost_model import (AttentionCandidate, AttentionProblem, Calibration, DEFAULT_CALIBRATION,
                          attention_candidates, rank_attention)
from ..cost_model.explain import explain_ranking
from ..cost_model.templates import rank_template
from ..hardware import H200, HardwareProfile
from .attention_tasks import attention_tasks
from .task import TuningTask
from .template_tasks import definition_task, template_task, wgmma_tasks

__all__ = ["TuningPlan", "NothingToTune", "plan_model", "plan_template", "plan_attention"]


class NothingToTune(ValueError):
    """A model compile makes no call that tuning can decide (no template calls, attention dense or not ours)."""


@dataclass
class TuningPlan:
    """Stage 1's result: the tasks, notes on calls left out, one explanation per ranked job, and the seconds
    spent in the analytical model (ranking only, not building the kernels' IR). A model's plan also has the
    ``target`` its compile builds for (``sm_90a`` for wgmma GEMMs), which stage 2 must measure on, and the
    ``calls`` it planned: ``[(template, shape, dtype, options, count)]``."""

    tasks: list[TuningTask] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    explanations: list[str] = field(default_factory=list)
    model_seconds: float = 0.0
    target: object = None
    calls: list = field(default_factory=list)

    def extend(self, other: "TuningPlan") -> "TuningPlan":
        self.tasks += other.tasks
        self.calls += other.calls
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
                   explain: bool = False, baseline=None) -> TuningPlan:
    """Tasks for one attention problem (its top ``top_k`` kernels; ``baseline``: the untuned kernel, first)."""
    started = time.perf_counter()
    ranked = rank_attention(problem, hw, cal, attention_candidates(problem, hw, kinds))
    plan = TuningPlan(model_seconds=time.perf_counter() - started)
    plan.tasks = attention_tasks(problem, target, top_k=top_k, hw=hw, cal=cal, kinds=kinds, weight=weight,
                                 ranked=ranked, baseline=baseline)
    if explain:
        title = (f"attention B={problem.batch} H={problem.heads} S={problem.seq_q} D={problem.head_dim} "
                 f"{problem.dtype}, mask density {problem.mask.density:.2%}: {len(ranked)} feasible kernels")
        plan.explanations.append(explain_ranking(title, ranked))
    return plan


def plan_template(template, shape: Mapping[str, int], target, *, dtype: str = "float16", top_k: int = 8,
                  hw: HardwareProfile = H200, cal: Calibration = DEFAULT_CALIBRATION, weight: float = 1.0,
                  options: Mapping | None = None, explain: bool = False, baseline: Mapping | None = None) -> TuningPlan:
    """The tasks of one template call: on CUDA its top ``top_k`` knob sets (one task, or one task per knob set
    for a wgmma template, the template's default first); on llvm its definition as it is
    (:mod:`.template_tasks`). ``options``: the definition's constants (``eps``); ``baseline``: an mma.sync
    template's untuned knobs (the compile's choice without records), made its first candidate."""
    plan = TuningPlan(calls=[(template.name, dict(shape), dtype, dict(options or {}), weight)])
    if _kind(target) != "cuda":
        plan.tasks = [definition_task(template, shape, dtype, options=options, weight=weight)]
        return plan
    started = time.perf_counter()
    ranked = rank_template(template, shape, dtype, hw, cal)
    plan.model_seconds = time.perf_counter() - started
    if template.name.endswith("_wgmma"):
        plan.tasks = wgmma_tasks(template, shape, dtype, top_k=top_k, hw=hw, cal=cal, weight=weight, ranked=ranked)
    else:
        plan.tasks = [template_task(template, shape, dtype, top_k=top_k, hw=hw, cal=cal, weight=weight,
                                    ranked=ranked, options=options, baseline=baseline)]
    if explain:
        plan.explanations.append(explain_ranking(f"{template.name} {dict(shape)} {dtype}: {len(ranked)} feasible "
                                                 "knob sets", ranked))
    return plan


def plan_model(model, *, batch: int, seq_len: int, mask, target, dtype: str = "float16", top_k: int = 8,
               hw: HardwareProfile = H200, cal: Calibration = DEFAULT_CALIBRATION, kinds=("block", "row"),
               kernel: str = "auto", templates: bool | None = None, gemm: str = "auto", database: str | None = None,
               explain: bool = False, gated_epilogue: bool = False) -> TuningPlan:
    """Tasks for every distinct call a compile of ``model`` at ``batch x seq_len`` under ``mask`` makes.

    ``dtype``, ``kernel``, ``templates``, ``gemm``, ``database`` and ``gated_epilogue`` mean what they mean for
    :func:`stof_tvm.compile` (whose front end decides the calls: which chains run on which templates, wgmma or
    mma.sync, fused or unfused LayerNorm). Each distinct template call becomes one job weighted by its count;
    the attention problem (user mask combined with the model's own masking) one job weighted by the number of
    sites, unless the attention is dense, carries a score bias (whose row-wise kernel takes its default
    configuration: the tuned kernels have no bias input) or runs on the Hopper wgmma kernel (not a tuning task: the
    notes say so; its configurations are the model's). Every job's first candidate is what the compile runs
    without records (its untuned choice), so that stage 2 measures it and tuning never makes a call slower; with
    ``kernel="block"`` or ``"row"`` only that kind is tuned (the compile takes no other).
    """
    from ..compiler import front_end
    from ..compiler.attention_match import shared_kv_heads
    from ..compiler.template_choice import TemplateChooser
    from ..schedules.templates import get_template

    target_spec = _target_spec(target)
    if database is not None and not os.path.isdir(database):
        database = None               # nothing recorded yet (and planning must not create the directory)
    front = front_end(_onnx_model(model), mask=mask, batch=batch, seq_len=seq_len, target=target_spec,
                      dtype=dtype, kernel=kernel, templates=templates, gemm=gemm, database=database, schedule=False,
                      gated_epilogue=gated_epilogue)
    untuned = TemplateChooser(front.target, None)
    plan = TuningPlan()
    for (name, shape, call_dtype, options), count in _template_calls(front.template_entry).items():
        template = get_template(name)
        try:
            baseline = untuned.knobs(template, dict(shape), call_dtype, dict(options)).knobs
            plan.extend(plan_template(template, dict(shape), target, dtype=call_dtype, top_k=top_k, hw=hw, cal=cal,
                                      weight=float(count), options=dict(options), explain=explain,
                                      baseline=baseline))
        except ValueError as err:
            plan.notes.append(f"{name} {dict(shape)} x{count}: {err}")
    if front.fallback is not None:
        plan.notes.append(f"attention: not on a stof-tvm kernel ({front.fallback}); nothing to tune")
    elif front.choice.kind == "dense" or front.choice.bias is not None:
        plan.notes.append(f"attention: {front.choice.kind} ({front.choice.reason}); nothing to tune")
    elif front.choice.kind == "wgmma":
        # Not a tuning task: its few configurations are priced by the model's own fitted constants and timed by
        # scripts/bench_attention.py; the tuner's records and workloads name the mma.sync kernels only.
        plan.notes.append(f"attention: wgmma ({front.choice.reason}); the wgmma kernel is not tuned")
    else:
        site = front.sites[0]
        problem = AttentionProblem.build(front.combined, batch=batch, heads=site.heads, seq_len=site.seq_q,
                                         head_dim=site.head_dim, dtype=site.dtype,
                                         kv_heads=shared_kv_heads(front.sites))
        plan.extend(plan_attention(problem, target, top_k=top_k, hw=hw, cal=cal,
                                   kinds=(kernel,) if kernel in ("block", "row") else kinds,
                                   weight=float(len(front.sites)), explain=explain,
                                   baseline=_untuned_attention(front, kernel)))
    plan.target = front.tspec
    if not plan.tasks:
        raise NothingToTune("model: nothing to tune" + (" (" + "; ".join(plan.notes) + ")" if plan.notes else ""))
    return plan


def _untuned_attention(front, kernel: str) -> AttentionCandidate:
    """The attention kernel and configuration a compile of ``front`` takes without records."""
    from ..compiler.attention_match import shared_kv_heads
    from ..compiler.kernels import choose_kernel, config_object

    site = front.sites[0]
    choice = choose_kernel(kernel, front.combined, batch=site.batch,
                           heads=site.heads, head_dim=site.head_dim, dtype=site.dtype, seq_q=site.seq_q,
                           target_kind=front.tspec["kind"], mask_batch=front.choice.mask_batch,
                           mask_heads=front.choice.mask_heads, target_arch=front.tspec.get("arch"),
                           kv_heads=shared_kv_heads(front.sites))
    return AttentionCandidate(choice.kind, config_object(choice.kind, choice.config))


def _template_calls(entry: dict) -> dict:
    """``{(template, shape items, dtype, option items): count}`` of a compile manifest's ``templates`` entry."""
    calls: dict = {}
    for site in entry.get("sites", []):
        for stage in site["stages"]:
            options = (("eps", stage["eps"]),) if "eps" in stage else ()
            key = (stage["template"], tuple(stage["shape"].items()), stage["dtype"], options)
            calls[key] = calls.get(key, 0) + site["count"]
    return calls


def _target_spec(target) -> dict:
    """The compile path's target dict of a tuning target (kind, and for CUDA its arch and limits)."""
    if isinstance(target, tvm.target.Target):
        if target.kind.name != "cuda":
            return {"kind": target.kind.name}
        keys = ("arch", "max_threads_per_block", "max_shared_memory_per_block")
        return {"kind": "cuda", **{k: target.attrs[k] for k in keys if k in target.attrs}}
    return target


def _onnx_model(model):
    """An ``onnx.ModelProto`` or path from a built-in model name (``bert-base``, ``tiny-bert``, ...), a path or a
    proto."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a built-in model name, an ONNX file path or an onnx.ModelProto, "
                        f"got {type(model).__name__}")
    from ..models import BUILTIN, builtin_model

    if str(model) in BUILTIN:
        return builtin_model(str(model))
    if not os.path.isfile(model):
        raise FileNotFoundError(f"model: {model!r} is neither a built-in model ({', '.join(sorted(BUILTIN))}) "
                                f"nor an ONNX file")
    return model
