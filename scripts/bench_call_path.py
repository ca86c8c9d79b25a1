"""The call users write against the module alone: ``model(input_ids=..., attention_mask=...)`` with torch CUDA
tensors vs ``model.run(model.prepare(...))``, with no padding and with ragged padding that changes every call;
then the cost of a new run-time mask (``model(..., mask=...)``) at S = 4096 and 16384.

Per model (Hugging Face BERT-base, RoBERTa-base, GPT-2: ``scripts/e2e_models.py``, seeded random weights, exported
by ``torch.onnx.export``) and shape (default 1x128, 8x512, 16x2048), compiled by stof-tvm with ``--mask`` (default
bigbird) and CUDA graphs, one line per padding kind:

| column | what runs |
|---|---|
| ``call`` | ``model(input_ids=ids, attention_mask=mask)``: torch tensors handed to the module as they are, the
  module on torch's stream, the padding applied on the device, the out-of-range token-id count checked by a
  later call without waiting (``stof_tvm.deferred_checks``) |
| ``sync`` | the same with ``check_values="sync"`` (the count read back after every call, waiting for it) |
| ``nocheck`` | the same with ``check_values=False`` (no check: ids are still clamped in the module) |
| ``bad ids`` | a call given a token id of 10**6 raises ``ValueError`` by ``model.synchronize()`` |
| ``module`` | ``model.run(prepared)`` on inputs ``prepare``d once (what BENCHMARKS.md's module figures time) |
| ``over us`` / ``goal <=`` / ``met`` | ``call - module``; the goal ``1.03 * module + 0.05 ms``; whether call meets it |
| ``host us`` / ``cpu us`` | one call's host time with the kernels left out (the module's ``main`` replaced by
  one FFI call taking the same arguments): binding, checks, the count read back, the outputs; wall clock and
  this thread's CPU time |
| ``torch`` | the HF model in float16, ``attn_implementation="sdpa"`` (dense attention, the model's padding) |
| ``rel`` / ``ok`` / ``stable`` | ours (float16) against the float32 model under the same sparse mask and its own
  padding (``scripts/e2e_torch``'s masked SDPA), at the positions the padding keeps, within ``--tolerance``;
  a returned output keeps its values after the next call |

Timings are CUDA events around back-to-back calls after warm-up (``scripts/benchlib.time_ms``: median of samples,
each sample on the next input set of a pool; ragged: every set has other per-row lengths, 1..S). Every model x
shape is exported and compiled first (``--jobs`` at a time in background processes, saved under ``--work`` and
reused by later runs), and nothing compiles while anything is timed. The tables and ``call_path.json`` (rows,
compile status, mask build) go to ``$OUT`` (or ``--out``), the JSON after every measured row.

On the GPU machine (full TVM compiler installed, 16 cores), from the repository root:

    PYTHONUNBUFFERED=1 python3 scripts/bench_call_path.py --budget-s 500 2>&1 | tee $OUT/log.txt

If the nine compiles do not fit one call (the compile table then says "out of budget"), run it in two calls while
the machine stays warm (artifacts stay under out/call_path and are reused): ``--models bert-base roberta-base``,
then ``--models gpt2``. On the CPU (tiny models, llvm, float32, wall-clock timing; the flow this repository's
tests run):

    .venv/bin/python scripts/bench_call_path.py --device cpu --models bert-tiny gpt2-tiny --shapes 2x64 \
        --mask-lengths 4096 --out out/cp

``--mask-build`` times only the new mask's build (the spec's mask, its format arrays on this host's CPU, their
upload), at ``--mask-lengths``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402
import e2e_models  # noqa: E402

OUTPUT = "last_hidden_state"
PADDINGS = ("none", "ragged")
GOAL_FACTOR, GOAL_MS = 1.03, 0.05


def parse_shape(text: str) -> tuple[int, int]:
    batch, length = text.lower().split("x")
    return int(batch), int(length)


# ------------------------------------------------------------------------------------------------ building
def row_dir(work: Path, name: str, batch: int, length: int) -> Path:
    return work / f"{name}_{batch}x{length}"


def export_onnx(spec, batch: int, length: int, directory: Path, seed: int) -> Path:
    """The model's ONNX file for this shape (exported once, float32, static shapes)."""
    path = directory / "model.onnx"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        model = e2e_models.build(spec, "sdpa", seed, length)
        e2e_models.export(model, e2e_models.inputs(spec, batch, length, seed), str(path))
    return path


