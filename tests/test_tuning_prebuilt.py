"""Pre-built tasks (no knobs: attention kernels, wgmma knob sets) are built in batches and recorded like
MetaSchedule's own records (:mod:`stof_tvm.tuning.prebuilt`).

Five pre-scheduled llvm kernels of one group, batches of two: the builder sees batches of 2, 2 and 1 (not one
kernel per build call, as MetaSchedule's task scheduler would send them); a kernel whose build fails is
recorded as failed and never chosen; the group's choice is the fastest measured; a second run measures nothing.
"""
from __future__ import annotations

import json

import pytest
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.script import tirx as T

from stof_tvm.tuning import TuningDatabase, TuningTask, make_builder, make_runner, tune_tasks, tuning_target
from stof_tvm.tuning.prebuilt import measure_prebuilt
from stof_tvm.tuning.progress import Progress


def doubled(n: int):
    @T.prim_func(s_tir=True)
    def func(A: T.Buffer((n,), "float32"), B: T.Buffer((n,), "float32")):
        for i in range(n):
            with T.sblock("B"):
                vi = T.axis.spatial(n, i)
                B[vi] = A[vi] * T.float32(2)

    return func


@derived_object
class BatchRecordingBuilder(ms.builder.PyBuilder):
    """The local builder, recording each call's batch size and failing the workloads listed in ``broken``."""

    def __init__(self, broken):
        super().__init__()
        self.inner = make_builder(1)
        self.broken = set(broken)
        self.batches = []

    def build(self, build_inputs):
        self.batches.append(len(build_inputs))
        results = self.inner.build(build_inputs)
        return [ms.builder.BuilderResult(None, "broken on purpose") if int(inp.mod["main"].params[0].shape[0])
                in self.broken else res for inp, res in zip(build_inputs, results)]


def test_prebuilt_tasks_build_in_batches_and_are_recorded(tmp_path):
    work = str(tmp_path / "db")
    sizes = (8, 16, 24, 32, 40)

    def tasks():
        return [TuningTask(f"double{n}", doubled(n), group="g") for n in sizes]

    builder = BatchRecordingBuilder(broken={24})
    report = tune_tasks(tasks(), "llvm", work, num_trials_per_iter=2, builder=builder, progress_stream=None)
    assert builder.batches == [2, 2, 1]
    status = {r.name: r.status for r in report.results}
    assert status == {"double8": "tuned", "double16": "tuned", "double24": "failed", "double32": "tuned",
                      "double40": "tuned"}
    assert all(r.best_s > 0 for r in report.results if r.status == "tuned")
    records = [json.loads(line) for line in open(f"{work}/database_tuning_record.json")]
    assert len(records) == 5 and sorted(r[1][1][0] for r in records)[-1] == 1e10   # the failure, as MetaSchedule
    choice = report.choices["g"]
    assert choice["best_s"] == min(r.best_s for r in report.results if r.best_s is not None)
    assert choice["name"] != "double24"
    again = tune_tasks(tasks(), "llvm", work, num_trials_per_iter=2, builder=builder, progress_stream=None)
    assert again.measured == 0 and builder.batches == [2, 2, 1]
    assert TuningDatabase(work).group_choice("g") == choice


def test_prebuilt_stops_between_batches_and_checks_its_input(tmp_path):
    tasks = [TuningTask(f"double{n}", doubled(n)) for n in (8, 16, 24)]
    progress = Progress([t.name for t in tasks], [1, 1, 1], time_budget_s=1e-6, stream=None)
    db = TuningDatabase(str(tmp_path / "db"))
    target = tuning_target("llvm")
    measure_prebuilt(tasks, target, db.ms, make_builder(1), make_runner("llvm"), progress, [0, 1, 2], chunk=2)
    assert progress.trials == [1, 1, 0] and progress.stop.reason.startswith("time budget")
    with pytest.raises(ValueError, match="chunk"):
        measure_prebuilt(tasks, target, db.ms, None, None, progress, [0, 1, 2], chunk=0)
    with pytest.raises(ValueError, match="task ids"):
        measure_prebuilt(tasks, target, db.ms, None, None, progress, [0], chunk=2)
