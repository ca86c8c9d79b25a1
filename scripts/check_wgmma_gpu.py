"""Check and time the opt-in wgmma GEMM templates on an H200, against cuBLAS and our mma.sync templates.

Two steps, because the GPU machine has no TVM compiler:

1. ``build`` (here): for each case, the wgmma kernel in each of its first ``--configs`` persistent cooperative knob
   choices, its best one-block-per-tile choice, its best ping-pong choice per tile width (unless
   ``--no-pingpong``) and the mma.sync template with its default knobs are compiled with TVM and exported to
   ``<out>/<key>.so`` (``--out``, default ``out/wgmma``);
   nvcc turns each module's CUDA source into a cubin (sm_90a for wgmma, sm_90 for mma.sync) stored under the
   source's hash, so the GPU machine never compiles CUDA (its NVRTC path would build for plain sm_90, which
   has no wgmma). ``manifest.json`` lists the modules with ptxas' register and spill figures.
2. ``run`` (on the GPU): loads every module (TVM's CUDA compile callback answers with the prebuilt cubin),
   checks each against torch in float32 (random inputs, output poisoned with NaN, relative Frobenius error
   within 1e-2 for float16 and 2e-2 for bfloat16), then times it with CUDA events (median of ``--iters`` after
   warm-up, fresh inputs per case) side by side with ``torch.matmul`` + the same epilogue in eager torch
   (cuBLAS) and the mma.sync template; prints a table (best cooperative and best ping-pong wgmma side by side)
   and writes ``<out>/results.json``. A launch that has not finished after 10 s is reported as a hang and ends
   the run (results so far are kept and tabulated).

Commands (the second one is the whole GPU call, ~3 minutes including the machine start)::

    .venv/bin/python scripts/check_wgmma_gpu.py build
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/check_wgmma_gpu.py run",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/wgmma"], timeout_s=600)

Cases: the square 4096^3 GEMM and the BERT-Base/-Large layer GEMMs at 4096 and 32768 tokens, float16 (plus one
bfloat16 case). A wgmma kernel that fails its check is reported as wrong and left out of the speed columns.

The ping-pong consumer schedule (knob ``pingpong``) side by side with the cooperative one, in its own folder so the
carry stays small (~14 MiB; about a minute on the GPU)::

    .venv/bin/python scripts/check_wgmma_gpu.py build --out out/wgmma_pp
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/check_wgmma_gpu.py run --out out/wgmma_pp --iters 30",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/wgmma_pp"], timeout_s=300)

``--suite ffn`` (both steps; artifacts in ``out/ffn_wgmma``): the fused FFN ``GELU(x @ W1^T + b1) @ W2^T + b2``
(``ffn_gelu_erf_bias_wgmma``, every knob set) at m in {4096, 32768} x hidden in {128, 256} x ffn in {512, 1024}
(float16, plus one bfloat16 case), checked against torch float32 like the GEMMs and timed side by side with torch
eager's unfused chain (``F.linear`` + ``F.gelu`` + ``F.linear``; also replayed as a CUDA graph, without launch
overhead) and with our unfused wgmma pair
(``gemm_bias_gelu_erf_wgmma`` + ``gemm_bias_wgmma``, default knobs, intermediate poisoned too). These kernels take
microseconds, so each CUDA-event sample spans ``--reps`` back-to-back calls. A launch that has not finished after
10 s is reported as a hang and ends the run (results so far are kept)::

    .venv/bin/python scripts/check_wgmma_gpu.py build --suite ffn
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/check_wgmma_gpu.py run --suite ffn",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/ffn_wgmma"], timeout_s=420)

``--suite norm`` (both steps; artifacts in ``out/norm_wgmma``): GEMM + bias + residual + LayerNorm in one wgmma
kernel (``gemm_bias_residual_layernorm_wgmma``: the ``n / block_n`` blocks of a row tile one cluster sharing their
row sums), its first :data:`NORM_SETS` knob sets of its first :data:`NORM_WIDTHS` tile widths against the pair the
compile path runs without it (``gemm_wgmma`` with its default knobs, then the ``bias_residual_layernorm``
template), at the attention-output and FFN-down shapes of BERT-Base (4096 and 32768 rows, ViT-Base's 1576, 128) and
BERT-Large, checked against torch float32 like the GEMMs (output NaN-poisoned; the pair's GEMM output too) and timed
as ``--reps`` back-to-back calls per CUDA-event sample::

    .venv/bin/python scripts/check_wgmma_gpu.py build --suite norm
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/check_wgmma_gpu.py run --suite norm",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/norm_wgmma"], timeout_s=420)

``--suite gated`` (both steps; artifacts in ``out/gated_wgmma``): the gated MLP GEMM ``silu(A Wg^T) * (A Wu^T)``
(``gemm_silu_mul_wgmma``, the compile option ``gated_epilogue``) in its first knob sets against float32 torch, and
timed beside the form the compile path runs without it (our wgmma GEMM on the concatenated weight, then the product)
and eager torch; SmolLM2-360M's and Qwen2.5-0.5B's shapes::

    .venv/bin/python scripts/check_wgmma_gpu.py build --suite gated
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/check_wgmma_gpu.py run --suite gated --iters 30",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/gated_wgmma"], timeout_s=300)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (timing, hang guard, CUDA graphs, cubin keys)
from benchlib import source_key  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUTS = {"gemm": ROOT / "out" / "wgmma", "ffn": ROOT / "out" / "ffn_wgmma", "norm": ROOT / "out" / "norm_wgmma",
        "gated": ROOT / "out" / "gated_wgmma"}
OUT = OUTS["gemm"]   # the suite's artifact folder (main() sets it)

# (template base name, m, n, k, dtype): base + "_wgmma" is the wgmma template, base alone the mma.sync one
CASES = [
    ("gemm", 4096, 4096, 4096, "float16"),
    ("gemm_bias", 4096, 768, 768, "float16"),            # BERT-Base attention output, 4096 tokens
    ("gemm_bias_gelu_erf", 4096, 3072, 768, "float16"),  # BERT-Base FFN up
    ("gemm_bias", 4096, 768, 3072, "float16"),           # BERT-Base FFN down
    ("gemm_bias_gelu_erf", 4096, 4096, 1024, "float16"),  # BERT-Large FFN up
    ("gemm_bias_gelu_erf", 32768, 3072, 768, "float16"),
    ("gemm_bias", 32768, 768, 3072, "float16"),
    ("gemm_bias_gelu_erf", 4096, 3072, 768, "bfloat16"),
    ("qkv_projection", 4096, 2304, 768, "float16"),      # BERT-Base QKV into [3, B, H, S, D], B=8, S=512
    ("qkv_projection", 32768, 3072, 1024, "float16"),    # BERT-Large, B=64, S=512
    ("gemm", 32768, 768, 768, "float16"),                # BERT-Base attention output (bias in the LayerNorm)
    ("qkv_projection", 32768, 2304, 768, "float16"),     # BERT-Base, B=64, S=512
]
SEQ, HEAD_DIM = 512, 64   # the QKV cases' sequence length and head size


def template_shape(base, m, n, k) -> dict:
    """The template's shape dict: (m, n, k) for the GEMMs; (batch, seq, heads, head_dim) for the QKV projection."""
    if base == "qkv_projection":
        return {"batch": m // SEQ, "seq": SEQ, "heads": k // HEAD_DIM, "head_dim": HEAD_DIM}
    return {"m": m, "n": n, "k": k}
TOL = {"float16": 1e-2, "bfloat16": 2e-2}
# fused FFN cases (m, hidden, ffn, dtype)
FFN_CASES = [(m, h, f, "float16") for m in (4096, 32768) for h in (128, 256) for f in (512, 1024)] + [
    (4096, 128, 512, "bfloat16")]
FFN_TEMPLATE = "ffn_gelu_erf_bias_wgmma"
# GEMM + bias + residual + LayerNorm cases (m, n, k, dtype): BERT-Base's attention output and FFN down at 8 x 512 and
# 64 x 512 tokens, ViT-Base's at 8 x 197 (a partial last row tile), RoBERTa-base's at 1 x 128, BERT-Large's at 8 x 512
NORM_CASES = [(m, 768, k, "float16") for m in (4096, 32768, 1576, 128) for k in (768, 3072)] + [
    (4096, 1024, 1024, "float16"), (4096, 1024, 4096, "float16"), (4096, 768, 768, "bfloat16")]
NORM_TEMPLATE = "gemm_bias_residual_layernorm_wgmma"
NORM_WIDTHS = 2  # tile widths per case, in the space's order
NORM_SETS = 2   # fused knob sets per tile width: the space's first two (staged, TMA, 4 and 3 stages)
# gated MLP cases (m, n, k, dtype): SmolLM2-360M's gate and up at 4 x 2048 and 1 x 2048 tokens, Qwen2.5-0.5B's at
# 4 x 2048, a partial last row tile (1000 rows), bfloat16
GATED_CASES = [(8192, 2560, 960, "float16"), (2048, 2560, 960, "float16"), (8192, 4864, 896, "float16"),
               (1000, 2560, 960, "float16"), (8192, 2560, 960, "bfloat16")]
GATED_TEMPLATE = "gemm_silu_mul_wgmma"
GATED_SETS = 3  # the gated template's first knob sets (the compile path's is the first)


def median_ms(fn, iters, reps=1):
    """Median over ``iters`` CUDA-event samples of the time per call, each sample ``reps`` back-to-back calls
    after 5 warm-up calls (:func:`benchlib.time_ms`)."""
    return bl.time_ms(fn, warmup=5, samples=iters, number=reps).median_ms


def case_key(base, m, n, k, dtype) -> str:
    return f"{base}_{m}x{n}x{k}_{dtype}"


# ---- build (here) ----------------------------------------------------------------------------------------

def build(args) -> None:
    from stof_tvm.schedules.templates.build import build as build_template
    from stof_tvm.schedules.templates import cuda_target, get_template
    from stof_tvm.schedules.templates.gemm_wgmma import build_kernel

    OUT.mkdir(parents=True, exist_ok=True)
    manifest = {"cases": [], "modules": {}}
    t0 = time.time()
    for base, m, n, k, dtype in CASES:
        shape = template_shape(base, m, n, k)
        ckey = case_key(base, m, n, k, dtype)
        entry = {"key": ckey, "template": base, "shape": {"m": m, "n": n, "k": k}, "dtype": dtype, "modules": []}
        wgmma = get_template(base + "_wgmma")
        space = wgmma.knob_space(shape, dtype)
        coop = [kn for kn in space if not kn["pingpong"]]
        # the best-ranked persistent choices and the best-ranked one-block-per-tile choice, side by side
        chosen = ([kn for kn in coop if kn["persistent"]][:args.configs]
                  + [kn for kn in coop if not kn["persistent"]][:1])
        if args.pingpong:  # and the best-ranked ping-pong choice of each tile width
            chosen += [next(kn for kn in space if kn["pingpong"] and kn["block_n"] == bn)
                       for bn in sorted({kn["block_n"] for kn in space if kn["pingpong"]})]
        builds = [(f"{ckey}__wgmma_n{kn['block_n']}_s{kn['stages']}{'_p' if kn['persistent'] else ''}"
                   f"{'_pp' if kn['pingpong'] else ''}", "wgmma",
                   kn, lambda kn=kn: build_kernel(base + "_wgmma", shape, dtype, kn)) for kn in chosen]
        mma = get_template(base)
        builds.append((f"{ckey}__mma_sync", "mma_sync", mma.default_knobs(shape, dtype),
                       lambda: build_template(mma.schedule(shape, dtype), cuda_target())))
        for key, kind, knobs, make in builds:
            _export(manifest, key, kind, knobs, make(), "gemm_wgmma" if kind == "wgmma" else "main")
            entry["modules"].append(key)
        manifest["cases"].append(entry)
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(manifest['modules'])} modules in {OUT} ({time.time() - t0:.0f} s)")


