"""The FFN-up GEMM + bias + GELU on the wgmma kernels (issue 17): CUDA's ``erff``/``tanhf`` epilogue against the
``fast_gelu`` one (:mod:`stof_tvm.schedules.templates.fast_gelu`) across tile shapes and consumer schedules, with
cuBLAS, torch eager and torch.compile in the same run.

RoBERTa-base / BERT-base FFN up-projection (n = 3072, k = 768) at 16 x 2048 tokens (m = 32768) and 8 x 512 (m = 4096),
erf GELU (BERT, RoBERTa) and tanh GELU (GPT-2), float16. Two steps, because the GPU machine has only TVM's runtime:

1. ``build`` (here, TVM compiler + nvcc): each case's knob sets (the untuned default before ``fast_gelu`` and the
   ``fast_gelu`` variants) exported as ``<out>/<key>.so`` with an sm_90a cubin per CUDA source (ptxas report in
   ``manifest.json``; a spill, stack frame or ptxas warning fails the build).
2. ``run`` (GPU machine): TVM's CUDA loader is answered with the prebuilt cubins. Per case: seeded inputs (activations
   N(0, 1), weights N(0, 1/k), bias N(0, 1)), the float32 torch reference (TF32 off), then every module with its
   output NaN-poisoned, checked (relative Frobenius error and max error over the reference's largest magnitude, both
   within ``--tolerance``) and timed with CUDA events (median of samples of back-to-back calls after warm-up,
   :func:`benchlib.time_ms`); cuBLAS ``F.linear`` alone, torch eager ``F.gelu(F.linear)`` and (``--compile``, when
   the budget allows: it is timed last) ``torch.compile`` of the same. Prints the table last, writes JSON (after every
   case, so a run cut short keeps what finished).

::

    .venv/bin/python scripts/bench_gelu_gemm.py build --out out/s7gelu
    python3 scripts/bench_gelu_gemm.py run --out out/s7gelu --json $OUT/gelu_gemm.json     # on the GPU machine
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)

ROOT = Path(__file__).resolve().parents[1]
DTYPE = "float16"
N, K = 3072, 768
HANG_S = 10.0
BASE = {"persistent": True, "pingpong": False, "staged": True}
# (template, m, [knob sets]): the first of each case is the untuned default before fast_gelu existed
ERF, TANH = "gemm_bias_gelu_erf_wgmma", "gemm_bias_gelu_tanh_wgmma"
OLD_ERF = dict(BASE, block_n=128, stages=4)
OLD_TANH = dict(BASE, block_n=192, stages=3, block_m=256)
FAST = {"fast_gelu": True}
CASES = [
    (ERF, 32768, [OLD_ERF, dict(OLD_ERF, **FAST), dict(BASE, block_n=192, stages=3, block_m=256, **FAST),
                  dict(BASE, block_n=128, stages=4, block_m=256, **FAST), dict(BASE, block_n=256, stages=3, **FAST),
                  dict(BASE, block_n=128, stages=4, pingpong=True, **FAST),
                  dict(BASE, block_n=128, stages=5, pingpong=True, **FAST),
                  dict(BASE, block_n=192, stages=4, pingpong=True, **FAST),
                  dict(BASE, block_n=256, stages=4, pingpong=True, **FAST),
                  dict(BASE, block_n=128, stages=4, pingpong=True)]),
    (ERF, 4096, [OLD_ERF, dict(OLD_ERF, **FAST), dict(BASE, block_n=192, stages=3, block_m=256, **FAST),
                 dict(BASE, block_n=192, stages=4, **FAST), dict(BASE, block_n=128, stages=4, pingpong=True, **FAST),
                 dict(BASE, block_n=128, stages=5, pingpong=True, **FAST)]),
    (TANH, 32768, [OLD_TANH, dict(OLD_TANH, **FAST), dict(OLD_ERF, **FAST),
                   dict(BASE, block_n=128, stages=4, pingpong=True, **FAST)]),
    (TANH, 4096, [OLD_TANH, dict(OLD_TANH, **FAST)]),
]


def knob_tag(knobs: dict) -> str:
    return (f"n{knobs['block_n']}_s{knobs['stages']}{'_p' if knobs['persistent'] else ''}"
            f"{'_pp' if knobs['pingpong'] else ''}{'_m256' if knobs.get('block_m', 128) != 128 else ''}"
            f"{'_st' if knobs.get('staged') else ''}{'_fast' if knobs.get('fast_gelu') else ''}")


def case_key(template: str, m: int) -> str:
    return f"{template.removeprefix('gemm_bias_').removesuffix('_wgmma')}_{m}x{N}x{K}"


# ---- build (here) --------------------------------------------------------------------------------------------

def build(args) -> None:
    from stof_tvm.schedules.templates import cuda_source, get_template
    from stof_tvm.schedules.templates.gemm_wgmma import build_kernel, nvcc_cubin

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"cases": [], "modules": {}, "built": bl.environment()}
    t0 = time.time()
    for template, m, knob_sets in CASES:
        shape = {"m": m, "n": N, "k": K}
        space = get_template(template).knob_space(shape, DTYPE)
        entry = {"key": case_key(template, m), "template": template, "shape": shape, "modules": [],
                 "default": knob_tag(space[0])}
        for knobs in knob_sets:
            key = f"{entry['key']}__{knob_tag(knobs)}"
            ex = build_kernel(template, shape, DTYPE, knobs)
            src = cuda_source(ex)
            ex.export_library(str(out / f"{key}.so"))
            cubin = out / f"{bl.source_key(src)}.cubin"
            report = nvcc_cubin(src, cubin)
            if report["spill_stores"] or report["spill_loads"] or report["stack_frame"] or report["warnings"]:
                raise RuntimeError(f"{key}: ptxas spilled, used a stack frame or warned: {report}")
            report["sass"] = sass_counts(cubin)
            manifest["modules"][key] = {"library": f"{key}.so", "knobs": knobs, "in_space": knobs in space,
                                        "ptxas": report}
            entry["modules"].append(key)
            print(f"{key}: {report['registers']} regs, no spills or warnings, SASS {report['sass']} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        manifest["cases"].append(entry)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in out.iterdir()) / 2 ** 20
    print(f"{len(manifest['modules'])} modules in {out} ({size:.1f} MiB, {time.time() - t0:.0f} s)")


def sass_counts(cubin: Path) -> dict | None:
    """Instruction counts of the cubin's SASS (all, HGMMA, MUFU.EX2, FFMA) where a cuobjdump is found (PATH, the
    CUDA toolkit or $STOF_CUOBJDUMP); None without one."""
    ops = bl.sass_opcodes(cubin)
    if ops is None:
        return None
    return {"instructions": len(ops), **{name: sum(op.startswith(name) for op in ops)
                                         for name in ("HGMMA", "MUFU.EX2", "FFMA")}}


# ---- run (GPU machine) -------------------------------------------------------------------------------------------

def run(args) -> None:
    import torch
    import torch.nn.functional as F
    import tvm

    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    budget = bl.Budget(args.budget)
    args.json = args.json or bl.out_dir() / "gelu_gemm.json"
    if not ensure_cuda_runtime():
        raise RuntimeError("TVM's CUDA runtime could not be loaded")
    out = args.out
    manifest = json.loads((out / "manifest.json").read_text())
    misses = bl.PrebuiltCubins(out).misses   # source keys compiled here instead of prebuilt
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    report = {"environment": bl.environment(), "tolerance": args.tolerance, "rows": rows, "misses": misses}
    dev = torch.device("cuda")
    compiled_row = None
    for case in manifest["cases"]:
        if not budget.allows(8):
            print(f"budget: skipping {case['key']}", flush=True)
            continue
        m, approximate = case["shape"]["m"], ("tanh" if "tanh" in case["template"] else "none")
        gen = torch.Generator(device=dev).manual_seed(17 + m)
        a = torch.randn(m, K, device=dev, generator=gen).half()
        w = (torch.randn(N, K, device=dev, generator=gen) / K ** 0.5).half()
        bias = torch.randn(N, device=dev, generator=gen).half()
        with torch.no_grad():
            ref = F.gelu(F.linear(a.float(), w.float(), bias.float()), approximate=approximate)
        flops = 2.0 * m * N * K
        timing = dict(warmup=2, samples=args.samples, sample_ms=5.0)
        cublas = bl.time_ms(lambda: F.linear(a, w, bias), **timing).median_ms
        eager = bl.time_ms(lambda: F.gelu(F.linear(a, w, bias), approximate=approximate), **timing).median_ms
        base = {"case": case["key"], "cublas_ms": cublas, "eager_ms": eager}
        rows.append(dict(base, variant="cuBLAS F.linear (no GELU)", ms=cublas, tflops=flops / cublas / 1e9))
        rows.append(dict(base, variant="torch eager gelu(linear)", ms=eager, tflops=flops / eager / 1e9))
        for key in case["modules"]:
            info = manifest["modules"][key]
            row = dict(base, variant=key.split("__")[1], knobs=info["knobs"],
                       default=key.split("__")[1] == case["default"])
            rows.append(row)
            print(f"{key}: launching", flush=True)   # a kernel that hangs is the last one named
            func = bl.guarded(row, "load", lambda: tvm.runtime.load_module(str(out / info["library"]))["gemm_wgmma"])
            if func is None:
                continue
            result = torch.empty(m, N, device=dev, dtype=torch.float16)
            bl.poison(result)
            tv = [tvm.runtime.from_dlpack(t) for t in (a, w, bias, result)]
            func(*tv)
            if not bl.finished(HANG_S):
                row["error"] = f"hang: not finished after {HANG_S:.0f} s"
                print(f"{key}: HANG; stopping the run", flush=True)
                bl.write_json(args.json, report)
                table(rows)
                os._exit(3)
            row.update(errors_on_device(torch, result, ref))
            row["ok"] = row["nonfinite"] == 0 and max(row["rel_err"], row["max_err"]) <= args.tolerance
            t = bl.time_ms(lambda: func(*tv), **timing).median_ms
            row.update(ms=t, tflops=flops / t / 1e9, vs_cublas=cublas / t, vs_eager=eager / t)
            print(f"{key}: {t:.4f} ms {row['tflops']:.0f} TFLOP/s rel err {row['rel_err']:.1e} "
                  f"{'ok' if row['ok'] else 'WRONG'}", flush=True)
        if args.compile and case["template"].endswith("erf_wgmma") and m == max(c["shape"]["m"] for c in
                                                                              manifest["cases"]):
            compiled_row = (dict(base, variant="torch.compile gelu(linear)"), a, w, bias, flops, timing)
        bl.write_json(args.json, report)
    if compiled_row is not None:
        row, a, w, bias, flops, timing = compiled_row
        if budget.allows(args.compile_estimate_s):
            fn = torch.compile(lambda x, y, z: F.gelu(F.linear(x, y, z)), dynamic=False)
            started = time.time()
            with torch.no_grad():
                fn(a, w, bias)
                torch.cuda.synchronize()
                row["compile_s"] = time.time() - started
                t = bl.time_ms(lambda: fn(a, w, bias), **timing).median_ms
            row.update(ms=t, tflops=flops / t / 1e9, vs_cublas=row["cublas_ms"] / t, vs_eager=row["eager_ms"] / t)
            rows.append(row)
        else:
            print(f"budget: torch.compile skipped ({budget.left():.0f} s left)", flush=True)
    report["wall_s"] = budget.used()
    bl.write_json(args.json, report)
    table(rows)
    print(f"cubins compiled on the GPU machine instead of prebuilt: {len(misses)}; wall {budget.used():.0f} s")


def errors_on_device(torch, out, ref) -> dict:
    """:func:`benchlib.errors`' figures computed on the GPU (100 M elements: a copy to the host per module would
    cost seconds): relative Frobenius error, max error over the reference's largest magnitude, non-finite count."""
    got = out.float()
    nonfinite = int((~torch.isfinite(got)).sum())
    diff = (got - ref).abs()
    return {"rel_err": float(diff.norm() / ref.norm()), "max_err": float(diff.max() / ref.abs().max()),
            "nonfinite": nonfinite}


