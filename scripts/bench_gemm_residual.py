"""The residual add in the GEMM's epilogue against the bias + residual LayerNorm after it (issue 17), on the H200.

In a post-LN model (BERT, RoBERTa) the attention-output and FFN-down GEMMs feed ``LayerNorm(y + bias + residual)``.
The compile path runs ``gemm_wgmma`` then ``bias_residual_layernorm``, which reads the GEMM's output and the
residual and writes the result (three [m, n] tensors through HBM; 39.4 us at 32768 x 768 against a 36.0 us floor,
session 11 call 5). The pair measured here instead adds bias and residual in the GEMM's epilogue
(``gemm_bias_residual_wgmma``: the residual read in the lanes' fragment layout one chunk ahead, under the other
consumer's main loop in the ping-pong sets) and normalises the sum with the plain ``layernorm`` template (two
tensors: floor 24 us): it wins if the GEMM hides the residual's read.

Cases (float16): RoBERTa-base's attention output (k 768) and FFN down (k 3072) at 16 x 2048 and 8 x 512 tokens (32768
and 4096 rows of 768), BERT-large's at 8 x 2048 (16384 rows of 1024). Per case the compile path's knob sets (the
chooser's, untuned, as ``stof_tvm.compile`` picks them) of ``gemm_wgmma``, ``bias_residual_layernorm``,
``gemm_bias_residual_wgmma``, ``layernorm``, and ``gemm_bias_wgmma`` (the bias alone in the epilogue: what the
residual's read costs the GEMM); and a third chain with the residual GEMM's ``residual_ahead="doubling"`` form (its
loads issued further ahead as the epilogue frees registers; same knobs).

Two steps, because the GPU machine has TVM's runtime only (as ``bench_rownorm.py``):

1. ``build`` (here): each kernel compiled for CUDA, its library exported under ``--out`` and its CUDA source compiled
   with nvcc for sm_90a into a cubin stored under the source's hash (``manifest.json``: modules, ptxas figures);
2. ``run`` (GPU machine): per case seeded random inputs (a pool of input sets together larger than 2.5x the L2
   cache, cycled call by call, so the residual comes from HBM as in a model), every output NaN-poisoned, each chain's
   LayerNorm output and the residual GEMM's sum checked against torch float32 (relative Frobenius error), then each
   chain and each kernel timed in 10-call bursts (CUDA events, median of ``--iters`` samples) and sustained (5
   samples of back-to-back calls lasting 50 ms each). Prints a table last; JSON to ``--json``.

``--plan s12epi`` (folder ``out/s12epi``)::

    .venv/bin/python scripts/bench_gemm_residual.py build --plan s12epi
    python3 scripts/bench_gemm_residual.py run --plan s12epi --json $OUT/s12epi.json   # GPU machine, ~60 s
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)

ROOT = Path(__file__).resolve().parents[1]
PLANS = {"s12epi": ROOT / "out" / "s12epi"}
DTYPE = "float16"
# (label, m, n, k): the post-LN GEMMs before a LayerNorm
CASES = [("RoBERTa 16x2048 attention output", 32768, 768, 768), ("RoBERTa 16x2048 FFN down", 32768, 768, 3072),
         ("RoBERTa 8x512 attention output", 4096, 768, 768), ("RoBERTa 8x512 FFN down", 4096, 768, 3072),
         ("BERT-large 8x2048 attention output", 16384, 1024, 1024), ("BERT-large 8x2048 FFN down", 16384, 1024, 4096)]
# the kernels of a case: role -> template
ROLES = {"gemm": "gemm_wgmma", "bias_residual_ln": "bias_residual_layernorm",
         "gemm_residual": "gemm_bias_residual_wgmma", "ln": "layernorm", "gemm_bias": "gemm_bias_wgmma",
         "gemm_residual_doubling": "gemm_bias_residual_wgmma"}
# roles whose template is built with another residual_ahead than the registered one (same knobs and name)
AHEAD = {"gemm_residual_doubling": "doubling"}
# the two chains: (name, [(role, input names, output name)])
CHAINS = {"current": [("gemm", ("x", "w"), "y"),
                      ("bias_residual_ln", ("y", "bias", "residual", "gamma", "beta"), "out")],
          "residual in the GEMM": [("gemm_residual", ("x", "w", "bias", "residual"), "sum"),
                                   ("ln", ("sum", "gamma", "beta"), "out")],
          "residual in the GEMM, doubling": [("gemm_residual_doubling", ("x", "w", "bias", "residual"), "sum"),
                                             ("ln", ("sum", "gamma", "beta"), "out")]}
SOLO = {"gemm_bias": ("x", "w", "bias")}   # role -> inputs; its output is named as the role
LN_EPS = 1e-5
TOLERANCE = {"out": 5e-3, "sum": 1e-2, "y": 1e-2}   # relative Frobenius error vs float32
L2_BYTES = 60e6
SUSTAINED_MS = 50.0


def _shape(role: str, m: int, n: int, k: int) -> dict:
    return {"m": m, "n": n} if role in ("bias_residual_ln", "ln") else {"m": m, "n": n, "k": k}


# ------------------------------------------------------------------------------------------------- build (here)
def build(args) -> None:
    import tvm

    from stof_tvm.compiler.template_choice import TemplateChooser
    from stof_tvm.schedules.templates import cuda_source, get_template
    from stof_tvm.schedules.templates.build import build as build_template
    from stof_tvm.schedules.templates.build import cuda_target
    from stof_tvm.schedules.templates.gemm_wgmma import WgmmaGemmResidualTemplate

    out = Path(args.out) if args.out else PLANS[args.plan]
    out.mkdir(parents=True, exist_ok=True)
    chooser = TemplateChooser(cuda_target("sm_90a"), None)
    manifest = {"plan": args.plan, "built": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "environment": bl.environment(), "cases": []}
    t0 = time.time()
    for label, m, n, k in CASES:
        case = {"label": label, "m": m, "n": n, "k": k, "modules": {}}
        for role, name in ROLES.items():
            template, shape = get_template(name), _shape(role, m, n, k)
            knobs = chooser.knobs(template, shape, DTYPE).knobs
            if role in AHEAD:
                template = WgmmaGemmResidualTemplate(AHEAD[role])
            if name.endswith("_wgmma"):
                ex, function = tvm.compile(tvm.IRModule({"main": template.kernel(shape, DTYPE, knobs)}),
                                           target=cuda_target("sm_90a")), "gemm_wgmma"
            else:
                ex, function = build_template(template.schedule(shape, DTYPE, knobs), cuda_target()), "main"
            key = f"{name}_{m}x{n}x{k}" + (f"_{AHEAD[role]}" if role in AHEAD else "")
            src = cuda_source(ex)
            ex.export_library(str(out / f"{key}.so"))
            report = bl.nvcc_cubin(src, out / f"{bl.source_key(src)}.cubin", "sm_90a", gencode=True)
            case["modules"][role] = {"template": name, "shape": shape, "knobs": knobs, "library": f"{key}.so",
                                     "function": function, "ptxas": report}
            print(f"{key}: {knobs} regs {report['registers']}, spills {report['spill_stores']}, stack "
                  f"{report['stack_frame']} ({time.time() - t0:.0f} s)", flush=True)
        manifest["cases"].append(case)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in out.iterdir()) / 2 ** 20
    spills = [f"{c['label']} {role}" for c in manifest["cases"] for role, info in c["modules"].items()
              if info["ptxas"]["spill_stores"] or info["ptxas"]["stack_frame"]]
    print(f"{sum(len(c['modules']) for c in manifest['cases'])} modules, {size:.1f} MiB in {out}; "
          f"spills or stack: {spills or 'none'}")


# ------------------------------------------------------------------------------------------------- run (GPU)
def make_pool(torch, m: int, n: int, k: int, seed: int) -> list[dict]:
    """Input sets (x, residual per set; the weights shared) with NaN outputs, together >= 2.5x the L2 cache."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = {"device": "cuda", "generator": gen}
    shared = {"w": (torch.randn(n, k, **dev) / k ** 0.5).half(), "bias": (0.5 * torch.randn(n, **dev)).half(),
              "gamma": (1.0 + 0.1 * torch.randn(n, **dev)).half(), "beta": (0.1 * torch.randn(n, **dev)).half()}
    per_set = 2 * (m * k + 4 * m * n)
    pool = []
    for _ in range(max(2, int(2.5 * L2_BYTES / per_set + 0.999))):
        t = dict(shared, x=torch.randn(m, k, **dev).half(), residual=torch.randn(m, n, **dev).half())
        for name in ("y", "sum", "gemm_bias", "out"):
            t[name] = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        pool.append(t)
    return pool


