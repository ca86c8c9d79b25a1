"""Stage 1 for the fusion templates: rank a template's knob space with the model, keep the top K.

The task's workload is the template's unscheduled PrimFunc; its design space is exactly the survivors, each
applied with ``template.apply(sch, knobs)`` (which completes the schedule). After stage 2 the database holds
the measured schedules, and :meth:`TuningDatabase.best_schedule` gives a later compile the fastest one.
"""
from __future__ import annotations

from typing import Mapping

from ..cost_model import Calibration, DEFAULT_CALIBRATION
from ..cost_model.templates import rank_template
from ..hardware import H200, HardwareProfile
from .task import TuningTask

__all__ = ["template_task"]


def template_task(template, shape: Mapping[str, int], dtype: str = "float16", *, top_k: int = 8,
                  hw: HardwareProfile = H200, cal: Calibration = DEFAULT_CALIBRATION, weight: float = 1.0,
                  name: str | None = None, ranked=None) -> TuningTask:
    """The tuning task of ``template`` at ``shape``/``dtype`` restricted to its ``top_k`` predicted best knobs
    (``ranked``: a ranking from :func:`rank_template` to reuse)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if ranked is None:
        ranked = rank_template(template, shape, dtype, hw, cal)
    if not ranked:
        raise ValueError(f"{template.name}: no knob set of shape {dict(shape)} fits {hw.name}")
    survivors = ranked[:top_k]
    label = "x".join(str(shape[k]) for k in template.shape_keys)
    return TuningTask(
        name=name or f"{template.name}_{label}", func=template.primfunc(shape, dtype),
        candidates=[r.candidate for r in survivors], apply=template.apply,
        predicted_s=[r.time_s for r in survivors], weight=weight,
        meta={"template": template.name, "shape": dict(shape), "dtype": dtype, "space": len(ranked)})