def table(rows) -> None:
    for row in rows:
        row["mark"] = ("default" if row.get("default") else "") + ("" if row.get("ok", True) else " WRONG")
        if row.get("error") or row.get("load_failed"):
            row["mark"] += " " + (row.get("error") or row["load_failed"])[:60]
    bl.print_table(rows, [("case", "case", "s"), ("variant", "variant", "s"), ("ms", "ms", ".4f"),
                          ("tflops", "TFLOP/s", ".0f"), ("vs_cublas", "x cuBLAS", ".2f"),
                          ("vs_eager", "x eager", ".2f"), ("rel_err", "rel err", ".1e"), ("max_err", "max err", ".1e"),
                          ("mark", "", "s")],
                   title="FFN-up GEMM + bias + GELU, float16, n=3072 k=768 (x cuBLAS: F.linear alone / ours)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("build", help="compile and export the kernels here (TVM compiler and nvcc)")
    r = sub.add_parser("run", help="check and time on the GPU machine")
    r.add_argument("--json", type=Path, default=None, help="results file (default $OUT/gelu_gemm.json)")
    r.add_argument("--tolerance", type=float, default=2e-3, help="relative error bound vs torch float32")
    r.add_argument("--samples", type=int, default=15, help="timed samples per kernel (median reported)")
    r.add_argument("--budget", type=float, default=60.0, help="seconds: no case starts past this")
    r.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile baseline of the largest erf case, timed last, if the budget allows")
    r.add_argument("--compile-estimate-s", type=float, default=25.0, help="budget the torch.compile step needs")
    for p in sub.choices.values():
        p.add_argument("--out", type=Path, default=ROOT / "out" / "s7gelu", help="artifact folder")
    args = parser.parse_args(argv)
    if not args.out.is_absolute():
        args.out = ROOT / args.out
    build(args) if args.step == "build" else run(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
