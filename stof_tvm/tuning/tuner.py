"""Stage 2: measure the stage-1 survivors of many tasks with MetaSchedule, resumably.

:func:`tune_tasks` takes :class:`~stof_tvm.tuning.task.TuningTask` objects and a work directory and

1. skips every task the directory already holds complete (never measured twice) and plans the rest: a task's
   plan is its survivor count, capped by ``trials``; a task stopped (or killed) part-way earlier keeps only what
   it has left, counted from the records themselves;
2. measures first what the compile runs without records (the untuned choice: the group member marked
   ``meta["untuned"]``, a searched task's first candidate), so every later choice is among measured candidates
   that include it; then the other pre-built tasks (no knobs: attention kernels, wgmma knob sets) and every
   candidate of each searched task whose plan covers all its unmeasured survivors (there is nothing for a search
   to choose: all are measured), in parallel-built batches (:mod:`.prebuilt`); then MetaSchedule's task
   scheduler over the tasks whose plan is smaller than their survivor list: one ``TuneContext`` per task
   whose design space is its survivors (:func:`~stof_tvm.tuning.space.survivor_space`), evolutionary search
   ranked by the XGBoost cost model, the builder, and the local or RPC runner with valid sparse-format
   inputs. Candidates build on one pool of worker processes kept for the whole run (:mod:`.build_pool`);
3. reports progress after every batch and stops cleanly on a time budget or Ctrl-C (records already measured
   stay in the database);
4. writes each task's status and each group's winner (:class:`~stof_tvm.records.TuningDatabase`).

Tasks whose fixed input arrays clash with another task's under the same argument signature are measured in a
second scheduler run, since a runner only sees the signature.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import tvm
from tvm.s_tir import meta_schedule as ms

from ..records import TuningDatabase
from .build_pool import BuildPool
from .prebuilt import measure_prebuilt
from .progress import Progress, StopFlag, interrupt_handler
from .runners import ArgumentFactory, make_runner
from .search import planned_search
from .space import survivor_space
from .task import TuningTask

__all__ = ["TaskResult", "TuningReport", "tune_tasks", "tuning_target"]

_MS_LOGGER = "tvm.s_tir.meta_schedule"


@dataclass
class TaskResult:
    """Outcome of one task: ``status`` is ``cached`` (complete before this run), ``tuned``, ``stopped``
    (part-way; a re-run resumes it) or ``failed`` (no candidate built and ran)."""

    task: TuningTask
    status: str
    planned: int
    trials: int
    measured_now: int
    best_s: float | None
    best_candidate: object = None
    predicted_s: float | None = None

    @property
    def name(self) -> str:
        return self.task.name


@dataclass
class TuningReport:
    results: list[TaskResult]
    elapsed_s: float
    work_dir: str
    stopped: str = ""
    choices: dict = field(default_factory=dict)
    plan: object = None

    @property
    def measured(self) -> int:
        return sum(r.measured_now for r in self.results)

    def table(self) -> str:
        """A table of every task: status, trials, best measured time, stage-1 prediction, best candidate."""
        lines = [f"  {'task':<44} {'status':>8} {'trials':>9} {'best':>11} {'predicted':>11}  best candidate"]
        for r in self.results:
            best = f"{r.best_s * 1e6:9.2f}us" if r.best_s is not None else "-"
            pred = f"{r.predicted_s * 1e6:9.2f}us" if r.predicted_s is not None else "-"
            cand = "" if r.best_candidate is None else str(r.best_candidate)
            lines.append(f"  {r.name[:44]:<44} {r.status:>8} {r.trials:>4}/{r.planned:<4} {best:>11} {pred:>11}  "
                         f"{cand}")
        for group, choice in sorted(self.choices.items()):
            lines.append(f"  choice for {group}: {choice['name']} ({choice['best_s'] * 1e6:.2f} us)")
        tail = f"  {self.measured} trials measured in {self.elapsed_s:.1f} s; database {self.work_dir}"
        return "\n".join(lines + [tail + (f"; stopped: {self.stopped}" if self.stopped else "")])

    def to_json(self) -> dict:
        return {
            "work_dir": self.work_dir, "elapsed_s": self.elapsed_s, "stopped": self.stopped,
            "measured": self.measured, "choices": self.choices,
            "tasks": [{"name": r.name, "key": r.task.key, "group": r.task.group, "status": r.status,
                       "planned": r.planned, "trials": r.trials, "measured_now": r.measured_now,
                       "best_s": r.best_s, "predicted_s": r.predicted_s,
                       "best_candidate": None if r.best_candidate is None else str(r.best_candidate),
                       "meta": r.task.meta} for r in self.results],
        }


def tuning_target(target) -> tvm.target.Target:
    """A Target fit for MetaSchedule: llvm gets ``num-cores`` (required there), CUDA keeps its limits."""
    if isinstance(target, str):
        target = {"kind": target}
    if isinstance(target, dict):
        target = dict(target)
        host = target.pop("host", None)
        if target.get("kind") == "llvm":
            target.setdefault("num-cores", _physical_cores())
        elif target.get("kind") == "cuda":
            target.setdefault("arch", "sm_90")
            target.setdefault("max_threads_per_block", 1024)
            target.setdefault("max_shared_memory_per_block", 232448)
            return tvm.target.Target(target, host=host or {"kind": "llvm"})
        return tvm.target.Target(target)
    if isinstance(target, tvm.target.Target):
        return target
    raise TypeError(f"target must be 'llvm', 'cuda', a target dict or a tvm Target, got {target!r}")


def _physical_cores() -> int:
    try:
        import psutil

        return int(psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except ImportError:
        return int(os.cpu_count() or 1)


def _dedup(tasks: list[TuningTask]) -> list[TuningTask]:
    """Merge tasks with the same workload (weights add up; the first one's candidates are kept)."""
    by_key: dict[str, TuningTask] = {}
    for task in tasks:
        if not isinstance(task, TuningTask):
            raise TypeError(f"tasks must be TuningTask objects, got {type(task).__name__}")
        if task.key in by_key:
            by_key[task.key].weight += task.weight
        else:
            by_key[task.key] = task
    return list(by_key.values())


def _passes(tasks: list[TuningTask], rpc: bool) -> list[tuple[list[TuningTask], ArgumentFactory]]:
    """Split tasks into scheduler runs whose fixed arguments never clash under one signature."""
    passes: list[tuple[list[TuningTask], ArgumentFactory]] = []
    for task in tasks:
        for members, factory in passes:
            if factory.register(task):
                members.append(task)
                break
        else:
            factory = ArgumentFactory(rpc=rpc)
            factory.register(task)
            passes.append(([task], factory))
    return passes


def tune_tasks(tasks, target, work_dir, *, trials: int | None = None, num_trials_per_iter: int = 16,
               time_budget_s: float | None = None, rpc_tracker: str | None = None, rpc_key: str | None = None,
               builder=None, runner=None, build_workers: int | None = None, seed: int | None = 0,
               progress_stream=sys.stderr, stop: StopFlag | None = None,
               handle_interrupt: bool = True) -> TuningReport:
    """Measure the survivors of ``tasks`` on ``target`` and record them in ``work_dir`` (see module docstring).

    ``trials``: at most this many measurements per task (default: all its survivors). ``time_budget_s``: stop
    when this much wall time has passed. ``rpc_tracker``/``rpc_key``: measure on the RPC tracker's devices
    instead of locally. ``builder``/``runner``: replace the defaults entirely (then ``runner`` must allocate
    sparse-format inputs itself; a :class:`~stof_tvm.tuning.build_pool.BuildPool` passed as ``builder`` is left
    open for the caller, who may have started its workers before stage 1). ``build_workers``: processes of the
    default builder (every core). ``stop``: a :class:`StopFlag` another thread may set.
    """
    started = time.monotonic()
    if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int) or trials < 1):
        raise ValueError(f"trials must be a positive int, got {trials!r}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"time budget must be positive seconds, got {time_budget_s!r}")
    if not isinstance(num_trials_per_iter, int) or num_trials_per_iter < 1:
        raise ValueError(f"num_trials_per_iter must be a positive int, got {num_trials_per_iter!r}")
    target = tuning_target(target)
    tasks = _dedup(list(tasks))
    if not tasks:
        raise ValueError("no tasks to tune")
    if runner is None and rpc_tracker is None:
        _check_local_device(target)
    db = TuningDatabase(work_dir)
    logger = logging.getLogger(_MS_LOGGER)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)     # MetaSchedule logs to files in work_dir/logs; keep the console quiet

    planned = {t.key: min(trials, t.space_size) if trials else t.space_size for t in tasks}
    left = {t.key: db.trials_left(t, planned[t.key]) for t in tasks}
    todo = [t for t in tasks if left[t.key] > 0]
    stop = stop if stop is not None else StopFlag()
    measured: dict[str, int] = {}
    finished: set[str] = set()

    own_builder = None
    if builder is None and todo:
        builder = own_builder = BuildPool(build_workers)
        builder.warm_up()
    try:
        _measure_passes(todo, left, planned, target, db, builder, runner, stop, measured, finished, started,
                        time_budget_s=time_budget_s, rpc_tracker=rpc_tracker, rpc_key=rpc_key,
                        num_trials_per_iter=num_trials_per_iter, seed=seed, progress_stream=progress_stream,
                        handle_interrupt=handle_interrupt)
    finally:
        if own_builder is not None:
            own_builder.close()

    results = []
    for task in tasks:
        # A task with nothing left but no status yet (its records outlived a killed run) is complete.
        status = db.refresh(task) if db.task_status(task) else db.update_task(
            task, planned=planned[task.key], measured=0, complete=left[task.key] == 0)
        if left[task.key] == 0:
            state = "cached"
        elif task.key in finished:
            state = "tuned" if status.get("best_s") is not None else "failed"
        else:
            state = "stopped"
        index = status.get("best_candidate")
        best_candidate = task.candidates[index] if index is not None else None
        predicted = (task.predicted_s[index if index is not None else 0] if task.predicted_s else None)
        results.append(TaskResult(task, state, planned[task.key], int(status.get("trials", 0)),
                                  measured.get(task.key, 0), status.get("best_s"), best_candidate, predicted))
    choices = {}
    for group in sorted({t.group for t in tasks if t.group}):
        choice = db.update_group(group, [t for t in tasks if t.group == group])
        if choice is not None:
            choices[group] = choice
    db.save()
    return TuningReport(results, time.monotonic() - started, db.work_dir, stop.reason if stop else "", choices)