def _export(manifest, key, kind, knobs, ex, function) -> None:
    """Export one built module and its cubin (by source hash) into OUT; record it with ptxas' figures."""
    from stof_tvm.schedules.templates import cuda_source
    from stof_tvm.schedules.templates.gemm_wgmma import nvcc_cubin

    ex[function]  # the name run() calls (raises here when missing)
    src = cuda_source(ex)
    ex.export_library(str(OUT / f"{key}.so"))
    report = _cubin(src, OUT / f"{source_key(src)}.cubin", kind, nvcc_cubin)
    manifest["modules"][key] = {"library": f"{key}.so", "function": function, "kind": kind, "knobs": knobs, **report}
    print(f"{key}: {report['registers']} regs, spills {report['spill_stores']}/{report['spill_loads']}, "
          f"warnings {len(report['warnings'])}", flush=True)


def _build_suite(suite: str, cases, add_case) -> None:
    """Build a suite into OUT: ``add_case(manifest, case)`` exports one case's modules (:func:`_export`) and returns
    its manifest entry; ``manifest.json`` lists them all."""
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = {"suite": suite, "cases": [], "modules": {}}
    t0 = time.time()
    for case in cases:
        manifest["cases"].append(add_case(manifest, case))
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(manifest['modules'])} modules in {OUT} ({time.time() - t0:.0f} s)")


