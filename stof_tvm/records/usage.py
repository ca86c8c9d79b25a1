"""Which tuning records a compile used: the ledger behind "N tuning records applied" (CLI line and manifest).

While :func:`record_usage` is active, every look-up the compile path makes through
:class:`~stof_tvm.records.database.TuningDatabase` (a template call's best record, a group's choice) is noted
with whether it found a measurement. :meth:`RecordUsage.summary` then says how many were applied, which calls
found none, and which measured jobs of the database no call asked for (a database tuned for this very compile
has none: the tuner plans exactly the calls the compile makes).
"""
from __future__ import annotations

import contextlib
import contextvars

__all__ = ["RecordUsage", "record_usage", "note_lookup"]

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("stof_tvm_record_usage", default=None)


class RecordUsage:
    """Look-ups of one compile: ``{job: (label, found)}``; a job is a workload key or a group name."""

    def __init__(self):
        self.lookups: dict[str, tuple[str, bool]] = {}

    def note(self, job: str, label: str, found: bool) -> None:
        previous = self.lookups.get(job)
        self.lookups[job] = (label, found or (previous is not None and previous[1]))

    @property
    def applied(self) -> list[str]:
        return sorted(label for label, found in self.lookups.values() if found)

    @property
    def missing(self) -> list[str]:
        return sorted(label for label, found in self.lookups.values() if not found)

    def summary(self, database=None) -> dict:
        """``{"applied", "missing", "unused"}``: counts of records applied, the calls that found none (by name),
        and the measured jobs of ``database`` (a :class:`TuningDatabase`) that nothing looked up."""
        unused = []
        if database is not None:
            unused = sorted(name for job, name in database.jobs().items() if job not in self.lookups)
        return {"applied": len(self.applied), "missing": self.missing, "unused": unused}


@contextlib.contextmanager
def record_usage():
    """Note the look-ups made inside the ``with`` block into the :class:`RecordUsage` it yields."""
    usage = RecordUsage()
    token = _ACTIVE.set(usage)
    try:
        yield usage
    finally:
        _ACTIVE.reset(token)


def note_lookup(job: str, label: str, found: bool) -> None:
    """Record one look-up in the active ledger (none active: nothing to do)."""
    usage = _ACTIVE.get()
    if usage is not None:
        usage.note(job, label, found)
