"""The tuning work directory: MetaSchedule's JSON database plus stof-tvm's per-task status file.

``DIR/database_workload.json`` and ``DIR/database_tuning_record.json`` are MetaSchedule's own (every measured
schedule, keyed by the workload's structural hash; opened by :func:`~.store.open_json_database`, which makes
every record readable in any process). ``DIR/stof_tuning.json`` records, per task, how many trials were spent of
how many planned and whether the task is complete, and, per group of alternatives (the attention configurations
of one problem, the knob sets of one wgmma call), which one won; and the jobs a whole-model check vetoed (their
records together made the forward pass slower than none: :mod:`stof_tvm.tuning_check`), which a compile then
ignores. MetaSchedule appends each record as it is
measured, so the records are the truth: a task's trials are never fewer than its records, and a job killed before
it wrote the status file loses no measurement.

The tuner writes through :class:`TuningDatabase`; the compiler reads through :func:`open_database` (one load per
process and directory state: loading replays every record) and its look-ups (:meth:`TuningDatabase.best_record`,
:meth:`TuningDatabase.choice`) are noted in the active :func:`~.usage.record_usage` ledger.
"""
from __future__ import annotations

import json
import math
import os
import tempfile

import tvm
import tvm_ffi

from .names import normalize_workload, workload_key
from .store import RECORD_FILE, WORKLOAD_FILE, open_json_database
from .usage import note_lookup

__all__ = ["TuningDatabase", "open_database", "mean_seconds", "STATUS_FILE", "FAILED_SECONDS"]

STATUS_FILE = "stof_tuning.json"
_VERSION = 1
# What MetaSchedule records for a candidate that failed to build or run (its kMaxMeanTime); anything from
# 1e9 s up reads as a failure.
FAILED_SECONDS = 1e10
# A group's untuned member stays its choice unless another member measured at least this much faster. Timed
# alone, differences of about 1% do not carry over to a whole forward pass: RoBERTa-base 16x2048's attention and
# FFN-down GEMM switched on 0.7% and 1.1%, and the tuned forward ran 1.4% slower interleaved (BENCHMARKS.md,
# session 23).
CHOICE_MARGIN = 0.03


def mean_seconds(record) -> float:
    """Mean measured seconds of a record; inf for a failed candidate."""
    secs = [float(s) for s in (record.run_secs or [])]
    mean = sum(secs) / len(secs) if secs else math.inf
    return mean if mean < FAILED_SECONDS / 10 else math.inf