def start_compile(directory: Path, batch: int, length: int, args) -> subprocess.Popen | None:
    """A background ``stof_tvm.compile`` of ``directory/model.onnx`` into ``directory/artifact`` (None when the
    artifact is already there)."""
    if (directory / "artifact" / "manifest.json").exists():
        return None
    cuda = args.device == "cuda"
    job = {"onnx": str(directory / "model.onnx"), "artifact": str(directory / "artifact"), "mask": args.mask,
           "batch": batch, "seq_len": length,
           "options": {"target": "cuda" if cuda else "llvm", "dtype": "float16" if cuda else "float32",
                       "cuda_graph": cuda, **json.loads(args.compile_options)}}
    env = {**os.environ, "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1"}
    log = open(directory / "compile.log", "w")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--compile-job", json.dumps(job)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def compile_job(spec: str) -> int:
    job = json.loads(spec)
    import stof_tvm

    start = time.time()
    art = stof_tvm.compile(job["onnx"], mask=job["mask"], batch=job["batch"], seq_len=job["seq_len"],
                           **job["options"])
    art.save(job["artifact"])
    bl.write_json(Path(job["artifact"]) / "compile.json", {"compile_s": time.time() - start, **job})
    return 0


# ------------------------------------------------------------------------------------------------ inputs
def input_pool(spec, batch: int, length: int, padding: str, count: int, seed: int, device: str) -> list[dict]:
    """``count`` input sets as torch tensors on ``device``; ragged: every set other per-row lengths in 1..S
    (one row of each set at full length, so the float32 reference has no fully padded row)."""
    import torch

    rng = np.random.default_rng(seed)
    pool = []
    for i in range(count):
        feeds = e2e_models.inputs(spec, batch, length, seed + i)
        if padding == "ragged":
            lengths = rng.integers(1, length + 1, batch)
            lengths[rng.integers(0, batch)] = length
            feeds["attention_mask"] = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
        pool.append({k: torch.from_numpy(v).to(device).clone() for k, v in feeds.items()})
    return pool


def load_compiled(directory: Path, spec, batch: int, length: int, seed: int):
    """The artifact, with its weights from weights.npz or, when saved without, from the ONNX initializers."""
    from stof_tvm import runtime

    artifact = directory / "artifact"
    if (artifact / "weights.npz").exists():
        return runtime.load(str(artifact))
    import onnx
    from onnx import numpy_helper

    onnx_path = export_onnx(spec, batch, length, directory, seed)
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(onnx_path)).graph.initializer}
    return runtime.load(str(artifact), weights=weights)


# ------------------------------------------------------------------------------------------------ measuring
def reference_model(spec, length: int, keep: np.ndarray, device: str, seed: int):
    """The float32 model under the sparse mask and its own padding (masked SDPA): ``feeds -> output`` (CPU).
    Every torch model here is built for ``length`` (its position table, and so its seeded weights, as exported)."""
    import e2e_torch

    e2e_torch.register()
    model32 = e2e_models.build(spec, "sdpa", seed, length).to(device)
    e2e_torch.use_attention(model32, e2e_torch.MASKED_SDPA)
    e2e_torch.set_mask(keep, spec.family == "gpt2", device, flex_mask=False)
    return lambda feeds: e2e_torch.forward(model32, tuple(feeds[n] for n in model32.input_names))().float().cpu()


def valid_errors(out, ref, attention_mask) -> dict:
    """benchlib.errors at the positions the padding keeps (a padded query row can keep no key: 0 in ours, NaN in
    SDPA), plus the non-finite count of the whole output."""
    keep = attention_mask.bool().cpu().numpy()
    errs = bl.errors(bl.as_float64(out)[keep], bl.as_float64(ref)[keep])
    errs["nonfinite_all"] = int(np.count_nonzero(~np.isfinite(bl.as_float64(out))))
    return errs


