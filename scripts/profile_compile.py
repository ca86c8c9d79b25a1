"""Where a compile's wall time goes: ``stof_tvm.compile`` of an ONNX export, phase by phase, run several times in
one process (the first run pays the imports; the later ones are what a recompile in a warm process costs, as in
scripts/bench_tuning_flow.py's ``recompile`` column).

Each phase is a function of the compile wrapped with a timer (inclusive: a phase's figure contains the phases it
calls, shown indented). Per phase: calls, wall seconds, this process's CPU seconds (all threads: CPU > wall means
the phase ran on several cores) and child-process CPU seconds (nvcc). A phase whose CPU is close to its wall time
runs on one core and will not get faster with more cores; nvcc's child CPU shows what a parallel build can spread.

    .venv/bin/python scripts/profile_compile.py --model roberta-base --shape 8x512 --runs 2
    .venv/bin/python scripts/profile_compile.py --onnx model.onnx --shape 8x512 --database db --runs 2 --json t.json

``--model`` exports the Hugging Face model (seeded weights, as bench_tuning_flow.py) unless ``--onnx`` names a
file; ``--cubin-cache DIR`` sets ``STOF_TVM_CUBIN_CACHE`` (``off`` disables it), so a run can start cold.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path

# (label, module, attribute, depth): the phases timed, in the order a compile reaches them
PHASES = [
    ("front end", "stof_tvm.compiler", "front_end", 0),
    ("load ONNX file", "stof_tvm.compiler", "load_model", 1),
    ("ONNX import", "stof_tvm.compiler", "import_onnx", 1),
    ("  onnx shape folding", "stof_tvm.compiler.onnx_import", "fold_shape_computations", 2),
    ("canonicalize", "stof_tvm.compiler", "canonicalize", 1),
    ("float16 (mixed precision)", "stof_tvm.compiler", "_to_float16", 1),
    ("attention sites + masks", "stof_tvm.compiler", "plan_masks", 1),
    ("kernel choice", "stof_tvm.compiler", "choose_kernel", 1),
    ("attention kernel TIR", "stof_tvm.compiler", "kernel_primfunc", 1),
    ("attention rewrite", "stof_tvm.compiler", "rewrite_attention", 1),
    ("templates (match + TIR)", "stof_tvm.compiler", "use_templates", 1),
    ("coverage", "stof_tvm.compiler", "coverage", 1),
    ("open database", "stof_tvm.records", "open_database", 0),
    ("optimize (Relax passes)", "stof_tvm.compiler", "optimize", 0),
    ("build (tvm.compile)", "stof_tvm.compiler", "build", 0),
    ("TIR lower + codegen", "tvm.tirx", "build", 1),
    ("  codegen (CUDA, LLVM host)", "tvm.tirx.build", "codegen_build", 2),
    ("prebuild cubins (nvcc)", "stof_tvm.compiler.cubins", "prebuild_cubins", 0),
]


class Timer:
    """Inclusive wall / CPU / child-CPU seconds per label, accumulated over calls."""

    def __init__(self):
        self.rows: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def phase(self, label: str):
        wall, cpu, child = time.perf_counter(), time.process_time(), _children_cpu()
        try:
            yield
        finally:
            row = self.rows.setdefault(label, [0, 0.0, 0.0, 0.0])
            row[0] += 1
            row[1] += time.perf_counter() - wall
            row[2] += time.process_time() - cpu
            row[3] += _children_cpu() - child

    def wrap(self, label: str, func):
        @functools.wraps(func)
        def timed(*args, **kwargs):
            with self.phase(label):
                return func(*args, **kwargs)
        return timed


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def install(timer: Timer) -> None:
    import importlib

    for label, module_name, attr, _ in PHASES:
        module = importlib.import_module(module_name)
        setattr(module, attr, timer.wrap(label.strip(), getattr(module, attr)))


def table(timer: Timer, total: tuple[float, float, float]) -> str:
    lines = [f"{'phase':34} {'calls':>5} {'wall s':>8} {'cpu s':>8} {'child s':>8}"]
    depth = {label.strip(): d for label, _, _, d in PHASES}
    order = [label.strip() for label, *_ in PHASES]
    for label in order:
        if label in timer.rows:
            calls, wall, cpu, child = timer.rows[label]
            name = "  " * depth[label] + label
            lines.append(f"{name:34} {calls:5d} {wall:8.2f} {cpu:8.2f} {child:8.2f}")
    lines.append(f"{'total':34} {'':5} {total[0]:8.2f} {total[1]:8.2f} {total[2]:8.2f}")
    return "\n".join(lines)


def module_hashes(art) -> dict:
    """SHA-256 (16 hex digits) of every CUDA source and prebuilt cubin of an artifact: equal hashes before and after
    a change to the build mean the same module."""
    from stof_tvm.compiler.cubins import cuda_sources

    sources = cuda_sources(art.executable)
    return {"cuda_sources": [hashlib.sha256(s.encode()).hexdigest()[:16] for s in sources],
            "cubins": {key: hashlib.sha256(blob).hexdigest()[:16] for key, blob in sorted(art.binaries.items())}}


def fill_stand_in_database(path: str, args, batch: int, seq: int) -> None:
    """Tune ``path`` into ``args.database`` with the stand-ins unless it already holds records (see --help)."""
    from stof_tvm.records import TuningDatabase

    if os.path.isdir(args.database) and TuningDatabase(args.database).jobs():
        print(f"stand-in database: {args.database} already holds records; kept as it is")
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from stand_in_tuning import write_stand_in_database

    started = time.perf_counter()
    report = write_stand_in_database(path, args.database, trials=args.trials, mask=args.mask, batch=batch,
                                     seq_len=seq, target=args.target)
    jobs = TuningDatabase(args.database).jobs()
    print(f"stand-in database: {len(report.results)} tasks tuned with made-up times, {len(jobs)} jobs recorded in "
          f"{time.perf_counter() - started:.1f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="roberta-base", help="bench_tuning_flow.py model name")
    parser.add_argument("--onnx", help="ONNX file (else --model is exported to --work)")
    parser.add_argument("--shape", default="8x512", help="BxS")
    parser.add_argument("--mask", default="bigbird")
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--database", help="tuning database to apply")
    parser.add_argument("--stand-in-database", action="store_true",
                        help="first fill --database (unless it holds records) by stage 1 + stage 2 with stand-ins for "
                             "the GPU (scripts/stand_in_tuning.py: made-up times, real records): a CPU-only machine "
                             "can then time the recompile with a full database")
    parser.add_argument("--trials", type=int, default=8, help="stand-in tuning: measurements per task (default 8)")
    parser.add_argument("--runs", type=int, default=2, help="compiles in this process (default 2)")
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--cubin-cache", help="STOF_TVM_CUBIN_CACHE for this run (a folder, or 'off')")
    parser.add_argument("--work", default="out/profile-compile", help="where exports go")
    parser.add_argument("--json", help="write the phase tables and module hashes here")
    args = parser.parse_args(argv)
    if args.stand_in_database and not args.database:
        parser.error("--stand-in-database needs --database DIR")
    if args.cubin_cache:
        os.environ["STOF_TVM_CUBIN_CACHE"] = args.cubin_cache
    batch, seq = (int(v) for v in args.shape.split("x"))
    path = args.onnx
    if path is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_tuning_flow import export_model

        Path(args.work).mkdir(parents=True, exist_ok=True)
        path = str(Path(args.work) / f"{args.model}-{batch}x{seq}.onnx")
        if not os.path.isfile(path):
            export_model(args.model, batch, seq, path)

    if args.stand_in_database:
        fill_stand_in_database(path, args, batch, seq)

    started = time.perf_counter()
    import stof_tvm

    import_s = time.perf_counter() - started
    timer = Timer()
    install(timer)
    results = []
    for run in range(args.runs):
        timer.rows.clear()
        wall, cpu, child = time.perf_counter(), time.process_time(), _children_cpu()
        art = stof_tvm.compile(path, mask=args.mask, batch=batch, seq_len=seq, target=args.target,
                               cuda_graph=not args.no_cuda_graph and args.target == "cuda", database=args.database)
        total = (time.perf_counter() - wall, time.process_time() - cpu, _children_cpu() - child)
        hashes = module_hashes(art) if args.target == "cuda" else {}
        print(f"\nrun {run + 1} of {args.runs} ({Path(path).name}, {args.shape}, mask {args.mask}"
              f"{', database ' + args.database if args.database else ''}; import stof_tvm {import_s:.1f} s)")
        print(table(timer, total))
        tuning = art.manifest.get("tuning")
        if tuning:
            print(f"tuning records: {tuning['applied']} applied, {len(tuning['missing'])} missing, "
                  f"{len(tuning['unused'])} unused")
        if hashes:
            print(f"cuda sources {hashes['cuda_sources']}, cubins {sorted(hashes['cubins'].values())}")
        results.append({"phases": {k: dict(zip(("calls", "wall_s", "cpu_s", "child_s"), v))
                                   for k, v in timer.rows.items()},
                        "total": dict(zip(("wall_s", "cpu_s", "child_s"), total)), "hashes": hashes,
                        "tuning": tuning})
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
