"""The wgmma GEMMs at BERT-Base's small-K shapes on an H200: the older knob sets against the ``block_m = 256`` and
``staged`` ones (:mod:`stof_tvm.schedules.templates.wgmma_kernel`), side by side with cuBLAS.

At K = 768 a tile's main loop is 12 steps of 64, so the per-tile costs weigh: the epilogue's 2-byte stores (one
``STG.E.U16`` per output element) and the ring refill after it. The new knob values attack both: 16-byte stores
through a per-warp shared-memory buffer (``staged``) and 256-row tiles (half the tiles, 22% fewer L2 bytes per flop
at 256 x 192 than at 128 x 256).

Two steps, because the GPU machine has no TVM compiler (same protocol as ``check_wgmma_gpu.py``):

1. ``build`` (here): per case the older knob sets (the template's first choice, the best-ranked persistent
   cooperative set and ping-pong set of each tile width) and the new ones (each older one with ``staged``, the
   best-ranked 256-row sets of width 128 and 192, direct and staged) are compiled with TVM, exported to
   ``<out>/<key>.so`` with an sm_90a cubin per source (nvcc; ptxas registers, spills and warnings in
   ``manifest.json``).
2. ``run`` (on the GPU): per case fresh random inputs, every module's output poisoned with NaN and checked against
   torch float32 (TF32 off; relative Frobenius error within 1e-2), then timed with CUDA events (median of
   ``--iters`` samples of ``--reps`` back-to-back calls, after warm-up) with the torch baselines in the same
   process: ``F.linear`` alone (cuBLAS, bias fused where the template has one) and torch eager's whole form (plus
   ``F.gelu``; for the QKV projection the permute into [3, B, H, S, D]). Prints a table (ms, TFLOP/s, x cuBLAS,
   error) and the best older vs best new set per case, writes ``--json``.

Cases (float16): attention output ``gemm`` 32768x768x768 and FFN down ``gemm`` 32768x768x3072 (the compile path's
GEMMs before the bias + residual LayerNorm), FFN up ``gemm_bias_gelu_erf`` 32768x3072x768, and the QKV projection
at batch 16, sequence 2048 (32768x2304x768)::

    .venv/bin/python scripts/bench_wgmma_small_k.py build
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/bench_wgmma_small_k.py run --json $OUT/small_k.json",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/wgmma_small_k"], timeout_s=420)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)
import check_wgmma_gpu as common  # noqa: E402  (the export, cubin, timing and hang helpers of the wgmma checks)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "wgmma_small_k"
DTYPE = "float16"
# (template, template shape): the compile path's forms of BERT-Base's layer GEMMs at 32768 tokens
CASES = [
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 768}),                                  # attention output
    ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768}),                   # FFN up + GELU
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 3072}),                                 # FFN down
    ("qkv_projection_wgmma", {"batch": 16, "seq": 2048, "heads": 12, "head_dim": 64}),  # QKV into [3, B, H, S, D]
]
TALL_PER_WIDTH = 2   # best-ranked 256-row knob sets per tile width


def is_new(knobs) -> bool:
    """Whether a knob set uses a value added by this work (256-row tiles or the staged epilogue)."""
    return knobs.get("block_m", 128) != 128 or bool(knobs.get("staged"))


def knob_tag(knobs) -> str:
    return (f"n{knobs['block_n']}_s{knobs['stages']}{'_p' if knobs['persistent'] else ''}"
            f"{'_pp' if knobs['pingpong'] else ''}{'_m256' if knobs.get('block_m', 128) != 128 else ''}"
            f"{'_st' if knobs.get('staged') else ''}")


def choose_knobs(space) -> list[dict]:
    """The older knob sets worth timing, then the new ones (module docstring), each once, in the space's order."""
    old = [kn for kn in space if not is_new(kn)]
    widths = sorted({kn["block_n"] for kn in old}, reverse=True)
    chosen = [old[0]]
    for pingpong in (False, True):
        chosen += [next(kn for kn in old if kn["persistent"] and kn["pingpong"] == pingpong and kn["block_n"] == bn)
                   for bn in widths if any(kn["pingpong"] == pingpong and kn["block_n"] == bn for kn in old)]
    chosen += [dict(kn, staged=True) for kn in chosen]
    tall = [kn for kn in space if kn.get("block_m", 128) != 128 and kn["persistent"] and not kn.get("staged")]
    for bn in sorted({kn["block_n"] for kn in tall}, reverse=True):
        best = [kn for kn in tall if kn["block_n"] == bn][:TALL_PER_WIDTH]
        chosen += best + [dict(kn, staged=True) for kn in best]
    unique = []
    for kn in chosen:
        if kn in space and kn not in unique:   # staged twins past the shared-memory limit are not in the space
            unique.append(kn)
    return unique