class TuningDatabase:
    """A work directory holding the MetaSchedule database and the task status (``create``: make it if missing).

    Tasks are the tuner's :class:`~stof_tvm.tuning.task.TuningTask` objects, read for their ``key``, ``mod``
    (normalised workload), ``name``, ``group``, ``meta``, ``candidates`` and ``apply`` only."""

    def __init__(self, work_dir: str, *, create: bool = True):
        if not isinstance(work_dir, (str, os.PathLike)) or not str(work_dir):
            raise TypeError(f"database directory must be a path, got {work_dir!r}")
        self.work_dir = os.path.abspath(os.fspath(work_dir))
        if os.path.exists(self.work_dir) and not os.path.isdir(self.work_dir):
            raise ValueError(f"database: {self.work_dir} exists and is not a directory")
        if not os.path.isdir(self.work_dir):
            if not create:
                raise FileNotFoundError(f"database: no tuning work directory at {self.work_dir} (write one with "
                                        "'stof-tvm tune', or compile with --tune-trials N)")
            os.makedirs(self.work_dir)
        self.ms = open_json_database(self.work_dir)
        self.status_path = os.path.join(self.work_dir, STATUS_FILE)
        self.status = self._load_status()
        self._index: dict | None = None
        self._index_size = -1

    def _load_status(self) -> dict:
        if not os.path.exists(self.status_path):
            return {"version": _VERSION, "tasks": {}, "groups": {}}
        try:
            with open(self.status_path) as handle:
                data = json.load(handle)
        except (OSError, ValueError) as err:
            raise ValueError(f"database: cannot read {self.status_path}: {err}") from err
        if data.get("version") != _VERSION:
            raise ValueError(f"{self.status_path}: unsupported status version {data.get('version')!r}")
        return data

    def save(self) -> None:
        """Write the status file atomically (an interrupted write never leaves it truncated)."""
        fd, tmp = tempfile.mkstemp(dir=self.work_dir, prefix=".stof_tuning.")
        with os.fdopen(fd, "w") as handle:
            json.dump(self.status, handle, indent=1, sort_keys=True)
        os.replace(tmp, self.status_path)

    # -- records of one workload -----------------------------------------------------------------------------

    def _all_records(self, mod: tvm.IRModule) -> list:
        """Every record of workload ``mod``, failed ones included (an index rebuilt when records were added)."""
        if not self.ms.has_workload(mod):
            return []
        if self._index is None or self._index_size != len(self.ms):
            self._index = {}
            for record in self.ms.get_all_tuning_records():
                self._index.setdefault(record.workload, []).append(record)
            self._index_size = len(self.ms)
        return self._index.get(self.ms.commit_workload(mod), [])

    def records(self, mod: tvm.IRModule) -> list:
        """Successful measurements of the normalised workload ``mod``, fastest first (MetaSchedule's
        ``get_top_k`` would skip the records of pre-scheduled kernels, whose traces are empty)."""
        return sorted((r for r in self._all_records(mod) if math.isfinite(mean_seconds(r))), key=mean_seconds)

    def measured(self, mod: tvm.IRModule) -> int:
        """Measurements of ``mod`` recorded, failures included (each one a trial spent)."""
        return len(self._all_records(mod))

    def candidate_index(self, mod: tvm.IRModule, candidates, apply, record) -> int | None:
        """Which of ``candidates`` (knob sets that ``apply(sch, knobs)`` schedules ``mod`` with) a record
        measured (the first that schedules the same module); None when none matches."""
        target = _replayed(mod, record)
        return next((i for i, knobs in enumerate(candidates) if _scheduled(mod, apply, knobs) == target), None)

    def measured_candidates(self, mod: tvm.IRModule, candidates, apply) -> set[int]:
        """Indices of the ``candidates`` whose schedule some record of ``mod`` measured (failures included):
        a schedule is measured once, whichever trace reached it (a resumed search, the untuned first candidate)."""
        records = self._all_records(mod)
        if not records or not candidates:
            return set()
        measured = {_replayed(mod, record) for record in records}
        return {i for i, knobs in enumerate(candidates) if _scheduled(mod, apply, knobs) in measured}

    # -- the tuner's tasks -----------------------------------------------------------------------------------

    def task_status(self, task) -> dict:
        return self.status["tasks"].get(task.key, {})

    def trials_left(self, task, planned: int) -> int:
        """Trials still to run for ``planned`` in total: 0 when the task is complete."""
        status = self.task_status(task)
        if status.get("complete"):
            return 0
        done = max(int(status.get("trials", 0)), self.measured(task.mod))
        return max(0, planned - done)

    def update_task(self, task, *, planned: int, measured: int, complete: bool) -> dict:
        """Add ``measured`` trials to ``task``'s count and refresh its best time and candidate."""
        status = self.status["tasks"].setdefault(task.key, {"trials": 0})
        status.update(name=task.name, group=task.group, planned=planned, meta=task.meta,
                      trials=int(status["trials"]) + measured, complete=bool(complete or status.get("complete")))
        return self.refresh(task)

    def refresh(self, task) -> dict:
        """Re-read ``task``'s best time and candidate from the records (its status entry must exist)."""
        status = self.status["tasks"][task.key]
        status["trials"] = max(int(status["trials"]), self.measured(task.mod))
        records = self.records(task.mod)
        if records:
            status["best_s"] = mean_seconds(records[0])
            status["best_candidate"] = (self.candidate_index(task.mod, task.candidates, task.apply, records[0])
                                        if task.candidates else None)
        return status

    # -- groups of alternatives ------------------------------------------------------------------------------

    def update_group(self, group: str, tasks: list) -> dict | None:
        """Record the fastest measured task of ``group`` (by mean run time) as the group's choice.

        A group with an untuned member (``meta["untuned"]``: what the compile runs without records) gets a choice
        only once that member is measured, so the choice is never slower than not tuning; another member replaces
        it only when :data:`CHOICE_MARGIN` faster."""
        untuned = next((t for t in tasks if t.meta.get("untuned")), None)
        untuned_s = self.task_status(untuned).get("best_s") if untuned is not None else None
        if untuned is not None and untuned_s is None:
            return None
        measured = [(self.task_status(task).get("best_s"), task) for task in tasks]
        measured = [(seconds, task) for seconds, task in measured if seconds is not None]
        if not measured:
            return None
        best_s, best_task = min(measured, key=lambda pair: pair[0])
        if untuned is not None and best_s > untuned_s * (1 - CHOICE_MARGIN):
            best_s, best_task = untuned_s, untuned
        best = {"task": best_task.key, "name": best_task.name, "best_s": best_s, "meta": best_task.meta}
        self.status["groups"][group] = best
        return best

    def group_choice(self, group: str) -> dict | None:
        return self.status["groups"].get(group)

    # -- the whole-model check's verdict ----------------------------------------------------------------------

    def veto(self, jobs, evidence: dict) -> None:
        """Mark ``jobs`` (group names, task keys) as not to be applied, with the ``evidence`` that says why (the
        whole forward pass timed with and without their records), and save."""
        self.vetoed().update({job: evidence for job in jobs})
        self.save()

    def unveto(self, jobs) -> None:
        """Lift the veto of ``jobs`` (a new whole-model check judges them again)."""
        for job in jobs:
            self.vetoed().pop(job, None)
        self.save()

    def vetoed(self) -> dict:
        """``{job: evidence}`` of every vetoed job (the status file's own mapping)."""
        return self.status.setdefault("vetoed", {})

    # -- what a compile reads ----------------------------------------------------------------------------------

    def best_record(self, func: tvm.tirx.PrimFunc):
        """The fastest successful record of ``func``'s workload, or None; noted in the usage ledger."""
        key = workload_key(func)
        records = [] if key in self.vetoed() else self.records(normalize_workload(func))
        note_lookup(key, bool(records))
        return records[0] if records else None

    def choice(self, group: str):
        """The group's recorded choice, or None (also where it is vetoed); noted in the usage ledger."""
        best = None if group in self.vetoed() else self.group_choice(group)
        note_lookup(group, best is not None)
        return best

    def best_schedule(self, func: tvm.tirx.PrimFunc, target) -> tvm.s_tir.Schedule | None:
        """The fastest recorded schedule of ``func`` (any PrimFunc structurally equal to a tuned workload)."""
        return self.ms.query(normalize_workload(func), tvm.target.Target(target), kind="schedule")

    def jobs(self) -> dict[str, str]:
        """``{job: name}`` of every measured job: groups with a choice, and ungrouped tasks with a best time."""
        jobs = {group: group for group in self.status["groups"]}
        for key, status in self.status["tasks"].items():
            if not status.get("group") and status.get("best_s") is not None:
                jobs[key] = status.get("name", key)
        return {job: name for job, name in jobs.items() if job not in self.vetoed()}


