"""Downstream fusion templates on the H200: ours (fused and unfused) vs torch eager, torch.compile, TVM dlight.

Two steps, because the GPU machine has TVM's runtime but builds nothing:

1. ``build`` (here, with the TVM compiler): for every case of the plan, schedule and compile the fused
   template and the stages of its unfused chain for CUDA sm_90, ``--candidates`` configurations each (the
   template's own ranking of its knob space), plus TVM's default (dlight) schedule of every unfused stage;
   export each module under ``--out``, compile its CUDA source with nvcc (-Xptxas -v: registers, spills) into a
   cubin stored under the source's hash, and write ``manifest.json``.
2. ``run`` (GPU machine: torch, TVM runtime from ``.devkit``): TVM's CUDA loader is answered with the prebuilt
   cubins. For every case: fresh random inputs, outputs poisoned with NaN, every module checked against torch
   float32 on the same inputs (relative Frobenius error), then timed with CUDA events (median of repeats of
   back-to-back calls after warm-up): our fused template (best measured candidate), our unfused chain (sum of
   its stages' best candidates), dlight (sum of its stages), torch eager (cuBLAS), and ``torch.compile`` of the
   same chain (dynamic=False; compiled first in parallel worker processes so the timed process hits the
   Inductor cache). Prints a table, writes JSON, and dumps SASS instruction counts (cuobjdump) of the fused
   templates' best candidates.

Every chain also has its Hopper form (``wgmma`` column): the GEMM and QKV stages on the wgmma kernels
(``*_wgmma`` templates, sm_90a cubins), LayerNorm on its template, what ``compile`` uses on an sm_90 target.

Plans: ``probe`` (square 4096^3 GEMM fp16/bf16 and the BERT-Base layer at 4096 tokens, no torch.compile),
``full`` (BERT-Base and BERT-Large layers at 128, 4096 and 32768 tokens, fp16, plus bf16 at 4096 tokens and the
square GEMM in both dtypes). Each chain: ``qkv`` (fused: qkv_projection; unfused: gemm_bias + split_heads),
``attn_out_ln`` / ``ffn_down_ln`` (fused: gemm_bias_residual_layernorm; unfused: gemm + bias_residual_layernorm),
``ffn_up_gelu`` (gemm_bias_gelu_erf, GELU in the epilogue), ``bias_res_ln`` (bias_residual_layernorm alone).

    python scripts/bench_templates.py build --plan full --out out/templates
    python3 scripts/bench_templates.py run --out out/templates --json $OUT/templates.json   # on the GPU machine
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)
from benchlib import source_key  # noqa: E402

MODELS = {"bert-base": {"hidden": 768, "ffn": 3072, "heads": 12},
          "bert-large": {"hidden": 1024, "ffn": 4096, "heads": 16}}
TOKENS = {128: (1, 128), 4096: (8, 512), 32768: (64, 512)}  # tokens -> (batch, seq)
TOLERANCE = {"float16": 5e-3, "bfloat16": 2e-2}
SASS_OPS = ("HMMA", "LDGSTS", "LDSM", "LDL", "STL", "STG.E.128", "LDG.E.128")


# ---------------------------------------------------------------------------------------------------------------
# cases

def chain_cases(model: str, tokens: int, dtype: str, compile_baseline: bool) -> list[dict]:
    """The downstream chains of one encoder layer: (fused template, shape), unfused stages, torch chain."""
    dims = MODELS[model]
    h, f, heads = dims["hidden"], dims["ffn"], dims["heads"]
    batch, seq = TOKENS[tokens]
    m = tokens
    qkv_shape = {"batch": batch, "seq": seq, "heads": heads, "head_dim": h // heads}
    base = {"model": model, "tokens": tokens, "dtype": dtype, "compile": compile_baseline}
    ln = ("bias_residual_layernorm", {"m": m, "n": h})
    return [
        dict(base, chain="qkv", fused=("qkv_projection", qkv_shape),
             unfused=[("gemm_bias", {"m": m, "n": 3 * h, "k": h}), ("split_heads", qkv_shape)],
             wgmma=[("qkv_projection_wgmma", qkv_shape)],
             torch={"kind": "qkv", "m": m, "h": h, **qkv_shape}),
        dict(base, chain="attn_out_ln", fused=("gemm_bias_residual_layernorm", {"m": m, "n": h, "k": h}),
             unfused=[("gemm", {"m": m, "n": h, "k": h}), ln], wgmma=[("gemm_wgmma", {"m": m, "n": h, "k": h}), ln],
             torch={"kind": "gemm_ln", "m": m, "n": h, "k": h}),
        dict(base, chain="ffn_up_gelu", fused=("gemm_bias_gelu_erf", {"m": m, "n": f, "k": h}),
             unfused=[("gemm_bias_gelu_erf", {"m": m, "n": f, "k": h})],
             wgmma=[("gemm_bias_gelu_erf_wgmma", {"m": m, "n": f, "k": h})],
             torch={"kind": "gemm_act", "act": "gelu_erf", "m": m, "n": f, "k": h}),
        dict(base, chain="ffn_down_ln", fused=("gemm_bias_residual_layernorm", {"m": m, "n": h, "k": f}),
             unfused=[("gemm", {"m": m, "n": h, "k": f}), ln], wgmma=[("gemm_wgmma", {"m": m, "n": h, "k": f}), ln],
             torch={"kind": "gemm_ln", "m": m, "n": h, "k": f}),
        dict(base, chain="bias_res_ln", fused=("bias_residual_layernorm", {"m": m, "n": h}),
             unfused=[("bias_residual_layernorm", {"m": m, "n": h})], wgmma=[],
             torch={"kind": "ln", "m": m, "n": h}),
    ]


def square_case(dtype: str, compile_baseline: bool) -> dict:
    shape = {"m": 4096, "n": 4096, "k": 4096}
    return {"model": "square", "tokens": 4096, "dtype": dtype, "compile": compile_baseline, "chain": "gemm_4096",
            "fused": ("gemm", shape), "unfused": [("gemm", shape)], "wgmma": [("gemm_wgmma", shape)],
            "torch": {"kind": "gemm", **shape}}


def plan(name: str) -> list[dict]:
    """The cases of a plan, in run order (most informative first, so a time budget cuts the least)."""
    if name == "probe":
        cases = [square_case("float16", False), square_case("bfloat16", False)]
        cases += chain_cases("bert-base", 4096, "float16", False)
    elif name == "full":
        # torch.compile for fp16 at >= 4096 tokens (BERT-Large at 32768 left out to fit the
        # device-time budget: its compile warm-up is the slowest); bf16 chains against eager only
        cases = [square_case("bfloat16", False), square_case("float16", True)]
        for model, tokens in (("bert-base", 4096), ("bert-large", 4096), ("bert-base", 32768),
                              ("bert-large", 32768), ("bert-base", 128), ("bert-large", 128)):
            compile_baseline = tokens >= 4096 and (model, tokens) != ("bert-large", 32768)
            cases += chain_cases(model, tokens, "float16", compile_baseline)
        cases += chain_cases("bert-base", 4096, "bfloat16", False)
    else:
        raise ValueError(f"unknown plan {name!r} (probe, full)")
    for case in cases:
        case["id"] = f"{case['model']}/{case['tokens']}/{case['chain']}/{case['dtype']}"
    return cases


def module_key(kind: str, template: str, shape: dict, dtype: str, knobs: dict | None) -> str:
    text = json.dumps([kind, template, shape, dtype, knobs], sort_keys=True)
    return f"{kind}_{template}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


# ---------------------------------------------------------------------------------------------------------------
# build (CPU machine)

def _nvcc(src: str, cubin: Path, arch: str = "sm_90") -> dict:
    # sm_90a needs the explicit gencode (the -arch shorthand adds an sm_90 pass)
    return bl.nvcc_cubin(src, cubin, arch, gencode=True)


def build(args) -> None:
    import tvm
    from tvm.s_tir import dlight as dl

    from stof_tvm.schedules.templates import get_template
    from stof_tvm.schedules.templates.build import build as build_template
    from stof_tvm.schedules.templates.gemm_wgmma import build_kernel as build_wgmma
    from stof_tvm.schedules.templates.build import cuda_source, cuda_target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = cuda_target()
    cases = plan(args.plan)
    modules: dict[str, dict] = {}
    sources: dict[str, str] = {}
    t0 = time.time()

    def add(kind, name, shape, dtype, knobs):
        key = module_key(kind, name, shape, dtype, knobs)
        if key in modules:
            return key
        tmpl = get_template(name)
        if kind == "wgmma":
            ex = build_wgmma(name, shape, dtype, knobs)
        elif kind == "ours":
            ex = build_template(tmpl.schedule(shape, dtype, knobs), target)
        else:
            mod = tvm.IRModule({"main": tmpl.primfunc(shape, dtype)})
            with target:
                mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                              dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
            ex = tvm.compile(mod, target=target)
        src = cuda_source(ex)
        lib = f"{key}.so"
        ex.export_library(str(out / lib))
        sources[source_key(src)] = (src, "sm_90a" if kind == "wgmma" else "sm_90")
        modules[key] = {"kind": kind, "template": name, "shape": shape, "dtype": dtype, "knobs": knobs,
                        "library": lib, "source": source_key(src),
                        "function": "gemm_wgmma" if kind == "wgmma" else "main",
                        "arguments": [[a, list(s), d] for a, s, d in tmpl.arguments(shape, dtype)],
                        "resources": tmpl.resources(shape, dtype, knobs) if knobs else None}
        return key

    for case in cases:
        stages = [case["fused"]] + [s for s in case["unfused"] if s != case["fused"]]
        case["modules"] = {}
        for name, shape in stages:
            tmpl = get_template(name)
            space = tmpl.knob_space(shape, case["dtype"])
            keys = [add("ours", name, shape, case["dtype"], knobs) for knobs in space[:args.candidates]]
            case["modules"][f"ours:{name}"] = keys
        for name, shape in case["unfused"]:
            case["modules"][f"dlight:{name}"] = [add("dlight", name, shape, case["dtype"], None)]
        for name, shape in case["wgmma"]:   # the Hopper form: wgmma stages (and the LayerNorm template)
            tmpl = get_template(name)
            kind = "wgmma" if name.endswith("_wgmma") else "ours"
            space = tmpl.knob_space(shape, case["dtype"])
            case["modules"][f"wgmma:{name}"] = [add(kind, name, shape, case["dtype"], knobs)
                                                 for knobs in space[:args.candidates]]
        print(f"built {case['id']}: {len(modules)} modules so far ({time.time() - t0:.0f} s)", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        reports = dict(zip(sources, pool.map(lambda kv: _nvcc(kv[1][0], out / f"{kv[0]}.cubin", kv[1][1]),
                                             sources.items())))
    for info in modules.values():
        info["ptxas"] = reports[info["source"]]
    manifest = {"plan": args.plan, "cases": cases, "modules": modules, "built": time.strftime("%Y-%m-%d %H:%M")}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    spills = [k for k, v in modules.items() if v["ptxas"]["spill_stores"] or v["ptxas"]["stack_frame"]]
    print(f"{len(cases)} cases, {len(modules)} modules, {len(sources)} cubins in {out} ({time.time() - t0:.0f} s); "
          f"modules with spills or stack: {spills or 'none'}")


# ---------------------------------------------------------------------------------------------------------------
# run (GPU machine)

def torch_chain(spec: dict, dtype: str):
    """(make_inputs, fn) of the torch form of a chain; inputs are named like the template arguments."""
    import torch
    import torch.nn.functional as F

    kind = spec["kind"]
    act = {"gelu_erf": lambda x: F.gelu(x), "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
           "relu": F.relu, "none": lambda x: x}

    if kind == "gemm":
        return lambda t: F.linear(t["A"], t["W"])
    if kind == "gemm_act":
        return lambda t: act[spec["act"]](F.linear(t["A"], t["W"], t["bias"]))
    if kind == "gemm_ln":
        return lambda t: F.layer_norm(F.linear(t["A"], t["W"], t["bias"]) + t["residual"], (spec["n"],),
                                      t["gamma"], t["beta"], eps=1e-5)
    if kind == "ln":
        return lambda t: F.layer_norm(t["x"] + t["bias"] + t["residual"], (spec["n"],), t["gamma"], t["beta"],
                                      eps=1e-5)
    if kind == "qkv":
        b, s, hh, d = spec["batch"], spec["seq"], spec["heads"], spec["head_dim"]
        return lambda t: F.linear(t["x"], t["W"], t["bias"]).view(b, s, 3, hh, d).permute(2, 0, 3, 1, 4).contiguous()
    raise ValueError(kind)


def _compile_worker(job):
    """Child process: compile (and run once) a torch chain so the parent's compile hits Inductor's cache."""
    import torch

    spec, dtype, arg_specs = job
    fn = torch.compile(torch_chain(spec, dtype), dynamic=False)
    inputs = {n: torch.randn(s, dtype=getattr(torch, dtype), device="cuda") for n, s, _ in arg_specs}
    with torch.no_grad():
        fn(inputs)
    torch.cuda.synchronize()
    return True


class Runner:
    def __init__(self, out: Path):
        import torch
        import tvm

        from stof_tvm.cuda_runtime import ensure_cuda_runtime

        if not ensure_cuda_runtime():
            raise RuntimeError("TVM's CUDA runtime could not be loaded")
        self.torch, self.tvm, self.out = torch, tvm, out
        self.manifest = json.loads((out / "manifest.json").read_text())
        self.cubins = bl.PrebuiltCubins(out)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.functions = {}

    def function(self, key: str):
        if key not in self.functions:
            lib = self.tvm.runtime.load_module(str(self.out / self.manifest["modules"][key]["library"]))
            self.functions[key] = lib[self.manifest["modules"][key].get("function", "main")]
        return self.functions[key]

    def timeit(self, fn, repeats: int = 7) -> float:
        """Median milliseconds per call: CUDA events around back-to-back calls (as many as fill ~5 ms) after a
        warm-up call (:func:`benchlib.time_ms`)."""
        return bl.time_ms(fn, warmup=1, samples=repeats, sample_ms=5.0).median_ms

    def inputs(self, arguments, dtype, outputs: int):
        """Random inputs (scaled like activations and weights) and NaN-poisoned outputs, as torch tensors."""
        torch = self.torch
        tensors = {}
        for name, shape, _ in arguments[:-outputs]:
            scale = 1.0 if name in ("A", "x", "residual", "y") else (0.05 if name.startswith("W") else 0.5)
            tensors[name] = (torch.randn(shape, device="cuda") * scale).to(getattr(torch, dtype))
        for name, shape, _ in arguments[-outputs:]:
            tensors[name] = torch.full(shape, float("nan"), device="cuda", dtype=getattr(torch, dtype))
        return tensors

    def run_tvm(self, key: str, tensors: dict, check_ref=None):
        info = self.manifest["modules"][key]
        fn = self.function(key)
        args = [self.tvm.runtime.from_dlpack(tensors[a]) for a, _, _ in info["arguments"]]
        out_name = info["arguments"][-1][0]
        tensors[out_name].fill_(float("nan"))
        fn(*args)
        self.torch.cuda.synchronize()
        err = None
        if check_ref is not None:
            got = tensors[out_name].float()
            err = float((got - check_ref).norm() / check_ref.norm()) if torch_finite(got) else float("inf")
        return (lambda: fn(*args)), err


def torch_finite(t) -> bool:
    return bool(t.isfinite().all())


def run(args) -> None:
    import torch

    out = Path(args.out)
    runner = Runner(out)
    manifest = runner.manifest
    cases = manifest["cases"]
    deadline = time.time() + args.budget
    results = []
    compile_jobs = []
    for case in cases:
        if case["compile"] and not args.no_compile:
            compile_jobs.append((case["torch"], case["dtype"], _torch_args(case, manifest)))
    t0 = time.time()
    if compile_jobs:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(min(14, len(compile_jobs))) as pool:
            pool.map(_compile_worker, compile_jobs)
    warm_compile_s = time.time() - t0
    print(f"torch.compile warm-up of {len(compile_jobs)} chains in workers: {warm_compile_s:.0f} s", flush=True)

    for case in cases:
        if time.time() > deadline:
            print(f"budget reached; skipping {case['id']}")
            continue
        res = run_case(runner, case, args)
        results.append(res)
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "meta": _meta(runner, warm_compile_s)},
                                                  indent=1))
    sass = dump_sass(runner, cases, results) if not args.no_sass else {}
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "sass": sass,
                                               "meta": _meta(runner, warm_compile_s)}, indent=1))
    print_table(results)
    print(f"module loads: prebuilt cubins {runner.cubins.hits}, compiled here {len(runner.cubins.misses)}")


def _meta(runner, warm_compile_s):
    torch = runner.torch
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cubin_hits": runner.cubins.hits,
            "cubin_misses": len(runner.cubins.misses), "compile_warmup_s": warm_compile_s,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def _torch_args(case, manifest):
    key = case["modules"][f"ours:{case['fused'][0]}"][0]
    return manifest["modules"][key]["arguments"][:-1]


def run_case(runner: Runner, case: dict, args) -> dict:
    torch = runner.torch
    manifest = runner.manifest
    dtype = case["dtype"]
    tol = TOLERANCE[dtype]
    res = {"id": case["id"], "chain": case["chain"], "model": case["model"], "tokens": case["tokens"],
           "dtype": dtype, "checks": {}, "ms": {}}
    fused_name = case["fused"][0]
    fused_info = manifest["modules"][case["modules"][f"ours:{fused_name}"][0]]
    # torch inputs named like the fused template's arguments; the unfused stages reuse them
    tensors = runner.inputs(fused_info["arguments"], dtype, 1)
    torch_inputs = {name: tensors[name] for name, _, _ in fused_info["arguments"][:-1]}
    chain = torch_chain(case["torch"], dtype)
    with torch.no_grad():
        ref = chain({k: v.float() for k, v in torch_inputs.items()}).float()
        res["ms"]["torch_eager"] = runner.timeit(lambda: chain(torch_inputs))
        if case["compile"] and not args.no_compile:
            compiled = torch.compile(chain, dynamic=False)
            compiled(torch_inputs)
            res["ms"]["torch_compile"] = runner.timeit(lambda: compiled(torch_inputs))

    def best_of(label, keys, stage_tensors, stage_ref):
        timings = {}
        for key in keys:
            fn, err = runner.run_tvm(key, stage_tensors, stage_ref)
            res["checks"][key] = err
            if err is None or not err <= tol:
                print(f"  FAIL {case['id']} {key}: rel err {err}", flush=True)
                continue
            timings[key] = runner.timeit(fn)
        if not timings:
            return None, None
        best = min(timings, key=timings.get)
        res.setdefault("candidates", {})[label] = timings
        return best, timings[best]

    key, ms = best_of(f"ours:{fused_name}", case["modules"][f"ours:{fused_name}"], tensors, ref)
    res["ms"]["ours_fused"], res["best_fused"] = ms, key
    if key:
        res["best_knobs"] = manifest["modules"][key]["knobs"]
    # unfused chains and the wgmma form: stage tensors are derived from the case inputs, references from torch
    # float32 stages
    for kind in ("ours", "dlight", "wgmma"):
        stages = case.get("wgmma", []) if kind == "wgmma" else case["unfused"]
        if not stages:
            continue
        total, ok = 0.0, True
        for stage_name, stage_shape in stages:
            stage_keys = case["modules"][f"{kind}:{stage_name}"]
            stage_tensors, stage_ref = stage_io(runner, case, stage_name, stage_shape, tensors, manifest,
                                                stage_keys[0])
            _, ms = best_of(f"{kind}:{stage_name}", stage_keys, stage_tensors, stage_ref)
            if ms is None:
                ok = False
                break
            total += ms
        res["ms"]["wgmma" if kind == "wgmma" else f"{kind}_unfused"] = total if ok else None
    flops = case_flops(case)
    if flops and res["ms"].get("ours_fused"):
        res["tflops_ours"] = flops / res["ms"]["ours_fused"] / 1e9
    print(f"{case['id']}: " + ", ".join(f"{k} {v:.4f}" for k, v in res["ms"].items() if v), flush=True)
    return res


def case_flops(case):
    shape = case["fused"][1]
    if "k" in shape:
        return 2 * shape["m"] * shape["n"] * shape["k"]
    if "head_dim" in shape:
        hidden = shape["heads"] * shape["head_dim"]
        return 2 * shape["batch"] * shape["seq"] * 3 * hidden * hidden
    return None


def stage_io(runner, case, stage_name, stage_shape, tensors, manifest, key):
    """Inputs and float32 reference of one unfused stage, derived from the case's inputs."""
    torch = runner.torch
    import torch.nn.functional as F

    info = manifest["modules"][key]
    dtype = case["dtype"]
    t = {}
    args = info["arguments"]
    stage_name = stage_name.removesuffix("_wgmma")   # a wgmma stage takes the inputs of its mma.sync twin
    with torch.no_grad():
        if stage_name == "split_heads":
            y = F.linear(tensors["x"], tensors["W"], tensors["bias"])
            t["y"] = y
            s = case["torch"]
            ref = y.float().view(s["batch"], s["seq"], 3, s["heads"], s["head_dim"]).permute(2, 0, 3, 1, 4)
        elif stage_name == "bias_residual_layernorm" and case["chain"] != "bias_res_ln":
            t["x"] = F.linear(tensors["A"], tensors["W"])
            for name in ("bias", "residual", "gamma", "beta"):
                t[name] = tensors[name]
            ref = F.layer_norm(t["x"].float() + t["bias"].float() + t["residual"].float(), (stage_shape["n"],),
                               t["gamma"].float(), t["beta"].float(), eps=1e-5)
        elif stage_name in ("gemm", "gemm_bias") and case["chain"] in ("qkv",):
            t = {"A": tensors["x"], "W": tensors["W"], "bias": tensors["bias"]}
            ref = F.linear(t["A"].float(), t["W"].float(), t["bias"].float())
        elif stage_name == "gemm" and case["chain"] != "gemm_4096":
            t = {"A": tensors["A"], "W": tensors["W"]}
            ref = F.linear(t["A"].float(), t["W"].float())
        else:  # the stage is the fused template itself
            t = dict(tensors)
            ref = torch_chain(case["torch"], dtype)({k: v.float() for k, v in tensors.items()}).float()
    for name, shape, _ in args[-1:]:
        t[name] = torch.full(shape, float("nan"), device="cuda", dtype=getattr(torch, dtype))
    return t, ref.float().contiguous()