def build_ffn(args) -> None:
    """The fused FFN in every knob set, and the unfused wgmma pair with default knobs, per FFN case."""
    from stof_tvm.schedules.templates import get_template
    from stof_tvm.schedules.templates.gemm_wgmma import build_kernel

    def add_case(manifest, case):
        m, h, f, dtype = case
        shape = {"m": m, "hidden": h, "ffn": f}
        ckey = f"ffn_{m}x{h}x{f}_{dtype}"
        entry = {"key": ckey, "shape": shape, "dtype": dtype, "fused": []}
        for kn in get_template(FFN_TEMPLATE).knob_space(shape, dtype):
            key = f"{ckey}__fused_c{kn['chunk_f']}_s{kn['stages']}"
            _export(manifest, key, "wgmma", kn, build_kernel(FFN_TEMPLATE, shape, dtype, kn), "ffn_wgmma")
            entry["fused"].append(key)
        for part, name, gemm in (("up", "gemm_bias_gelu_erf_wgmma", {"m": m, "n": f, "k": h}),
                                 ("down", "gemm_bias_wgmma", {"m": m, "n": h, "k": f})):
            kn = get_template(name).default_knobs(gemm, dtype)
            _export(manifest, f"{ckey}__{part}", "wgmma", kn, build_kernel(name, gemm, dtype, kn), "gemm_wgmma")
            entry[part] = f"{ckey}__{part}"
        return entry

    _build_suite("ffn", FFN_CASES, add_case)


def build_norm(args) -> None:
    """The fused GEMM + LayerNorm in its first knob sets of each tile width, and the unfused pair (the GEMM's default
    wgmma knobs, the LayerNorm template's default schedule), per case."""
    from stof_tvm.schedules.templates import cuda_target, get_template
    from stof_tvm.schedules.templates.build import build as build_template
    from stof_tvm.schedules.templates.gemm_wgmma import build_kernel

    def add_case(manifest, case):
        m, n, k, dtype = case
        shape = {"m": m, "n": n, "k": k}
        ckey = f"norm_{m}x{n}x{k}_{dtype}"
        entry = {"key": ckey, "shape": shape, "dtype": dtype, "fused": []}
        space = get_template(NORM_TEMPLATE).knob_space(shape, dtype)
        for bn in list(dict.fromkeys(kn["block_n"] for kn in space))[:NORM_WIDTHS]:
            for kn in [kn for kn in space if kn["block_n"] == bn][:NORM_SETS]:
                key = (f"{ckey}__fused_n{bn}_s{kn['stages']}{'_st' if kn['staged'] else ''}"
                       f"{'_tma' if kn['loads'] == 'tma' else ''}")
                _export(manifest, key, "wgmma", kn, build_kernel(NORM_TEMPLATE, shape, dtype, kn), "gemm_wgmma")
                entry["fused"].append(key)
        kn = get_template("gemm_wgmma").default_knobs(shape, dtype)
        _export(manifest, f"{ckey}__gemm", "wgmma", kn, build_kernel("gemm_wgmma", shape, dtype, kn), "gemm_wgmma")
        norm = get_template("bias_residual_layernorm")
        ln_shape = {"m": m, "n": n}
        _export(manifest, f"{ckey}__layernorm", "mma_sync", norm.default_knobs(ln_shape, dtype),
                build_template(norm.schedule(ln_shape, dtype), cuda_target()), "main")
        entry.update(gemm=f"{ckey}__gemm", layernorm=f"{ckey}__layernorm")
        return entry

    _build_suite("norm", NORM_CASES, add_case)


