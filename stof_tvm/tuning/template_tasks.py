"""Stage 1 for the fusion templates: the tasks of one template call.

- mma.sync templates on CUDA (:func:`template_task`): the workload is the template's unscheduled PrimFunc and
  its design space exactly the model's top K knob sets, each applied with ``template.apply(sch, knobs)``
  (which completes the schedule), led by the compile's untuned choice (``baseline``), which stage 2 measures
  first so that tuning never ends slower than not tuning. The compile path reads the measured-best record back
  into its knob set (:class:`~stof_tvm.compiler.template_choice.TemplateChooser`).
- wgmma templates (:func:`wgmma_tasks`): thread-level kernels with no TIR schedule to search, so each knob set
  is its own pre-built task (``template.kernel(shape, dtype, knobs)``, measured as it is by the same builder,
  runner and database); the tasks of one call form a group (:func:`wgmma_group`) whose fastest member the
  database records with its knobs, which is what a later compile reads (group names: :mod:`stof_tvm.records`).
- any template on llvm (:func:`definition_task`): the templates have no CPU schedule; the definition is measured
  as TVM lowers it, so that a CPU compile finds the record of every call it makes.
"""
from __future__ import annotations

import json
from typing import Mapping

from ..cost_model import Calibration, DEFAULT_CALIBRATION
from ..cost_model.templates import rank_template
from ..hardware import H200, HardwareProfile
from ..records import wgmma_group, workload_key
from .task import TuningTask

__all__ = ["template_task", "wgmma_tasks", "wgmma_group", "definition_task"]


def _label(template, shape: Mapping[str, int]) -> str:
    return "x".join(str(shape[k]) for k in template.shape_keys)


def _check_top_k(top_k) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")


def template_task(template, shape: Mapping[str, int], dtype: str = "float16", *, top_k: int = 8,
                  hw: HardwareProfile = H200, cal: Calibration = DEFAULT_CALIBRATION, weight: float = 1.0,
                  name: str | None = None, ranked=None, options: Mapping | None = None,
                  baseline: Mapping | None = None) -> TuningTask:
    """The tuning task of ``template`` at ``shape``/``dtype`` restricted to its ``top_k`` predicted best knobs
    (``ranked``: a ranking from :func:`rank_template` to reuse; ``options``: the definition's constants, e.g.
    a model's LayerNorm ``eps``, which change the workload but not the knobs). ``baseline``: the knobs a compile
    takes without records, made the first candidate (default: the model's best, already first)."""
    _check_top_k(top_k)
    if ranked is None:
        ranked = rank_template(template, shape, dtype, hw, cal)
    if not ranked:
        raise ValueError(f"{template.name}: no knob set of shape {dict(shape)} fits {hw.name}")
    survivors = [(r.candidate, r.time_s) for r in ranked[:top_k]]
    if baseline is not None and dict(baseline) != survivors[0][0]:
        predicted = {json.dumps(r.candidate, sort_keys=True): r.time_s for r in ranked}
        rest = [s for s in survivors if s[0] != dict(baseline)]
        first = (dict(baseline), predicted.get(json.dumps(dict(baseline), sort_keys=True), ranked[0].time_s))
        survivors = [first] + rest[:top_k - 1]
    options = dict(options or {})
    return TuningTask(
        name=name or f"{template.name}_{_label(template, shape)}", func=template.primfunc(shape, dtype, **options),
        candidates=[knobs for knobs, _ in survivors], apply=template.apply,
        predicted_s=[time_s for _, time_s in survivors], weight=weight,
        meta={"template": template.name, "shape": dict(shape), "dtype": dtype, "space": len(ranked), **options})


def wgmma_tasks(template, shape: Mapping[str, int], dtype: str = "float16", *, top_k: int = 8,
                hw: HardwareProfile = H200, cal: Calibration = DEFAULT_CALIBRATION, weight: float = 1.0,
                ranked=None) -> list[TuningTask]:
    """One pre-built task per knob set of a wgmma template call: the template's own first configuration (the
    compile path's untuned choice, so tuning never ends slower than not tuning) and the model's best ranked
    others, ``top_k`` distinct kernels in all (knob sets that build the same kernel at this shape, e.g. more
    pipeline stages than the K loop has iterations, count once). Each task's ``meta["knobs"]`` is its knob set."""
    _check_top_k(top_k)
    if ranked is None:
        ranked = rank_template(template, shape, dtype, hw, cal)
    predicted = {json.dumps(r.candidate, sort_keys=True): r.time_s for r in ranked}
    group, label = wgmma_group(template, shape, dtype), _label(template, shape)
    tasks, seen = [], set()
    for knobs in [dict(template.default_knobs(shape, dtype))] + [r.candidate for r in ranked]:
        if len(tasks) == top_k:
            break
        func = template.kernel(shape, dtype, knobs)
        key = workload_key(func)
        if key in seen:
            continue
        seen.add(key)
        tag = "_".join(f"{k}{v.replace('.', '') if isinstance(v, str) else int(v)}" for k, v in knobs.items())
        time_s = predicted.get(json.dumps(knobs, sort_keys=True))
        tasks.append(TuningTask(
            name=f"{template.name}_{label}_{tag}", func=func, weight=weight,
            predicted_s=[time_s] if time_s is not None else [], group=group,
            meta={"template": template.name, "shape": dict(shape), "dtype": dtype, "knobs": dict(knobs),
                  **({"untuned": True} if not tasks else {})}))
    return tasks


def definition_task(template, shape: Mapping[str, int], dtype: str = "float16", *, options: Mapping | None = None,
                    weight: float = 1.0) -> TuningTask:
    """The template's unscheduled definition as a task measured as it is (the CPU path)."""
    options = dict(options or {})
    return TuningTask(name=f"{template.name}_{_label(template, shape)}_definition",
                      func=template.primfunc(shape, dtype, **options), weight=weight,
                      meta={"template": template.name, "shape": dict(shape), "dtype": dtype, **options})