def reference(torch, t: dict) -> dict:
    """Float32 from the fp16 inputs: the GEMM, the residual sum, its LayerNorm."""
    import torch.nn.functional as F

    f = {name: t[name].float() for name in ("x", "w", "bias", "residual", "gamma", "beta")}
    y = f["x"] @ f["w"].t()
    total = y + f["bias"] + f["residual"]
    return {"y": y, "sum": total, "gemm_bias": y + f["bias"],
            "out": F.layer_norm(total, (total.shape[-1],), f["gamma"], f["beta"], eps=LN_EPS)}


def rel_err(torch, got, ref) -> float:
    got = got.float()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))


def timings(fn, iters: int) -> dict:
    """ms per call: 10-call bursts (median of ``iters`` samples) and sustained (5 samples of 50 ms of calls)."""
    burst = bl.time_ms(fn, warmup=5, samples=iters, number=10).median_ms
    number = max(1, min(5000, round(SUSTAINED_MS / burst)))
    return {"burst_ms": burst, "sustained_ms": bl.time_ms(fn, warmup=5, samples=5, number=number).median_ms}


def cycled(calls: list):
    """One callable running ``calls[i % len]`` on its i-th call: each call takes the next input set."""
    state = {"i": 0}

    def call():
        calls[state["i"] % len(calls)]()
        state["i"] += 1
    return call