def build_gated(args) -> None:
    """The gated GEMM (``silu(A Wg^T) * (A Wu^T)`` on the interleaved weight) in its first knob sets, and the plain
    wgmma GEMM on the concatenated weight that the compile path runs without it (default knobs), per case."""
    from stof_tvm.schedules.templates import get_template
    from stof_tvm.schedules.templates.gemm_wgmma import build_kernel

    def add_case(manifest, case):
        m, n, k, dtype = case
        shape = {"m": m, "n": n, "k": k}
        ckey = f"gated_{m}x{n}x{k}_{dtype}"
        entry = {"key": ckey, "shape": shape, "dtype": dtype, "fused": []}
        for kn in get_template(GATED_TEMPLATE).knob_space(shape, dtype)[:GATED_SETS]:
            key = (f"{ckey}__fused_n{kn['block_n']}_s{kn['stages']}{'_p' if kn['persistent'] else ''}"
                   f"{'_pp' if kn['pingpong'] else ''}")
            _export(manifest, key, "wgmma", kn, build_kernel(GATED_TEMPLATE, shape, dtype, kn), "gemm_wgmma")
            entry["fused"].append(key)
        pair = {"m": m, "n": 2 * n, "k": k}
        kn = get_template("gemm_wgmma").default_knobs(pair, dtype)
        _export(manifest, f"{ckey}__gemm", "wgmma", kn, build_kernel("gemm_wgmma", pair, dtype, kn), "gemm_wgmma")
        entry["gemm"] = f"{ckey}__gemm"
        return entry

    _build_suite("gated", GATED_CASES, add_case)


def _cubin(src, path, kind, nvcc_cubin) -> dict:
    """sm_90a cubin for the wgmma kernels (nvcc_cubin), sm_90 for the mma.sync templates."""
    if kind == "wgmma":
        return nvcc_cubin(src, path)
    import re
    import subprocess

    cu = path.with_suffix(".cu")
    cu.write_text(src)
    proc = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "-o", str(path), str(cu)],
                          capture_output=True, text=True)
    cu.unlink()
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    text = proc.stderr
    return {"registers": int(re.search(r"Used (\d+) registers", text).group(1)),
            "stack_frame": int(re.search(r"(\d+) bytes stack frame", text).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", text).group(1)),
            "spill_loads": int(re.search(r"(\d+) bytes spill loads", text).group(1)), "warnings": []}


# ---- run (on the GPU) --------------------------------------------------------------------------------------

def run(args) -> None:
    import torch
    import tvm
    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    if not ensure_cuda_runtime():
        raise RuntimeError("TVM's CUDA runtime could not be loaded")
    misses = bl.PrebuiltCubins(OUT).misses   # source keys compiled here instead of prebuilt
    manifest = json.loads((OUT / "manifest.json").read_text())
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    results = []
    for case in manifest["cases"]:
        if args.suite == "ffn":
            results.append(_run_ffn_case(case, manifest["modules"], torch, tvm, dev, args, results, misses))
        elif args.suite == "norm":
            results.append(_run_norm_case(case, manifest["modules"], torch, tvm, dev, args, results, misses))
        elif args.suite == "gated":
            results.append(_run_gated_case(case, manifest["modules"], torch, tvm, dev, args, results, misses))
        else:
            results.append(_run_case(case, manifest["modules"], torch, tvm, dev, args.iters, results, misses))
        (OUT / "results.json").write_text(json.dumps({"results": results, "cubin_misses": misses}, indent=1))
    {"ffn": _ffn_table, "norm": _norm_table, "gated": _gated_table}.get(args.suite, _table)(results)
    print(f"cubins compiled on the GPU machine instead of prebuilt: {len(misses)}")


def _torch_epilogue(torch, base, y, bias):
    if base == "qkv_projection":   # + bias, then [B*S, 3*H*D] -> [3, B, H, S, D]
        y = y + bias
        return y.view(-1, SEQ, 3, y.shape[1] // (3 * HEAD_DIM), HEAD_DIM).permute(2, 0, 3, 1, 4).contiguous()
    if "bias" in base:
        y = y + bias
    if base.endswith("relu"):
        return torch.relu(y)
    if base.endswith("gelu_erf"):
        return torch.nn.functional.gelu(y)
    if base.endswith("gelu_tanh"):
        return torch.nn.functional.gelu(y, approximate="tanh")
    return y


def _case_setup(case, torch, dev, keys):
    """A case's dims (its shape's ``keys``), dtype, torch dtype and seeded generator (:func:`_case_generator`)."""
    dtype = case["dtype"]
    return (tuple(case["shape"][key] for key in keys), dtype, getattr(torch, dtype),
            _case_generator(case, torch, dev))


def _case_generator(case, torch, dev):
    """A torch generator on ``dev`` seeded from the case's key: every run draws the same inputs for a case."""
    return torch.Generator(device=dev).manual_seed(int(source_key(case["key"]), 16) % 2 ** 31)


def _run_case(case, modules, torch, tvm, dev, iters, results, misses) -> dict:
    base, dtype, shape = case["template"], case["dtype"], case["shape"]
    m, n, k = shape["m"], shape["n"], shape["k"]
    tdt = getattr(torch, dtype)
    gen = _case_generator(case, torch, dev)
    a = torch.randn(m, k, device=dev, generator=gen).to(tdt)
    w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).to(tdt)
    bias = torch.randn(n, device=dev, generator=gen).to(tdt)
    ref = _torch_epilogue(torch, base, a.float() @ w.float().T, bias.float())
    args = [a, w] + ([bias] if "bias" in base or base == "qkv_projection" else [])
    flops = 2 * m * n * k
    row = {"case": case["key"], "template": base, "shape": shape, "dtype": dtype, "kernels": {}}
    row["cublas_ms"] = median_ms(lambda: _torch_epilogue(torch, base, torch.matmul(a, w.T), bias), iters)
    for key in case["modules"]:
        info = modules[key]
        print(f"{key}: launching", flush=True)  # a kernel that hangs is the last one named
        entry = {"kind": info["kind"], "knobs": info["knobs"], "registers": info["registers"]}
        try:
            func = tvm.runtime.load_module(str(OUT / info["library"]))[info["function"]]
        except Exception as err:  # a failed load is a result to report, not a reason to stop the run
            entry["error"] = f"load: {err}"[:300]
            row["kernels"][key] = entry
            continue
        out = torch.full(tuple(ref.shape), float("nan"), device=dev, dtype=tdt)
        tv = [tvm.runtime.from_dlpack(t) for t in args + [out]]
        func(*tv)
        if not bl.finished(HANG_S):
            row["kernels"][key] = dict(entry, error=f"hang: not finished after {HANG_S:.0f} s")
            _give_up(row, results, misses, key, _table)
        err = float(torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref))
        entry["rel_err"] = err
        entry["finite"] = bool(torch.isfinite(out).all())
        entry["correct"] = entry["finite"] and err < TOL[dtype]
        if not entry["correct"]:
            entry["diagnosis"] = _diagnose(torch, out.float().reshape(-1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1]))
        if entry["correct"]:
            entry["ms"] = median_ms(lambda: func(*tv), iters)
            entry["tflops"] = flops / entry["ms"] / 1e9
            entry["vs_cublas"] = row["cublas_ms"] / entry["ms"]
        row["kernels"][key] = entry
        print(f"{key}: err {err:.2e} {'ok' if entry['correct'] else 'WRONG'}"
              + (f", {entry['ms']:.3f} ms, {entry['tflops']:.0f} TFLOP/s, {entry['vs_cublas']:.2f}x cuBLAS"
                 if entry["correct"] else ""), flush=True)
    row["cublas_tflops"] = flops / row["cublas_ms"] / 1e9
    return row


