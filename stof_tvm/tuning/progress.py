"""Progress reporting and clean stopping for stage 2.

:class:`Progress` backs a MetaSchedule measure callback: after every measured batch it counts trials per task,
keeps each task's best time and redraws a one-line progress bar (trials done, tasks done, the current task's
best, elapsed and time left). It also decides when to stop (time budget spent, or Ctrl-C): the search
strategies ask :meth:`Progress.should_stop` before each batch and return no more candidates, so MetaSchedule's
task scheduler ends every task normally and every record measured so far is already in the database
(MetaSchedule commits each record as it is measured).

:func:`interrupt_handler` turns the first Ctrl-C into such a stop request; a second Ctrl-C aborts at once.
"""
from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

__all__ = ["Progress", "StopFlag", "interrupt_handler", "format_seconds"]


def format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}:" if hours else "") + f"{rest // 60:02d}:{rest % 60:02d}"


class StopFlag:
    """A thread-safe request to stop tuning, with the reason."""

    def __init__(self):
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


@contextlib.contextmanager
def interrupt_handler(stop: StopFlag, stream=sys.stderr):
    """While active, the first SIGINT sets ``stop`` (tuning ends after the batch in flight); the second one
    raises KeyboardInterrupt. Only installs itself in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.set("interrupted (Ctrl-C)")
        print("\nstof-tvm tune: stopping after the batch in flight; Ctrl-C again to abort", file=stream,
              flush=True)

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Progress:
    """Per-task trial counts and best times, the progress line, and the stop decision (see module docstring).

    ``names[i]``/``planned[i]``: the i-th MetaSchedule task's name and trial plan; ``time_budget_s``: stop once
    this much time has passed (None: no limit); ``stream``: where the bar goes (None: silent).
    """

    def __init__(self, names, planned, *, time_budget_s=None, stop: StopFlag | None = None, stream=sys.stderr,
                 clock=time.monotonic):
        self.names = list(names)
        self.planned = [int(p) for p in planned]
        self.trials = [0] * len(self.names)
        self.failed = [0] * len(self.names)
        self.best = [math.inf] * len(self.names)
        self.time_budget_s = time_budget_s
        self.stop = stop if stop is not None else StopFlag()
        self.stream = stream
        self._clock = clock
        self.start = clock()
        self._tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())

    # -- bookkeeping -----------------------------------------------------------------------------------------

    def record(self, task_id: int, run_secs: list) -> None:
        """Count the results of one batch of ``task_id`` (``run_secs`` entries: list of seconds, or None)."""
        for secs in run_secs:
            self.trials[task_id] += 1
            if secs:
                self.best[task_id] = min(self.best[task_id], sum(secs) / len(secs))
            else:
                self.failed[task_id] += 1

    @property
    def elapsed(self) -> float:
        return self._clock() - self.start

    def time_left(self) -> float:
        """Seconds left: of the time budget when there is one, else estimated from the trial rate."""
        if self.time_budget_s is not None:
            return max(0.0, self.time_budget_s - self.elapsed)
        done, total = sum(self.trials), sum(self.planned)
        if done == 0:
            return math.inf
        return self.elapsed / done * max(0, total - done)

    def should_stop(self) -> bool:
        """True once a stop was requested or the time budget is spent (then the flag is set, with the reason).

        The budget is checked between batches and only once something was measured: every run makes progress.
        """
        if self.time_budget_s is not None and self.elapsed >= self.time_budget_s and sum(self.trials):
            self.stop.set(f"time budget of {self.time_budget_s:g} s spent")
        return bool(self.stop)

    # -- display ---------------------------------------------------------------------------------------------

    def line(self, task_id: int | None = None) -> str:
        done, total = sum(self.trials), sum(self.planned)
        width = 24
        filled = int(width * min(done, total) / total) if total else width
        finished = sum(t >= p for t, p in zip(self.trials, self.planned))
        parts = [f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} trials",
                 f"{finished}/{len(self.names)} tasks"]
        if task_id is not None and math.isfinite(self.best[task_id]):
            parts.append(f"{self.names[task_id]}: best {self.best[task_id] * 1e6:.1f} us")
        left = self.time_left()
        label = "left in budget" if self.time_budget_s is not None else "left (est.)"
        parts.append(f"{format_seconds(self.elapsed)} elapsed, {format_seconds(left)} {label}")
        return " | ".join(parts)

    def show(self, task_id: int | None = None) -> None:
        if self.stream is None:
            return
        text = self.line(task_id)
        if self._tty:
            print("\r\033[K" + text, end="", file=self.stream, flush=True)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.stream is not None and self._tty:
            print(file=self.stream, flush=True)

    def callback(self, ids=None):
        """The MetaSchedule measure callback bound to this object; ``ids[i]``: the index here of the scheduler's
        task i (default: the same index)."""
        return _ProgressCallback(self, ids)


@derived_object
class _ProgressCallback(ms.measure_callback.PyMeasureCallback):
    """Forwards each measured batch to a :class:`Progress`."""

    def __init__(self, progress: Progress, ids=None):
        super().__init__()
        self.progress = progress
        self.ids = None if ids is None else list(ids)

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        secs = []
        for build, run in zip(builder_results, runner_results):
            ok = build.error_msg is None and run.error_msg is None and run.run_secs
            secs.append([float(s) for s in run.run_secs] if ok else None)
        task_id = task_id if self.ids is None else self.ids[task_id]
        self.progress.record(task_id, secs)
        self.progress.should_stop()
        self.progress.show(task_id)