def _measure_passes(todo, left, planned, target, db, builder, runner, stop, measured, finished, started, *,
                    time_budget_s, rpc_tracker, rpc_key, num_trials_per_iter, seed, progress_stream,
                    handle_interrupt) -> None:
    """Measure ``todo`` in scheduler passes whose fixed arguments never clash; fills ``measured`` (trials per
    task key) and ``finished`` (keys of complete tasks) and records every task's status in ``db``."""
    for members, factory in _passes(todo, rpc=rpc_tracker is not None):
        if stop:
            break
        progress = Progress([t.name for t in members], [left[t.key] for t in members],
                            time_budget_s=None if time_budget_s is None else
                            max(1e-3, time_budget_s - (time.monotonic() - started)),
                            stop=stop, stream=progress_stream)
        pass_runner = runner or make_runner(target.kind.name, arguments=factory, rpc_tracker=rpc_tracker,
                                            rpc_key=rpc_key)
        direct, spaces = _measured_directly(members, db, [left[t.key] for t in members])
        try:
            with interrupt_handler(stop) if handle_interrupt else contextlib.nullcontext():
                if direct:        # one build per kernel, in parallel batches (see .prebuilt)
                    measure_prebuilt([members[i] for i, _ in direct], target, db.ms, builder, pass_runner,
                                     progress, [i for i, _ in direct], chunk=num_trials_per_iter,
                                     schedules=[sch for _, sch in direct])
                rest = {i: min(left[members[i].key] - progress.trials[i], len(space)) for i, space in spaces.items()}
                searched = [i for i in spaces if rest[i] > 0]
                if searched and not progress.should_stop():
                    _run_scheduler([members[i] for i in searched], searched, [spaces[i] for i in searched],
                                   [rest[i] for i in searched], target, db, progress, num_trials_per_iter,
                                   builder, pass_runner, seed)
        finally:
            progress.close()
            for i, task in enumerate(members):
                measured[task.key] = progress.trials[i]
                # Without a stop request the scheduler only returns once each task has spent its plan or
                # exhausted its survivors: the task is complete either way.
                if not stop or progress.trials[i] >= left[task.key]:
                    finished.add(task.key)
                db.update_task(task, planned=planned[task.key], measured=progress.trials[i],
                               complete=task.key in finished)
            db.save()


