"""Two-stage tuning: the analytical model's survivors (stage 1) measured by MetaSchedule (stage 2).

- :mod:`.task`: :class:`TuningTask`, a workload plus its stage-1 survivors;
- :mod:`.space`: survivor design spaces for MetaSchedule;
- :mod:`.runners`: builders, local/RPC runners, valid sparse-format inputs;
- :mod:`.progress`: progress bar, time budget, Ctrl-C;
- :mod:`.prebuilt`: pre-built tasks (attention kernels, wgmma knob sets) measured in parallel-built batches;
- :mod:`.tuner`: :func:`tune_tasks`, stage 2 over many tasks, resumable;
- :mod:`.attention_tasks`, :mod:`.template_tasks`, :mod:`.plan`: stage 1 (the model's top K per job);
- :mod:`.api`: :func:`tune` and :func:`plan` for a model, a template call or an attention problem.

Records go to the work directory of :mod:`stof_tvm.records` (:class:`TuningDatabase`, re-exported here), which
the compiler reads; a model's plan reads the compiler's front end, so this package sits above the compiler.
"""
from ..records import TuningDatabase
from .api import plan, resolve_hardware, tune
from .progress import StopFlag
from .runners import ArgumentFactory, make_builder, make_runner, parse_tracker
from .task import TuningTask, normalize_workload, workload_key
from .tuner import TaskResult, TuningReport, tune_tasks, tuning_target

__all__ = ["plan", "resolve_hardware", "tune", "TuningDatabase", "StopFlag", "ArgumentFactory", "make_builder",
           "make_runner", "parse_tracker",
           "TuningTask", "normalize_workload", "workload_key", "TaskResult", "TuningReport", "tune_tasks",
           "tuning_target"]