def run(args) -> None:
    import torch
    import tvm

    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    started = time.time()
    out = Path(args.out) if args.out else PLANS[args.plan]
    manifest = json.loads((out / "manifest.json").read_text())
    if not ensure_cuda_runtime():
        raise RuntimeError("TVM's CUDA runtime could not be loaded")
    cubins = bl.PrebuiltCubins(out)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict] = []
    payload = {"plan": manifest["plan"], "built": manifest["built"], "environment": bl.environment(), "rows": rows}
    json_path = Path(args.json) if args.json else bl.out_dir() / "s12epi.json"
    for ci, case in enumerate(manifest["cases"]):
        m, n, k = case["m"], case["n"], case["k"]
        pool = make_pool(torch, m, n, k, seed=ci)
        fns = {role: tvm.runtime.load_module(str(out / info["library"]))[info["function"]]
               for role, info in case["modules"].items()}
        tv = [{name: tvm.runtime.from_dlpack(value) for name, value in t.items()} for t in pool]
        ref = reference(torch, pool[0])
        row = {"case": case["label"], "m": m, "n": n, "k": k, "sets": len(pool),
               "knobs": {role: info["knobs"] for role, info in case["modules"].items()}, "chains": {}, "kernels": {}}
        rows.append(row)

        def chain_call(steps, i):
            return lambda: [fns[role](*(tv[i][a] for a in ins), tv[i][res]) for role, ins, res in steps]

        for chain, steps in CHAINS.items():
            print(f"{case['label']}: {chain}: launching", flush=True)   # a kernel that faults is the last named
            bl.write_json(json_path, payload)
            for _, _, res in steps:                 # poisoned again: the other chain wrote ``out`` too
                pool[0][res].fill_(float("nan"))
            chain_call(steps, 0)()
            torch.cuda.synchronize()
            errs = {res: rel_err(torch, pool[0][res], ref[res]) for _, _, res in steps}
            entry = {"rel_err": errs, "correct": all(e < TOLERANCE[res] for res, e in errs.items())}
            if entry["correct"]:
                entry.update(timings(cycled([chain_call(steps, i) for i in range(len(pool))]), args.iters))
                for role, ins, res in steps:        # each kernel alone, on the same cycled sets
                    row["kernels"][role] = timings(cycled([chain_call([(role, ins, res)], i)
                                                           for i in range(len(pool))]), args.iters)
            row["chains"][chain] = entry
            print(f"{case['label']}: {chain}: errors {errs}"
                  + (f", {entry['burst_ms'] * 1e3:.1f} / {entry['sustained_ms'] * 1e3:.1f} us" if entry["correct"]
                     else " WRONG"), flush=True)
        for role, ins in SOLO.items():              # the bias alone in the epilogue: checked, then timed
            step = [(role, ins, role)]
            chain_call(step, 0)()
            torch.cuda.synchronize()
            err = rel_err(torch, pool[0][role], ref[role])
            row["kernels"][role] = {"rel_err": err, **(timings(cycled([chain_call(step, i) for i in range(len(pool))]),
                                                               args.iters) if err < TOLERANCE["y"] else {})}
        del pool, tv
        torch.cuda.empty_cache()
        bl.write_json(json_path, payload)
    payload["cubins"] = {"hits": cubins.hits, "misses": len(cubins.misses)}
    bl.write_json(json_path, payload)
    table(rows)
    print(f"cubins: {cubins.hits} prebuilt, {len(cubins.misses)} compiled here; {time.time() - started:.0f} s; "
          f"JSON {json_path}")


