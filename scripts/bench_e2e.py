"""End-to-end benchmark: Hugging Face models exported by torch.onnx, compiled by stof-tvm with a sparse mask, timed
against torch and onnxruntime on the same models, in one run on the GPU machine.

Per model and shape (each in a child process, so a crash or a sticky CUDA error costs only that row):

1. build the transformers model from its config with seeded random weights (``stof_tvm.models.hf_export``) and
   export it with ``torch.onnx.export`` (TorchScript exporter, static shapes, opset ``--opset``);
2. compile that ONNX file with stof-tvm in background processes while the torch baselines run: ``ours``
   (``--mask``, default BigBird; cuda float16 with CUDA graphs; the compile's defaults otherwise: attention kernel
   chosen from the mask, fusion templates, wgmma GEMMs on sm_90) and ``tvm-default``, TVM's own default
   pipeline on the same ONNX file, not through stof-tvm's compiler (``scripts/e2e_tvm.py``: ``from_onnx``,
   ``ToMixedPrecision``, ``tvm.compile`` with dlight's default GPU rules; dense attention);
3. float32 references on the device (TF32 off): the model with dense SDPA, and with the sparse mask (AND the
   model's own: the decoders' causality, T5's position bias) through ``scripts/e2e_torch.py``; DeBERTa, which has no
   SDPA form, with its own attention for both (the sparse mask ANDed into the mask it applies);
4. time (CUDA events after warm-up, median of ``--samples`` samples of back-to-back calls, cycling
   ``--input-sets`` sets of fresh random inputs; ``scripts/benchlib.py``) and check against the matching
   reference (relative Frobenius error <= ``--tolerance``, every output element finite; outputs poisoned first
   where we own the buffer):

   | label | what runs | checked against |
   |---|---|---|
   | ``ours-call`` | ``model(input_ids=..., attention_mask=...)``, torch CUDA tensors (the call users write) | sparse |
   | ``ours`` | the module alone: ``run`` on inputs ``prepare``d once | sparse |
   | ``torch-eager`` | the HF model in float16, ``attn_implementation="sdpa"`` (DeBERTa: ``eager``; dense) | dense |
   | ``torch-compile`` | the same through ``torch.compile`` (``--torch-compile-mode``) | dense |
   | ``torch-flex`` | ``torch.compile`` of the model, FlexAttention on a BlockMask of the same sparse mask | sparse |
   | ``ort`` | onnxruntime, CUDA EP + CUDA graph, this ONNX after ORT's transformer optimizer, fp16, IOBinding | dense |
   | ``tvm-default`` | TVM's default pipeline on the same ONNX (see 2.) | dense |
   | ``ours-nograph`` | with ``--profile``: ``ours`` without CUDA graphs, timed and profiled per kernel class | sparse |

   A stage a model cannot run is not run, and the row says why (``<stage>_skipped``, ``-`` in the table):
   ``torch-flex`` for DeBERTa, whose disentangled attention FlexAttention would need as a score_mod
   (``e2e_torch.UNSUPPORTED``). ORT's optimizer fuses no attention of DeBERTa (``ort`` runs it unfused:
   ``weak:ort``).

With ``--profile`` the row also gets ``ours_timeline``: ``ours``' kernels over 20 back-to-back calls as CUPTI saw them
in place (torch.profiler; :func:`benchlib.timeline`): kernels a call, the device span and its idle part, and each
kernel class's and the largest kernels' exposed time (how far each moves the end of the work past the kernels
before it: under dependent launches kernels overlap, so their own durations add up to more than the call takes).

Reported per row: ms of each; ours' coverage from its manifest (linears on fusion templates, attention sites on
sparse kernels: accelerated / total); the hardware limit of the useful work (``scripts/e2e_models.work``: matrix
FLOPs plus attention FLOPs of the kept pairs at 790 TFLOP/s, least bytes at 4.2 TB/s), each time's fraction of it
and, for ``ours``, its compute and memory fractions apart (useful TFLOP/s / 790, least bytes per second / 4.2 TB/s);
``vs best`` = the best correct baseline's ms / ours (``torch-*`` and ``ort``) and ``vs tvm`` = tvm-default / ours,
both for the module (``ours``) and for the call path (``ours-call``). Last in a row, ``ours``, its ``--ours-variants``
and ``ort`` (the modules still loaded) are timed again **interleaved** (:func:`benchlib.time_interleaved`: one sample of
each per round), since timed one after another the same module has measured up to 5% apart on an H100; the table's
``interleaved`` column is the best baseline's interleaved time over ours' where that baseline is ``ort`` (the torch
models are freed before ``ours`` runs). ``results.json`` (rewritten after every
row, and by each child after every stage) and a table go to ``$OUT`` (the device tool's) or ``--out``.
The ``ort`` stage prints one ``ort config:`` line (``scripts/e2e_ort.describe``: model_type, fused operator counts
and the fusions missing against one attention / biased GELU / two residual LayerNorms per layer, the session's graph
level and CUDA graph, nodes per execution provider from one profiled forward, Memcpy nodes) and an ``ORT WARNING:``
line for each weakness (fusion missing, node on the CPU EP, host-device copy, a lower graph level, no CUDA graph);
a row with any has status ``weak:ort``. ``--budget-s`` bounds the whole run: a row or a stage that would not fit
is skipped and reported, never cut off mid-write.

ViT's sequence is its patch grid: ``vit-base`` 197 tokens, ``vit-base-384`` 577; a shape's batch applies, its
length is replaced. Models: ``scripts/e2e_models.py`` (``bert-base roberta-base bert-large gpt2 vit-base
vit-base-384 t5-base deberta-v3-base smollm2-360m qwen2.5-0.5b``, and ``*-tiny`` for the CPU).

On the GPU machine (the lead's calls; the devkit's README: /work/shared/device/README.md). Here, once:
``../shared/device/pack`` and ``.venv/bin/python scripts/ort_parts.py prepare`` (parts of 24 + 32 + 7.7 MiB in
.whl/). Then three calls back to back (the machine keeps .devkit-site/ and /tmp only while warm, ~30 s):

    1. carry [".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", ".devkit/compiler.a", ".whl/ort-part-1-of-3"]
       command: source .devkit/bootstrap.sh; source scripts/ort_install.sh
    2. carry [".devkit/bootstrap.sh", ".devkit/compiler.b", ".whl/ort-part-2-of-3"]
       command: source .devkit/bootstrap.sh; source scripts/ort_install.sh
    3. carry [".devkit/bootstrap.sh", ".whl/ort-part-3-of-3"], timeout_s 600
       command: source .devkit/bootstrap.sh && source scripts/ort_install.sh && python3 -m pip install -q
         --no-deps --no-build-isolation --no-index -e . && PYTHONUNBUFFERED=1 python3 scripts/bench_e2e.py
         --rows bert-base:8x512 vit-base-384:8x512 roberta-base:8x512 --budget-s 520 2>&1 | tee $OUT/log.txt

Later calls while warm carry only ``.devkit/bootstrap.sh`` and start with both ``source`` lines.

Splitting a large set into calls: ``--rows MODEL:BxS ...`` runs exactly those rows in that order (``--models`` x
``--shapes`` runs every pair). With every stage on, a base-size row took 100-150 s on the H200 (2026-12-01, session
5: ~25 s of process start and model build, export 6-9 s, the stof-tvm compile 36-48 s in the background, which
the first timing waits for, torch.compile 13-18 s, Flex 12-37 s, onnxruntime 11-17 s); rows the budget cannot
fit are reported as skipped, so order them by importance and give each call 3 rows (``--budget-s 520``).

On the CPU (the whole flow on tiny models, llvm, float32; what tests/test_bench_e2e.py runs):

    .venv/bin/python scripts/bench_e2e.py --device cpu --models bert-tiny --shapes 2x256 \\
        --skip torch-compile torch-flex --out out/e2e-cpu

(DeBERTa's row: ``--rows deberta-tiny:2x128``, what tests/test_e2e_deberta.py runs.)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

import benchlib as bl  # noqa: E402
import e2e_models  # noqa: E402

BASELINES = ("torch-eager", "torch-compile", "torch-flex", "ort")
OURS = ("ours", "ours-call")
STAGES = ("export", "reference") + BASELINES + ("ours", "ours-nograph", "tvm-default")
# seconds a stage may take on the H200 machine at the largest shapes: a stage starts only if this fits
STAGE_COST_S = {"export": 30, "reference": 15, "torch-eager": 15, "torch-compile": 90, "torch-flex": 120,
                "ort": 60, "ours": 30, "ours-nograph": 30, "tvm-default": 30}
COMPILED = ("ours", "ours-nograph", "tvm-default")         # stages whose module compiles in the background
ROW_MIN_S = 60             # a row starts only with this much of the budget left
RESERVE_S = 20             # kept back for the final JSON and table (and a child's exit)
TIMELINE_CALLS = 20        # --profile: back-to-back calls of ours traced in place
TIMELINE_TOP = 12          # ... and the kernels kept in the row, largest exposed time first
# Relax symbol substrings -> kernel class, first match wins (the per-kernel-class breakdown of --profile)
KERNEL_CLASSES = (("attention", ("attention", "blockwise", "rowwise", "softmax")),
                  ("gemm", ("gemm", "matmul", "qkv", "ffn", "dense", "linear", "conv")),
                  ("norm", ("layernorm", "layer_norm", "rmsnorm", "rms_norm")),
                  ("vm/memory", ("vm.builtin", "alloc", "null_value", "reshape", "view", "copy", "shape", "kill")))


# -------------------------------------------------------------------------------------------- pure helpers
def parse_shape(text: str) -> tuple[int, int]:
    try:
        batch, length = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape: expected BxS such as 8x512, got {text!r}") from None
    if batch < 1 or length < 1:
        raise argparse.ArgumentTypeError(f"shape: batch and length must be positive, got {text!r}")
    return batch, length


def parse_row(text: str) -> tuple[str, tuple[int, int]]:
    """``MODEL:BxS`` (one row of ``--rows``) -> (model, (batch, length))."""
    name, sep, shape = text.partition(":")
    if not sep or name not in e2e_models.MODELS:
        raise argparse.ArgumentTypeError(f"row: expected MODEL:BxS with MODEL one of {sorted(e2e_models.MODELS)}, "
                                         f"got {text!r}")
    return name, parse_shape(shape)


def rows_to_run(models: list[str], shapes: list[tuple[int, int]],
                rows: list[tuple[str, tuple[int, int]]] | None = None) -> list[tuple[str, int, int]]:
    """(model, batch, length) of every row, in order: ``rows`` (``--rows``) as given when there are any, else
    every model at every shape; ViT's length is its own, so shapes that differ only in length give one ViT row."""
    pairs = rows or [(name, shape) for name in models for shape in shapes]
    found = []
    for name, (batch, length) in pairs:
        row = (name, batch, e2e_models.seq_len(e2e_models.spec(name), length))
        if row not in found:
            found.append(row)
    return found


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME=JSON`` (one of ``--ours-variants``) -> (name, extra ``stof_tvm.compile`` options)."""
    name, sep, options = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise argparse.ArgumentTypeError(f"variant: expected NAME=JSON (NAME of letters, digits, _ . -), got {text!r}")
    try:
        extra = json.loads(options)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"variant {name}: {err}") from None
    if not isinstance(extra, dict):
        raise argparse.ArgumentTypeError(f"variant {name}: options must be a JSON object, got {options!r}")
    return name, extra


def variant_stages(args) -> tuple[str, ...]:
    """The stage label of every ``--ours-variants`` entry: ``ours:NAME``."""
    return tuple(f"ours:{name}" for name, _ in args.ours_variants)


def variant_labels(row: dict) -> list[str]:
    """The ``ours:NAME`` stages a row timed (``<label>_ms``; not the wall-clock cross-checks ``<label>_wall_ms`` nor
    the interleaved timings ``<label>_interleaved_ms``)."""
    return [key[:-len("_ms")] for key in row if key.startswith("ours:") and key.endswith("_ms")
            and not key.endswith(("_wall_ms", "_interleaved_ms"))]


def compile_options(stage: str, args) -> dict:
    """Build options of a compiled stage: ``stof_tvm.compile`` keyword arguments (besides the model, mask and
    shape) for ours (``--ours-options``; a variant ``ours:NAME`` adds its own on top, with ours' CUDA graph),
    ``e2e_tvm.build``'s target and dtype for tvm-default."""
    cuda = args.target == "cuda"
    if stage == "tvm-default":
        return {"target": args.target, "dtype": args.dtype}
    variant = stage.startswith("ours:")
    options = {"target": args.target, "dtype": args.dtype, "cuda_graph": cuda and (stage == "ours" or variant)}
    options.update(json.loads(args.ours_options))
    if variant:
        options.update(dict(args.ours_variants)[stage.partition(":")[2]])
    if stage == "ours-nograph":
        options["cuda_graph"] = False
    return options


def kernel_class(symbol: str) -> str:
    name = symbol.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")


def class_breakdown(profile_rows: list[dict]) -> list[dict]:
    """:class:`stof_tvm.profiling.CallProfile` rows folded into kernel classes: ms per forward, calls, share."""
    classes: dict[str, dict] = {}
    for row in profile_rows:
        entry = classes.setdefault(kernel_class(row["symbol"]), {"ms": 0.0, "calls": 0, "share": 0.0})
        entry["ms"] += row["ms"]
        entry["calls"] += row["calls"]
        entry["share"] += row["share"]
    return [{"class": c, **v} for c, v in sorted(classes.items(), key=lambda kv: -kv[1]["ms"])]


def timeline_text(summary: dict) -> str:
    """:func:`benchlib.timeline`'s summary of ours (the CUDA-graph module) as a short table: per call, the exposed
    time of each kernel class and of the largest kernels."""
    head = (f"ours in place (CUDA graph, CUPTI via torch.profiler, {summary['calls']} calls): "
            f"{summary['kernels_per_call']} kernels a call, span {summary['span_us']:.1f} us (idle "
            f"{summary['idle_us']:.1f}), the kernels' own durations {summary['kernel_us']:.1f} us (they overlap)")
    columns = [("class", "class", ""), ("us", "exposed us", ".1f"), ("kernels", "kernels", ".0f"),
               ("share", "share", ".1%")]
    top = [("kernel", "kernel", ""), ("us", "exposed us", ".1f"), ("kernels", "kernels", ".0f"),
           ("share", "share", ".1%")]
    return "\n".join([head, bl.format_table(summary["classes"], columns), bl.format_table(summary["kernels"], top)])


def coverage_counts(coverage: dict, kind: str) -> str | None:
    """``"accelerated/total"`` of one kind of a manifest's ``coverage`` entry (None when the kind is absent)."""
    counts = (coverage or {}).get(kind)
    return None if counts is None else f"{counts['accelerated']}/{counts['total']}"


def summarise(row: dict, tolerance: float) -> dict:
    """Add the row's comparisons: the best correct baseline, ``ours`` and ``ours-call`` against it and against
    tvm-default, every timed stage's fraction of the hardware limit (and ours' compute and memory fractions),
    and ours' coverage (linears on templates, attention sites on sparse kernels). A stage counts only if it was
    checked and passed (``<label>_ok``)."""
    def ok_ms(label):
        return row.get(f"{label}_ms") if row.get(f"{label}_ok") else None

    baselines = [(ok_ms(b), b) for b in BASELINES if ok_ms(b) is not None]
    if baselines:
        best_ms, best = min(baselines)
        row["best_baseline"], row["best_baseline_ms"] = best, best_ms
    limit_ms = None
    if row.get("flops") and row.get("device") == "cuda":
        limit_ms = bl.limit(1.0, row["flops"], row["bytes"])["limit_ms"]
        row["limit_ms"] = limit_ms
    for label in OURS:
        ms = ok_ms(label)
        if ms is None:
            continue
        if baselines:
            row[f"{label}_vs_best"] = row["best_baseline_ms"] / ms
        if ok_ms("tvm-default") is not None:
            row[f"{label}_vs_tvm"] = row["tvm-default_ms"] / ms
        if limit_ms is not None:
            achieved = bl.limit(ms, row["flops"], row["bytes"])
            row[f"{label}_tflops"], row[f"{label}_tbps"] = achieved["tflops"], achieved["tbps"]
            row[f"{label}_compute_fraction"] = achieved["tflops"] / bl.PEAK_TFLOPS
            row[f"{label}_memory_fraction"] = achieved["tbps"] / bl.PEAK_TBPS
    for label in variant_labels(row):
        if ok_ms(label) is not None and ok_ms("ours") is not None:
            row[f"{label}_vs_ours"] = row["ours_ms"] / row[f"{label}_ms"]
        if row.get(f"{label}_interleaved_ms") and row.get("ours_interleaved_ms"):
            row[f"{label}_interleaved_vs_ours"] = row["ours_interleaved_ms"] / row[f"{label}_interleaved_ms"]
    best_interleaved = row.get(f"{row.get('best_baseline')}_interleaved_ms")
    if best_interleaved and row.get("ours_interleaved_ms") and ok_ms("ours") is not None:
        row["ours_vs_best_interleaved"] = best_interleaved / row["ours_interleaved_ms"]
    if limit_ms is not None:
        for label in STAGES + ("ours-call",):
            if row.get(f"{label}_ms"):
                row[f"{label}_fraction"] = limit_ms / row[f"{label}_ms"]
    coverage = (row.get("ours_compile") or {}).get("coverage")
    if coverage:
        row["ours_linears"] = coverage_counts(coverage, "linear")
        row["ours_attention_sites"] = coverage_counts(coverage, "attention")
    failed = [label for label in STAGES + ("ours-call",) if row.get(f"{label}_ok") is False]
    errors = [label for label in STAGES + ("ours-call", "row") if f"{label}_failed" in row]
    problems = [f"wrong:{x}" for x in failed] + [f"error:{x}" for x in errors]
    if row.get("ort_warnings"):
        problems.append("weak:ort")         # ORT ran, but not fully fused / on the GPU alone: the log says how
    if row.get("child_exit"):
        problems.append(f"exit:{row['child_exit']}")
    row["status"] = " ".join(problems) or "ok"
    return row


TABLE = [("model", "model", ""), ("shape", "B x S", ""), ("ours_ms", "ours", ".3f"), ("ours-call_ms", "call", ".3f"),
         ("torch-eager_ms", "eager", ".3f"), ("torch-compile_ms", "compile", ".3f"), ("torch-flex_ms", "flex", ".3f"),
         ("ort_ms", "ort", ".3f"), ("tvm-default_ms", "tvm", ".3f"), ("best_baseline", "best", ""),
         ("ours_vs_best", "vs best", ".2f"), ("ours_vs_best_interleaved", "interleaved", ".2f"),
         ("ours-call_vs_best", "call vs best", ".2f"),
         ("ours_vs_tvm", "vs tvm", ".2f"), ("ours-call_vs_tvm", "call vs tvm", ".2f"),
         ("ours_linears", "linears", ""), ("ours_attention_sites", "attn", ""), ("limit_ms", "limit", ".3f"),
         ("ours_fraction", "of limit", ".2f"), ("ours_compute_fraction", "of 790T", ".2f"),
         ("ours_memory_fraction", "of 4.2TB", ".2f"), ("status", "status", "")]


def print_results(rows: list[dict]) -> None:
    shown = [{**r, "shape": f"{r['batch']}x{r['seq_len']}"} for r in rows]
    for row in shown:
        if row.get("ours-nograph_classes"):
            print(f"\n{row['model']} {row['shape']}: where ours (no CUDA graph, "
                  f"{row.get('ours-nograph_ms', float('nan')):.3f} ms) spends its time "
                  f"(device synchronised around each call)")
            bl.print_table(row["ours-nograph_classes"], [("class", "class", ""), ("ms", "ms/fwd", ".3f"),
                                                        ("calls", "calls", "d"), ("share", "share", ".1%")])
    variants = [{"model": r["model"], "shape": r["shape"], "variant": label, "ms": r[f"{label}_ms"],
                 "vs_ours": r.get(f"{label}_vs_ours"), "ms_il": r.get(f"{label}_interleaved_ms"),
                 "ours_il": r.get("ours_interleaved_ms"), "vs_ours_il": r.get(f"{label}_interleaved_vs_ours"),
                 "ok": r.get(f"{label}_ok")}
                for r in shown for label in variant_labels(r)]
    if variants:
        bl.print_table(variants, [("model", "model", ""), ("shape", "B x S", ""), ("variant", "variant", ""),
                                  ("ms", "ms", ".3f"), ("vs_ours", "ours / variant", ".3f"),
                                  ("ours_il", "ours interleaved", ".3f"), ("ms_il", "variant interleaved", ".3f"),
                                  ("vs_ours_il", "ours / variant interleaved", ".3f"), ("ok", "ok", "")],
                       title="--ours-variants (module alone, CUDA graph): ours' ms over the variant's, > 1 = faster; "
                             "timed one after the other, then interleaved round by round (what to judge by)")
    bl.print_table(shown, TABLE, title="ms per forward pass (sparse: ours, flex; dense: eager, compile, ort, "
                                       "tvm = TVM's default pipeline)\nlinears / attn: ours on templates / sparse "
                                       "kernels; 'of limit' = hardware floor / ours; of 790T / of 4.2TB: ours' "
                                       "useful TFLOP/s and least bytes/s over the H200's peaks")


# ------------------------------------------------------------------------------------------ parent process
def run_parent(args) -> int:
    budget = bl.Budget(args.budget_s)
    out = Path(args.out) if args.out else bl.out_dir(os.path.join("out", "e2e"))
    out.mkdir(parents=True, exist_ok=True)
    rows_dir = Path(args.work) / "rows"
    rows_dir.mkdir(parents=True, exist_ok=True)
    header = {"environment": bl.environment(), "command": sys.argv, "args": vars(args)}
    rows = []
    for name, batch, length in rows_to_run(args.models, args.shapes, args.rows):
        base = {"model": name, "batch": batch, "seq_len": length}
        if not budget.allows(ROW_MIN_S + RESERVE_S):
            rows.append({**base, "status": f"skipped: {budget.left():.0f} s of --budget-s left"})
            continue
        row_path = rows_dir / f"{name}_{batch}x{length}.json"
        row_path.unlink(missing_ok=True)
        deadline = time.time() + budget.left() - RESERVE_S
        code = run_child(args, name, batch, length, row_path, deadline)
        row = {**base, **(json.loads(row_path.read_text()) if row_path.exists() else {})}
        if code:
            row["child_exit"] = code
        rows.append(summarise(row, args.tolerance))
        print(f"== {name} {batch}x{length}: {row['status']} ({json.dumps(_brief(row))})", flush=True)
        bl.write_json(out / "results.json", {**header, "rows": rows})
    bl.write_json(out / "results.json", {**header, "rows": rows})
    print_results(rows)
    print(f"\n{out / 'results.json'} ({budget.used():.0f} s)")
    return 0


def _brief(row: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()
            if k.endswith(("_ms", "_vs_best", "_vs_tvm", "_fraction"))
            or k in ("best_baseline", "ours_linears", "ours_attention_sites")}


def run_child(args, name: str, batch: int, length: int, row_path: Path, deadline: float) -> int:
    """Run one row in a child process (its own process group: on timeout it and its compile jobs are killed
    together); returns its exit code (-9 when killed at the deadline)."""
    command = [sys.executable, os.path.abspath(__file__), "--row", name, f"{batch}x{length}", "--row-json",
               str(row_path), "--deadline", str(deadline)] + args.child_argv
    proc = subprocess.Popen(command, start_new_session=True)
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.time() + 10))
    except subprocess.TimeoutExpired:
        print(f"  {name} {batch}x{length}: past the budget, stopped", flush=True)
        code = -9
    try:                                  # the child, if still there, and compile jobs it left running
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return code


