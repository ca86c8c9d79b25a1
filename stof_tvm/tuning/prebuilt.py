"""Measure pre-built tasks (no knobs left: attention kernels, wgmma knob sets) in batches, builds in parallel.

MetaSchedule's task scheduler works one task at a time: it asks the task's search strategy for a batch, builds
that batch (a fresh pool of builder processes per batch), runs it, then moves to the next task. A task with
one schedule therefore costs a builder pool start-up and a build that uses one CPU core, for each trial, and
the model's per-knob-set wgmma tasks and per-configuration attention tasks are all of that kind. Here such
tasks are measured directly instead: ``chunk`` of them are built in one builder call (all cores), the chunk is
run while the next two build, and each result is committed to the MetaSchedule database as the scheduler
would (same workload, an empty trace, the measured seconds, or 1e10 s for a failure), so later look-ups, the
task status and the group choices treat them exactly like scheduler records.

The same path measures given schedules of a searched task (its untuned first candidate, which the tuner
measures before anything else, and all its candidates when its trial plan covers them all), each committed with
its schedule's trace.
"""
from __future__ import annotations

import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import tvm
from tvm.s_tir import meta_schedule as ms

from ..records import FAILED_SECONDS
from .task import TuningTask

__all__ = ["measure_prebuilt"]

# Chunks building at once: the one the runner needs next and the one after it, so the builder's workers never
# wait for the slowest build of a chunk (or for the runner) before starting on the next.
_AHEAD = 2


def _build(builder, schedules, target):
    return builder.build([ms.builder.BuilderInput(sch.mod, target) for sch in schedules])


def measure_prebuilt(tasks: list[TuningTask], target: tvm.target.Target, database, builder, runner, progress,
                     task_ids: list[int], chunk: int = 32, schedules: list | None = None) -> None:
    """Measure each of ``tasks`` once and commit the records to ``database`` (a MetaSchedule database);
    ``progress`` (a :class:`~stof_tvm.tuning.progress.Progress`) counts each under its ``task_ids`` entry and
    says when to stop: between chunks, never inside one. ``schedules[i]``: the schedule of ``tasks[i]`` to
    measure (a searched task's candidate); None, or no list, for a pre-built task (measured as it is)."""
    schedules = list(schedules) if schedules is not None else [None] * len(tasks)
    if len(task_ids) != len(tasks) or len(schedules) != len(tasks):
        raise ValueError(f"{len(task_ids)} task ids and {len(schedules)} schedules for {len(tasks)} tasks")
    if any(task.candidates and sch is None for task, sch in zip(tasks, schedules)):
        raise ValueError("measure_prebuilt measures a task with candidates only through a given schedule")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    schedules = [tvm.s_tir.Schedule(task.mod) if sch is None else sch for task, sch in zip(tasks, schedules)]
    order = list(range(len(tasks)))
    chunks = [order[i:i + chunk] for i in range(0, len(order), chunk)]
    pending: deque = deque()
    with ThreadPoolExecutor(max_workers=_AHEAD) as pool:
        def build_next() -> None:
            part = chunks[len(pending) + done]
            pending.append(pool.submit(_build, builder, [schedules[i] for i in part], target))

        done = 0
        while len(pending) < min(_AHEAD, len(chunks)):
            build_next()
        for part in chunks:
            built = pending.popleft().result()
            done += 1
            if len(pending) + done < len(chunks) and not progress.should_stop():
                build_next()
            _run_and_commit([tasks[i] for i in part], [schedules[i] for i in part], [task_ids[i] for i in part],
                            built, target, database, runner, progress)
            if progress.should_stop():
                for future in pending:
                    future.cancel()
                break


def _run_and_commit(tasks, schedules, ids, built, target, database, runner, progress) -> None:
    infos = [ms.arg_info.ArgInfo.from_prim_func(task.mod["main"]) for task in tasks]
    ready = [i for i, result in enumerate(built) if result.error_msg is None]
    device = "cuda" if target.kind.name == "cuda" else "cpu"      # the runner's device name of the target
    inputs = [ms.runner.RunnerInput(built[i].artifact_path, device, infos[i]) for i in ready]
    futures = dict(zip(ready, runner.run(inputs) if inputs else []))
    for i, task in enumerate(tasks):
        secs = None
        if i in futures:
            result = futures[i].result()
            if result.error_msg is None and result.run_secs:
                secs = [float(s) for s in result.run_secs]
            shutil.rmtree(os.path.dirname(built[i].artifact_path), ignore_errors=True)
        workload = database.commit_workload(task.mod)
        database.commit_tuning_record(ms.database.TuningRecord(
            schedules[i].trace, workload, secs or [FAILED_SECONDS], target, infos[i]))
        progress.record(ids[i], [secs])
        progress.show(ids[i])
