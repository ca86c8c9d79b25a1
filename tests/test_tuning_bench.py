"""scripts/bench_tuning.py's bookkeeping (the GPU run itself is the script's): trials in the model's order to
come within 5% of the 10x budget's best, per job and per layer set, and the task lists of its phases (the 10x
budget's extra candidates, the first n per job)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from tvm.script import tirx as T

from stof_tvm.tuning import TuningTask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    spec = importlib.util.spec_from_file_location("bench_tuning", os.path.join(ROOT, "scripts", "bench_tuning.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_tuning"] = module
    spec.loader.exec_module(module)
    return module


bench = _script()


def scaled(n: int):
    @T.prim_func(s_tir=True)
    def func(A: T.Buffer((n, 8), "float32"), B: T.Buffer((n, 8), "float32")):
        for i, j in T.grid(n, 8):
            with T.sblock("B"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, vj] * T.float32(3)

    return func


def split_j(sch, knobs):
    _, j = sch.get_loops("B")
    sch.split(j, [None, knobs["tj"]])


def test_trials_to_reach_and_job_summary():
    assert bench.trials_to_reach([5.0, None, 1.04, 1.0], 1.0) == 3        # 1.04 is within 5% of 1.0
    assert bench.trials_to_reach([5.0, 1.06], 1.0) is None
    row = bench.summarise_job([2.0, None, 1.5, 1.2, 1.0], k=3)
    assert row == {"candidates": 5, "measured": 4, "best_s": 1.0, "top_k_best_s": 1.5, "top_k_over_best": 1.5,
                   "model_first_s": 2.0, "trials_to_reach": 5}
    jobs = {"a": {**row, "weight": 2.0, "k": 3}, "b": {**bench.summarise_job([1.0, 3.0], k=3), "weight": 1.0, "k": 3}}
    layer = bench.layer_summary(jobs)
    assert layer["weighted_top_k_s"] == pytest.approx(4.0) and layer["weighted_best_s"] == pytest.approx(3.0)
    assert layer["trials_to_reach"] == 6 and layer["default_trials"] == 5      # min(k, candidates) per job
    jobs["c"] = {**bench.summarise_job([None], k=3), "weight": 1.0, "k": 3}
    assert bench.layer_summary(jobs)["trials_to_reach"] is None                  # a job that never ran


def test_phase_task_lists():
    knobs = [{"tj": 8}, {"tj": 4}, {"tj": 2}, {"tj": 1}]
    searched = TuningTask("ln", scaled(16), knobs, split_j, weight=2.0)
    kernels = [TuningTask(f"k{n}", scaled(n), group="g") for n in (8, 24, 32)]
    big = [searched] + kernels
    jobs = bench.jobs_of(big)
    assert list(jobs) == ["ln", "g"] and [i for _, i in jobs["ln"]] == [0, 1, 2, 3]
    assert [t.name for t, _ in jobs["g"]] == ["k8", "k24", "k32"]
    # the default top 2 planned ln's first two knob sets and the first two kernels; the 10x budget adds the rest
    rest = bench.rest_tasks(big, {kernels[0].key, kernels[1].key}, k=2)
    assert [t.name for t in rest] == ["ln", "k32"] and rest[0].candidates == knobs[2:]
    assert rest[0].key == searched.key and rest[0].weight == 2.0
    assert bench._knob_key(rest[0], 0) == bench._knob_key(searched, 2)      # one key across both databases
    first = bench.first_n_tasks(jobs, {"ln": 3, "g": 1})
    assert [t.name for t in first] == ["ln", "k8"] and first[0].candidates == knobs[:3]
