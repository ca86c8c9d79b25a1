"""Check and time the Hopper wgmma attention kernel (schedules/attention_wgmma.py) on an H200, against SDPA.

Two steps, because the GPU machine has no TVM compiler:

1. ``build`` (here): every module of ``MODULES`` is built with TVM for sm_90a, exported to ``<out>/<key>.so``,
   and its CUDA source compiled by nvcc into a cubin stored under the source's hash (ptxas' register and spill
   figures go to ``manifest.json``).
2. ``run`` (GPU machine): TVM's CUDA compile callback answers with the prebuilt cubins. Correctness modules run
   every mask of ``CHECK_MASKS`` (fresh random inputs, output poisoned with NaN, against a float32 torch
   reference: masked softmax, rows with no kept key 0); the bshd module reads Q, K and V as views into one packed
   [3, B, H, S, D] tensor. Timing modules are checked on causal and dense masks against float32 SDPA, then timed
   with ``triton.testing.do_bench`` (median) beside fp16 SDPA with ``is_causal`` / no mask. The SASS of every
   cubin is read with cuobjdump (HGMMA count, local-memory instructions). Prints a table; JSON to ``--json``.

Commands::

    .venv/bin/python scripts/check_attention_wgmma_gpu.py build
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/check_attention_wgmma_gpu.py run --json $OUT/attn_wgmma.json",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/attn_wgmma"], timeout_s=240)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)
from benchlib import source_key  # noqa: E402
OUT = ROOT / "out" / "attn_wgmma"
CHECK_MASKS = ("causal", "dense", "sliding", "bigbird", "random:0.3", "random_empty:0.05", "padding")
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
# key: (kind, batch, heads, seq, head_dim, dtype, out_layout, block_n, stages, pingpong[, persistent, sm_count]);
# the persistent check modules use a few blocks only, so each walks several work items
MODULES = {
    "check_d64": ("check", 2, 3, 300, 64, "float16", "bhsd", 128, 3, True),
    "check_d128_bshd": ("check", 2, 3, 300, 128, "float16", "bshd", 128, 2, True),
    "check_d64_bf16_bn64": ("check", 2, 3, 200, 64, "bfloat16", "bhsd", 64, 2, True),
    "time_d64": ("time", 16, 12, 4096, 64, "float16", "bhsd", 128, 3, True),
    "time_d128": ("time", 4, 16, 8192, 128, "float16", "bhsd", 128, 2, True),
    "time_d64_nopp": ("time", 16, 12, 4096, 64, "float16", "bhsd", 128, 3, False),
    "time_d128_nopp": ("time", 4, 16, 8192, 128, "float16", "bhsd", 128, 2, False),
    "time_d64_s2": ("time", 16, 12, 4096, 64, "float16", "bhsd", 128, 2, True),
    "time_d128_bn64": ("time", 4, 16, 8192, 128, "float16", "bhsd", 64, 4, True),
    "check_d64_persist": ("check", 2, 3, 300, 64, "float16", "bhsd", 128, 3, True, True, 4),
    "check_d128_persist_bshd": ("check", 2, 3, 300, 128, "bfloat16", "bshd", 128, 2, True, True, 5),
    "time_d64_persist": ("time", 16, 12, 4096, 64, "float16", "bhsd", 128, 3, True, True, 132),
    "time_d128_persist": ("time", 4, 16, 8192, 128, "float16", "bhsd", 128, 2, True, True, 132),
}
HANG_S = 10.0            # a launch not finished by then is reported as a hang and ends the run
GOALS_MS = {("causal", 64): 0.92, ("causal", 128): 1.77}   # issue 16: 1.1x SDPA causal on the H200


def _spec(key):
    kind, batch, heads, seq, head_dim, dtype, layout, block_n, stages, pingpong, *rest = MODULES[key]
    persistent, sm_count = rest or (False, 132)
    return dict(kind=kind, batch=batch, heads=heads, seq=seq, head_dim=head_dim, dtype=dtype, out_layout=layout,
                block_n=block_n, stages=stages, pingpong=pingpong, persistent=persistent, sm_count=sm_count,
                # check modules: one mask group per (batch, head), so every mask kind runs through one module
                mask_batch=batch if kind == "check" else 1, mask_heads=heads if kind == "check" else 1)


# ---- build (here) ----------------------------------------------------------------------------------------

def build(args) -> None:
    import tvm
    from stof_tvm.schedules.attention_wgmma import WgmmaAttentionConfig, wgmma_attention_primfunc
    from stof_tvm.schedules.templates.build import cuda_source, cuda_target
    from stof_tvm.schedules.templates.gemm_wgmma import nvcc_cubin

    OUT.mkdir(parents=True, exist_ok=True)
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"modules": {}}
    for key in args.only.split(",") if args.only else MODULES:
        s = _spec(key)
        t0 = time.time()
        func = wgmma_attention_primfunc(
            batch=s["batch"], heads=s["heads"], seq_q=s["seq"], seq_k=s["seq"], head_dim=s["head_dim"],
            dtype=s["dtype"], mask_batch=s["mask_batch"], mask_heads=s["mask_heads"], out_layout=s["out_layout"],
            config=WgmmaAttentionConfig(block_n=s["block_n"], stages=s["stages"], pingpong=s["pingpong"],
                                        persistent=s["persistent"]), sm_count=s["sm_count"])
        ex = tvm.compile(tvm.IRModule({"main": func}), target=cuda_target("sm_90a"))
        src = cuda_source(ex)
        ex.export_library(str(OUT / f"{key}.so"))
        report = nvcc_cubin(src, OUT / f"{source_key(src)}.cubin")
        manifest["modules"][key] = {**s, "library": f"{key}.so", "cubin": f"{source_key(src)}.cubin", **report}
        manifest_path.write_text(json.dumps(manifest, indent=1))
        print(f"{key}: {report['registers']} regs, spills {report['spill_stores']}/{report['spill_loads']}, "
              f"warnings {report['warnings']} ({time.time() - t0:.0f} s)", flush=True)


# ---- run (GPU machine) -----------------------------------------------------------------------------------

def _reference(torch, q, k, v, mask, scale):
    """float32 masked attention, one (batch) at a time; rows with no kept key give 0."""
    outs = []
    for b in range(q.shape[0]):
        s = torch.matmul(q[b].float(), k[b].float().transpose(-1, -2)) * scale
        s = s.masked_fill(~mask[b % mask.shape[0]], float("-inf"))
        outs.append(torch.matmul(torch.softmax(s, dim=-1).nan_to_num(0.0), v[b].float()))
    return torch.stack(outs)


def _format(torch, dev, mask4, block_n):
    from bench_attention import tiled_arrays

    return [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in tiled_arrays(mask4, 128, block_n)]


def _sass(cubin: Path) -> dict:
    try:
        sass = subprocess.run(["cuobjdump", "--dump-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        return {"sass_error": str(err)[:200]}
    lines = sass.splitlines()
    return {"hgmma": sum("HGMMA" in ln for ln in lines),
            "local_mem": sum(any(f" {op}" in ln for op in ("LDL", "STL")) for ln in lines)}


def run(args) -> None:
    import torch
    import triton
    import tvm
    from bench_attention import build_mask
    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    if not ensure_cuda_runtime():
        raise RuntimeError("TVM's CUDA runtime could not be loaded")
    misses = bl.PrebuiltCubins(OUT).misses   # source keys compiled here instead of prebuilt
    manifest = json.loads((OUT / "manifest.json").read_text())
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    results = []
    for key, info in manifest["modules"].items():
        info = dict(info, **_sass(OUT / info["cubin"]))
        try:
            func = tvm.runtime.load_module(str(OUT / info["library"]))["wgmma_attention"]
        except Exception as err:   # a failed load is a result to report
            results.append({"module": key, "error": f"load: {err}"[:300]})
            continue
        runner = _check_module if info["kind"] == "check" else _time_module
        rows = []
        try:
            runner(key, info, func, torch, triton, tvm, dev, build_mask, rows)
        except Hang:
            hung = True
        else:
            hung = False
        results.extend(rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "cubin_misses": misses}, indent=1))
        if hung:
            _table(results)
            print(f"{key} hung: run ended (the GPU context is lost)", flush=True)
            os._exit(3)
    _table(results)
    print(f"cubins compiled on the GPU machine instead of prebuilt: {len(misses)}")


def _inputs(torch, dev, info, seed, packed=False):
    gen = torch.Generator(device=dev).manual_seed(seed)
    shape = (info["batch"], info["heads"], info["seq"], info["head_dim"])
    tdt = getattr(torch, info["dtype"])
    if packed:   # views into one [3, B, H, S, D] tensor, as the QKV projection writes it
        qkv = torch.randn((3,) + shape, device=dev, generator=gen).to(tdt)
        return qkv[0], qkv[1], qkv[2]
    return tuple(torch.randn(shape, device=dev, generator=gen).to(tdt) for _ in range(3))


def _call(torch, tvm, func, info, q, k, v, fmt):
    b, h, s, d = info["batch"], info["heads"], info["seq"], info["head_dim"]
    shape = (b, s, h, d) if info["out_layout"] == "bshd" else (b, h, s, d)
    out = torch.full(shape, float("nan"), device=q.device, dtype=q.dtype)
    args = [tvm.runtime.from_dlpack(t) for t in (q, k, v, *fmt, out)]
    return out, (lambda: func(*args))


class Hang(RuntimeError):
    """A kernel launch that did not finish within HANG_S (a deadlock: the run ends with what it has)."""


def _launch_or_give_up(torch, call, key, recipe, rows) -> None:
    done = torch.cuda.Event()
    call()
    done.record()
    deadline = time.time() + HANG_S
    while not done.query():
        if time.time() > deadline:
            rows.append({"module": key, "mask": recipe, "error": f"hang: not finished after {HANG_S:.0f} s"})
            raise Hang(key)
        time.sleep(0.01)


def _error(torch, out, ref, layout):
    out = out.float().transpose(1, 2) if layout == "bshd" else out.float()
    finite = bool(torch.isfinite(out).all())
    return finite, float(torch.linalg.norm(out - ref) / max(float(torch.linalg.norm(ref)), 1e-30))


def _check_module(key, info, func, torch, triton, tvm, dev, build_mask, rows):
    b, h, s, d = info["batch"], info["heads"], info["seq"], info["head_dim"]
    for n, recipe in enumerate(CHECK_MASKS):
        mask4 = np.broadcast_to(build_mask(recipe, b, h, s, seed=n), (b, h, s, s))
        fmt = _format(torch, dev, np.ascontiguousarray(mask4), info["block_n"])
        q, k, v = _inputs(torch, dev, info, seed=n, packed=info["out_layout"] == "bshd")
        out, call = _call(torch, tvm, func, info, q, k, v, fmt)
        _launch_or_give_up(torch, call, key, recipe, rows)
        ref = _reference(torch, q, k, v, torch.from_numpy(np.ascontiguousarray(mask4)).to(dev), 1 / math.sqrt(d))
        finite, err = _error(torch, out, ref, info["out_layout"])
        ok = finite and err < TOLERANCE[info["dtype"]]
        rows.append({"module": key, "mask": recipe, "rel_err": err, "finite": finite, "correct": ok,
                     "hgmma": info.get("hgmma"), "local_mem": info.get("local_mem"), "registers": info["registers"],
                     "spills": info["spill_stores"] + info["spill_loads"]})
        print(f"{key} {recipe}: err {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)


def _time_module(key, info, func, torch, triton, tvm, dev, build_mask, rows):
    import torch.nn.functional as F

    b, h, s, d = info["batch"], info["heads"], info["seq"], info["head_dim"]
    for n, recipe in enumerate(("causal", "dense")):
        mask4 = build_mask(recipe, 1, 1, s, seed=0)
        fmt = _format(torch, dev, mask4, info["block_n"])
        q, k, v = _inputs(torch, dev, info, seed=100 + n)
        out, call = _call(torch, tvm, func, info, q, k, v, fmt)
        _launch_or_give_up(torch, call, key, recipe, rows)
        causal = recipe == "causal"
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        finite, err = _error(torch, out, ref, info["out_layout"])
        ok = finite and err < TOLERANCE[info["dtype"]]
        row = {"module": key, "mask": recipe, "rel_err": err, "finite": finite, "correct": ok,
               "hgmma": info.get("hgmma"), "local_mem": info.get("local_mem"), "registers": info["registers"],
               "spills": info["spill_stores"] + info["spill_loads"]}
        pairs = s * (s + 1) // 2 if causal else s * s
        flops = 4.0 * b * h * d * pairs
        row["sdpa_ms"] = float(triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=25, rep=100,
            return_mode="median"))
        if ok:
            row["ms"] = float(triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"))
            row["tflops"] = flops / row["ms"] / 1e9
            row["vs_sdpa"] = row["sdpa_ms"] / row["ms"]
            row["goal_ms"] = GOALS_MS.get((recipe, d), row["sdpa_ms"])
        row["sdpa_tflops"] = flops / row["sdpa_ms"] / 1e9
        rows.append(row)
        print(f"{key} {recipe}: err {err:.2e} {'ok' if ok else 'WRONG'}"
              + (f", {row['ms']:.3f} ms ({row['tflops']:.0f} TFLOP/s), SDPA {row['sdpa_ms']:.3f} ms, "
                 f"{row['vs_sdpa']:.2f}x" if ok else ""), flush=True)


def _table(results) -> None:
    print(f"{'module':<22}{'mask':<18}{'err':>10}{'ok':>4}{'ms':>8}{'TF/s':>6}{'sdpa':>8}{'x':>6}{'goal':>7}"
          f"{'hgmma':>6}{'ldl':>4}{'regs':>5}")
    for r in results:
        if "error" in r:   # a failed load or a hang
            print(f"{r['module']:<22}{r['error']}")
            continue
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        print(f"{r['module']:<22}{r['mask']:<18}{r['rel_err']:>10.2e}{'y' if r['correct'] else 'N':>4}{ms:>8}"
              f"{r.get('tflops', 0):>6.0f}{r.get('sdpa_ms', 0):>8.3f}{r.get('vs_sdpa', 0):>6.2f}"
              f"{r.get('goal_ms', 0):>7.2f}{str(r.get('hgmma')):>6}{str(r.get('local_mem')):>4}{r['registers']:>5}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("build", "run"))
    parser.add_argument("--only", default="", help="build: comma-separated module keys (default: all)")
    parser.add_argument("--json", default="", help="run: write results here")
    args = parser.parse_args(argv)
    build(args) if args.step == "build" else run(args)


if __name__ == "__main__":
    main()
