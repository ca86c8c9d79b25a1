"""Which tuning records a compile used: the ledger behind "N tuning records applied" (CLI line and manifest).

While :func:`record_usage` is active, every look-up the compile path makes through
:class:`~stof_tvm.records.database.TuningDatabase` (a template call's best record, a group's choice) that finds
a measurement is noted, including look-ups that only decide between forms (fused or unfused LayerNorm).
:meth:`RecordUsage.summary` takes the calls the compile made, each with whether a record decided it, and says how
many were applied, which found none, and which measured jobs of the database nothing consulted (a database tuned
for this very compile has none: the tuner plans exactly the calls the compile makes).
"""
from __future__ import annotations

import contextlib
import contextvars

__all__ = ["RecordUsage", "record_usage", "note_lookup"]

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("stof_tvm_record_usage", default=None)


class RecordUsage:
    """The jobs (workload keys, group names) whose records one compile consulted."""

    def __init__(self):
        self.consulted: set[str] = set()

    def note(self, job: str, found: bool) -> None:
        if found:
            self.consulted.add(job)

    def summary(self, calls, database=None) -> dict:
        """``{"applied", "missing", "unused"}`` for ``calls`` (``[(label, decided by a record)]``): how many calls
        a record decided, the labels of those none did, and the names of ``database``'s measured jobs (a
        :class:`TuningDatabase`) that nothing consulted."""
        decided: dict[str, bool] = {}
        for label, applied in calls:
            decided[label] = decided.get(label, False) or bool(applied)
        unused = []
        if database is not None:
            unused = sorted(name for job, name in database.jobs().items() if job not in self.consulted)
        return {"applied": sum(decided.values()), "missing": sorted(k for k, v in decided.items() if not v),
                "unused": unused}


@contextlib.contextmanager
def record_usage():
    """Note the look-ups made inside the ``with`` block into the :class:`RecordUsage` it yields."""
    usage = RecordUsage()
    token = _ACTIVE.set(usage)
    try:
        yield usage
    finally:
        _ACTIVE.reset(token)


def note_lookup(job: str, found: bool) -> None:
    """Record one look-up in the active ledger (none active: nothing to do)."""
    usage = _ACTIVE.get()
    if usage is not None:
        usage.note(job, found)