def dump_sass(runner, cases, results) -> dict:
    """Instruction counts in the SASS of each fused template's best candidate (cuobjdump on this machine)."""
    counts = {}
    manifest = runner.manifest
    for res in results:
        key = res.get("best_fused")
        if not key or manifest["modules"][key]["template"] in counts:
            continue
        cubin = runner.out / manifest["modules"][key]["ptxas"]["cubin"]
        proc = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True)
        if proc.returncode:
            continue
        ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z][A-Z0-9_.]*)", proc.stdout, flags=re.M)
        counts[manifest["modules"][key]["template"]] = {
            "case": res["id"], "module": key, "ptxas": manifest["modules"][key]["ptxas"],
            **{op: sum(1 for o in ops if o.startswith(op)) for op in SASS_OPS}}
    for name, c in counts.items():
        print(f"SASS {name} ({c['case']}): " + ", ".join(f"{op} {c[op]}" for op in SASS_OPS)
              + f"; registers {c['ptxas']['registers']}, spills {c['ptxas']['spill_stores']}/"
                f"{c['ptxas']['spill_loads']}, stack {c['ptxas']['stack_frame']}")
    return counts


def print_table(results) -> None:
    cols = ["ours_fused", "ours_unfused", "wgmma", "dlight_unfused", "torch_eager", "torch_compile"]
    print("\n| case | " + " | ".join(cols) + " | fused vs eager | fused vs compile | TFLOP/s | wgmma vs compile |")
    print("|---|" + "---:|" * (len(cols) + 4))
    for r in results:
        ms = r["ms"]
        cells = [f"{ms[c]:.4f}" if ms.get(c) else "-" for c in cols]
        vs_wgmma = f"{ms['torch_compile'] / ms['wgmma']:.2f}x" if ms.get("wgmma") and ms.get("torch_compile") else "-"
        vs_eager = f"{ms['torch_eager'] / ms['ours_fused']:.2f}x" if ms.get("ours_fused") else "-"
        vs_comp = (f"{ms['torch_compile'] / ms['ours_fused']:.2f}x" if ms.get("ours_fused") and ms.get("torch_compile")
                   else "-")
        tf = f"{r['tflops_ours']:.0f}" if r.get("tflops_ours") else "-"
        print(f"| {r['id']} | " + " | ".join(cells) + f" | {vs_eager} | {vs_comp} | {tf} | {vs_wgmma} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the plan's modules here")
    b.add_argument("--plan", default="probe")
    b.add_argument("--out", default="out/templates")
    b.add_argument("--candidates", type=int, default=3, help="configurations per template (its own ranking)")
    b.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes")
    r = sub.add_parser("run", help="check and time on the GPU machine")
    r.add_argument("--out", default="out/templates")
    r.add_argument("--json", default=None)
    r.add_argument("--budget", type=float, default=400.0, help="seconds after which no new case starts")
    r.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    r.add_argument("--no-sass", action="store_true")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        build(args)
    else:
        run(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
