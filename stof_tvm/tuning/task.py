"""A tuning task: one workload (a static-shaped PrimFunc) and the stage-1 survivors of its design space.

Stage 1 (the analytical model) turns a template's knob space, or the attention configurations of one problem,
into a short list of candidates, best predicted first. Stage 2 measures them with MetaSchedule. A
:class:`TuningTask` carries what stage 2 needs:

- ``func``: the workload MetaSchedule tunes and records under (its structural hash keys the database;
  :mod:`stof_tvm.records.names`);
- ``candidates`` and ``apply``: each candidate is a knob set that ``apply(sch, knobs)`` turns into a complete
  schedule; the design space is exactly these schedules. With no candidates the function is already
  scheduled (our attention kernels are written per configuration) and is measured as it is;
- ``fixed_args``: arrays that must have valid contents when the kernel runs (the sparse formats' index
  arrays), by parameter position; every other argument gets random data;
- ``group``: tasks of one group are alternatives for the same job (the attention configurations of one
  problem); after tuning the group's fastest task is its choice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tvm

from ..records import normalize_workload, workload_key

__all__ = ["TuningTask", "normalize_workload", "workload_key"]


@dataclass
class TuningTask:
    """One MetaSchedule task restricted to stage-1 survivors (see the module docstring)."""

    name: str
    func: tvm.tirx.PrimFunc
    candidates: Sequence[Any] = ()
    apply: Callable[[Any, Any], None] | None = None
    predicted_s: Sequence[float] = ()
    fixed_args: Mapping[int, np.ndarray] = field(default_factory=dict)
    weight: float = 1.0
    group: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("TuningTask.name must be a non-empty string")
        self.mod = normalize_workload(self.func)
        self.key = workload_key(self.func)
        self.candidates = list(self.candidates)
        if self.candidates and self.apply is None:
            raise ValueError(f"task {self.name}: candidates need an apply(sch, knobs) function")
        if self.predicted_s and len(self.predicted_s) != len(self.candidates or [None]):
            raise ValueError(f"task {self.name}: {len(self.predicted_s)} predicted times for "
                             f"{len(self.candidates)} candidates")
        params = self.mod["main"].params
        for index, array in self.fixed_args.items():
            if not 0 <= index < len(params):
                raise ValueError(f"task {self.name}: fixed argument index {index} outside 0..{len(params) - 1}")
            if not isinstance(array, np.ndarray):
                raise TypeError(f"task {self.name}: fixed argument {index} must be a numpy array")
        if not self.weight > 0:
            raise ValueError(f"task {self.name}: weight must be positive, got {self.weight!r}")

    @property
    def space_size(self) -> int:
        """Distinct schedules stage 2 can measure: the survivors, or 1 for a pre-scheduled function."""
        return max(1, len(self.candidates))

    def signature(self) -> tuple:
        """(dtype, shape) of every parameter: what MetaSchedule's runner sees of the arguments."""
        return tuple((str(p.dtype), tuple(int(s) for s in p.shape)) for p in self.mod["main"].params)
