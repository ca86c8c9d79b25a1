"""Tuning records without a GPU: the real stage 1 and stage 2 code with a builder and runner that stand in for it.

A machine without a GPU cannot measure CUDA candidates, but it can still rehearse everything around the
measurements: the plan of a model's tasks, MetaSchedule's search over each task's knob sets, the database
written as stage 2 writes it, and a later compile replaying those records. Here the builder only records what it
is given (no CUDA build) and the runner "measures" every candidate faster than the one before, so each task's
last candidate wins. The times are made up; the records (workloads, traces, knob sets, group choices) are the
ones a real tuning job writes, so a compile that reads them does the same work as a compile after real tuning.

Two users: tests/test_tuning_flow.py (records of every task kind apply in a fresh process) and
scripts/profile_compile.py ``--stand-in-database`` (the wall time of a recompile with a full database, on a CPU).
"""
from __future__ import annotations

import itertools
import os
import tempfile

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

__all__ = ["RecordingBuilder", "ScriptedRunner", "write_stand_in_database"]


@derived_object
class RecordingBuilder(ms.builder.PyBuilder):
    """Stands in for the CUDA build: keeps each input's module and hands back one empty artifact folder per input."""

    def __init__(self, root):
        super().__init__()
        self.root = str(root)
        self.modules = []

    def build(self, build_inputs):
        results = []
        for build_input in build_inputs:
            self.modules.append(build_input.mod)
            folder = tempfile.mkdtemp(dir=self.root)
            results.append(ms.builder.BuilderResult(os.path.join(folder, "unbuilt.so"), None))
        return results


@derived_object
class ScriptedRunner(ms.runner.PyRunner):
    """Stands in for the GPU: every candidate "runs" in less time than the one before it."""

    def __init__(self):
        super().__init__()
        self.times = (1e-3 / n for n in itertools.count(1))

    def run(self, runner_inputs):
        return [ms.runner.LocalRunnerFuture(res=[next(self.times)], error_message=None) for _ in runner_inputs]


def write_stand_in_database(model, work_dir: str, *, trials: int | None = None, **plan_options):
    """Plan ``model``'s tasks (``plan_options``: what :func:`stof_tvm.tuning.plan` takes, as the compile will be
    called) and tune them into ``work_dir`` with the stand-ins; returns the tuning report."""
    from stof_tvm.tuning import plan, tune_tasks, tuning_target

    stage1 = plan(model, **plan_options)
    with tempfile.TemporaryDirectory() as artifacts:
        return tune_tasks(stage1.tasks, tuning_target(stage1.target), work_dir, trials=trials,
                          builder=RecordingBuilder(artifacts), runner=ScriptedRunner(), progress_stream=None)