def _diagnose(torch, out, ref) -> dict:
    """Where a wrong output is wrong: which rows (mod 128) and columns (mod 256) hold bad elements, and a sample.
    One GPU run then says whether a layout, a pipeline slot or the epilogue is at fault."""
    bad = ~torch.isclose(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().mean()))
    rows, cols = bad.nonzero(as_tuple=True)
    hist = lambda idx, mod: torch.bincount(idx % mod, minlength=mod).tolist()  # noqa: E731
    return {"bad_fraction": float(bad.float().mean()), "nan_fraction": float(torch.isnan(out).float().mean()),
            "bad_rows_mod128": hist(rows, 128) if rows.numel() else [],
            "bad_cols_mod256": hist(cols, 256) if cols.numel() else [],
            "bad_row_blocks": torch.unique(rows // 128).tolist()[:16],
            "sample_out": out[0, :8].tolist(), "sample_ref": ref[0, :8].tolist(),
            "ratio_mean_bad": float((out[bad] / ref[bad]).nanmean()) if rows.numel() else 1.0}


def _best(row, kind, pingpong=None):
    """(ms, key) of the fastest correct module of ``kind`` (wgmma: of either schedule, or only ping-pong /
    only cooperative when ``pingpong`` is True / False); None when none was timed."""
    timed = [(e["ms"], key) for key, e in row["kernels"].items() if e.get("kind") == kind and "ms" in e
             and (pingpong is None or bool(e["knobs"].get("pingpong")) == pingpong)]
    return min(timed) if timed else None


def _table(results) -> None:
    print(f"\n{'case':42s} {'eager ms':>8s} {'cuBLAS TF/s':>11s} {'mma.sync x':>10s} {'coop ms':>8s} {'pp ms':>8s} "
          f"{'pp/coop':>7s} {'wgmma x':>8s}  best coop / best ping-pong / wrong")
    nan = float("nan")
    for row in results:
        mma, wg = _best(row, "mma_sync"), _best(row, "wgmma")
        coop, pp = _best(row, "wgmma", False), _best(row, "wgmma", True)
        wrong = [key.split("__")[1] for key, e in row["kernels"].items() if not e.get("correct")]
        cublas_tflops = row.get("cublas_tflops", nan)
        print(f"{row['case']:42s} {row['cublas_ms']:8.3f} {cublas_tflops:11.0f} "
              f"{(row['cublas_ms'] / mma[0]) if mma else nan:10.2f} {coop[0] if coop else nan:8.3f} "
              f"{pp[0] if pp else nan:8.3f} {(coop[0] / pp[0]) if coop and pp else nan:7.2f} "
              f"{(row['cublas_ms'] / wg[0]) if wg else nan:8.2f}  "
              f"{coop[1].split('__')[1] if coop else '-'} / {pp[1].split('__')[1] if pp else '-'} / {' '.join(wrong)}")
    print("(x = speed relative to torch.matmul + eager epilogue: cuBLAS time / kernel time, best wgmma of either "
          "schedule; pp/coop = best cooperative time / best ping-pong time, > 1: ping-pong faster)")


# ---- the fused FFN suite (on the GPU) ----------------------------------------------------------------------

HANG_S = 10.0


def _give_up(row, results, misses, key, table) -> None:
    """After a hang: keep the results so far (with ``row``), print their table, and end the process (a kernel that
    never finishes cannot be stopped from the host; exiting releases the GPU)."""
    import os

    results.append(row)
    (OUT / "results.json").write_text(json.dumps({"results": results, "cubin_misses": misses}, indent=1))
    print(f"{key}: HANG (no result after {HANG_S:.0f} s); stopping the run", flush=True)
    table(results)
    os._exit(3)


def _check_and_time(torch, entry, call, out, ref, dtype, args, on_hang) -> dict:
    """Run ``call`` once into the poisoned ``out`` (``on_hang(entry)`` ends the run when it does not finish), check it
    against the float32 ``ref`` and, where correct, time it (``--iters`` samples of ``--reps`` calls); ``entry`` gains
    ``rel_err``, ``max_abs``, ``finite``, ``correct`` and ``ms`` or ``diagnosis``."""
    call()
    if not bl.finished(HANG_S):
        on_hang(dict(entry, error=f"hang: not finished after {HANG_S:.0f} s"))
    err = float(torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref))
    entry.update(rel_err=err, max_abs=float((out.float() - ref).abs().max()),
                 finite=bool(torch.isfinite(out).all()))
    entry["correct"] = entry["finite"] and err < TOL[dtype]
    if entry["correct"]:
        entry["ms"] = median_ms(call, args.iters, args.reps)
    else:
        entry["diagnosis"] = _diagnose(torch, out.float(), ref)
    return entry


