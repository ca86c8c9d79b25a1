"""What keeps a tuning run's wall time down (issue 15), on the CPU:

- a searched task whose trial plan covers every unmeasured survivor is measured whole as pre-built schedules
  (no MetaSchedule search to pay for), in the order untuned choices, other pre-built tasks, the rest task by task;
  a smaller plan leaves the search the candidates after the first;
- the build pool keeps its worker processes across build calls (MetaSchedule's LocalBuilder starts new ones for
  every batch);
- the tuning flow plans a second time only when the records moved an attention problem to the other kernel kind;
- ``scripts/bench_tuning_flow.py --reference-budget F`` reports the default budget against F x the budget.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import tvm
from tvm.s_tir import meta_schedule as ms

from stof_tvm.tuning import TuningTask, tuning_target
from stof_tvm.tuning.build_pool import BuildPool, worker_ready
from stof_tvm.tuning.tuner import _measured_directly
from stof_tvm.workflow import _attention_kind_moved

from test_tuning import TILES, apply_tiles, matmul
from test_tuning_prebuilt import doubled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RecordedCandidates:
    """The one database method ``_measured_directly`` reads: which candidates records already hold."""

    def __init__(self, done):
        self.done = set(done)

    def measured_candidates(self, mod, candidates, apply):
        return set(self.done)


def scheduled(task, knobs):
    sch = tvm.s_tir.Schedule(task.mod)
    apply_tiles(sch, knobs)
    return sch.mod


def test_a_plan_covering_every_survivor_is_measured_without_a_search():
    tiles = TuningTask("tiles", matmul, TILES, apply_tiles)
    untuned = TuningTask("kernel8", doubled(8), group="g", meta={"untuned": True})
    other = TuningTask("kernel16", doubled(16), group="g")
    direct, spaces = _measured_directly([other, tiles, untuned], RecordedCandidates([]), [1, 3, 1])
    assert [i for i, _ in direct] == [2, 1, 0, 1, 1]     # untuned kernel, tiles' first, other kernel, tiles' rest
    assert spaces == {1: []}
    for (_, sch), knobs in zip([d for d in direct if d[0] == 1], TILES):
        tvm.ir.assert_structural_equal(sch.mod, scheduled(tiles, knobs))
    assert direct[0][1] is None and direct[2][1] is None    # pre-built kernels are measured as they are


def test_a_smaller_plan_leaves_the_rest_to_the_search():
    tiles = TuningTask("tiles", matmul, TILES, apply_tiles)
    direct, spaces = _measured_directly([tiles], RecordedCandidates([]), [2])
    assert [i for i, _ in direct] == [0] and spaces == {0: TILES[1:]}
    tvm.ir.assert_structural_equal(direct[0][1].mod, scheduled(tiles, TILES[0]))
    # the first candidate already recorded (a resumed run): the two left fit a plan of two
    direct, spaces = _measured_directly([tiles], RecordedCandidates([0]), [2])
    assert len(direct) == 2 and spaces == {0: []}
    tvm.ir.assert_structural_equal(direct[1][1].mod, scheduled(tiles, TILES[2]))


def test_build_pool_keeps_its_workers_across_builds():
    pool = BuildPool(1)
    pool.warm_up()
    try:
        started = pool.starting[0].result()
        mod = scheduled(TuningTask("tiles", matmul, TILES, apply_tiles), TILES[0])
        target = tuning_target("llvm")
        for _ in range(2):
            results = pool.build([ms.builder.BuilderInput(mod, target)] * 2)
            assert [r.error_msg for r in results] == [None, None]
            assert all(os.path.isfile(r.artifact_path) for r in results)
        assert pool.pool.submit(worker_ready).result() == started          # the same process built everything
    finally:
        pool.close()
    with pytest.raises(ValueError, match="positive int"):
        BuildPool(0)


def _report(untuned_kind: str, chosen_kind: str):
    def task(key, kind, untuned):
        return SimpleNamespace(key=key, group="attention:p", meta={"kind": kind, **({"untuned": True} if untuned
                                                                                     else {})})
    tasks = [task("a", untuned_kind, True), task("b", chosen_kind, False)]
    results = [SimpleNamespace(task=t) for t in tasks]
    return SimpleNamespace(results=results, choices={"attention:p": {"task": "b"}})


def test_planning_again_only_when_the_attention_kernel_changes_kind():
    assert not _attention_kind_moved(_report("block", "block"))       # another block configuration: same calls
    assert _attention_kind_moved(_report("block", "row"))
    assert _attention_kind_moved(_report("row", "block"))
    assert not _attention_kind_moved(SimpleNamespace(results=[], choices={}))


def _bench_flow():
    path = os.path.join(ROOT, "scripts", "bench_tuning_flow.py")
    spec = importlib.util.spec_from_file_location("bench_tuning_flow", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_tuning_flow"] = module
    spec.loader.exec_module(module)
    return module


def test_bench_flow_reports_the_reference_budget(capsys):
    bench = _bench_flow()
    row = {"model": "roberta-base", "shape": "8x512", "tuning_s": 50.0, "measured": 56, "applied": 7,
           "untuned_ms": 2.3, "tuned_ms": 1.9, "tuned_over_untuned": 0.83, "recompile_s": 18.0,
           "untuned_compile_s": 35.0}
    plain = bench.table([row])
    assert "tuned/ref" not in plain
    text = bench.table([{**row, "reference_tuning_s": 200.0, "reference_measured": 448, "reference_ms": 1.85,
                         "tuned_over_reference": 1.9 / 1.85}])
    header, line = text.splitlines()
    assert "tuned/ref" in header and line.split()[-4:] == ["200.0", "448", "1.850", "1.027"]
    with pytest.raises(SystemExit):
        bench.main(["--reference-budget", "1"])
    assert "factor >= 2" in capsys.readouterr().err
