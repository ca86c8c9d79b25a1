"""Distributed tuning on loopback: a TVM RPC tracker and two RPC servers for the ``llvm`` target, started here.

A tiny MetaSchedule run through the RPC runner, and ``stof-tvm tune --rpc-tracker --rpc-key`` on an attention
problem, must each be measured by both servers and write one database; the helpers that start and describe the
tracker must reject bad input. Everything listens on 127.0.0.1; the servers and tracker are stopped when the
module's tests end (the cluster fixture's context manager).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.script import tirx as T

from stof_tvm.tuning import rpc
from stof_tvm.tuning.runners import make_builder, make_runner

N = 64


@T.prim_func(s_tir=True)
def matmul(A: T.Buffer((N, N), "float32"), B: T.Buffer((N, N), "float32"), C: T.Buffer((N, N), "float32")):
    T.func_attr({"tirx.noalias": True})
    for i, j, k in T.grid(N, N, N):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]


def tile_space(sch):
    """A two-knob template: the i and j tile sizes."""
    i, j, k = sch.get_loops("C")
    io, ii = sch.split(i, sch.sample_perfect_tile(i, n=2, max_innermost_factor=16))
    jo, ji = sch.split(j, sch.sample_perfect_tile(j, n=2, max_innermost_factor=16))
    sch.reorder(io, jo, k, ii, ji)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A tracker and two CPU servers on 127.0.0.1 for this module's tests, stopped at the end."""
    if importlib.util.find_spec("tornado") is None:
        pytest.skip("the RPC tracker needs tornado (pip install tornado)")
    with rpc.LocalCluster("stof-loopback", devices=[None, None], log_dir=tmp_path_factory.mktemp("rpc")) as running:
        yield running