def _hang_handler(row, key, results, misses, table):
    """``on_hang`` of :func:`_check_and_time`: record the hung entry in ``row`` and give up (:func:`_give_up`)."""
    def on_hang(entry):
        row["kernels"][key] = entry
        _give_up(row, results, misses, key, table)
    return on_hang


def _run_ffn_case(case, modules, torch, tvm, dev, args, results, misses) -> dict:
    F = torch.nn.functional
    (m, h, f), dtype, tdt, gen = _case_setup(case, torch, dev, ("m", "hidden", "ffn"))
    x = torch.randn(m, h, device=dev, generator=gen).to(tdt)
    w1 = (torch.randn(f, h, device=dev, generator=gen) / h ** 0.5).to(tdt)
    b1 = torch.randn(f, device=dev, generator=gen).to(tdt)
    w2 = (torch.randn(h, f, device=dev, generator=gen) / f ** 0.5).to(tdt)
    b2 = torch.randn(h, device=dev, generator=gen).to(tdt)
    ref = F.linear(F.gelu(F.linear(x.float(), w1.float(), b1.float())), w2.float(), b2.float())
    row = {"case": case["key"], "shape": case["shape"], "dtype": dtype, "kernels": {}, "flops": 4 * m * h * f}
    chain = lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)  # noqa: E731
    row["eager_ms"] = median_ms(chain, args.iters, args.reps)
    try:
        row["graph_ms"] = median_ms(bl.graphed(chain)[0], args.iters, args.reps)
    except RuntimeError as err:  # the stronger baseline when capture works; eager alone otherwise
        row["graph_ms"], row["graph_error"] = None, str(err)[:300]
    tv = lambda *ts: [tvm.runtime.from_dlpack(t) for t in ts]  # noqa: E731
    nan = lambda *shape: torch.full(shape, float("nan"), device=dev, dtype=tdt)  # noqa: E731
    pair_key = f"{case['key']}__unfused_pair"
    forms = [(key, "fused") for key in case["fused"]] + [(pair_key, "unfused")]
    for key, kind in forms:
        print(f"{key}: launching", flush=True)
        entry = {"kind": kind}
        try:
            if kind == "fused":
                fused = tvm.runtime.load_module(str(OUT / modules[key]["library"]))["ffn_wgmma"]
                entry.update(knobs=modules[key]["knobs"], registers=modules[key]["registers"])
                out = nan(m, h)
                targs = tv(x, w1, b1, w2, b2, out)
                call = lambda fused=fused, targs=targs: fused(*targs)  # noqa: E731
            else:
                up, down = (tvm.runtime.load_module(str(OUT / modules[case[p]]["library"]))["gemm_wgmma"]
                            for p in ("up", "down"))
                entry.update(knobs={p: modules[case[p]]["knobs"] for p in ("up", "down")})
                mid, out = nan(m, f), nan(m, h)
                up_args, down_args = tv(x, w1, b1, mid), tv(mid, w2, b2, out)
                call = lambda: (up(*up_args), down(*down_args))  # noqa: E731
        except Exception as err:  # a failed load is a result to report, not a reason to stop the run
            entry["error"] = f"load: {err}"[:300]
            row["kernels"][key] = entry
            continue
        _check_and_time(torch, entry, call, out, ref, dtype, args,
                        _hang_handler(row, key, results, misses, _ffn_table))
        if entry["correct"]:
            entry["tflops"] = row["flops"] / entry["ms"] / 1e9
        row["kernels"][key] = entry
        print(f"{key}: err {entry['rel_err']:.2e} {'ok' if entry['correct'] else 'WRONG'}"
              + (f", {entry['ms'] * 1e3:.1f} us, {entry['tflops']:.0f} TFLOP/s" if entry["correct"] else ""), flush=True)
    timed = [(e["ms"], key) for key, e in row["kernels"].items() if e["kind"] == "fused" and "ms" in e]
    row["fused_best"] = min(timed) if timed else None
    row["unfused_ms"] = row["kernels"][pair_key].get("ms")
    return row