def _check_local_device(target: tvm.target.Target) -> None:
    """Stage 2 measures on this machine's device unless an RPC tracker is given: refuse a CUDA target without one."""
    if target.kind.name == "cuda" and not tvm.cuda(0).exist:
        raise ValueError("stage 2 measures on the GPU, and no CUDA device is visible here: tune on the GPU machine, "
                         "measure on remote GPUs with --rpc-tracker HOST:PORT --rpc-key KEY, or tune for the CPU "
                         "with --target llvm")


def _measured_directly(members: list[TuningTask], db: TuningDatabase,
                       left: list[int]) -> tuple[list, dict[int, list]]:
    """What :func:`measure_prebuilt` measures, in order, as ``[(member index, schedule or None)]``: the untuned
    choices first (pre-built group members marked ``meta["untuned"]``, and the first candidate of each searched
    task unless a record has it), then the other pre-built tasks and, task after task, every unmeasured candidate
    of each searched task whose plan (``left[i]`` trials) covers them all. Also ``{member index: candidates}``
    of each searched task: the ones left for the search (none for a task measured whole here, none that a record
    already measured).

    A task measured whole has nothing for a search to choose, and MetaSchedule's scheduler costs far more than
    the measurements it picks (two LayerNorm tasks' 14 trials took ~80 s on the H200 machine, where a batch of
    16 pre-built candidates took ~12 s). Candidates that cannot be applied are left out, as the survivor space
    leaves them out."""
    untuned, first, others, spaces = [], [], [], {}
    for i, task in enumerate(members):
        if not task.candidates:
            (untuned if task.meta.get("untuned") else others).append((i, None))
            continue
        done = db.measured_candidates(task.mod, task.candidates, task.apply)
        todo = [j for j in range(len(task.candidates)) if j not in done]
        plan = left[i]
        if 0 in todo:
            todo.remove(0)
            sch = _schedule(task, 0)
            if sch is not None:
                first.append((i, sch))
                plan -= 1
        if len(todo) <= plan:
            others += [(i, sch) for sch in (_schedule(task, j) for j in todo) if sch is not None]
            todo = []
        spaces[i] = [task.candidates[j] for j in todo]
    return untuned + first + others, spaces