@pytest.mark.slow
def test_tuning_measures_on_both_servers(cluster, tmp_path):
    assert cluster.tracker.startswith("127.0.0.1:")
    assert rpc.count_servers(cluster.tracker, "stof-loopback") == 2
    assert rpc.count_servers(cluster.tracker, "some-other-key") == 0
    before = cluster.measurements()
    # by default the runner keeps one session per registered server, so both measure at once
    runner = make_runner("llvm", rpc_tracker=cluster.tracker, rpc_key="stof-loopback", session_timeout_sec=60)
    assert isinstance(runner, ms.runner.RPCRunner)
    assert runner.pool._threadpool._max_workers == 2          # (TVM keeps the pool size private)
    with pytest.raises(ValueError, match="no RPC server is registered under key 'nobody'"):
        make_runner("llvm", rpc_tracker=cluster.tracker, rpc_key="nobody")
    target = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    db = ms.tune_tir(matmul, target, work_dir=str(tmp_path / "work"), max_trials_global=4,
                     num_trials_per_iter=4, strategy="replay-trace", cost_model="random",
                     space=ms.space_generator.ScheduleFn(tile_space, sch_rules=[], postprocs=[],
                                                         mutator_probs={}),
                     builder=make_builder(max_workers=1, timeout_sec=300), runner=runner)
    per_server = [now - then for now, then in zip(cluster.measurements(), before)]
    records = db.get_all_tuning_records()
    times = [float(r.run_secs[0]) for r in records]
    assert len(records) >= 2 and all(0 < t < 1.0 for t in times), times      # failed runs record 1e10 s
    assert per_server[0] >= 1 and per_server[1] >= 1, per_server
    assert sum(per_server) == len(records), (per_server, len(records))
    # the database written through RPC measurements compiles to a correct kernel here
    sch = ms.tir_integration.compile_tir(db, matmul, target)
    assert sch is not None
    ex = tvm.compile(sch.mod, target=target)
    rng = np.random.default_rng(0)
    a, b = rng.random((N, N), dtype="float32"), rng.random((N, N), dtype="float32")
    c = tvm.runtime.tensor(np.full((N, N), np.nan, "float32"))
    ex["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), c)
    np.testing.assert_allclose(c.numpy(), a.astype("float64") @ b, rtol=1e-4)


@pytest.mark.slow
def test_stof_tvm_tune_over_rpc(cluster, tmp_path):
    """The command line's --rpc-tracker/--rpc-key: an attention problem (sparse-format index arrays as inputs,
    allocated on the servers) tuned on the llvm target: two candidates, one on each server."""
    before = cluster.measurements()
    database = tmp_path / "db"
    argv = [sys.executable, "-m", "stof_tvm", "tune", "--target", "llvm", "--mask", "sliding:window=16", "--seq-len", "64", "--heads", "2",
            "--head-dim", "64", "--trials", "1", "--top-k", "2", "--database", str(database),
            "--rpc-tracker", cluster.tracker, "--rpc-key", "stof-loopback"]
    # its own process, as a user runs it (MetaSchedule's file loggers from an earlier tune_tir in the same
    # process break the next task scheduler's logger set-up)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    per_server = [now - then for now, then in zip(cluster.measurements(), before)]
    assert per_server == [1, 1], (per_server, out)
    tuned = [line for line in out.splitlines() if line.split()[1:2] == ["tuned"]]
    assert len(tuned) == 2, out
    records = ms.database.JSONDatabase(work_dir=str(database)).get_all_tuning_records()
    assert len(records) == 2 and all(0 < float(r.run_secs[0]) < 1.0 for r in records)


def test_cluster_reports_a_dead_server_and_cleans_up(tmp_path):
    # a server pointed at a python that cannot import tvm dies at once: start() must say so, not hang
    cluster = rpc.LocalCluster("k", devices=[None], log_dir=tmp_path, start_timeout_s=30)
    cluster.python = "/bin/false"
    with pytest.raises(RuntimeError, match="RPC tracker exited"):
        cluster.start()
    assert cluster._procs == []


def test_tracker_summary_without_tracker_is_a_connection_error():
    port = rpc._free_port("127.0.0.1")
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        rpc.tracker_summary(f"127.0.0.1:{port}", timeout_s=1.0)
    with pytest.raises(TimeoutError, match="did not register"):
        rpc.wait_for_servers(f"127.0.0.1:{port}", "k", 1, timeout_s=0.5)


def test_commands_and_argument_checks():
    assert rpc.parse_address("gpu-host:9190") == ("gpu-host", 9190)
    assert rpc.parse_address("[::1]:9190") == ("[::1]", 9190)
    for bad in ("9190", "host:", ":9190", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            rpc.parse_address(bad)
    command = rpc.server_command("tracker:9190", "h200", port=9090, custom_addr="10.0.0.5", python="py")
    assert command[:3] == ["py", "-m", "stof_tvm.tuning.rpc_server"]   # TVM's server, CUDA-capable sessions
    assert command[command.index("--tracker") + 1] == "tracker:9190"
    assert command[command.index("--key") + 1] == "h200"
    assert command[command.index("--custom-addr") + 1] == "10.0.0.5"
    tracker = rpc.tracker_command("0.0.0.0", 9190, python="py")
    assert tracker[2] == "tvm.exec.rpc_tracker" and tracker[tracker.index("--port-end") + 1] == "9191"
    for key in ("", "a b", "a:b", None):
        with pytest.raises(ValueError, match="RPC key"):
            rpc.server_command("t:1", key)
    with pytest.raises(ValueError, match="port"):
        rpc.tracker_command(port=0)
    with pytest.raises(ValueError, match="devices"):
        rpc.LocalCluster("k", devices=[])


def test_summary_counting_and_table():
    summary = {"queue_info": {"h200": {"free": 1, "pending": 0}},
               "server_info": [{"key": "server:h200", "addr": ["10.0.0.2", 9090]},
                               {"key": "server:h200", "addr": ["10.0.0.3", 9091]},
                               {"key": "server:llvm", "addr": ["10.0.0.4", 9090]},
                               {"key": "client:h200", "addr": ["10.0.0.9", 5000]}]}
    assert rpc.servers_by_key(summary) == {"h200": 2, "llvm": 1}
    table = rpc.format_summary("t:9190", summary)
    assert "server 10.0.0.3:9091 key h200" in table
    row = next(line for line in table.splitlines() if line.split()[:1] == ["h200"])
    assert row.split()[1:] == ["2", "1", "0"]
    assert "no servers registered" in rpc.format_summary("t:9190", {"queue_info": {}, "server_info": []})


def test_sessions_fork_from_a_server_that_preloaded_tvm_without_the_torch_cuda_hook(tmp_path):
    """The RPC server's sessions are forked from a fork server whose environment disables tvm_ffi's torch hook
    (on a host with torch and a GPU that hook initialises CUDA, and a forked session then cannot use the GPU) and
    which has already imported TVM's RPC server (so a session does not import it again)."""
    probe = (
        "import multiprocessing, os, sys\n"
        "from stof_tvm.tuning.rpc_server import use_fork_server\n"
        "def report(queue):\n"
        "    queue.put((os.environ.get('TVM_FFI_DISABLE_TORCH_C_DLPACK'), 'tvm.rpc.server' in sys.modules,\n"
        "               multiprocessing.get_start_method()))\n"
        "if __name__ == '__main__':\n"
        "    use_fork_server()\n"
        "    queue = multiprocessing.Queue()\n"
        "    child = multiprocessing.Process(target=report, args=(queue,))\n"
        "    child.start(); print(queue.get(timeout=60)); child.join()\n")
    script = tmp_path / "probe.py"
    script.write_text(probe)
    env = {k: v for k, v in os.environ.items() if k != "TVM_FFI_DISABLE_TORCH_C_DLPACK"}
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "('1', True, 'forkserver')"