def _ffn_table(results) -> None:
    print(f"\n{'case':34s} {'eager us':>9s} {'graph us':>9s} {'pair us':>8s} {'fused us':>9s} {'x torch':>8s} "
          f"{'x pair':>7s} {'TF/s':>5s}  best fused / wrong")
    for row in results:
        best, pair = row.get("fused_best"), row.get("unfused_ms") or float("nan")
        wrong = [key.split("__")[1] for key, e in row["kernels"].items() if not e.get("correct")]
        fused_ms = best[0] if best else float("nan")
        graph_ms = row["graph_ms"] or float("nan")
        torch_ms = min(row["eager_ms"], row["graph_ms"] or row["eager_ms"])
        print(f"{row['case']:34s} {row['eager_ms'] * 1e3:9.1f} {graph_ms * 1e3:9.1f} {pair * 1e3:8.1f} "
              f"{fused_ms * 1e3:9.1f} {torch_ms / fused_ms:8.2f} {pair / fused_ms:7.2f} "
              f"{row['flops'] / fused_ms / 1e9:5.0f}  {best[1].split('__')[1] if best else '-'} {' '.join(wrong)}")
    print("(x torch = the faster of torch eager (F.linear + F.gelu + F.linear) and the same chain replayed as a CUDA "
          "graph, over the best fused FFN's time; x pair = our unfused wgmma pair's time over it)")


def _run_norm_case(case, modules, torch, tvm, dev, args, results, misses) -> dict:
    F = torch.nn.functional
    (m, n, k), dtype, tdt, gen = _case_setup(case, torch, dev, ("m", "n", "k"))
    a = torch.randn(m, k, device=dev, generator=gen).to(tdt)
    w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).to(tdt)
    bias = torch.randn(n, device=dev, generator=gen).to(tdt)
    # a residual stream with a mean of its own per row (LayerNorm's two passes are for that) and large columns
    residual = (torch.randn(m, n, device=dev, generator=gen) * 2 + torch.randn(m, 1, device=dev, generator=gen) * 4
                ).to(tdt)
    gamma = (1 + 0.1 * torch.randn(n, device=dev, generator=gen)).to(tdt)
    beta = (0.1 * torch.randn(n, device=dev, generator=gen)).to(tdt)
    y = a.float() @ w.float().T + bias.float() + residual.float()
    ref = F.layer_norm(y, (n,), gamma.float(), beta.float(), 1e-5)
    row = {"case": case["key"], "shape": case["shape"], "dtype": dtype, "kernels": {}}
    row["torch_ms"] = median_ms(lambda: F.layer_norm(F.linear(a, w, bias) + residual, (n,), gamma, beta, 1e-5),
                                args.iters, args.reps)
    tv = lambda *ts: [tvm.runtime.from_dlpack(t) for t in ts]  # noqa: E731

    def make_call(key, kind, entry, out):
        if kind == "fused":
            fused = tvm.runtime.load_module(str(OUT / modules[key]["library"]))["gemm_wgmma"]
            entry.update(knobs=modules[key]["knobs"], registers=modules[key]["registers"])
            targs = tv(a, w, bias, residual, gamma, beta, out)
            return lambda: fused(*targs)
        gemm = tvm.runtime.load_module(str(OUT / modules[case["gemm"]]["library"]))["gemm_wgmma"]
        norm = tvm.runtime.load_module(str(OUT / modules[case["layernorm"]]["library"]))["main"]
        entry.update(knobs=modules[case["gemm"]]["knobs"])
        mid = torch.full((m, n), float("nan"), device=dev, dtype=tdt)
        gemm_args, norm_args = tv(a, w, mid), tv(mid, bias, residual, gamma, beta, out)
        return lambda: (gemm(*gemm_args), norm(*norm_args))

    return _fused_and_pair(torch, dev, case, row, make_call, (m, n), ref, args, results, misses, _norm_table)


def _fused_and_pair(torch, dev, case, row, make_call, out_shape, ref, args, results, misses, table) -> dict:
    """Check and time each fused module of ``case`` and its unfused pair into ``row``: ``make_call(key, kind, entry,
    out)`` loads a module (``kind`` "fused" or "unfused"), records its knobs in ``entry`` and returns the call that
    writes ``out`` (poisoned here). Adds ``fused_best``, ``fused_first`` and ``unfused_ms``."""
    pair_key = f"{case['key']}__unfused_pair"
    for key, kind in [(key, "fused") for key in case["fused"]] + [(pair_key, "unfused")]:
        print(f"{key}: launching", flush=True)
        entry = {"kind": kind}
        out = torch.full(out_shape, float("nan"), device=dev, dtype=getattr(torch, case["dtype"]))
        try:
            call = make_call(key, kind, entry, out)
        except Exception as err:  # a failed load is a result to report, not a reason to stop the run
            entry["error"] = f"load: {err}"[:300]
            row["kernels"][key] = entry
            continue
        _check_and_time(torch, entry, call, out, ref, case["dtype"], args,
                        _hang_handler(row, key, results, misses, table))
        row["kernels"][key] = entry
        print(f"{key}: err {entry['rel_err']:.2e} max {entry['max_abs']:.2e} {'ok' if entry['correct'] else 'WRONG'}"
              + (f", {entry['ms'] * 1e3:.1f} us" if entry["correct"] else ""), flush=True)
    timed = [(e["ms"], key) for key, e in row["kernels"].items() if e["kind"] == "fused" and "ms" in e]
    row["fused_best"] = min(timed) if timed else None
    row["fused_first"] = row["kernels"][case["fused"][0]].get("ms")
    row["unfused_ms"] = row["kernels"][pair_key].get("ms")
    return row