# ------------------------------------------------------------------------------------------ compile jobs
def artifact_dir(work_dir: Path, stage: str) -> Path:
    """Where a compiled stage's artifact goes (``ours:NAME`` -> ``ours-NAME``)."""
    return work_dir / stage.replace(":", "-")


def start_compile(stage: str, onnx_path: Path, artifact: Path, mask: str, batch: int, length: int, args):
    """Compile ``onnx_path`` for ``stage`` in a background process (CPU work overlapping the torch stages)."""
    shutil.rmtree(artifact, ignore_errors=True)
    job = {"stage": stage, "onnx": str(onnx_path), "artifact": str(artifact), "mask": mask, "batch": batch,
           "seq_len": length, "options": compile_options(stage, args)}
    env = {**os.environ, "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1"}      # the job needs no torch or CUDA
    log = open(str(artifact) + ".log", "w")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--compile-job", json.dumps(job)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def compile_job(spec: str) -> int:
    """The background compile: ``stof_tvm.compile`` then ``save`` (ours), or ``e2e_tvm.build`` (TVM's default
    pipeline, no stof-tvm compiler); its report (or error) beside the artifact."""
    job = json.loads(spec)
    report_path = Path(job["artifact"] + ".json")
    start = time.time()
    try:
        if job["stage"] == "tvm-default":
            import e2e_tvm

            built = e2e_tvm.build(job["onnx"], job["artifact"], job["batch"], job["seq_len"], **job["options"])
            report = {"compile_s": time.time() - start, "seconds": built["seconds"], "options": job["options"]}
        else:
            import stof_tvm

            art = stof_tvm.compile(job["onnx"], mask=job["mask"], batch=job["batch"], seq_len=job["seq_len"],
                                   **job["options"])
            art.save(job["artifact"])
            manifest = art.manifest
            report = {"compile_s": time.time() - start, "kernel": manifest["attention"]["kernel"]["kind"],
                      "templates": (manifest.get("templates") or {}).get("calls", {}),
                      "coverage": manifest.get("coverage"), "cuda_graph": manifest.get("cuda_graph"),
                      "options": job["options"]}
    except Exception as err:      # noqa: BLE001 - reported to the row, never fatal
        report = {"failed": f"{type(err).__name__}: {err}"[:600], "compile_s": time.time() - start}
    bl.write_json(report_path, report)
    return 0


