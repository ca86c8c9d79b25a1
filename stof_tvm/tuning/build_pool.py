"""A MetaSchedule builder whose worker processes live for a whole tuning run, started ahead of need.

MetaSchedule's ``LocalBuilder`` starts a fresh pool of worker processes for every ``build`` call (every batch),
and each new worker first imports TVM and our build function before it builds anything. On the H200 machine a
batch of 16 candidates took ~12 s of which the builds themselves are ~1-2 s (here, on a loaded CPU: 31 s for two
candidates through ``LocalBuilder``, 2.9 s for the same two built in-process); a base model's 56 candidates
paid that start-up in every batch. :class:`BuildPool` keeps one pool (TVM's ``PopenPoolExecutor``, the same
process isolation and per-build timeout) for all its ``build`` calls, and :meth:`BuildPool.warm_up` starts every
worker in the background, so the caller can start them before stage 1 and have them ready when stage 2 begins.

Each worker is replaced after ``max_uses`` builds (the leak that makes ``LocalBuilder`` restart its pool shows
after many uses). :meth:`BuildPool.close` ends the workers; the tuner closes the pools it made itself.
"""
from __future__ import annotations

import os

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import local_builder
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from .runners import build_candidate

__all__ = ["BuildPool", "worker_ready"]


def worker_ready() -> int:
    """Run once in each worker by :meth:`BuildPool.warm_up`: loading it imports this module (and with it the
    build function) and MetaSchedule's builder worker, the start-up every later build would otherwise pay."""
    from tvm.s_tir.meta_schedule.builder import local_builder as _  # noqa: F401

    return os.getpid()


@derived_object
class BuildPool(ms.builder.PyBuilder):
    """Builds candidates with :func:`~stof_tvm.tuning.runners.build_candidate` on ``max_workers`` long-lived
    worker processes (default: every core); see the module docstring."""

    def __init__(self, max_workers: int | None = None, timeout_sec: float = 120.0, max_uses: int = 64):
        super().__init__()
        if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(max_workers, int)
                                        or max_workers < 1):
            raise ValueError(f"build workers must be a positive int, got {max_workers!r}")
        self.max_workers = max_workers or os.cpu_count() or 1
        self.timeout_sec = timeout_sec
        self.pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=timeout_sec,
                                      maximum_process_uses=max_uses)
        self.starting: list = []

    def warm_up(self) -> None:
        """Start every worker now, in the background (returns at once)."""
        self.starting = [self.pool.submit(worker_ready) for _ in range(self.max_workers)]

    def build(self, build_inputs):
        results = []
        jobs = [(build_candidate, None, item.mod, item.target, None) for item in build_inputs]
        for result in self.pool.map_with_error_catching(lambda job: local_builder._worker_func(*job), jobs):
            if result.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(result.value, None))
            elif result.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(None, f"BuildPool: timeout, killed after "
                                                              f"{self.timeout_sec} seconds"))
            else:
                results.append(ms.builder.BuilderResult(None, f"BuildPool: an exception occurred\n{result.value}"))
        return results

    def close(self) -> None:
        """End the worker processes (a later ``build`` would fail)."""
        self.pool.shutdown(wait=False)
