"""Stage 2 end to end on the CPU (llvm): survivors measured into a database, resumed, never measured twice.

One tuning sequence (the MetaSchedule runs are the slow part) covers a template-like task with three
survivors and a sparse attention problem whose kernels read real format arrays:

1. a run stopped by its time budget after the first batch keeps what it measured ("stopped");
2. the next run measures only what is left and records the group's choice;
3. a third run measures nothing: every task is complete in the database.
"""
from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from stof_tvm.cli import main as cli_main
from stof_tvm.cost_model import AttentionProblem
from stof_tvm.records.database import CHOICE_MARGIN
from stof_tvm.tuning import ArgumentFactory, StopFlag, TuningDatabase, TuningTask, make_runner, tune_tasks
from stof_tvm.tuning.attention_tasks import attention_tasks, attention_workload
from stof_tvm.tuning.progress import Progress, interrupt_handler
from stof_tvm.tuning.runners import parse_tracker

N = 32


@T.prim_func(s_tir=True)
def matmul(A: T.Buffer((N, N), "float32"), B: T.Buffer((N, N), "float32"), C: T.Buffer((N, N), "float32")):
    for i, j, k in T.grid(N, N, N):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]


def apply_tiles(sch, knobs):
    """A two-knob template: tile the i and j loops."""
    i, j, k = sch.get_loops("C")
    io, ii = sch.split(i, [None, knobs["ti"]])
    jo, ji = sch.split(j, [None, knobs["tj"]])
    sch.reorder(io, jo, k, ii, ji)


TILES = [{"ti": 4, "tj": 16}, {"ti": 8, "tj": 8}, {"ti": 16, "tj": 4}]


def record_count(work):
    return sum(1 for _ in open(work / "database_tuning_record.json"))


def test_tuning_writes_resumes_and_reuses_the_database(tmp_path):
    work = tmp_path / "db"
    problem = AttentionProblem.build("sliding:window=8", batch=1, heads=2, seq_len=32, head_dim=64)

    def tasks():
        gemm = TuningTask("tiles", matmul, TILES, apply_tiles, predicted_s=[1e-6, 2e-6, 3e-6])
        return [gemm] + attention_tasks(problem, "llvm", top_k=2)

    first = tasks()
    assert len(first) == 3 and first[1].group == first[2].group and first[1].key != first[2].key
    # 1. The budget is spent as soon as the first batch is measured: the run stops with records kept.
    stopped = tune_tasks(first, "llvm", work, num_trials_per_iter=1, time_budget_s=1e-3, build_workers=1,
                         progress_stream=None)
    assert stopped.stopped.startswith("time budget")
    assert 1 <= stopped.measured < 5 and record_count(work) == stopped.measured
    assert {r.status for r in stopped.results} >= {"stopped"}
    # 2. Resume: only the rest is measured; every survivor ends up with one record.
    resumed = tune_tasks(tasks(), "llvm", work, build_workers=1, progress_stream=None)
    assert not resumed.stopped
    assert stopped.measured + resumed.measured == 5 == record_count(work)
    by_name = {r.name: r for r in resumed.results}
    assert by_name["tiles"].trials == 3 and by_name["tiles"].best_candidate in TILES
    assert all(r.best_s and r.best_s > 0 for r in resumed.results)
    (group, choice), = resumed.choices.items()
    # the fastest member, unless the untuned member (what a compile runs without records) is within the margin
    members = [r for r in resumed.results if r.task.group == group]
    fastest = min(members, key=lambda r: r.best_s)
    untuned = next((r for r in members if r.task.meta.get("untuned")), None)
    kept = untuned if untuned is not None and fastest.best_s > untuned.best_s * (1 - CHOICE_MARGIN) else fastest
    assert (choice["name"], choice["best_s"]) == (kept.name, kept.best_s)
    # 3. Everything is complete: nothing is measured again, the records and the choice stay.
    again = tune_tasks(tasks(), "llvm", work, build_workers=1, progress_stream=None)
    assert again.measured == 0 and record_count(work) == 5
    assert {r.status for r in again.results} == {"cached"}
    assert again.choices == resumed.choices
    status = json.loads((work / "stof_tuning.json").read_text())
    assert all(t["complete"] for t in status["tasks"].values())
    # A later compile finds the tuned schedule of the template task.
    db = TuningDatabase(str(work))
    best = db.best_schedule(matmul, tvm.target.Target({"kind": "llvm", "num-cores": 1}))
    assert best is not None and best.mod["main"].body is not None


