"""The search strategy of a task: MetaSchedule's evolutionary search, held to the task's own trial plan and to
schedules never measured before.

MetaSchedule gives every task of a run the same ``max_trials_per_task``. Our tasks differ (a survivor space of
3 schedules next to one of 16; a task resumed with 5 trials left), and a run must be able to stop between
batches. :class:`PlannedSearch` wraps an :class:`~tvm.s_tir.meta_schedule.search_strategy.EvolutionarySearch`:
it passes the task's own plan to the inner search as its ``max_trials``, and returns no candidates once
``should_stop()`` says so, which makes the task scheduler end the task through its normal path (terminating
tasks from a callback instead trips the scheduler's own termination checks).

The inner evolutionary search ranks the survivors with the shared XGBoost cost model (epsilon-greedy) and picks
each batch. It also seeds its population with the database's best records of the workload and can pick one of
them again (seen: a resumed task, and a task whose untuned first candidate the tuner had measured before the
search, both re-measured a recorded schedule). So each pick is kept only when it is one of the design space's
schedules (the survivors not measured yet) and was not proposed before in this run; the batch is then filled
up with the remaining survivors in stage-1 order. No schedule is measured twice, and the plan is spent on
unmeasured survivors as long as there are any.
"""
from __future__ import annotations

from typing import Callable

import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

__all__ = ["PlannedSearch", "planned_search"]


def _evolutionary(space_size: int) -> ms.search_strategy.EvolutionarySearch:
    """Evolutionary search sized to a survivor space (no mutators act on it, so one genetic round suffices)."""
    return ms.search_strategy.EvolutionarySearch(population_size=max(16, 2 * space_size),
                                                 init_min_unmeasured=min(space_size, 16), max_fail_count=3,
                                                 genetic_num_iters=1)


@derived_object
class PlannedSearch(ms.search_strategy.PySearchStrategy):
    """Evolutionary search limited to ``plan`` trials of distinct, unmeasured survivors, stopping when
    ``should_stop()`` is true."""

    def __init__(self, inner, plan: int, should_stop: Callable[[], bool]):
        super().__init__()
        self.inner = inner
        self.plan = int(plan)
        self.should_stop = should_stop
        self.batch = 1
        self.spaces: list = []
        self.proposed: set[int] = set()

    def _initialize_with_tune_context(self, context) -> None:
        self.inner._initialize_with_tune_context(context)

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.plan = min(int(max_trials), self.plan)
        self.batch = max(1, min(int(num_trials_per_iter), self.plan))
        self.spaces = [(tvm_ffi.structural_hash(sch.mod), sch) for sch in design_spaces]
        self.proposed = set()
        self.inner.pre_tuning(self.plan, self.batch, design_spaces, database, cost_model)

    def post_tuning(self) -> None:
        self.inner.post_tuning()

    def generate_measure_candidates(self):
        size = min(self.batch, self.plan - len(self.proposed))
        if self.should_stop() or size <= 0:
            return None
        space = {key for key, _ in self.spaces}
        picks = []
        for candidate in self.inner.generate_measure_candidates() or []:
            key = tvm_ffi.structural_hash(candidate.sch.mod)
            if key in space and key not in self.proposed and len(picks) < size:
                self.proposed.add(key)
                picks.append(candidate)
        for key, sch in self.spaces:                 # fill up in stage-1 order
            if len(picks) == size:
                break
            if key not in self.proposed:
                self.proposed.add(key)
                picks.append(ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"])))
        return picks or None

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.inner.notify_runner_results(measure_candidates, results)

    def clone(self):
        return PlannedSearch(self.inner.clone(), self.plan, self.should_stop)


def planned_search(space_size: int, plan: int, should_stop: Callable[[], bool]) -> PlannedSearch:
    """The strategy for a task with ``space_size`` survivors and ``plan`` trials to run."""
    return PlannedSearch(_evolutionary(space_size), plan, should_stop)
