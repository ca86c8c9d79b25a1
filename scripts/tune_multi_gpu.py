"""Tuning wall time with one RPC server per GPU: the same tasks and trials measured on 1 GPU, then on N.

Each run starts a TVM RPC tracker and its servers on this host (:class:`stof_tvm.tuning.rpc.LocalCluster`,
each server seeing one GPU), then tunes with :func:`stof_tvm.tuning.tune_tasks` through ``rpc_tracker``/
``rpc_key``. The tasks are either one CUDA GEMM whose design space is a fixed list of tile configurations
(MetaSchedule's task scheduler: build a batch, then measure it), or with ``--model`` the stage-1 plan of a
model's layer set as ``stof-tvm tune`` makes it (the product's path: pre-built kernels, built in parallel chunks,
each chunk measured while the next builds). Every run measures the same candidates in a fresh work directory,
so the runs differ only in the number of GPUs measuring. Candidates build on this host's CPUs either way. Prints
a table and writes JSON.

    python scripts/tune_multi_gpu.py --gpus 0,1 --json out/multi_gpu.json         # on a 2-GPU host
    python scripts/tune_multi_gpu.py --gpus 0,1 --model bert-base --batch 8 --seq-len 512 --json ...
    python scripts/tune_multi_gpu.py --target llvm --gpus cpu,cpu --size 128      # dry run on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import tvm
from tvm.script import tirx as T

from stof_tvm.tuning import TuningTask, tune_tasks
from stof_tvm.tuning.rpc import LocalCluster


def gemm(n: int):
    """C = A @ B, all n x n float32."""

    @T.prim_func(s_tir=True)
    def func(A: T.Buffer((n, n), "float32"), B: T.Buffer((n, n), "float32"), C: T.Buffer((n, n), "float32")):
        for i, j, k in T.grid(n, n, n):
            with T.sblock("C"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    C[vi, vj] = T.float32(0)
                C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]

    return func


def cuda_configs(n: int) -> list[tuple[int, int, int, int]]:
    """(block rows, block cols, rows per thread, cols per thread) with 64..1024 threads per block."""
    out = []
    for bm in (32, 64, 128):
        for bn in (32, 64, 128):
            for tm in (1, 2, 4):
                for tn in (1, 2, 4):
                    threads = (bm // tm) * (bn // tn)
                    if n % bm == 0 and n % bn == 0 and 64 <= threads <= 1024:
                        out.append((bm, bn, tm, tn))
    return out


def apply_cuda(sch, knobs):
    """Block tile bm x bn per thread block, tm x tn outputs per thread accumulated in registers."""
    bm, bn, tm, tn = knobs
    block = sch.get_sblock("C")
    i, j, k = sch.get_loops(block)
    bi, ti, ii = sch.split(i, [None, bm // tm, tm])
    bj, tj, jj = sch.split(j, [None, bn // tn, tn])
    sch.reorder(bi, bj, ti, tj, k, ii, jj)
    sch.bind(sch.fuse(bi, bj), "blockIdx.x")
    thread = sch.fuse(ti, tj)
    sch.bind(thread, "threadIdx.x")
    local = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(local, thread)


def cpu_configs(n: int) -> list[tuple[int, int]]:
    return [(ti, tj) for ti in (4, 8, 16, 32) for tj in (8, 16, 32, 64) if n % ti == 0 and n % tj == 0]


def apply_cpu(sch, knobs):
    ti_, tj_ = knobs
    i, j, k = sch.get_loops(sch.get_sblock("C"))
    io, ii = sch.split(i, [None, ti_])
    jo, ji = sch.split(j, [None, tj_])
    sch.reorder(io, jo, k, ii, ji)
    sch.parallel(sch.fuse(io, jo))


def tune_on(devices, tasks, target, trials, work_root: Path, key: str):
    """One tuning run of ``tasks`` with one RPC server per entry of ``devices``; returns its figures."""
    log_dir = work_root / f"rpc_{len(devices)}"
    with LocalCluster(key, devices=devices, log_dir=log_dir) as cluster:
        started = time.monotonic()
        report = tune_tasks(tasks, target, work_root / f"work_{len(devices)}", trials=trials,
                            num_trials_per_iter=16, rpc_tracker=cluster.tracker, rpc_key=key, seed=0,
                            handle_interrupt=False)
        wall = time.monotonic() - started
        per_server = cluster.measurements()
    best = [r.best_s for r in report.results]
    run = {"servers": len(devices), "devices": [str(d) for d in devices], "wall_s": wall,
           "measured": report.measured, "per_server": per_server, "status": [r.status for r in report.results],
           "best_us": None if None in best else sum(best) * 1e6,          # one task: its best; a layer set: the sum
           "task_best_us": {r.name: None if r.best_s is None else r.best_s * 1e6 for r in report.results},
           "best_config": list(report.results[0].best_candidate)
           if len(tasks) == 1 and report.results[0].best_candidate is not None else None}
    if None in best:  # a task had no candidate run: keep what the servers and the runner said, for the diagnosis
        logs = sorted(log_dir.glob("*.log")) + sorted((work_root / f"work_{len(devices)}" / "logs").glob("*task*.log"))
        run["server_log_tails"] = {log.name: _error_lines(log.read_text(errors="replace")) for log in logs}
        for name, tail in run["server_log_tails"].items():
            print(f"--- {name} (last lines)\n{tail}", flush=True)
    return run


def _error_lines(text: str, limit: int = 2500) -> str:
    """The lines of a log that report errors (with the line after each), else its tail."""
    lines = text.splitlines()
    picked = [f"{line}\n{lines[i + 1] if i + 1 < len(lines) else ''}" for i, line in enumerate(lines)
              if "rror" in line or "Traceback" in line]
    return ("\n".join(picked) if picked else text)[-limit:]


def model_tasks(args, target):
    """The stage-1 plan of ``args.model``'s layer set (what ``stof-tvm tune`` measures), its target, a label."""
    from stof_tvm.tuning import plan, tuning_target

    stage1 = plan(args.model, mask="bigbird", batch=args.batch, seq_len=args.seq_len, top_k=args.top_k,
                  target=tuning_target(target))
    trials = sum(task.space_size for task in stage1.tasks)
    label = f"{args.model} {args.batch}x{args.seq_len} layer set, {len(stage1.tasks)} tasks, {trials} candidates"
    return stage1.tasks, tuning_target(stage1.target), label


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="0,1", help="GPU ids, one RPC server each ('cpu' for a CPU server)")
    parser.add_argument("--target", choices=["cuda", "llvm"], default="cuda")
    parser.add_argument("--size", type=int, default=1024, help="GEMM size n (default 1024)")
    parser.add_argument("--trials", type=int, default=0, help="candidates to measure (default: all)")
    parser.add_argument("--model", help="tune this model's layer set (stage-1 plan, BigBird) instead of the GEMM")
    parser.add_argument("--batch", type=int, default=8, help="with --model (default 8)")
    parser.add_argument("--seq-len", type=int, default=512, help="with --model (default 512)")
    parser.add_argument("--top-k", type=int, default=8, help="with --model: stage-1 survivors per job (default 8)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    devices = [None if g.strip() == "cpu" else int(g) for g in args.gpus.split(",")]
    if len(devices) < 2:
        parser.error("--gpus needs at least two entries to compare with one")
    n = args.size
    if args.target == "cuda":
        target = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
                  "max_shared_memory_per_block": 232448, "host": {"kind": "llvm"}}
    else:
        target = {"kind": "llvm"}
    if args.model:
        tasks, target, what = model_tasks(args, target)
        trials = None
    else:
        configs, apply = (cuda_configs(n), apply_cuda) if args.target == "cuda" else (cpu_configs(n), apply_cpu)
        if args.trials:
            configs = configs[:args.trials]
        tasks = [TuningTask(name=f"gemm{n}", func=gemm(n), candidates=configs, apply=apply)]
        trials, what = len(configs), f"GEMM {n}^3 float32, {len(configs)} candidates"
    import tvm.s_tir.tensor_intrin  # noqa: F401  (MetaSchedule imports it once per process: not in the timings)

    with tempfile.TemporaryDirectory(prefix="stof-multi-gpu-") as tmp:
        root = Path(tmp)
        runs = [tune_on(devices[:1], tasks, target, trials, root, "gpu1"),
                tune_on(devices, tasks, target, trials, root, f"gpu{len(devices)}")]
    one, many = runs
    speedup = one["wall_s"] / many["wall_s"]
    print(f"\n{what} on {args.target}, builds on {os.cpu_count()} CPUs")
    print(f"{'servers':>7} {'wall s':>8} {'measured':>8} {'per server':>14} {'best us':>9}  best config")
    for run in runs:
        best = "-" if run["best_us"] is None else f"{run['best_us']:.1f}"
        print(f"{run['servers']:>7} {run['wall_s']:>8.1f} {run['measured']:>8} {str(run['per_server']):>14} "
              f"{best:>9}  {run['best_config']}")
    print(f"tuning wall-time speed-up, {len(devices)} servers vs 1: {speedup:.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "target": args.target,
            "workload": what, "cpus": os.cpu_count(), "runs": runs, "speedup": speedup,
            "tvm": tvm.__version__, "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}, indent=2))
    ok = runs[0]["measured"] == runs[1]["measured"] > 0 and all(c > 0 for c in many["per_server"]) \
        and all(run["best_us"] is not None for run in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
