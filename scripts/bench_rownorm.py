"""Bias + residual + LayerNorm and residual + RMSNorm between the GEMMs (issue 17) on the H200, prebuilt here.

The row-normalisation templates at the shapes of RoBERTa-base / T5-base (hidden 768) at 16x2048 and 8x512 tokens
(m = 32768 and 4096 rows, fp16): the shared-memory row (``registers`` 0: what the compiler ran before the register
knob, its old default knob set first) against the register row (``registers`` 1, the new default first), each at a
few knob sets; torch eager (``F.layer_norm(x + residual + bias)``; T5's RMSNorm as HF writes it) and
``torch.compile`` of the same function as baselines.

Two steps, because the GPU machine has TVM's runtime only:

1. ``build`` (here): schedule and compile each kernel for CUDA, export its library under ``--out`` and compile its
   CUDA source with nvcc for sm_90a into a cubin stored under the source's hash (``manifest.json`` lists them);
2. ``run`` (GPU machine): TVM's CUDA compile callback is answered with those cubins. For each case: fresh random
   inputs (a pool of input sets, together larger than the L2 cache, cycled call by call so that every call reads
   HBM as it does between GEMMs), NaN-poisoned outputs, each kernel checked against a float32 torch reference
   (relative Frobenius error; both outputs of residual_rmsnorm), then timed with CUDA events after warm-up behind
   a GPU sleep (the host enqueues every call before the first starts, so launch overhead is not timed). Bytes moved
   per call: the activations read and written once (vectors ignored). Prints a table last (us, GB/s, fraction of
   4.2 TB/s, speed-up over the old default), writes JSON to ``$OUT`` (or ``--json``).

    python scripts/bench_rownorm.py build --out out/s7ln
    python3 scripts/bench_rownorm.py run --out out/s7ln       # on the GPU machine, <= ~50 s

``--plan s11norm`` (issue 17; folder ``out/s11norm``): bias + residual + LayerNorm at RoBERTa-base's 16x2048, 8x512
and 1x128 tokens (32768, 4096, 128 rows of 768) and BERT-large's 8x2048 (16384 rows of 1024), plain LayerNorm and
``residual_layernorm`` (pre-LN GPT-2, ViT: the 16-bit sum written too; beside it the torch add alone, what the
compile path ran before it with ``layernorm``) at 32768 and 4096 rows of 768: the compile path's kernel (the
model-ranked knob set: "old default" in the table) and the other register-row tilings, beside torch eager
(``F.layer_norm`` of the sum) and the memory floor (no torch.compile: ``--no-compile``). Session 11 ran it at
59f749b with a thread-level warp kernel beside (each warp taking several rows, the next row's loads in flight;
BENCHMARKS.md): no faster, removed::

    python scripts/bench_rownorm.py build --plan s11norm
    python3 scripts/bench_rownorm.py run --plan s11norm --no-compile   # GPU machine, ~20 s
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)

HIDDEN = 768
ROWS = {"16x2048": 16 * 2048, "8x512": 8 * 512}
TEMPLATES = ("bias_residual_layernorm", "residual_rmsnorm")
OLD_DEFAULT = {"rows": 8, "lanes": 32, "vec": 8, "registers": 0}
# per (template, m): the old default first, then other shared-memory rows, then the register rows (new default first)
VARIANTS = [OLD_DEFAULT, {"rows": 2, "lanes": 32, "vec": 8, "registers": 0},
            {"rows": 1, "lanes": 32, "vec": 8, "registers": 0},
            {"rows": 8, "lanes": 32, "vec": 8, "registers": 1}, {"rows": 4, "lanes": 32, "vec": 8, "registers": 1},
            {"rows": 2, "lanes": 32, "vec": 8, "registers": 1}, {"rows": 1, "lanes": 32, "vec": 8, "registers": 1},
            {"rows": 4, "lanes": 64, "vec": 4, "registers": 1}]
LN_EPS, RMS_EPS = 1e-5, 1e-6
TOLERANCE = 5e-3
L2_BYTES = 60e6          # pool of input sets per case: together at least 2.5x this
# --plan s11norm: (template, size label, m, n) of bias + residual + LayerNorm, plain LayerNorm and (pre-LN GPT-2,
# ViT: the GEMM's output + the residual, the sum also written) residual + LayerNorm; per case the compile path's
# knob set (the model's first), then the other register rows of S11_TE
S11_CASES = [("bias_residual_layernorm", size, m, n) for size, m, n in (
    ("16x2048", 32768, 768), ("8x512", 4096, 768), ("1x128", 128, 768), ("large 8x2048", 16384, 1024))]
S11_CASES += [(name, size, m, 768) for name in ("layernorm", "residual_layernorm")   # pre-LN
              for size, m in (("16x2048", 32768), ("8x512", 4096))]
S11_TE = [{"rows": r, "lanes": 32, "vec": 8, "registers": 1} for r in (8, 4, 2, 1)]
PLANS = {"s7": "out/s7ln", "s11norm": "out/s11norm"}


def activation_bytes(template: str, m: int, n: int) -> int:
    """HBM bytes one call must move: [m, n] fp16 activations read (x, residual) and written (out; residual_rmsnorm
    also the sum)."""
    tensors = {"residual_rmsnorm": 4, "residual_layernorm": 4, "layernorm": 2}.get(template, 3)
    return tensors * m * n * 2


def _label(knobs: dict) -> str:
    form = "reg" if knobs["registers"] else "smem"
    return f"{form} r{knobs['rows']} l{knobs['lanes']} v{knobs['vec']}"


def _cases(plan: str) -> list[tuple[str, str, dict, list[dict], dict]]:
    """(template, size label, shape, knob sets, the old default) per case of ``plan``: ``s7`` the templates of
    :data:`TEMPLATES` at :data:`ROWS` with :data:`VARIANTS`; ``s11norm`` :data:`S11_CASES`, the compile path's
    current knob set (the model's first, as the compiler picks it) first."""
    if plan == "s7":
        return [(name, size, {"m": m, "n": HIDDEN}, VARIANTS, OLD_DEFAULT) for name in TEMPLATES
                for size, m in ROWS.items()]
    from stof_tvm.compiler.template_choice import TemplateChooser
    from stof_tvm.schedules.templates import get_template
    from stof_tvm.schedules.templates.build import cuda_target

    chooser = TemplateChooser(cuda_target(), None)
    cases = []
    for name, size, m, n in S11_CASES:
        template, shape = get_template(name), {"m": m, "n": n}
        current = chooser.knobs(template, shape, "float16").knobs
        cases.append((name, size, shape, [current] + [k for k in S11_TE if k != current and m % k["rows"] == 0],
                      current))
    return cases


# ------------------------------------------------------------------------------------------------- build (here)
def build(args) -> None:
    from stof_tvm.schedules.templates import get_template
    from stof_tvm.schedules.templates.build import build as build_template
    from stof_tvm.schedules.templates.build import cuda_source, cuda_target

    out = Path(args.out or PLANS[args.plan])
    out.mkdir(parents=True, exist_ok=True)
    target = cuda_target()
    modules, sources, t0 = [], {}, time.time()
    for name, size, shape, variants, old in _cases(args.plan):
        template = get_template(name)
        default = template.default_knobs(shape)
        for knobs in variants:
            if knobs not in template.knob_space(shape):
                raise ValueError(f"{name} {shape}: {knobs} is not in the knob space")
            key = f"{name}_{size.replace(' ', '_')}_{_label(knobs).replace(' ', '_')}"
            executable = build_template(template.schedule(shape, "float16", knobs), target)
            src = cuda_source(executable)
            executable.export_library(str(out / f"{key}.so"))
            sources[bl.source_key(src)] = src
            modules.append({"key": key, "template": name, "size": size, "shape": shape, "knobs": knobs,
                            "label": _label(knobs), "library": f"{key}.so", "source": bl.source_key(src),
                            "old_default": knobs == old, "new_default": knobs == default and args.plan == "s7",
                            "arguments": [[a, list(s), d] for a, s, d in template.arguments(shape)],
                            "outputs": template.outputs()})
        print(f"built {name} {size} ({time.time() - t0:.0f} s)", flush=True)

    def compile_one(item):
        key, src = item
        return key, bl.nvcc_cubin(src, out / f"{key}.cubin", "sm_90a", gencode=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        reports = dict(pool.map(compile_one, sources.items()))
    for info in modules:
        info["ptxas"] = reports[info["source"]]
    manifest = {"built": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "environment": bl.environment(),
                "modules": modules}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    spills = [m["key"] for m in modules if m["ptxas"]["spill_stores"] or m["ptxas"]["stack_frame"]]
    print(f"{len(modules)} modules, {len(sources)} cubins, {size:.1f} MB in {out} ({time.time() - t0:.0f} s); "
          f"spills or stack: {spills or 'none'}")


# ------------------------------------------------------------------------------------------------- run (GPU)
def torch_chain(template: str):
    """The torch form of a template, on named fp16 tensors (returns the outputs as a tuple)."""
    import torch
    import torch.nn.functional as F

    if template == "bias_residual_layernorm":
        def chain(t):
            return (F.layer_norm(t["x"] + t["residual"] + t["bias"], (t["x"].shape[-1],), t["gamma"], t["beta"],
                                 eps=LN_EPS),)
        return chain
    if template == "layernorm":
        def chain(t):
            return (F.layer_norm(t["x"], (t["x"].shape[-1],), t["gamma"], t["beta"], eps=LN_EPS),)
        return chain
    if template == "residual_layernorm":     # pre-LN GPT-2 / ViT: the fp16 sum (the next residual) and its LN
        def chain(t):
            total = t["x"] + t["residual"]
            return total, F.layer_norm(total, (total.shape[-1],), t["gamma"], t["beta"], eps=LN_EPS)
        return chain

    def chain(t):         # Hugging Face T5: the sum in fp16, the mean square in float32, weight * normalised
        total = t["x"] + t["residual"]
        var = total.float().pow(2).mean(-1, keepdim=True)
        return total, t["weight"] * (total.float() * torch.rsqrt(var + RMS_EPS)).to(total.dtype)
    return chain


def reference(template: str, t: dict):
    """Float32 outputs from the fp16 inputs (the sum of residual_rmsnorm rounded to fp16, as the template does)."""
    import torch
    import torch.nn.functional as F

    f = {k: v.float() for k, v in t.items()}
    if template == "bias_residual_layernorm":
        return (F.layer_norm(f["x"] + f["residual"] + f["bias"], (f["x"].shape[-1],), f["gamma"], f["beta"],
                             eps=LN_EPS),)
    if template == "layernorm":
        return (F.layer_norm(f["x"], (f["x"].shape[-1],), f["gamma"], f["beta"], eps=LN_EPS),)
    if template == "residual_layernorm":
        total = (f["x"] + f["residual"]).half().float()
        return total, F.layer_norm(total, (total.shape[-1],), f["gamma"], f["beta"], eps=LN_EPS)
    total = (f["x"] + f["residual"]).half().float()
    return total, total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + RMS_EPS) * f["weight"]


def make_inputs(torch, template, arguments, outputs, sets):
    """``sets`` input sets (random activations, weights near 1, biases near 0) and NaN outputs per set."""
    pool = []
    for _ in range(sets):
        t = {}
        for name, shape, _ in arguments[:-outputs]:
            if name in ("x", "residual"):
                t[name] = torch.randn(shape, device="cuda", dtype=torch.float16)
            elif name in ("gamma", "weight"):
                t[name] = (1.0 + 0.1 * torch.randn(shape, device="cuda")).half()
            else:
                t[name] = (0.1 * torch.randn(shape, device="cuda")).half()
        for name, shape, _ in arguments[-outputs:]:
            t[name] = torch.full(shape, float("nan"), device="cuda", dtype=torch.float16)
        pool.append(t)
    return pool


def _errors(torch, out, ref) -> dict:
    """:func:`benchlib.errors`' figures computed on the GPU (a host copy of a 32768 x 768 output costs seconds)."""
    out = out.float()
    nonfinite = int((~torch.isfinite(out)).sum())
    if nonfinite:
        return {"max_abs": float("inf"), "max_rel": float("inf"), "rel": float("inf"), "nonfinite": nonfinite}
    diff = (out - ref).abs()
    max_abs = float(diff.max())
    return {"max_abs": max_abs, "max_rel": max_abs / float(ref.abs().max()),
            "rel": float(diff.norm() / ref.norm()), "nonfinite": 0}


def gpu_time_us(torch, calls, repeats: int = 5, per_sample: int = 60) -> float:
    """Median microseconds per call of ``calls`` (a list of no-argument callables, cycled): each sample enqueues
    ``per_sample`` calls behind a GPU sleep, between two CUDA events."""
    for call in calls[:3]:
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(8_000_000)           # ~4 ms: the host enqueues the sample before it starts
        start.record()
        for i in range(per_sample):
            calls[i % len(calls)]()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / per_sample)
    return sorted(times)[len(times) // 2]


def _compile_worker(shapes: str) -> None:
    """Child process (``run --compile-worker``): compile the torch chains so the parent's compile hits the cache."""
    import torch

    for template, m, n in json.loads(shapes):
        t = {name: torch.randn(m, n, device="cuda").half() for name in ("x", "residual")}
        for name in (("weight",) if template == "residual_rmsnorm" else ("bias", "gamma", "beta")):
            t[name] = torch.randn(n, device="cuda").half()
        torch.compile(torch_chain(template), dynamic=False)(t)
    torch.cuda.synchronize()


def run(args) -> None:
    started = time.time()
    import torch
    import tvm

    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    out = Path(args.out or PLANS[args.plan])
    manifest = json.loads((out / "manifest.json").read_text())
    cases = list(dict.fromkeys((m["template"], m["size"]) for m in manifest["modules"]))
    shapes = {(m["template"], m["size"]): m["shape"] for m in manifest["modules"]}
    worker = None
    if not args.no_compile:   # Inductor compiles on the CPU while the TVM kernels are checked and timed
        shapes_arg = json.dumps([[template, shapes[(template, size)]["m"], shapes[(template, size)]["n"]]
                                 for template, size in cases])
        log = open(bl.out_dir() / "compile_worker.log", "w")  # noqa: SIM115 (the worker writes it while we run)
        worker = subprocess.Popen([sys.executable, __file__, "run", "--out", str(out), "--compile-worker", shapes_arg],
                                  stdout=log, stderr=subprocess.STDOUT, text=True)
    if not ensure_cuda_runtime():
        raise RuntimeError("TVM's CUDA runtime could not be loaded")
    cubins = bl.PrebuiltCubins(out)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict] = []
    payload = {"environment": bl.environment(), "built": manifest["built"], "rows": rows}
    json_path = Path(args.json) if args.json else bl.out_dir() / "rownorm.json"
    pools = {}
    for template, size in cases:
        mods = [m for m in manifest["modules"] if m["template"] == template and m["size"] == size]
        m, n = shapes[(template, size)]["m"], shapes[(template, size)]["n"]
        nbytes = activation_bytes(template, m, n)
        sets = max(2, int(2.5 * L2_BYTES / nbytes + 0.999))
        pool = make_inputs(torch, template, mods[0]["arguments"], mods[0]["outputs"], sets)
        pools[(template, size)] = pool
        names = [a for a, _, _ in mods[0]["arguments"]]
        inputs = names[:-mods[0]["outputs"]]
        refs = reference(template, {k: pool[0][k] for k in inputs})
        chain = torch_chain(template)
        with torch.no_grad():
            eager_us = gpu_time_us(torch, [lambda t=t: chain({k: t[k] for k in inputs}) for t in pool])
            warm_us = bl.time_ms(lambda: chain({k: pool[0][k] for k in inputs}), warmup=3, samples=10).median_ms * 1e3
        base = {"template": template, "size": size, "m": m, "n": n, "bytes": nbytes,
                "floor_us": nbytes / (bl.PEAK_TBPS * 1e12) * 1e6}
        rows.append(dict(base, kernel="torch eager", us=eager_us, us_warm=warm_us))
        if template == "residual_layernorm":   # the add the fused kernel replaces (before it: add + layernorm)
            with torch.no_grad():
                add_us = gpu_time_us(torch, [lambda t=t: t["x"] + t["residual"] for t in pool])
            rows.append(dict(base, kernel="add alone (torch)", us=add_us, bytes=3 * m * n * 2,
                             floor_us=3 * m * n * 2 / (bl.PEAK_TBPS * 1e12) * 1e6))
        for info in mods:
            row = dict(base, kernel=info["label"], knobs=info["knobs"], old_default=info["old_default"],
                       new_default=info["new_default"], registers_ptxas=info["ptxas"]["registers"])
            fn = tvm.runtime.load_module(str(out / info["library"]))["main"]
            targs = [[tvm.runtime.from_dlpack(t[a]) for a in names] for t in pool]
            for a in names[-info["outputs"]:]:          # poisoned again: an earlier kernel filled them
                pool[0][a].fill_(float("nan"))
            fn(*targs[0])
            torch.cuda.synchronize()
            got = [pool[0][a] for a in names[-info["outputs"]:]]
            errs = [_errors(torch, g, r) for g, r in zip(got, refs)]
            row["rel_err"] = max(e["rel"] for e in errs)
            row["correct"] = all(bl.within(e, TOLERANCE) for e in errs)
            if row["correct"]:
                row["us"] = gpu_time_us(torch, [lambda a=a: fn(*a) for a in targs])
                # the same inputs back to back (bl.time_ms): what an L2-resident input (the GEMM's output) sees
                row["us_warm"] = bl.time_ms(lambda: fn(*targs[0]), warmup=3, samples=10).median_ms * 1e3
            else:
                print(f"  FAIL {info['key']}: errors {errs}", flush=True)
            rows.append(row)
            bl.write_json(json_path, payload)
        print(f"{template} {size}: " + ", ".join(f"{r['kernel']} {r.get('us', float('nan')):.1f}"
                                                  for r in rows if r["template"] == template and r["size"] == size),
              flush=True)
    if worker is not None:
        _torch_compile_rows(torch, worker, cases, shapes, pools, rows, started, args.budget)
    payload["cubins"] = {"hits": cubins.hits, "misses": len(cubins.misses)}
    _summarise(rows)
    bl.write_json(json_path, payload)
    _print(rows)
    print(f"cubins: {cubins.hits} prebuilt, {len(cubins.misses)} compiled here; {time.time() - started:.0f} s; "
          f"JSON {json_path}")