def _schedule(task: TuningTask, index: int):
    """The schedule of ``task``'s candidate ``index``, or None when its knobs do not apply."""
    sch = tvm.s_tir.Schedule(task.mod)
    try:
        task.apply(sch, task.candidates[index])
    except (tvm.s_tir.ScheduleError, ValueError):
        return None
    return sch


def _run_scheduler(members, ids, spaces, budget, target, db, progress, num_trials_per_iter, builder, runner, seed):
    """MetaSchedule's task scheduler over ``members`` (tasks with candidates), counted in ``progress`` under
    ``ids``: task i searches the candidates ``spaces[i]`` for at most ``budget[i]`` trials."""
    names = [t.name for t in members]
    loggers = ms.logging.get_loggers_from_work_dir(db.work_dir, names)
    seeds = ms.utils.fork_seed(seed, n=len(members))
    cores = int(target.attrs.get("num-cores", 0)) or _physical_cores()
    contexts = [
        ms.TuneContext(mod=task.mod, target=target, space_generator=survivor_space(task, target, space),
                       search_strategy=planned_search(len(space), plan, progress.should_stop),
                       task_name=task.name,
                       rand_state=rand, num_threads=cores, logger=log).clone()
        for task, space, plan, log, rand in zip(members, spaces, budget, loggers, seeds)
    ]
    cost_model = ms.cost_model.XGBModel(num_warmup_samples=min(8, sum(budget)), num_tuning_cores=cores)
    ms.tune.tune_tasks(
        tasks=contexts, task_weights=[t.weight for t in members], work_dir=db.work_dir,
        max_trials_global=sum(budget), max_trials_per_task=max(budget),
        num_trials_per_iter=min(num_trials_per_iter, max(budget)), builder=builder, runner=runner,
        database=db.ms, cost_model=cost_model,
        measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [progress.callback(ids)],
        task_scheduler="gradient")