def wait_compile(proc, artifact: Path, deadline: float) -> dict:
    """Wait for a compile job until ``deadline``; its report; raises on failure or timeout."""
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise TimeoutError("compile did not finish within the budget") from None
    report_path = Path(str(artifact) + ".json")
    if not report_path.exists():
        tail = Path(str(artifact) + ".log").read_text()[-400:]
        raise RuntimeError(f"compile job exited {proc.returncode} without a report: {tail}")
    report = json.loads(report_path.read_text())
    if "failed" in report:
        raise RuntimeError(report["failed"])
    return report


# --------------------------------------------------------------------------------------------- one row
class Row:
    """One (model, shape) measurement: its dict, written after every stage; stages run only if they fit and are
    not in ``skip`` (stage -> why not: ``--skip``, or what the model lacks)."""

    def __init__(self, path: Path, deadline: float, skip: dict[str, str], base: dict):
        self.path, self.deadline, self.skip, self.data = path, deadline, skip, dict(base)
        self.save()

    def save(self) -> None:
        bl.write_json(self.path, self.data)

    def quiet(self) -> None:
        """Wait for the background compile jobs (``self.jobs``) before a timed measurement: no timing may share
        the CPU with a compile. A job still running at the deadline is killed (its stage reports it)."""
        for stage, job in getattr(self, "jobs", {}).items():
            try:
                job.wait(timeout=max(1.0, self.deadline - time.time() - 30))
            except subprocess.TimeoutExpired:
                job.kill()
                self.data[f"{stage}_killed"] = "still compiling at the row's deadline"

    def stage(self, label: str, fn, *args):
        if label in self.skip:
            self.data[f"{label}_skipped"] = self.skip[label]
            return None
        left = self.deadline - time.time()
        if left < STAGE_COST_S.get(label, 30) * 0.5:
            self.data[f"{label}_skipped"] = f"budget ({left:.0f} s left)"
            print(f"  {label}: skipped, {left:.0f} s left", flush=True)
            self.save()
            return None
        start = time.time()
        print(f"  {label} ...", flush=True)
        result = bl.guarded(self.data, label, fn, *args)
        self.data[f"{label}_s"] = round(time.time() - start, 2)
        self.save()
        return result

    def check(self, label: str, out, ref, tolerance: float) -> None:
        errs = bl.errors(out, ref)
        self.data[f"{label}_err"] = errs
        self.data[f"{label}_ok"] = bl.within(errs, tolerance)
        flag = "ok" if self.data[f"{label}_ok"] else f"WRONG (tolerance {tolerance:g})"
        print(f"    {label}: rel {errs['rel']:.2e}, max rel {errs['max_rel']:.2e} {flag}", flush=True)

    def timed(self, label: str, fn, inputs, args) -> None:
        self.quiet()
        device = "cuda" if args.device == "cuda" else "cpu"
        budget = max(1.0, min(20.0, (self.deadline - time.time()) / 4))
        timing = bl.time_ms(fn, device=device, inputs=inputs, warmup=args.warmup, samples=args.samples,
                            budget_s=budget)
        self.data[f"{label}_ms"] = timing.median_ms
        self.data[f"{label}_timing"] = timing.as_dict()
        wall = ""
        if device == "cuda":          # cross-check: device-wide syncs see work on any stream, events only torch's
            check = bl.time_ms(fn, device="cuda-wall", inputs=inputs, warmup=1, samples=max(3, args.samples // 2),
                               number=timing.calls_per_sample, budget_s=budget / 2)
            self.data[f"{label}_wall_ms"] = check.median_ms
            wall = f", {check.median_ms:.3f} ms by the wall clock between device syncs"
        print(f"    {label}: {timing.median_ms:.3f} ms (median of {timing.samples} x {timing.calls_per_sample}{wall})",
              flush=True)


def run_row(args) -> int:
    """The child process of one row; an error outside the guarded stages is recorded as ``row_failed``."""
    row = Row(Path(args.row_json), args.deadline, dict.fromkeys(args.skip, "--skip"), {})
    try:
        measure_row(args, row)
    except Exception as err:      # noqa: BLE001 - the row file says what broke
        bl.guarded(row.data, "row", _raise, err)
        row.save()
        return 1
    return 0


def _raise(err):
    raise err


def measure_row(args, row: "Row") -> None:
    import numpy as np
    import torch

    import e2e_torch
    import stof_tvm

    name, (batch, length) = args.row[0], parse_shape(args.row[1])
    model = e2e_models.spec(name)
    dev = args.device
    data = row.data
    data.update({"model": name, "batch": batch, "seq_len": length, "mask": args.mask, "device": dev,
                 "dtype": args.dtype, "target": args.target, "seed": args.seed})
    row.save()
    for label, why in e2e_torch.UNSUPPORTED.get(model.family, {}).items():
        if label not in row.skip:
            row.skip[label] = why
            print(f"  {label}: not run, {why}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = 64
    e2e_torch.register()
    dtype = getattr(torch, args.dtype)
    work_dir = Path(args.work) / f"{name}_{batch}x{length}"
    work_dir.mkdir(parents=True, exist_ok=True)

    sets = [e2e_models.inputs(model, batch, length, args.seed + i) for i in range(args.input_sets)]
    e2e_torch.check_unpadded(sets[0])
    model32 = e2e_models.build(model, args.export_attn, args.seed, length).to(dev)   # ValueError: table too short
    info = e2e_models.shape_info(model32)
    keep = np.asarray(stof_tvm.make_mask(args.mask, length), dtype=bool)
    causal = model.family in e2e_models.CAUSAL_FAMILIES
    combined = keep & np.tril(np.ones_like(keep)) if causal else keep
    data.update(info)
    data.update(e2e_models.work(info, batch, length, int(combined.sum()), 2 if args.dtype == "float16" else 4))
    data["mask_density"] = float(combined.mean())
    biased = model.family in ("t5", "deberta")         # T5's position bias, DeBERTa's c2p + p2c terms
    data["mask_applied"] = args.mask + (" AND causal" if causal else "") + (" + bias" if biased else "")

    onnx_path = work_dir / "model.onnx"
    # --export-dtype float16: the ONNX file users make after model.half() (the same float16 weights ours stores)
    exported = (model32 if args.export_dtype == "float32"
                else copy.deepcopy(model32).to(getattr(torch, args.export_dtype)))
    row.stage("export", e2e_models.export, exported, sets[0], str(onnx_path), args.opset)
    del exported
    jobs = {}
    if onnx_path.exists():
        for stage in COMPILED + variant_stages(args):
            if stage not in row.skip and (stage != "ours-nograph" or args.profile):
                jobs[stage] = start_compile(stage, onnx_path, artifact_dir(work_dir, stage), args.mask, batch,
                                            length, args)
    row.jobs = jobs

    input_names = tuple(model32.input_names)

    def torch_args(feeds, float_dtype):
        tensors = []
        for input_name in input_names:
            t = torch.from_numpy(feeds[input_name]).to(dev)
            tensors.append(t.to(float_dtype) if t.is_floating_point() else t)
        return tuple(tensors)

    e2e_torch.set_mask(keep, causal, dev, flex_mask="torch-flex" not in row.skip)
    dense = data["dense_attention"] = e2e_torch.dense_attention(model.family)
    refs = {}

    def reference():
        fp32 = torch_args(sets[0], torch.float32)
        e2e_torch.use_attention(model32, dense)
        refs["dense"] = e2e_torch.forward(model32, fp32)().float().cpu()
        e2e_torch.use_attention(model32, e2e_torch.MASKED_SDPA)
        refs["sparse"] = e2e_torch.forward(model32, fp32)().float().cpu()
        data["sparse_vs_dense_rel"] = bl.errors(refs["sparse"], refs["dense"])["rel"]
    row.stage("reference", reference)
    if not refs:
        return
    model16 = copy.deepcopy(model32).to(dtype)
    del model32
    half_sets = [torch_args(s, dtype) for s in sets]

    def torch_variant(label, attention, compiled, ref):
        e2e_torch.use_attention(model16, attention)
        torch._dynamo.reset()
        target = torch.compile(model16, dynamic=False, mode=args.torch_compile_mode) if compiled else model16
        start = time.time()
        out = e2e_torch.forward(target, half_sets[0])()
        if compiled:
            data[f"{label}_compile_s"] = round(time.time() - start, 1)
            data[f"{label}_mode"] = args.torch_compile_mode
        row.check(label, out, ref, args.tolerance)
        row.timed(label, lambda *a: e2e_torch.forward(target, a)(), half_sets, args)
    row.stage("torch-eager", torch_variant, "torch-eager", dense, False, refs["dense"])
    row.stage("torch-compile", torch_variant, "torch-compile", dense, True, refs["dense"])
    row.stage("torch-flex", torch_variant, "torch-flex", e2e_torch.FLEX, True, refs["sparse"])
    del model16
    torch._dynamo.reset()
    if dev == "cuda":
        torch.cuda.empty_cache()

    # ours, its variants and onnxruntime (the best baseline at most rows), kept alive for the interleaved timing
    interleave = {}

    def onnxruntime_stage():
        import e2e_ort

        data["ort_version"] = e2e_ort.version()
        optimized = work_dir / "ort.onnx"
        start = time.time()
        prep = e2e_ort.optimize(str(onnx_path), str(optimized), model.family, info["heads"], info["hidden"],
                                info["layers"], fp16=args.dtype == "float16", gpu=dev == "cuda",
                                mask=args.ort_mask)
        data["ort_prep"], data["ort_fused"] = prep, prep["fused"]
        data["ort_optimize_s"] = round(time.time() - start, 1)
        shape = tuple(refs["dense"].shape)
        runners = [e2e_ort.OrtRunner(str(optimized), feeds, shape, dev, cuda_graph=args.ort_cuda_graph)
                   for feeds in sets]
        session = data["ort_session"] = runners[0].session_record()
        data["ort_providers"] = session["providers"]
        summary = data["ort_placement"] = e2e_ort.placement(str(optimized), sets[0], dev, runners[0].level,
                                                            str(work_dir / "ort-profile"))
        warnings = [f"fusions missing: {'; '.join(prep['missing'])}"] if prep["missing"] else []
        warnings += e2e_ort.placement_problems(summary, dev) + session["notes"]
        if session["level"] != e2e_ort.GRAPH_LEVELS[0]:
            warnings.append(f"session at {session['level']}")
        data["ort_warnings"] = warnings
        print("    " + e2e_ort.describe(prep, session, summary), flush=True)
        for warning in warnings:
            print(f"    ORT WARNING: {warning}", flush=True)
        row.check("ort", runners[0].run(), refs["dense"], args.tolerance)
        row.timed("ort", lambda r: r.run(), [(r,) for r in runners], args)
        if dev == "cuda" and data.get("ort_ok"):
            interleave["ort"] = (lambda r: r.run(), [(r,) for r in runners])
    if onnx_path.exists():
        row.stage("ort", onnxruntime_stage)

    def load(stage):
        report = wait_compile(jobs[stage], artifact_dir(work_dir, stage), row.deadline)
        data[f"{stage}_compile"] = report
        if stage == "tvm-default":
            import e2e_tvm

            return e2e_tvm.TvmRunner(str(artifact_dir(work_dir, stage)), dev)
        from stof_tvm import runtime

        if report.get("coverage"):
            from stof_tvm.compiler.coverage import coverage_lines

            print("    " + "\n    ".join(coverage_lines(report["coverage"])), flush=True)
        return runtime.load(str(artifact_dir(work_dir, stage)))

    def device_feeds(feeds):
        # torch's own allocations (aligned as TVM's DLPack import requires; from_numpy's buffers may not be)
        return {k: torch.from_numpy(v).to(dev).clone() for k, v in feeds.items()}

    def first_output(outs):
        return outs[0] if isinstance(outs, (list, tuple)) else outs

    def ours_stage(stage):
        compiled = load(stage)
        data[f"{stage}_kernel"] = compiled.kernel
        feeds = [device_feeds(s) for s in sets]
        if stage == "ours":
            out = compiled(**feeds[0])
            row.check("ours-call", first_output(list(out.values())), refs["sparse"], args.tolerance)
            row.timed("ours-call", lambda f: compiled(**f), [(f,) for f in feeds], args)
            row.save()
        prepared = [compiled.prepare(f) for f in feeds]
        row.check(stage, first_output(compiled.run(prepared[0])), refs["sparse"], args.tolerance)
        row.timed(stage, lambda p: compiled.run(p), [(p,) for p in prepared], args)
        if dev == "cuda" and (stage == "ours" or stage.startswith("ours:")) and data.get(f"{stage}_ok"):
            interleave[stage] = (lambda *p, run=compiled.run: run(list(p)), prepared)
        if stage == "ours" and args.profile:      # its own failure is recorded in the row, the timings kept
            bl.guarded(data, "ours-timeline", trace_timeline, lambda p: compiled.run(p), [(p,) for p in prepared])
        if stage == "ours-nograph":
            from stof_tvm.profiling import profile_calls

            profile = profile_calls(compiled.vm, compiled.device, prepared[0] + compiled.params)
            data["ours-nograph_profile"] = profile.rows()[:30]
            data["ours-nograph_classes"] = class_breakdown(profile.rows())
            print(profile.table(), flush=True)

    def trace_timeline(fn, inputs):
        summary = bl.timeline(bl.trace_kernels(fn, inputs, TIMELINE_CALLS), TIMELINE_CALLS, kernel_class)
        summary["kernels"] = summary["kernels"][:TIMELINE_TOP]
        data["ours_timeline"] = summary
        print(timeline_text(summary), flush=True)

    def tvm_default_stage(stage):
        runner = load(stage)
        prepared = [runner.prepare(f) for f in (device_feeds(s) for s in sets)]
        row.check(stage, runner.run(prepared[0]), refs["dense"], args.tolerance)      # dense attention, as ONNX has it
        row.timed(stage, lambda p: runner.run(p), [(p,) for p in prepared], args)

    def interleaved_stage():
        budget = max(2.0, min(60.0, (row.deadline - time.time()) / 2))
        timings = bl.time_interleaved(interleave, warmup=args.warmup, rounds=2 * args.samples, budget_s=budget)
        for stage, timing in timings.items():
            data[f"{stage}_interleaved_ms"] = timing.median_ms
            data[f"{stage}_interleaved_timing"] = timing.as_dict()
            print(f"    {stage}: {timing.median_ms:.3f} ms interleaved (median of {timing.samples} x "
                  f"{timing.calls_per_sample})", flush=True)

    for stage in COMPILED + variant_stages(args):
        if stage in jobs:
            row.stage(stage, tvm_default_stage if stage == "tvm-default" else ours_stage, stage)
    if "ours" in interleave and len(interleave) > 1:
        row.stage("interleaved", interleaved_stage)
    interleave.clear()
    for job in jobs.values():              # a compile skipped for the budget must not outlive the row
        if job.poll() is None:
            job.kill()


# ------------------------------------------------------------------------------------------------------ CLI
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["roberta-base"], choices=sorted(e2e_models.MODELS),
                   metavar="MODEL", help=f"models (default roberta-base; GPU set: {' '.join(e2e_models.GPU_MODELS)})")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[(8, 512), (16, 2048), (1, 128)],
                   metavar="BxS", help="batch x sequence length (default 8x512 16x2048 1x128)")
    p.add_argument("--rows", nargs="+", type=parse_row, metavar="MODEL:BxS",
                   help="exactly these rows, in this order (e.g. bert-base:8x512 gpt2:16x2048), instead of every "
                        "--models at every --shapes")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--target", help="stof-tvm target (default: cuda on --device cuda, else llvm)")
    p.add_argument("--dtype", choices=("float16", "float32"),
                   help="compute dtype of ours and the torch / ort baselines (default float16 on cuda, float32 else)")
    p.add_argument("--mask", default="bigbird", help="sparse mask spec (stof_tvm.make_mask), default bigbird")
    p.add_argument("--skip", nargs="*", default=[], choices=STAGES, metavar="STAGE",
                   help=f"stages left out: {' '.join(STAGES)}")
    p.add_argument("--profile", action="store_true",
                   help="also trace ours' kernels in place (CUPTI: each kernel's exposed time in the CUDA graph, by "
                        "class) and build ours without CUDA graphs, time it and profile it call by call")
    p.add_argument("--ours-options", default="{}", metavar="JSON",
                   help='extra stof_tvm.compile options for ours, e.g. \'{"gemm": "mma"}\'')
    p.add_argument("--ours-variants", nargs="*", type=parse_variant, default=[], metavar="NAME=JSON",
                   help="more builds of ours, each with these options on top of --ours-options, compiled beside "
                        "ours and timed as modules (CUDA graph), e.g. older='{\"lean_padding\": false}'; then "
                        "ours and the variants are timed again interleaved (one sample of each per round), which "
                        "is what to judge by: one after another, one module measured up to 5%% apart on an H100, "
                        "interleaved a control same='{}' (ours built again) came within 0.3%% (BENCHMARKS.md "
                        "session 21)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run (default 540)")
    p.add_argument("--tolerance", type=float, default=2e-3, help="largest relative error that passes (default 2e-3)")
    p.add_argument("--samples", type=int, default=20, help="timed samples per variant (default 20)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--input-sets", type=int, default=2, help="sets of fresh random inputs cycled while timing")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (inputs: seed, seed + 1, ...)")
    p.add_argument("--export-attn", choices=("eager", "sdpa"), default="eager",
                   help="attn_implementation of the model exported to ONNX (default eager)")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--export-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="export the model after model.to(this dtype), as users exporting for GPU inference do")
    p.add_argument("--ort-cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="onnxruntime's CUDA EP replays the forward as a CUDA graph (default on; shapes are static)")
    p.add_argument("--ort-mask", choices=("index", "none"), default="index",
                   help="onnxruntime's fused attention mask: index (per-row key lengths, the optimizer's default) or "
                        "none (no mask input, so ORT's flash kernels may run; same output on the unpadded inputs)")
    p.add_argument("--torch-compile-mode", default="reduce-overhead",
                   choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                   help="torch.compile mode of the torch-compile and torch-flex baselines (default reduce-overhead: "
                        "CUDA graphs, as ours uses; max-autotune also tunes Triton GEMMs but compiles for minutes)")
    p.add_argument("--work", default=os.path.join("out", "e2e-work"), help="exports, artifacts, row files")
    p.add_argument("--out", help="results.json goes here (default $OUT, else out/e2e)")
    p.add_argument("--row", nargs=2, metavar=("MODEL", "BxS"), help=argparse.SUPPRESS)
    p.add_argument("--row-json", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--compile-job", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    if args.compile_job:
        return compile_job(args.compile_job)
    args.target = args.target or ("cuda" if args.device == "cuda" else "llvm")
    args.dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    json.loads(args.ours_options)                                   # a bad --ours-options fails here, at once
    if args.row:
        return run_row(args)
    args.child_argv = argv
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
