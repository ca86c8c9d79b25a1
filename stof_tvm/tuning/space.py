"""The design space of stage 2: exactly the stage-1 survivors of a task.

A survivor space is a :class:`~tvm.s_tir.meta_schedule.space_generator.ScheduleFn` that returns one complete
schedule per surviving knob set (``task.apply(copy_of_sch, knobs)``), with no schedule rules and no mutators:
MetaSchedule's search then only chooses *which* survivors to measure, in the order its XGBoost model predicts
best. No postprocessors: our schedules are complete (each template's ``apply`` finishes its own), stage 1 has
already checked shared memory, threads and registers, our sparse kernels have data-dependent loops that the
default ``DisallowDynamicLoop`` rejects (tvm-0.27-notes 4c), and MetaSchedule's ``VerifyGPUCode`` rejects the
templates' complete mma/ldmatrix schedules (seen: every candidate of a 128x512x128 GEMM dropped).
"""
from __future__ import annotations

import logging

import tvm
from tvm.s_tir import meta_schedule as ms

from .task import TuningTask

__all__ = ["survivor_space"]

_LOG = logging.getLogger(__name__)


def survivor_space(task: TuningTask, target: tvm.target.Target, candidates=None) -> ms.space_generator.ScheduleFn:
    """The design space of ``task``: one schedule per survivor (or the pre-scheduled function as it is);
    ``candidates``: the survivors to offer instead of all of ``task.candidates`` (those not measured yet)."""
    candidates = list(task.candidates if candidates is None else candidates)

    def schedules(sch):
        if not task.candidates:
            return [sch]
        out = []
        for knobs in candidates:
            copy = sch.copy()
            try:
                task.apply(copy, knobs)
            except (tvm.s_tir.ScheduleError, ValueError) as err:
                _LOG.warning("task %s: candidate %s cannot be applied: %s", task.name, knobs,
                             str(err).splitlines()[-1] if str(err) else type(err).__name__)
                continue
            out.append(copy)
        if not out:
            raise ValueError(f"task {task.name}: none of the {len(candidates)} candidates could be applied")
        return out

    return ms.space_generator.ScheduleFn(schedules, sch_rules=[], postprocs=[], mutator_probs={})