def _run_gated_case(case, modules, torch, tvm, dev, args, results, misses) -> dict:
    """The gated kernels against float32 torch, and the unfused form (our wgmma GEMM on the concatenated weight, then
    torch's ``silu(gate) * up``) and eager torch (two ``F.linear`` calls and the product), timed alike."""
    F = torch.nn.functional
    (m, n, k), dtype, tdt, gen = _case_setup(case, torch, dev, ("m", "n", "k"))
    a = torch.randn(m, k, device=dev, generator=gen).to(tdt)
    w_gate, w_up = ((torch.randn(n, k, device=dev, generator=gen) * 2 / k ** 0.5).to(tdt) for _ in range(2))
    w_pairs = torch.stack([w_gate, w_up], dim=1).reshape(2 * n, k).contiguous()    # gated_gemm.interleaved_rows
    w_cat = torch.cat([w_gate, w_up]).contiguous()
    ref = F.silu(a.float() @ w_gate.float().T) * (a.float() @ w_up.float().T)
    row = {"case": case["key"], "shape": case["shape"], "dtype": dtype, "kernels": {}}
    row["torch_ms"] = median_ms(lambda: F.silu(F.linear(a, w_gate)) * F.linear(a, w_up), args.iters, args.reps)
    tv = lambda *ts: [tvm.runtime.from_dlpack(t) for t in ts]  # noqa: E731

    def make_call(key, kind, entry, out):
        if kind == "fused":
            fused = tvm.runtime.load_module(str(OUT / modules[key]["library"]))["gemm_wgmma"]
            entry.update(knobs=modules[key]["knobs"], registers=modules[key]["registers"])
            targs = tv(a, w_pairs, out)
            return lambda: fused(*targs)
        gemm = tvm.runtime.load_module(str(OUT / modules[case["gemm"]]["library"]))["gemm_wgmma"]
        entry.update(knobs=modules[case["gemm"]]["knobs"])
        mid = torch.full((m, 2 * n), float("nan"), device=dev, dtype=tdt)
        gemm_args = tv(a, w_cat, mid)

        def call():
            gemm(*gemm_args)
            torch.mul(F.silu(mid[:, :n]), mid[:, n:], out=out)
        return call

    return _fused_and_pair(torch, dev, case, row, make_call, (m, n), ref, args, results, misses, _gated_table)


def _gated_table(results) -> None:
    print(f"\n{'case':34s} {'torch us':>9s} {'pair us':>8s} {'first us':>9s} {'best us':>8s} {'pair/first':>10s} "
          f"{'TFLOP/s':>8s}  best fused / wrong")
    nan = float("nan")
    for row in results:
        best = row.get("fused_best")
        m, n, k = (row["shape"][key] for key in ("m", "n", "k"))
        pair, first = row.get("unfused_ms") or nan, row.get("fused_first") or nan
        wrong = [key.split("__")[1] for key, e in row["kernels"].items() if not e.get("correct")]
        print(f"{row['case']:34s} {row['torch_ms'] * 1e3:9.1f} {pair * 1e3:8.1f} {first * 1e3:9.1f} "
              f"{(best[0] if best else nan) * 1e3:8.1f} {pair / first:10.2f} {4 * m * n * k / first / 1e9:8.0f}  "
              f"{best[1].split('__')[1] if best else '-'} / {' '.join(wrong)}")
    print("(torch = eager silu(F.linear) * F.linear; pair = our gemm_wgmma on the concatenated weight + torch's silu * "
          "up; first = the gated template's first knob set (the compile path's); pair/first > 1: gated faster)")


def _norm_table(results) -> None:
    print(f"\n{'case':30s} {'torch us':>9s} {'pair us':>8s} {'first us':>9s} {'best us':>8s} {'pair/best':>9s} "
          f"{'pair/first':>10s}  best fused / wrong")
    for row in results:
        best = row.get("fused_best")
        nan = float("nan")
        pair, first = row.get("unfused_ms") or nan, row.get("fused_first") or nan
        best_ms = best[0] if best else nan
        wrong = [key.split("__")[1] for key, e in row["kernels"].items() if not e.get("correct")]
        print(f"{row['case']:30s} {row['torch_ms'] * 1e3:9.1f} {pair * 1e3:8.1f} {first * 1e3:9.1f} "
              f"{best_ms * 1e3:8.1f} {pair / best_ms:9.2f} {pair / first:10.2f}  "
              f"{best[1].split('__')[1] if best else '-'} / {' '.join(wrong)}")
    print("(torch = eager F.linear + add + F.layer_norm; pair = our unfused gemm_wgmma + bias_residual_layernorm; "
          "first = the fused template's first knob set (the compile path's), best = its fastest measured; "
          "ratios > 1: fused faster)")


def main(argv=None) -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="compile and export the kernels here (TVM compiler and nvcc)")
    b.add_argument("--configs", type=int, default=2,
                   help="persistent cooperative wgmma knob choices per case (best-ranked first; plus the best "
                        "non-persistent)")
    b.add_argument("--no-pingpong", dest="pingpong", action="store_false",
                   help="gemm suite: leave out the ping-pong variants (best-ranked one per tile width)")
    r = sub.add_parser("run", help="check and time on the GPU")
    r.add_argument("--iters", type=int, default=50, help="timed runs per kernel (median reported)")
    r.add_argument("--reps", type=int, default=20, help="back-to-back calls per timed sample (ffn suite)")
    for p in (b, r):
        p.add_argument("--suite", choices=sorted(OUTS), default="gemm",
                       help="gemm: the GEMM and QKV kernels; ffn: the fused FFN against its unfused forms; norm: the "
                            "fused GEMM + bias + residual + LayerNorm against its unfused pair; gated: the gated "
                            "MLP GEMM (silu(gate) * up) against the plain GEMM + the product")
        p.add_argument("--out", type=Path, default=None,
                       help="artifact folder (default out/wgmma, out/ffn_wgmma, out/norm_wgmma, out/gated_wgmma)")
    args = parser.parse_args(argv)
    OUT = OUTS[args.suite] if args.out is None else (args.out if args.out.is_absolute() else ROOT / args.out)
    if args.step == "build":
        {"ffn": build_ffn, "norm": build_norm, "gated": build_gated}.get(args.suite, build)(args)
    else:
        run(args)


if __name__ == "__main__":
    sys.exit(main())