def _torch_compile_rows(torch, worker, cases, shapes, pools, rows, started, budget) -> None:
    """torch.compile of each chain (cache warmed by the worker) where the budget still allows it."""
    try:
        worker.wait(timeout=max(1.0, budget - 15 - (time.time() - started)))
    except subprocess.TimeoutExpired:
        worker.kill()
        print("torch.compile: the warm-up did not finish within the budget; no compile rows", flush=True)
        return
    if worker.returncode:
        log = (bl.out_dir() / "compile_worker.log").read_text()
        print(f"torch.compile warm-up failed (exit {worker.returncode}): {log[-600:]}", flush=True)
        return
    for template, size in cases:
        if time.time() - started > budget - 8:
            print(f"budget reached: no torch.compile row for {template} {size}", flush=True)
            continue
        pool = pools[(template, size)]
        inputs = [k for k in pool[0] if k not in ("out", "sum")]
        compiled = torch.compile(torch_chain(template), dynamic=False)
        with torch.no_grad():
            us = gpu_time_us(torch, [lambda t=t: compiled({k: t[k] for k in inputs}) for t in pool])
            warm = bl.time_ms(lambda: compiled({k: pool[0][k] for k in inputs}), warmup=3, samples=10).median_ms
        m, n = shapes[(template, size)]["m"], shapes[(template, size)]["n"]
        rows.append({"template": template, "size": size, "m": m, "n": n, "kernel": "torch.compile",
                     "bytes": activation_bytes(template, m, n), "us": us, "us_warm": warm * 1e3})


