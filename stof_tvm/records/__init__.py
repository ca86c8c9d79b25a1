"""Tuning records: what stage 2 writes and what a compile reads back, in the one place both import.

Data flows one way: :mod:`stof_tvm.tuning` writes records here, :mod:`stof_tvm.compiler` reads them, and
neither imports the other for it (the tuner reads the compiler's front end to plan; :mod:`stof_tvm.workflow`,
above both, tunes and then compiles).

- :mod:`.names`: the workload and group names records are filed under;
- :mod:`.store`: MetaSchedule's JSON database opened so that every record is readable in any process;
- :mod:`.database`: the work directory (records + per-task status, group choices), :func:`open_database`;
- :mod:`.usage`: which records a compile applied.
"""
from .database import FAILED_SECONDS, STATUS_FILE, TuningDatabase, mean_seconds, open_database
from .names import attention_group, is_attention_group, normalize_workload, wgmma_group, workload_key
from .usage import RecordUsage, record_usage

__all__ = ["TuningDatabase", "open_database", "mean_seconds", "STATUS_FILE", "FAILED_SECONDS", "attention_group",
           "is_attention_group", "normalize_workload", "wgmma_group", "workload_key", "RecordUsage", "record_usage"]