def _replayed(mod: tvm.IRModule, record) -> int:
    """Structural hash of ``mod`` scheduled by ``record``'s trace."""
    sch = tvm.s_tir.Schedule(mod)
    record.trace.apply_to_schedule(sch, remove_postproc=True)
    return tvm_ffi.structural_hash(sch.mod)


def _scheduled(mod: tvm.IRModule, apply, knobs) -> int | None:
    """Structural hash of ``mod`` scheduled by ``apply(sch, knobs)``; None when the knobs do not apply."""
    sch = tvm.s_tir.Schedule(mod)
    try:
        apply(sch, knobs)
    except (tvm.s_tir.ScheduleError, ValueError):
        return None
    return tvm_ffi.structural_hash(sch.mod)


_OPEN: dict[str, tuple[tuple, TuningDatabase]] = {}


def _state(work_dir: str) -> tuple:
    stats = []
    for name in (WORKLOAD_FILE, RECORD_FILE, STATUS_FILE):
        try:
            info = os.stat(os.path.join(work_dir, name))
            stats.append((info.st_size, info.st_mtime_ns))
        except FileNotFoundError:
            stats.append(None)
    return tuple(stats)


def open_database(work_dir: str) -> TuningDatabase:
    """The existing work directory ``work_dir`` for reading, loaded once per process while its files are
    unchanged (each load replays every record; a compile reads it from several places)."""
    path = os.path.abspath(os.fspath(work_dir))
    state = _state(path)
    cached = _OPEN.get(path)
    if cached is None or cached[0] != state:
        _OPEN[path] = (state, TuningDatabase(path, create=False))
    return _OPEN[path][1]
