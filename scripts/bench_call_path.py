"""The call users write against the module alone: ``model(input_ids=..., attention_mask=...)`` with torch CUDA
tensors vs ``model.run(model.prepare(...))``, with no padding and with ragged padding that changes every call.

Per model (Hugging Face BERT-base, RoBERTa-base, GPT-2: ``scripts/e2e_models.py``, seeded random weights, exported
by ``torch.onnx.export``) and shape (default 1x128, 8x512, 16x2048), compiled by stof-tvm with ``--mask`` (default
bigbird) and CUDA graphs:

| column | what runs |
|---|---|
| ``call`` | ``model(input_ids=ids, attention_mask=mask)``: inputs bound by DLPack, the module on torch's stream, the
  padding applied on the device, the module's out-of-range token-id count read back (a few bytes) |
| ``nocheck`` | the same with ``check_values=False`` (no read back: ids are still clamped in the module) |
| ``module`` | ``model.run(prepared)`` on inputs ``prepare``d once (what BENCHMARKS.md's module figures time) |
| ``torch`` | the HF model in float16, ``attn_implementation="sdpa"`` (dense attention, the model's padding) |

Each is timed with CUDA events around back-to-back calls after warm-up (``scripts/benchlib.time_ms``: median of
samples, each sample on the next input set of a pool; ragged: every set has other per-row lengths, 1..S). The
goal: ``call <= 1.03 * module + 0.05 ms`` at every shape. Correctness in the same run: ours (float16) against the
float32 model with the same sparse mask (``scripts/e2e_torch``'s masked SDPA, the model's own padding ANDed in),
at the positions the padding keeps, on one set of each kind; ``stable`` says a returned output keeps its values
after the next call (outputs are not reused buffers). Table and ``call_path.json`` go to ``$OUT`` (or ``--out``).

Where it compiles: on the machine it runs on (each model x shape in a background process, ``--jobs`` at a time,
saved under ``--work`` and reused by later runs), or takes artifacts built elsewhere into ``--work`` (layout
``WORK/<model>_<B>x<S>/artifact``; saved without weights.npz they get their weights from the ONNX file next to
them, re-exported from the seed when missing).

On the GPU machine (full TVM compiler installed, 16 cores), from the repository root:

    PYTHONUNBUFFERED=1 python3 scripts/bench_call_path.py --budget-s 560 2>&1 | tee $OUT/log.txt

(one model per call when the compiles do not fit one call: ``--models bert-base``, then ``roberta-base``, then
``gpt2``; artifacts stay under out/call_path while the machine is warm). On the CPU (tiny models, llvm, float32,
wall-clock timing; the flow this repository's tests run):

    .venv/bin/python scripts/bench_call_path.py --device cpu --models bert-tiny gpt2-tiny --shapes 2x64 --out out/cp

``--mask-build`` instead times the host build of a new run-time mask's format (``model(..., mask=...)``, once per
mask) at S = 4096 and 16384 on this machine's CPU.
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
        model = e2e_models.build(spec, "sdpa", seed)
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


def wait_for(proc, directory: Path, deadline: float) -> None:
    """Wait for a compile job until ``deadline`` (then it is stopped); raises when it failed."""
    if proc is not None:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise TimeoutError("the compile did not finish within the budget") from None
        if proc.returncode:
            tail = (directory / "compile.log").read_text()[-600:]
            raise RuntimeError(f"compile exited {proc.returncode}: {tail}")


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
def reference_outputs(spec, pool: list[dict], keep: np.ndarray, device: str, seed: int) -> list:
    """The float32 model under the sparse mask and its own padding (masked SDPA), one output per input set."""
    import torch
    import e2e_torch

    e2e_torch.register()
    model32 = e2e_models.build(spec, "sdpa", seed).to(device)
    e2e_torch.use_attention(model32, e2e_torch.MASKED_SDPA)
    e2e_torch.set_mask(keep, spec.family == "gpt2", device, flex_mask=False)
    outs = []
    for feeds in pool:
        args = tuple(feeds[name] for name in model32.input_names)
        outs.append(e2e_torch.forward(model32, args)().float().cpu())
    del model32
    if device == "cuda":
        torch.cuda.empty_cache()
    return outs


def valid_errors(out, ref, attention_mask) -> dict:
    """benchlib.errors at the positions the padding keeps (a padded query row can keep no key: 0 in ours, NaN in
    SDPA), plus the non-finite count of the whole output."""
    keep = attention_mask.bool().cpu().numpy()
    errs = bl.errors(bl.as_float64(out)[keep], bl.as_float64(ref)[keep])
    errs["nonfinite_all"] = int(np.count_nonzero(~np.isfinite(bl.as_float64(out))))
    return errs


def measure_row(spec, batch: int, length: int, directory: Path, args) -> dict:
    import torch

    import stof_tvm

    row = {"model": spec.name, "batch": batch, "seq_len": length, "mask": args.mask}
    device = args.device
    compiled = load_compiled(directory, spec, batch, length, args.seed)
    row["kernel"] = compiled.kernel
    row["padding_on"] = (compiled.manifest["mask"].get("padding") or {}).get("on", "host")
    row["cuda_graph"] = compiled.manifest.get("cuda_graph")
    keep = np.asarray(stof_tvm.make_mask(args.mask, length), dtype=bool)
    torch16 = None
    if args.torch and device == "cuda":
        torch16 = e2e_models.build(spec, "sdpa", args.seed).to(device).half()
    timing = dict(device=device, samples=args.samples, warmup=3)
    for padding in PADDINGS:
        pool = input_pool(spec, batch, length, padding, args.pool, args.seed + 100 * (padding == "ragged"), device)
        refs = reference_outputs(spec, pool[:1], keep, device, args.seed)
        first = compiled(**pool[0])[OUTPUT]
        errs = valid_errors(first, refs[0], pool[0]["attention_mask"])
        row[f"{padding}_rel"], row[f"{padding}_nonfinite"] = errs["rel"], errs["nonfinite_all"]
        kept = first.clone()
        compiled(**pool[1 % len(pool)])
        row[f"{padding}_stable"] = bool(torch.equal(first, kept))
        sets = [(f,) for f in pool]
        row[f"{padding}_call_ms"] = bl.time_ms(lambda f: compiled(**f), inputs=sets, **timing).median_ms
        compiled.check_values = False
        row[f"{padding}_nocheck_ms"] = bl.time_ms(lambda f: compiled(**f), inputs=sets, **timing).median_ms
        compiled.check_values = True
        prepared = [(compiled.prepare(f),) for f in pool]
        row[f"{padding}_module_ms"] = bl.time_ms(compiled.run, inputs=prepared, **timing).median_ms
        if torch16 is not None:
            def run_torch(f):
                with torch.no_grad():
                    return torch16(*(f[name] for name in torch16.input_names))
            row[f"{padding}_torch_ms"] = bl.time_ms(run_torch, inputs=sets, **timing).median_ms
        module, call = row[f"{padding}_module_ms"], row[f"{padding}_call_ms"]
        row[f"{padding}_over_us"] = (call - module) * 1e3
        row[f"{padding}_goal"] = bool(call <= GOAL_FACTOR * module + GOAL_MS)
        print(f"  {spec.name} {batch}x{length} {padding}: call {call:.3f} ms, module {module:.3f} ms, "
              f"rel {errs['rel']:.2e}", flush=True)
    return row


def mask_build_times(args) -> list[dict]:
    """Host build of a new run-time mask's format (normalise + the kernel's format arrays), per S."""
    from stof_tvm.mask_formats import format_arrays
    from stof_tvm.sparse_formats import normalize_mask

    rows = []
    for seq in (4096, 16384):
        for kind, config in (("block", {"block_m": 64, "block_n": 32}), ("row", {})):
            manifest = {"attention": {"kernel": {"kind": kind, "config": config}}}
            mask_ms, format_ms = [], []
            for _ in range(3):
                start = time.perf_counter()
                mask = normalize_mask(args.mask, batch=1, heads=1, seq_q=seq)
                middle = time.perf_counter()
                format_arrays(manifest, mask)
                mask_ms.append((middle - start) * 1e3)
                format_ms.append((time.perf_counter() - middle) * 1e3)
            rows.append({"seq_len": seq, "kernel": kind, "mask": args.mask, "mask_ms": float(np.median(mask_ms)),
                         "format_ms": float(np.median(format_ms)), "density": float(mask.mean())})
    bl.print_table(rows, [("seq_len", "S", "d"), ("kernel", "format", "s"), ("mask_ms", "mask ms", ".1f"),
                          ("format_ms", "format ms", ".1f"), ("density", "density", ".4f")],
                   f"a new mask at run time ({args.mask}, host CPU): the spec's boolean mask, then its format")
    return rows


COLUMNS = [("model", "model", "s"), ("shape", "BxS", "s"), ("kernel", "kernel", "s")] + [
    column for padding in PADDINGS for column in (
        (f"{padding}_call_ms", f"{padding}: call", ".3f"), (f"{padding}_nocheck_ms", "nocheck", ".3f"),
        (f"{padding}_module_ms", "module", ".3f"), (f"{padding}_over_us", "over us", ".0f"),
        (f"{padding}_goal", "goal", ""), (f"{padding}_torch_ms", "torch", ".3f"), (f"{padding}_rel", "rel", ".1e"),
        (f"{padding}_stable", "stable", ""))]


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=560.0)
    p.add_argument("--no-torch", dest="torch", action="store_false", help="leave the torch timing out")
    p.add_argument("--compile-options", default="{}", help="extra stof_tvm.compile options as JSON")
    p.add_argument("--build-only", action="store_true", help="export and compile, measure nothing")
    p.add_argument("--mask-build", action="store_true", help="time a new mask's host format build only")
    p.add_argument("--compile-job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_job:
        return compile_job(args.compile_job)
    out = bl.out_dir(args.out)
    if args.mask_build:
        bl.write_json(out / "mask_build.json", {"env": bl.environment(), "rows": mask_build_times(args)})
        return 0
    budget, work = bl.Budget(args.budget_s), Path(args.work)
    deadline = time.time() + args.budget_s
    todo = [(e2e_models.spec(name), b, s) for name in args.models for b, s in args.shapes]
    jobs, pending = {}, list(todo)

    def start_more():
        while pending and sum(1 for j in jobs.values() if j is not None and j.poll() is None) < args.jobs:
            spec, b, s = pending.pop(0)
            directory = row_dir(work, spec.name, b, s)
            export_onnx(spec, b, s, directory, args.seed)
            jobs[(spec.name, b, s)] = start_compile(directory, b, s, args)
    rows = []
    for spec, b, s in todo:
        start_more()
        while (spec.name, b, s) not in jobs:
            time.sleep(1.0)
            start_more()
        directory = row_dir(work, spec.name, b, s)
        row = {"model": spec.name, "shape": f"{b}x{s}"}
        bl.guarded(row, "compile", wait_for, jobs[(spec.name, b, s)], directory, deadline)
        if args.build_only or "compile_failed" in row:
            rows.append(row)
            continue
        if not budget.allows(20):
            row["skipped"] = "budget"
            rows.append(row)
            continue
        measured = bl.guarded(row, "measure", measure_row, spec, b, s, directory, args)
        rows.append({**row, **(measured or {})})
        bl.write_json(out / "call_path.json", {"env": bl.environment(), "goal": "call <= 1.03 module + 0.05 ms",
                                               "rows": rows})
    for proc in jobs.values():          # compiles of rows the budget left out
        if proc is not None and proc.poll() is None:
            proc.kill()
    bl.print_table(rows, COLUMNS, f"call path vs module ({args.device}, mask {args.mask}; ms, medians)")
    bl.write_json(out / "call_path.json", {"env": bl.environment(), "goal": "call <= 1.03 module + 0.05 ms",
                                           "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