def test_attention_workloads_carry_valid_formats():
    problem = AttentionProblem.build("causal", batch=1, heads=2, seq_len=40, head_dim=64)
    tasks = attention_tasks(problem, "llvm", top_k=3)
    assert len({t.key for t in tasks}) == len(tasks)
    for task in tasks:
        params = task.mod["main"].params
        for index, array in task.fixed_args.items():
            assert tuple(int(s) for s in params[index].shape) == array.shape
            assert str(params[index].dtype) == str(array.dtype)
        assert all(isinstance(s, tvm.tirx.IntImm) for p in params for s in p.shape)   # static for the runner
    func, fixed = attention_workload(problem, "row", _row_config(), "llvm")
    indptr = fixed[3]
    assert indptr[-1] == problem.mask.kept and (np.diff(indptr) >= 0).all()


def _row_config():
    from stof_tvm.schedules.attention_rowwise import RowConfig

    return RowConfig(key_groups=4, keys_per_step=2, rows_per_block=2)


def test_argument_factory_fills_fixed_arrays_and_detects_clashes():
    indptr = np.array([0, 2, 5], dtype=np.int32)
    fac = ArgumentFactory()

    @T.prim_func(s_tir=True)
    def uses(ptr: T.Buffer((3,), "int32"), out: T.Buffer((2,), "float32")):
        for i in range(2):
            with T.sblock("o"):
                vi = T.axis.remap("S", [i])
                out[vi] = T.Cast("float32", ptr[vi + 1] - ptr[vi])

    task = TuningTask("uses", uses, fixed_args={0: indptr})
    assert fac.register(task)
    assert fac.register(TuningTask("same", uses, fixed_args={0: indptr.copy()}))
    assert not fac.register(TuningTask("other", uses, fixed_args={0: np.array([0, 1, 1], dtype=np.int32)}))
    info = [["TENSOR", "int32", [3]], ["TENSOR", "float32", [2]]]
    args = fac(tvm.cpu(0), info, 2)
    assert len(args) == 2 and all((a[0].numpy() == indptr).all() for a in args)
    assert fac(tvm.cpu(0), info, 2) is args          # a later candidate of the signature reuses them
    other = ArgumentFactory()                         # another pass: same signature, other format arrays
    assert other.register(TuningTask("other", uses, fixed_args={0: np.array([0, 1, 1], dtype=np.int32)}))
    theirs = other(tvm.cpu(0), info, 2)
    assert theirs is not args and (theirs[0][0].numpy() == [0, 1, 1]).all() and (args[0][0].numpy() == indptr).all()
    with pytest.raises(ValueError, match="expects"):
        fac.register(TuningTask("bad", uses, fixed_args={0: np.zeros(4, dtype=np.int32)}))


def test_runner_and_tracker_arguments():
    assert parse_tracker("127.0.0.1:9190") == ("127.0.0.1", 9190)
    for bad in ("localhost", ":9190", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_tracker(bad)
    with pytest.raises(ValueError, match="rpc-tracker"):
        make_runner("llvm", rpc_key="k")
    with pytest.raises(ValueError, match="rpc-key"):
        make_runner("llvm", rpc_tracker="127.0.0.1:9190")


def test_progress_line_budget_and_stop():
    now = [0.0]
    progress = Progress(["a", "b"], [4, 2], time_budget_s=10.0, stream=None, clock=lambda: now[0])
    progress.record(0, [[2e-6], None, [1e-6, 3e-6]])
    now[0] = 4.0
    line = progress.line(0)
    assert "3/6 trials" in line and "a: best 2.0 us" in line and "00:06 left in budget" in line
    assert progress.failed[0] == 1 and not progress.should_stop()
    now[0] = 10.5
    empty = Progress(["a"], [1], time_budget_s=1.0, stream=None, clock=lambda: now[0])
    assert not empty.should_stop()                      # nothing measured yet: the first batch always runs
    assert progress.should_stop() and "time budget" in progress.stop.reason
    unbounded = Progress(["a"], [4], stream=None, clock=lambda: now[0])
    unbounded.record(0, [[1e-6]])
    assert unbounded.time_left() == pytest.approx(3 * (now[0] - unbounded.start))


def test_first_ctrl_c_requests_a_stop_the_second_aborts():
    before = signal.getsignal(signal.SIGINT)      # default_int_handler, or SIG_IGN in a shell's background job
    stop = StopFlag()
    with interrupt_handler(stop, stream=open("/dev/null", "w")):
        signal.raise_signal(signal.SIGINT)
        assert stop and "interrupted" in stop.reason
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_cli_dry_run_explains_the_ranking(capsys):
    code = cli_main(["tune", "--target", "llvm", "--mask", "longformer", "--batch", "2", "--heads", "2",
                     "--seq-len", "256", "--top-k", "3", "--explain", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "feasible kernels" in out and "L2 time" in out and "stage 1: 3 tasks" in out
    assert cli_main(["tune", "--template", "gemm", "--target", "llvm"]) == 2
    assert "--shape" in capsys.readouterr().err