def gemm_dims(name, shape) -> tuple[int, int, int]:
    if name == "qkv_projection_wgmma":
        hidden = shape["heads"] * shape["head_dim"]
        return shape["batch"] * shape["seq"], 3 * hidden, hidden
    return shape["m"], shape["n"], shape["k"]


# ---- build (here) ----------------------------------------------------------------------------------------

def build(args) -> None:
    from stof_tvm.schedules.templates import get_template
    from stof_tvm.schedules.templates.gemm_wgmma import build_kernel

    OUT.mkdir(parents=True, exist_ok=True)
    common.OUT = OUT
    manifest = {"suite": "small_k", "cases": [], "modules": {}}
    t0 = time.time()
    for name, shape in CASES:
        m, n, k = gemm_dims(name, shape)
        ckey = f"{name}_{m}x{n}x{k}_{DTYPE}"
        entry = {"key": ckey, "template": name, "shape": shape, "gemm": [m, n, k], "modules": []}
        for knobs in choose_knobs(get_template(name).knob_space(shape, DTYPE)):
            key = f"{ckey}__{knob_tag(knobs)}"
            common._export(manifest, key, "wgmma", knobs, build_kernel(name, shape, DTYPE, knobs), "gemm_wgmma")
            manifest["modules"][key]["new"] = is_new(knobs)
            entry["modules"].append(key)
        manifest["cases"].append(entry)
    bad = {key: info for key, info in manifest["modules"].items()
           if info["spill_stores"] or info["spill_loads"] or info["stack_frame"] or info["warnings"]}
    if bad:
        raise RuntimeError(f"ptxas spilled or warned for {sorted(bad)}")
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(manifest['modules'])} modules in {OUT} ({time.time() - t0:.0f} s); no spills, no ptxas warnings")


# ---- run (on the GPU) --------------------------------------------------------------------------------------

def torch_forms(torch, name, shape, a, w, bias):
    """(cuBLAS GEMM alone, torch eager's whole form) as callables on the case's inputs."""
    F = torch.nn.functional
    b = bias if name != "gemm_wgmma" else None
    gemm = lambda: F.linear(a, w, b)  # noqa: E731
    if name == "gemm_bias_gelu_erf_wgmma":
        return gemm, lambda: F.gelu(F.linear(a, w, b))
    if name == "qkv_projection_wgmma":
        B, S, H, D = (shape[key] for key in ("batch", "seq", "heads", "head_dim"))
        return gemm, lambda: F.linear(a, w, b).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4).contiguous()
    return gemm, gemm


def run(args) -> None:
    import torch
    import tvm
    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    if not ensure_cuda_runtime():
        raise RuntimeError("TVM's CUDA runtime could not be loaded")
    common.OUT = OUT
    misses = bl.PrebuiltCubins(OUT).misses   # source keys compiled here instead of prebuilt
    manifest = json.loads((OUT / "manifest.json").read_text())
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    results = []
    report = lambda: {"results": results, "cubin_misses": misses, "iters": args.iters, "reps": args.reps}  # noqa: E731
    for case in manifest["cases"]:
        results.append(run_case(case, manifest["modules"], torch, tvm, args, lambda: save(args, report())))
        save(args, report())
    table(results)
    print(f"cubins compiled on the GPU machine instead of prebuilt: {len(misses)}")


