"""Open MetaSchedule's JSON database of a work directory so that every record in it can be read back.

MetaSchedule replays each record's trace onto its workload while it loads the files (``JSONDatabase`` parses
records in parallel and applies every instruction), so whatever a trace names must exist in the process first:
the tensor intrinsics a ``tensorize`` step uses above all. A process that compiles with records it never tuned
(``stof-tvm compile --database DIR`` after ``stof-tvm tune``) has imported none of the schedules that register
them; loading then failed with ``TensorIntrin 'stof_ldmatrix_a_f16' is not registered``. Here:

1. stof-tvm's own intrinsics (:mod:`stof_tvm.schedules.templates.intrin`, the only ones our records name) are
   registered before any file is read;
2. a record naming another intrinsic (a database MetaSchedule's generic rules wrote) makes us register TVM's
   whole set (``tvm.s_tir.tensor_intrin``, about 30 s of CPU, so only then) and read again;
3. a file cut short by a killed writer (a last line without its newline) loses that partial line, so a tuning
   job killed with ``kill -9`` resumes instead of failing to parse;
4. anything still unreadable is a ``ValueError`` naming the directory and the reason.
"""
from __future__ import annotations

import os
import re

from tvm.s_tir import meta_schedule as ms

__all__ = ["WORKLOAD_FILE", "RECORD_FILE", "open_json_database", "register_record_names"]

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
_UNREGISTERED = re.compile(r"TensorIntrin '([^']+)' is not registered")


def register_record_names() -> None:
    """Register every intrinsic a stof-tvm record can name (built on first use; safe to repeat)."""
    from stof_tvm.schedules.templates import intrin

    intrin.register_all()


def _drop_torn_tail(path: str) -> int:
    """Cut a partial last line (no newline: the writer was killed mid-write); returns the bytes dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path, "rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return 0
        keep = size
        while keep > 0:
            step = min(keep, 1 << 16)
            handle.seek(keep - step)
            chunk = handle.read(step)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = keep - step + cut + 1
                break
            keep -= step
        handle.truncate(keep)
        return size - keep


def _load(work_dir: str) -> ms.database.JSONDatabase:
    return ms.database.JSONDatabase(work_dir=work_dir, module_equality="structural")


def open_json_database(work_dir: str) -> ms.database.JSONDatabase:
    """MetaSchedule's JSON database of ``work_dir`` (an existing directory), every record readable (see above)."""
    register_record_names()
    for name in (WORKLOAD_FILE, RECORD_FILE):
        _drop_torn_tail(os.path.join(work_dir, name))
    try:
        return _load(work_dir)
    except RuntimeError as err:
        missing = _UNREGISTERED.search(str(err))
        if missing is None:
            raise ValueError(f"database {work_dir}: MetaSchedule cannot read its records: "
                             f"{str(err).strip().splitlines()[-1]}") from err
    import tvm.s_tir.tensor_intrin  # noqa: F401  (registers every intrinsic TVM ships)

    try:
        return _load(work_dir)
    except RuntimeError as err:
        missing = _UNREGISTERED.search(str(err))
        reason = (f"a record uses the tensor intrinsic {missing.group(1)!r}, which neither stof-tvm nor TVM "
                  "registers (was the database written by another tool?)" if missing else
                  str(err).strip().splitlines()[-1])
        raise ValueError(f"database {work_dir}: MetaSchedule cannot read its records: {reason}") from err