def _summarise(rows) -> None:
    """Bandwidth, fraction of the H200's 4.2 TB/s, and speed-up over the old default and the torch baselines."""
    for row in rows:
        if row.get("us"):
            lim = bl.limit(row["us"] * 1e-3, bytes_moved=row["bytes"])
            row["gbps"], row["fraction"] = lim["tbps"] * 1e3, lim["fraction"]
            # above the chip's bandwidth: the events did not bracket the kernels (another stream?)
            row["suspect"] = lim["fraction"] > 1.1
    for template, size in {(r["template"], r["size"]) for r in rows}:
        group = [r for r in rows if r["template"] == template and r["size"] == size]
        old = next((r["us"] for r in group if r.get("old_default") and r.get("us")), None)
        best_torch = min((r["us"] for r in group if r["kernel"].startswith("torch") and r.get("us")), default=None)
        for row in group:
            if row.get("us") and old:
                row["vs_old"] = old / row["us"]
            if row.get("us") and best_torch:
                row["vs_torch"] = best_torch / row["us"]


def _print(rows) -> None:
    def tag(r):
        return ("old default" if r.get("old_default") else "") + ("new default" if r.get("new_default") else "")

    table = [dict(r, tag=tag(r), err="-" if "rel_err" not in r else f"{r['rel_err']:.1e}") for r in rows]
    bl.print_table(table, [("template", "template", ""), ("size", "BxS", ""), ("n", "n", "d"),
                           ("kernel", "kernel", ""), ("tag", "", ""), ("us", "us", ".1f"),
                           ("floor_us", "floor us", ".1f"), ("gbps", "GB/s", ".0f"),
                           ("fraction", "of 4.2 TB/s", ".2f"), ("us_warm", "us warm", ".1f"),
                           ("vs_old", "vs old", ".2f"), ("vs_torch", "vs best torch", ".2f"), ("err", "rel err", "")],
                   title="Row normalisations between GEMMs, fp16 (H200; us per call on HBM-cold inputs, "
                         "GB/s and fraction from those; us warm: the same inputs back to back)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the kernels and their sm_90a cubins here")
    b.add_argument("--plan", choices=sorted(PLANS), default="s7")
    b.add_argument("--out", default=None, help="default: the plan's folder (PLANS)")
    b.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes")
    r = sub.add_parser("run", help="check and time on the GPU machine (TVM runtime only)")
    r.add_argument("--plan", choices=sorted(PLANS), default="s7")
    r.add_argument("--out", default=None, help="default: the plan's folder (PLANS)")
    r.add_argument("--json", default=None, help="default: $OUT/rownorm.json")
    r.add_argument("--budget", type=float, default=50.0, help="seconds; torch.compile rows only within it")
    r.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    r.add_argument("--compile-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args)
    elif args.compile_worker:
        _compile_worker(args.compile_worker)
    else:
        run(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