def save(args, report) -> None:
    text = json.dumps(report, indent=1)
    (OUT / "results.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)


def run_case(case, modules, torch, tvm, args, checkpoint) -> dict:
    import os

    dev = torch.device("cuda")
    m, n, k = case["gemm"]
    gen = torch.Generator(device=dev).manual_seed(int(common.source_key(case["key"]), 16) % 2 ** 31)
    a = torch.randn(m, k, device=dev, generator=gen).half()
    w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).half()
    bias = torch.randn(n, device=dev, generator=gen).half()
    name, shape = case["template"], case["shape"]
    gemm, eager = torch_forms(torch, name, shape, a, w, bias)
    ref = torch_forms(torch, name, shape, a.float(), w.float(), bias.float())[1]()
    flops = 2 * m * n * k
    row = {"case": case["key"], "template": name, "shape": shape, "flops": flops, "kernels": {},
           "cublas_ms": common.median_ms(gemm, args.iters, args.reps),
           "eager_ms": common.median_ms(eager, args.iters, args.reps)}
    args_in = [a, w] + ([bias] if name != "gemm_wgmma" else [])
    for key in case["modules"]:
        info = modules[key]
        entry = {"knobs": info["knobs"], "new": info["new"]}
        print(f"{key}: launching", flush=True)  # a kernel that hangs is the last one named
        try:
            func = tvm.runtime.load_module(str(OUT / info["library"]))[info["function"]]
        except Exception as err:  # a failed load is a result to report, not a reason to stop the run
            row["kernels"][key] = dict(entry, error=f"load: {err}"[:300])
            continue
        out = torch.full(tuple(ref.shape), float("nan"), device=dev, dtype=torch.float16)
        tv = [tvm.runtime.from_dlpack(t) for t in args_in + [out]]
        func(*tv)
        if not common.bl.finished(common.HANG_S):
            row["kernels"][key] = dict(entry, error=f"hang: not finished after {common.HANG_S:.0f} s")
            print(f"{key}: HANG; stopping the run", flush=True)
            checkpoint()
            os._exit(3)
        err = float(torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref))
        entry.update(rel_err=err, finite=bool(torch.isfinite(out).all()))
        entry["correct"] = entry["finite"] and err < common.TOL[DTYPE]
        if entry["correct"]:
            entry["ms"] = common.median_ms(lambda: func(*tv), args.iters, args.reps)
            entry["tflops"] = flops / entry["ms"] / 1e9
            entry["vs_cublas"] = row["cublas_ms"] / entry["ms"]
        else:
            entry["diagnosis"] = common._diagnose(torch, out.float().reshape(-1, ref.shape[-1]),
                                                  ref.reshape(-1, ref.shape[-1]))
        row["kernels"][key] = entry
        print(f"{key}: err {err:.2e} {'ok' if entry['correct'] else 'WRONG'}"
              + (f", {entry['ms']:.4f} ms" if entry["correct"] else ""), flush=True)
    for new in (False, True):
        timed = [(e["ms"], key) for key, e in row["kernels"].items() if e["new"] == new and "ms" in e]
        row["best_new" if new else "best_old"] = min(timed) if timed else None
    return row


def table(results) -> None:
    for row in results:
        print(f"\n{row['case']}: cuBLAS F.linear {row['cublas_ms']:.4f} ms "
              f"({row['flops'] / row['cublas_ms'] / 1e9:.0f} TFLOP/s), torch eager {row['eager_ms']:.4f} ms")
        print(f"  {'knobs':22s} {'new':>3s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuBLAS':>8s} {'x eager':>8s} "
              f"{'rel err':>8s}")
        for key, e in row["kernels"].items():
            head = f"  {key.split('__')[1]:22s} {'yes' if e['new'] else '':>3s}"
            if "ms" in e:
                print(f"{head} {e['ms']:8.4f} {e['tflops']:8.0f} {e['vs_cublas']:8.2f} "
                      f"{row['eager_ms'] / e['ms']:8.2f} {e['rel_err']:8.1e}")
            else:
                print(f"{head} {e.get('error') or 'WRONG err %.1e' % e['rel_err']}")
    print(f"\n{'case':46s} {'cuBLAS ms':>9s} {'eager ms':>9s} {'best old':>9s} {'best new':>9s} {'new/old':>7s}  "
          "best old knobs / best new knobs")
    for row in results:
        old, new = row["best_old"], row["best_new"]
        print(f"{row['case']:46s} {row['cublas_ms']:9.4f} {row['eager_ms']:9.4f} "
              f"{old[0] if old else float('nan'):9.4f} {new[0] if new else float('nan'):9.4f} "
              f"{(old[0] / new[0]) if old and new else float('nan'):7.3f}  "
              f"{old[1].split('__')[1] if old else '-'} / {new[1].split('__')[1] if new else '-'}")
    print("(x cuBLAS = F.linear time / kernel time; x eager = torch eager's whole form / kernel time; new/old > 1: the "
          "best new knob set is faster than the best older one)")


def main(argv=None) -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("build", help="compile and export the kernels here (TVM compiler and nvcc)")
    r = sub.add_parser("run", help="check and time on the GPU")
    r.add_argument("--iters", type=int, default=30, help="timed samples per kernel (median reported)")
    r.add_argument("--reps", type=int, default=10, help="back-to-back calls per timed sample")
    r.add_argument("--json", default=None, help="also write the results here (e.g. $OUT/small_k.json)")
    for p in sub.choices.values():
        p.add_argument("--out", type=Path, default=OUT, help="artifact folder (default out/wgmma_small_k)")
    args = parser.parse_args(argv)
    OUT = args.out if args.out.is_absolute() else ROOT / args.out
    build(args) if args.step == "build" else run(args)


if __name__ == "__main__":
    sys.exit(main())