def host_us(compiled, feeds: dict, calls: int) -> tuple[float, float]:
    """Host time of one ``compiled(**feeds)`` in microseconds with the kernels left out: the module's ``main``
    becomes one FFI call taking the same arguments (converted in C as the module's are) and returning the
    outputs of a real run, so what is timed is the rest of the call as users make it: binding, checks, the
    out-of-range count read back, the outputs. (wall clock, this thread's CPU time), each the best of 3 rounds
    of ``calls`` calls (the CPU time is what a loaded host still measures fairly)."""
    import tvm_ffi

    real = compiled._invoke(compiled.prepare(feeds))
    pack = tvm_ffi.get_global_func("ffi.Array")
    main = compiled._main
    compiled._main = lambda *args: pack(*real, *args)
    try:
        wall = cpu = float("inf")
        for _ in range(3):
            for _ in range(calls // 10):
                compiled(**feeds)
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                compiled(**feeds)
            wall = min(wall, (time.perf_counter() - start) / calls * 1e6)
            cpu = min(cpu, (time.thread_time() - start_cpu) / calls * 1e6)
        return wall, cpu
    finally:
        compiled._main = main


def bad_ids_raise(compiled, inputs: dict) -> bool:
    """Whether a call given a token id outside the table raises by ``synchronize()`` (deferred value check), the
    calls after it staying correct."""
    bad = dict(inputs, input_ids=inputs["input_ids"].clone())
    bad["input_ids"].view(-1)[0] = 10 ** 6
    compiled.synchronize()
    try:
        compiled(**bad)
        compiled.synchronize()
    except ValueError as error:
        return "outside" in str(error)
    return False


def measure_row(spec, batch: int, length: int, directory: Path, args) -> list[dict]:
    """One record per padding kind (``PADDINGS``) of this model and shape."""
    import torch

    import stof_tvm

    device = args.device
    compiled = load_compiled(directory, spec, batch, length, args.seed)
    common = {"model": spec.name, "shape": f"{batch}x{length}", "batch": batch, "seq_len": length,
              "mask": args.mask, "kernel": compiled.kernel, "cuda_graph": compiled.manifest.get("cuda_graph"),
              "padding_on": (compiled.manifest["mask"].get("padding") or {}).get("on", "host")}
    keep = np.asarray(stof_tvm.make_mask(args.mask, length), dtype=bool)
    reference = reference_model(spec, length, keep, device, args.seed)
    torch16 = None
    if args.torch and device == "cuda":
        torch16 = e2e_models.build(spec, "sdpa", args.seed, length).to(device).half()
    timing = dict(device=device, samples=args.samples, warmup=3)
    records = []
    for padding in PADDINGS:
        rec = {**common, "padding": padding}
        pool = input_pool(spec, batch, length, padding, args.pool, args.seed + 100 * (padding == "ragged"), device)
        first = compiled(**pool[0])[OUTPUT]
        errs = valid_errors(first, reference(pool[0]), pool[0]["attention_mask"])
        rec["rel"], rec["nonfinite"] = errs["rel"], errs["nonfinite_all"]
        rec["correct"] = bool(errs["rel"] <= args.tolerance and not errs["nonfinite_all"])
        kept = first.clone()
        compiled(**pool[1 % len(pool)])
        rec["stable"] = bool(torch.equal(first, kept))
        sets = [(f,) for f in pool]
        rec["call_ms"] = bl.time_ms(lambda f: compiled(**f), inputs=sets, **timing).median_ms
        compiled.check_values = "sync"
        rec["sync_ms"] = bl.time_ms(lambda f: compiled(**f), inputs=sets, **timing).median_ms
        compiled.check_values = False
        rec["nocheck_ms"] = bl.time_ms(lambda f: compiled(**f), inputs=sets, **timing).median_ms
        compiled.check_values = True
        rec["bad_ids_raise"] = bad_ids_raise(compiled, pool[0])
        prepared = [(compiled.prepare(f),) for f in pool]
        rec["module_ms"] = bl.time_ms(compiled.run, inputs=prepared, **timing).median_ms
        del prepared
        rec["host_us"], rec["host_cpu_us"] = host_us(compiled, pool[0], args.host_calls)
        if torch16 is not None:
            def run_torch(f):
                with torch.no_grad():
                    return torch16(*(f[name] for name in torch16.input_names))
            rec["torch_ms"] = bl.time_ms(run_torch, inputs=sets, **timing).median_ms
        rec["over_us"] = (rec["call_ms"] - rec["module_ms"]) * 1e3
        rec["bound_ms"] = GOAL_FACTOR * rec["module_ms"] + GOAL_MS
        rec["goal"] = bool(rec["call_ms"] <= rec["bound_ms"])
        print(f"  {spec.name} {batch}x{length} {padding}: call {rec['call_ms']:.3f} ms, module "
              f"{rec['module_ms']:.3f} ms, host {rec['host_us']:.1f} us, rel {errs['rel']:.2e}", flush=True)
        records.append(rec)
    del compiled, torch16, reference
    if device == "cuda":
        torch.cuda.empty_cache()
    return records


def mask_build_times(args) -> list[dict]:
    """A new run-time mask (``model(..., mask=...)``, once per mask): the spec's boolean mask, its format arrays
    for the block-wise (64x32 tiles) and row-wise kernels, and their upload to the device, per S (medians of
    3)."""
    import tvm

    from stof_tvm.mask_formats import format_arrays
    from stof_tvm.sparse_formats import normalize_mask

    device = tvm.cuda(0) if args.device == "cuda" else tvm.cpu(0)
    rows = []
    for seq in args.mask_lengths:
        for kind, config in (("block", {"block_m": 64, "block_n": 32}), ("row", {})):
            manifest = {"attention": {"kernel": {"kind": kind, "config": config}}}
            times = {"mask_ms": [], "format_ms": [], "upload_ms": []}
            for _ in range(3):
                start = time.perf_counter()
                mask = normalize_mask(args.mask, batch=1, heads=1, seq_q=seq)
                built = time.perf_counter()
                arrays = format_arrays(manifest, mask)
                formatted = time.perf_counter()
                tensors = [tvm.runtime.tensor(a, device) for a in arrays]
                device.sync()
                times["mask_ms"].append((built - start) * 1e3)
                times["format_ms"].append((formatted - built) * 1e3)
                times["upload_ms"].append((time.perf_counter() - formatted) * 1e3)
                del tensors
            row = {"seq_len": seq, "kernel": kind, "mask": args.mask, "density": float(mask.mean()),
                   "format_mb": sum(a.nbytes for a in arrays) / 2**20}
            row.update({key: float(np.median(values)) for key, values in times.items()})
            row["total_ms"] = row["mask_ms"] + row["format_ms"] + row["upload_ms"]
            rows.append(row)
    bl.print_table(rows, [("seq_len", "S", "d"), ("kernel", "format", "s"), ("density", "density", ".4f"),
                          ("mask_ms", "mask ms", ".1f"), ("format_ms", "format ms", ".1f"),
                          ("upload_ms", "upload ms", ".2f"), ("total_ms", "total ms", ".1f"),
                          ("format_mb", "MB", ".2f")],
                   f"a new mask at run time ({args.mask}; built on this host's CPU, uploaded to {args.device})")
    return rows


COLUMNS = [("model", "model", "s"), ("shape", "BxS", "s"), ("padding", "padding", "s"), ("kernel", "kernel", "s"),
           ("call_ms", "call", ".3f"), ("sync_ms", "sync", ".3f"), ("nocheck_ms", "nocheck", ".3f"), ("module_ms", "module", ".3f"),
           ("over_us", "over us", ".0f"), ("bound_ms", "goal <=", ".3f"), ("goal", "met", ""),
           ("host_us", "host us", ".1f"), ("host_cpu_us", "cpu us", ".1f"), ("torch_ms", "torch", ".3f"),
           ("rel", "rel", ".1e"),
           ("correct", "ok", ""), ("stable", "stable", ""), ("bad_ids_raise", "bad ids", "")]
STATUS = [("model", "model", "s"), ("shape", "BxS", "s"), ("compile_s", "compile s", ".0f"), ("status", "status", "s")]
# seconds to measure one model x shape (load, references, timings), for the budget
MEASURE_S = {"cuda": 12.0, "cpu": 30.0}


def save(out: Path, rows: list[dict], status: list[dict], mask_rows: list[dict]) -> None:
    bl.write_json(out / "call_path.json", {"env": bl.environment(), "goal": "call <= 1.03 module + 0.05 ms",
                                           "rows": rows, "status": status, "mask_build": mask_rows})


def compile_all(todo: list, work: Path, args, deadline: float) -> dict:
    """Export every row and compile it (``--jobs`` at a time, in the background), waiting for all of them, so
    that nothing compiles while the call path is timed; returns ``{(name, B, S): status row}``."""
    status, running, pending = {}, {}, list(todo)
    while pending or running:
        while pending and len(running) < args.jobs:
            spec, b, s = pending.pop(0)
            key, directory = (spec.name, b, s), row_dir(work, spec.name, b, s)
            status[key] = row = {"model": spec.name, "shape": f"{b}x{s}"}
            if bl.guarded(row, "export", export_onnx, spec, b, s, directory, args.seed) is None:
                row["status"] = "export failed"
                continue
            proc = start_compile(directory, b, s, args)
            if proc is None:
                row["status"] = "reused"
            else:
                running[key] = (proc, time.time())
        for key, (proc, started) in list(running.items()):
            if proc.poll() is None and time.time() < deadline:
                continue
            del running[key]
            row = status[key]
            row["compile_s"] = time.time() - started
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                row["status"] = "compile: out of budget"
            elif proc.returncode:
                tail = (row_dir(work, *key) / "compile.log").read_text()[-400:]
                row["status"] = f"compile failed ({proc.returncode})"
                row["compile_failed"] = tail
                print(f"  {key[0]} {key[1]}x{key[2]}: compile failed: {tail}", flush=True)
            else:
                row["status"] = "compiled"
        if pending and time.time() >= deadline:
            for spec, b, s in pending:
                status[(spec.name, b, s)] = {"model": spec.name, "shape": f"{b}x{s}", "status": "not started: budget"}
            pending = []
        time.sleep(0.5)
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["bert-base", "roberta-base", "gpt2"],
                   choices=sorted(e2e_models.MODELS), metavar="MODEL")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[(1, 128), (8, 512), (16, 2048)],
                   metavar="BxS")
    p.add_argument("--mask", default="bigbird")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--work", default="out/call_path", help="exports and artifacts (reused when present)")
    p.add_argument("--out", default="out/call_path", help="where results go without $OUT")
    p.add_argument("--jobs", type=int, default=3, help="compiles at a time")
    p.add_argument("--pool", type=int, default=6, help="input sets per padding kind")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--host-calls", type=int, default=2000, help="calls per round of the host-time figure")
    p.add_argument("--tolerance", type=float, help="relative error bound (default 2e-3 on cuda, 1e-4 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=500.0)
    p.add_argument("--no-torch", dest="torch", action="store_false", help="leave the torch timing out")
    p.add_argument("--compile-options", default="{}", help="extra stof_tvm.compile options as JSON")
    p.add_argument("--build-only", action="store_true", help="export and compile, measure nothing")
    p.add_argument("--mask-lengths", nargs="*", type=int, default=[4096, 16384],
                   help="S of the new-mask build figure (none: leave it out)")
    p.add_argument("--mask-build", action="store_true", help="only the new-mask build figure")
    p.add_argument("--compile-job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_job:
        return compile_job(args.compile_job)
    if args.tolerance is None:
        args.tolerance = 2e-3 if args.device == "cuda" else 1e-4
    out = bl.out_dir(args.out)
    if args.mask_build:
        save(out, [], [], mask_build_times(args))
        return 0
    budget, work = bl.Budget(args.budget_s), Path(args.work)
    todo = [(e2e_models.spec(name), b, s) for name in args.models for b, s in args.shapes]
    mask_reserve = 15.0 * len(args.mask_lengths)
    measure_reserve = MEASURE_S[args.device] * len(todo) + mask_reserve
    status = compile_all(todo, work, args, time.time() + max(30.0, budget.left() - measure_reserve))
    rows, mask_rows = [], []
    for spec, b, s in todo:
        row = status[(spec.name, b, s)]
        if args.build_only or row.get("status") not in ("compiled", "reused"):
            continue
        if not budget.allows(MEASURE_S[args.device] + mask_reserve):
            row["status"] += ", not measured: budget"
            continue
        records = bl.guarded(row, "measure", measure_row, spec, b, s, row_dir(work, spec.name, b, s), args)
        if records is None:
            row["status"] += ", measure failed"
        rows.extend(records or [])
        save(out, rows, list(status.values()), mask_rows)
    if args.mask_lengths and not args.build_only and budget.allows(mask_reserve / 2):
        mask_rows = bl.guarded({}, "mask_build", mask_build_times, args) or []
    bl.print_table(list(status.values()), STATUS, "compiles")
    bl.print_table(rows, COLUMNS, f"call path vs module ({args.device}, mask {args.mask}; ms, medians; host us: one "
                                  "call's host time with the kernels left out)")
    save(out, rows, list(status.values()), mask_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