def table(rows) -> None:
    cur, new, dbl = CHAINS
    lines = []
    for row in rows:
        a, b, c, kern = (row["chains"].get(cur, {}), row["chains"].get(new, {}), row["chains"].get(dbl, {}),
                         row["kernels"])
        us = lambda e, f: e.get(f, float("nan")) * 1e3  # noqa: E731
        line = {"case": row["case"]}
        for f, tag in (("burst_ms", "b"), ("sustained_ms", "s")):
            line[f"cur_{tag}"], line[f"new_{tag}"], line[f"dbl_{tag}"] = us(a, f), us(b, f), us(c, f)
            line[f"x_{tag}"] = line[f"cur_{tag}"] / line[f"new_{tag}"]
            for role in ROLES:
                line[f"{role}_{tag}"] = us(kern.get(role, {}), f)
        errs = [e for chain in (a, b, c) for e in chain.get("rel_err", {}).values()]
        line["err"] = f"{max(errs or [float('nan')]):.1e}"
        lines.append(line)
    bl.print_table(lines, [("case", "case", ""), ("cur_b", "GEMM + bias_res_LN us", ".1f"),
                           ("new_b", "GEMM+res + LN us", ".1f"), ("x_b", "x", ".3f"),
                           ("cur_s", "sustained cur", ".1f"), ("new_s", "sustained new", ".1f"), ("x_s", "x", ".3f"),
                           ("dbl_b", "doubling", ".1f"), ("dbl_s", "sust. dbl", ".1f"),
                           ("gemm_b", "gemm", ".1f"), ("gemm_bias_b", "gemm+bias", ".1f"),
                           ("gemm_residual_b", "gemm+res", ".1f"), ("gemm_residual_doubling_b", "gemm+res dbl", ".1f"),
                           ("bias_residual_ln_b", "bias_res_LN", ".1f"),
                           ("ln_b", "LN", ".1f"), ("err", "max rel err", "")],
                   title="Residual add in the GEMM epilogue vs in the LayerNorm (fp16, H200; us per chain / kernel: "
                         "10-call bursts, then sustained 50 ms; inputs cycled over sets > 2.5x L2)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("build", "compile the kernels and their sm_90a cubins here"),
                           ("run", "check and time on the GPU machine (TVM runtime only)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--plan", choices=sorted(PLANS), default="s12epi")
        p.add_argument("--out", default=None, help="default: the plan's folder")
    sub.choices["run"].add_argument("--json", default=None, help="default: $OUT/s12epi.json")
    sub.choices["run"].add_argument("--iters", type=int, default=20, help="burst samples per chain / kernel")
    args = parser.parse_args(argv)
    build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
