"""The tuning work directory: MetaSchedule's JSON database plus our per-task status file.

``DIR/database_workload.json`` and ``DIR/database_tuning_record.json`` are MetaSchedule's own (every
measured schedule, keyed by the workload's structural hash); later compiles read them with
``ms.database.JSONDatabase(work_dir=DIR)`` or through :func:`best_schedule`. ``DIR/stof_tuning.json`` records,
per task, how many trials were spent of how many planned and whether the task is complete, and, per group of
alternatives (the attention configurations of one problem), which one won. A complete task is never measured
again; a task stopped part-way resumes with the trials it has left.
"""
from __future__ import annotations

import json
import math
import os
import tempfile

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from .task import TuningTask

__all__ = ["TuningDatabase", "STATUS_FILE"]

STATUS_FILE = "stof_tuning.json"
_VERSION = 1


# MetaSchedule records a candidate that failed to build or run with this run time (kMaxMeanTime, 1e10 s).
_FAILED_SECONDS = 1e9


def _mean_seconds(record) -> float:
    """Mean measured seconds of a record; inf for a failed candidate."""
    secs = [float(s) for s in (record.run_secs or [])]
    mean = sum(secs) / len(secs) if secs else math.inf
    return mean if mean < _FAILED_SECONDS else math.inf


class TuningDatabase:
    """A work directory (created if missing) holding the MetaSchedule database and the task status."""

    def __init__(self, work_dir: str):
        if not isinstance(work_dir, (str, os.PathLike)) or not str(work_dir):
            raise TypeError(f"database directory must be a path, got {work_dir!r}")
        self.work_dir = os.path.abspath(os.fspath(work_dir))
        if os.path.exists(self.work_dir) and not os.path.isdir(self.work_dir):
            raise ValueError(f"--database {self.work_dir} exists and is not a directory")
        os.makedirs(self.work_dir, exist_ok=True)
        self.ms = ms.database.JSONDatabase(work_dir=self.work_dir, module_equality="structural")
        self.status_path = os.path.join(self.work_dir, STATUS_FILE)
        self.status = self._load_status()

    def _load_status(self) -> dict:
        if not os.path.exists(self.status_path):
            return {"version": _VERSION, "tasks": {}, "groups": {}}
        with open(self.status_path) as handle:
            data = json.load(handle)
        if data.get("version") != _VERSION:
            raise ValueError(f"{self.status_path}: unsupported status version {data.get('version')!r}")
        return data

    def save(self) -> None:
        """Write the status file atomically (an interrupted write never leaves it truncated)."""
        fd, tmp = tempfile.mkstemp(dir=self.work_dir, prefix=".stof_tuning.")
        with os.fdopen(fd, "w") as handle:
            json.dump(self.status, handle, indent=1, sort_keys=True)
        os.replace(tmp, self.status_path)

    # -- per task ----------------------------------------------------------------------------------------------

    def task_status(self, task: TuningTask) -> dict:
        return self.status["tasks"].get(task.key, {})

    def records(self, task: TuningTask) -> list:
        """Successful measurements of ``task``'s workload, fastest first.

        MetaSchedule's ``get_top_k`` skips records whose trace is empty, which is every record of a
        pre-scheduled kernel (nothing to transform); those are read from the full record list instead.
        """
        if not self.ms.has_workload(task.mod):
            return []
        workload = self.ms.commit_workload(task.mod)
        if task.candidates:
            return list(self.ms.get_top_k(workload, 1 << 30))
        mine = [r for r in self.ms.get_all_tuning_records()
                if r.workload.same_as(workload) and math.isfinite(_mean_seconds(r))]
        return sorted(mine, key=_mean_seconds)

    def trials_left(self, task: TuningTask, planned: int) -> int:
        """Trials still to run for ``planned`` in total: 0 when the task is complete."""
        status = self.task_status(task)
        if status.get("complete"):
            return 0
        done = max(int(status.get("trials", 0)), len(self.records(task)))
        return max(0, planned - done)

    def update_task(self, task: TuningTask, *, planned: int, measured: int, complete: bool) -> dict:
        """Add ``measured`` trials to ``task``'s count and refresh its best time and candidate."""
        status = self.status["tasks"].setdefault(task.key, {"trials": 0})
        status.update(name=task.name, group=task.group, planned=planned, meta=task.meta,
                      trials=int(status["trials"]) + measured, complete=bool(complete or status.get("complete")))
        return self.refresh(task)

    def refresh(self, task: TuningTask) -> dict:
        """Re-read ``task``'s best time and candidate from the records (its status entry must exist)."""
        status = self.status["tasks"][task.key]
        records = self.records(task)
        status["trials"] = max(int(status["trials"]), len(records))
        if records:
            status["best_s"] = _mean_seconds(records[0])
            status["best_candidate"] = self.candidate_index(task, records[0])
        return status

    def candidate_index(self, task: TuningTask, record) -> int | None:
        """Which of ``task.candidates`` a record measured (None when the task has no candidates or no match)."""
        if not task.candidates:
            return None
        sch = tvm.s_tir.Schedule(task.mod)
        record.trace.apply_to_schedule(sch, remove_postproc=True)
        target = tvm_ffi.structural_hash(sch.mod)
        for index, knobs in enumerate(task.candidates):
            candidate = tvm.s_tir.Schedule(task.mod)
            try:
                task.apply(candidate, knobs)
            except (tvm.s_tir.ScheduleError, ValueError):
                continue
            if tvm_ffi.structural_hash(candidate.mod) == target:
                return index
        return None

    # -- groups of alternatives ------------------------------------------------------------------------------

    def update_group(self, group: str, tasks: list[TuningTask]) -> dict | None:
        """Record the fastest measured task of ``group`` (by mean run time) as the group's choice."""
        best = None
        for task in tasks:
            status = self.task_status(task)
            if status.get("best_s") is not None and (best is None or status["best_s"] < best["best_s"]):
                best = {"task": task.key, "name": task.name, "best_s": status["best_s"], "meta": task.meta}
        if best is not None:
            self.status["groups"][group] = best
        return best

    def group_choice(self, group: str) -> dict | None:
        return self.status["groups"].get(group)

    # -- reuse by later compiles ------------------------------------------------------------------------------

    def best_schedule(self, func: tvm.tirx.PrimFunc, target) -> tvm.s_tir.Schedule | None:
        """The fastest recorded schedule of ``func`` (any PrimFunc structurally equal to a tuned workload)."""
        from .task import normalize_workload

        return self.ms.query(normalize_workload(func), tvm.target.Target(target), kind="schedule")
