"""Attention with a score bias (T5's position bias) on the H200: the block-wise kernel with a bias against the
row-wise kernel with a bias (T5's path today), torch SDPA with a float mask and FlexAttention with a score_mod.

Every variant computes ``softmax(q k^T * scale + bias, over kept keys) v``. Two steps, as
``scripts/bench_attention.py`` (whose mask, format, nvcc and runner helpers this script reuses):

    python scripts/check_bias_gpu.py build --out out/bias        # here: CUDA modules + nvcc cubins (registers)
    python3 scripts/check_bias_gpu.py run --out out/bias --json $OUT/bias.json      # GPU machine

``check`` cases (small shapes: bias layouts [1,H] / [B,H] / [B,1] / [1,1], float16 / bfloat16 / float32 biases,
odd S, partial edge tiles, empty rows, both bias paths of the CUDA kernel: staged 32-bit pairs and bias-initialised
accumulators) and ``time`` cases at T5's shape (B=16, S=2048, H=12, D=64, BigBird, fp16) with a float16 bias
[1, 12, S, S] and the float32 bias [16, 12, S, S] a compiled T5 passes (position bias plus padding, one term).
Our kernels read a bias poisoned with NaN/inf wherever the mask drops the key, write into NaN-poisoned outputs
(again after timing), and are compared with torch float32 in the same run; the baselines get the clean bias.
Times: ``triton.testing.do_bench`` medians after warm-up. Prints a table and writes JSON.
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

from bench_attention import (CUDA_TARGET, TOLERANCE, Runner, _nvcc_cubin, build_mask, row_arrays, sass_summary,
                             source_key, tiled_arrays)

T5 = dict(batch=16, heads=12, seq=2048, head_dim=64, dtype="float16", mask="bigbird")
T5_CONFIGS = [(64, 32, 4, 2, True), (128, 64, 4, 2, False), (64, 64, 2, 2, False)]   # sparse default, default, one more
T5_BIASES = [(1, 12, "float16"), (16, 12, "float32")]


def _case(kind, family, mask, batch, heads, seq, head_dim, dtype, config, bias):
    return {"kind": kind, "family": family, "mask": mask, "batch": batch, "heads": heads, "seq": seq,
            "head_dim": head_dim, "dtype": dtype, "config": list(config) if config else None,
            "bias": list(bias) if bias else None}


def plan() -> list[dict]:
    small = dict(batch=2, heads=3, head_dim=64, dtype="float16")
    cases = [
        _case("check", "block", "random:0.2", seq=300, config=(64, 32, 4, 2, True), bias=(1, 3, "float16"), **small),
        _case("check", "block", "random_empty:0.2", seq=299, config=(128, 64, 4, 2, False), bias=(2, 3, "float16"),
              **small),
        _case("check", "block", "random:0.1", seq=300, config=(64, 32, 4, 2, False), bias=(1, 1, "float32"), **small),
        _case("check", "block", "padding", seq=257, config=(64, 32, 4, 2, True), bias=(2, 1, "float16"), **small),
        _case("check", "block", "bigbird", batch=2, heads=3, seq=300, head_dim=128, dtype="bfloat16",
              config=(128, 64, 8, 2, False), bias=(2, 1, "bfloat16")),
        _case("check", "block", "causal", batch=2, heads=3, seq=511, head_dim=128, dtype="bfloat16",
              config=(64, 32, 4, 2, True), bias=(1, 3, "float32")),
        _case("check", "row", "random:0.2", seq=300, config=None, bias=(1, 3, "float16"), **small),
    ]
    t5 = {k: T5[k] for k in ("mask", "batch", "heads", "seq", "head_dim", "dtype")}
    for bias in T5_BIASES:
        cases += [_case("time", "block", config=cfg, bias=bias, **t5) for cfg in T5_CONFIGS]
        cases.append(_case("time", "row", config=None, bias=bias, **t5))
    cases += [_case("time", "block", config=cfg, bias=None, **t5) for cfg in T5_CONFIGS]   # the bias's cost
    return cases


def mask_groups(case: dict) -> tuple[int, int]:
    from bench_attention import mask_groups as groups
    return groups(case["mask"], case["batch"], case["heads"])


def module_key(case: dict) -> str:
    mb, mh = mask_groups(case)
    cfg = "x".join(map(str, case["config"])) if case["config"] else "default"
    bias = "x".join(map(str, case["bias"])) if case["bias"] else "nobias"
    return (f"{case['family']}_b{case['batch']}h{case['heads']}s{case['seq']}d{case['head_dim']}_{case['dtype']}_"
            f"g{mb}x{mh}_{cfg}_{bias}")


def primfunc(case: dict):
    mb, mh = mask_groups(case)
    common = dict(batch=case["batch"], heads=case["heads"], seq_q=case["seq"], seq_k=case["seq"],
                  head_dim=case["head_dim"], dtype=case["dtype"], mask_batch=mb, mask_heads=mh, scale=None,
                  target_kind="cuda", bias=tuple(case["bias"]) if case["bias"] else None)
    if case["family"] == "block":
        from stof_tvm.schedules.attention_blockwise import BlockConfig, blockwise_attention_primfunc
        return blockwise_attention_primfunc(config=BlockConfig(*case["config"]), **common)
    from stof_tvm.schedules.attention_rowwise import rowwise_attention_primfunc
    return rowwise_attention_primfunc(config=None, **common)


def build(args) -> None:
    """Compile every module, nvcc each distinct CUDA source into a cubin (registers/spills in the manifest)."""
    import tvm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = tvm.target.Target(CUDA_TARGET, host={"kind": "llvm"})
    cases, modules, sources = plan(), {}, {}
    t0 = time.time()
    for case in cases:
        key = case["module"] = module_key(case)
        if key in modules:
            continue
        ex = tvm.compile(primfunc(case), target=target)
        if "cuda" not in [m.kind for m in ex.mod.imports]:
            raise RuntimeError(f"{key}: no CUDA module in the build")
        ex.export_library(str(out / f"{key}.so"))
        src = ex.mod.imports[0].inspect_source()
        modules[key] = {"library": f"{key}.so", "source": source_key(src)}
        sources.setdefault(source_key(src), src)
        print(f"built {key} ({time.time() - t0:.0f} s)", flush=True)
    reports = {h: _nvcc_cubin(src, out / f"{h}.cubin") for h, src in sources.items()}
    sass = {}
    for key, info in modules.items():
        info.update(reports[info["source"]])
        sass[key] = info
        print(f"{key:<70} regs {info['registers']:>3} spill {info['spill_stores']}/{info['spill_loads']}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (out / "manifest.json").write_text(json.dumps({"cases": cases, "modules": modules, "sass": sass,
                                                   "commit": commit}, indent=1))
    print(f"{len(cases)} cases, {len(modules)} modules, {len(sources)} cubins in {out} ({time.time() - t0:.0f} s)")


# ----------------------------------------------------------------------------------------------------------
# run (GPU machine)
# ----------------------------------------------------------------------------------------------------------

class BiasRun:
    """One run: the bench_attention Runner (modules with prebuilt cubins, do_bench, compiled flex_attention)
    plus the bias tensors, references and baselines of each problem."""

    def __init__(self, runner, device: str = "cuda"):
        self.runner, self.torch, self.device = runner, runner.torch, device
        self.problem_key, self.problem = None, None

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def make_problem(self, case: dict) -> dict:
        """Inputs of a (mask, shape, bias layout) problem, shared by the kernels and baselines timed on it."""
        torch = self.torch
        key = (case["mask"], case["batch"], case["heads"], case["seq"], case["head_dim"], case["dtype"],
               tuple(case["bias"]) if case["bias"] else None)
        if key == self.problem_key:
            return self.problem
        self.problem_key = self.problem = None
        if self.device == "cuda":
            torch.cuda.empty_cache()
        B, H, S, D = case["batch"], case["heads"], case["seq"], case["head_dim"]
        mask4 = build_mask(case["mask"], B, H, S, seed=0)
        mask_t = torch.from_numpy(np.ascontiguousarray(mask4)).to(self.device)
        gen = torch.Generator(device=self.device).manual_seed(7)
        q, k, v = (torch.randn((B, H, S, D), generator=gen, device=self.device, dtype=getattr(torch, case["dtype"]))
                   for _ in range(3))
        bias = poisoned = None
        if case["bias"]:
            bb, bh, bdt = case["bias"]
            bias = (torch.randn((bb, bh, S, S), generator=gen, device=self.device) * 2).to(getattr(torch, bdt))
            keep = mask_t.expand(B, H, S, S)
            keep = keep.any(dim=0, keepdim=True) if bb == 1 else keep
            keep = keep.any(dim=1, keepdim=True) if bh == 1 else keep
            junk = torch.tensor([float("nan"), float("inf"), float("-inf")], device=self.device, dtype=bias.dtype)
            pick = torch.randint(0, 3, bias.shape, generator=gen, device=self.device, dtype=torch.int32)
            poisoned = torch.where(keep, bias, junk[pick])
            del pick
            del keep
        kept = int(mask4.sum(dtype=np.int64)) * (B // mask4.shape[0]) * (H // mask4.shape[1])
        self.problem = {"mask4": mask4, "mask_t": mask_t, "q": q, "k": k, "v": v, "bias": bias,
                        "poisoned": poisoned, "kept": kept, "scale": 1.0 / math.sqrt(D), "formats": {},
                        "ref": self.reference(q, k, v, mask_t, bias, 1.0 / math.sqrt(D)), "baselines": None}
        self.problem_key = key
        return self.problem

    def reference(self, q, k, v, mask_t, bias, scale):
        """float32 softmax(q k^T * scale + bias over kept keys) v, four heads at a time; empty rows give 0."""
        torch = self.torch
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for b in range(q.shape[0]):
            m = mask_t[b if mask_t.shape[0] > 1 else 0]
            for h0 in range(0, q.shape[1], 4):
                hs = slice(h0, h0 + 4)
                s = torch.matmul(q[b, hs].float(), k[b, hs].float().transpose(-1, -2)) * scale
                if bias is not None:
                    s = s + bias[b if bias.shape[0] > 1 else 0, hs if bias.shape[1] > 1 else slice(0, 1)].float()
                s = s.masked_fill(~(m[hs] if m.shape[0] > 1 else m), float("-inf"))
                out[b, hs] = torch.matmul(torch.softmax(s, dim=-1).nan_to_num(0.0), v[b, hs].float())
        return out

    def ours(self, case: dict, p: dict) -> dict:
        torch, runner = self.torch, self.runner
        if case["family"] == "block":
            fkey = tuple(case["config"][:2])
            if fkey not in p["formats"]:
                p["formats"][fkey] = [torch.from_numpy(a).to(self.device) for a in tiled_arrays(p["mask4"], *fkey)]
        else:
            fkey = "row"
            if fkey not in p["formats"]:
                p["formats"][fkey] = [torch.from_numpy(a).to(self.device) for a in row_arrays(p["mask4"])]
        out = torch.full_like(p["q"], float("nan"))
        extra = [p["poisoned"]] if case["bias"] else []
        args = [runner.to_tvm(t) for t in (p["q"], p["k"], p["v"], *p["formats"][fkey], *extra, out)]
        fn = runner.kernel(case["module"])
        fn(*args)
        self.sync()
        row = dict(case, kept=p["kept"], rel_err=runner.rel_err(out, p["ref"]))
        empty = ~p["mask_t"].any(-1).expand(out.shape[:3])
        row["empty_rows_zero"] = bool((out[empty] == 0).all()) if bool(empty.any()) else None
        if case["kind"] == "time":
            row["ms"] = runner.bench(lambda: fn(*args))
            out.fill_(float("nan"))
            fn(*args)
            self.sync()
            row["rel_err_after_timing"] = runner.rel_err(out, p["ref"])
            row["tflops"] = 4.0 * p["kept"] * case["head_dim"] / row["ms"] / 1e9
        errs = [row["rel_err"], row.get("rel_err_after_timing", 0.0)]
        row["ok"] = max(errs) <= TOLERANCE[case["dtype"]] and row["empty_rows_zero"] is not False
        return row

    def baselines(self, case: dict, p: dict) -> dict:
        """SDPA with a float mask (bias, -inf at dropped keys) and FlexAttention (score_mod adds the bias,
        BlockMask from the same mask), each checked against the reference and timed once per problem."""
        if p["baselines"] is not None or not case["bias"]:
            return p["baselines"] or {}
        torch, runner = self.torch, self.runner
        import torch.nn.functional as F
        from torch.nn.attention.flex_attention import create_block_mask

        q, k, v, bias, mask_t = p["q"], p["k"], p["v"], p["bias"], p["mask_t"]
        dense = mask_t[0, 0]
        float_mask = bias.to(q.dtype).masked_fill(~mask_t, float("-inf"))
        bb, bh = bias.shape[:2]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b if bb > 1 else 0, h if bh > 1 else 0, q_idx, kv_idx]

        def mask_mod(b, h, q_idx, kv_idx):
            return dense[q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=case["seq"], KV_LEN=case["seq"],
                                       device=self.device)
        result = {}
        for name, fn in (("sdpa_float_mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)),
                         ("flex_score_mod", lambda: runner.flex(q, k, v, score_mod=score_mod, block_mask=block_mask))):
            try:
                err = runner.rel_err(fn(), p["ref"])
                ms = runner.bench(fn)
                result[name] = {"ms": ms, "rel_err": err, "tflops": 4.0 * p["kept"] * case["head_dim"] / ms / 1e9}
            except Exception as exc:     # a baseline that cannot run is reported, not fatal
                result[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        p["baselines"] = result
        return result


def run(args) -> None:
    job = BiasRun(Runner(Path(args.out), Path(args.json) if args.json else None, args.budget))
    runner, torch = job.runner, job.torch
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "commit": runner.manifest.get("commit"), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        info["sass"] = sass_summary(runner.out, runner.manifest)
    except FileNotFoundError:
        info["sass"] = "cuobjdump not found"
    skipped = 0
    for case in runner.manifest["cases"]:
        if time.time() > runner.deadline:
            skipped += 1
            continue
        t0 = time.time()
        try:
            p = job.make_problem(case)
            row = job.ours(case, p)
            row["baselines"] = job.baselines(case, p) if case["kind"] == "time" else {}
        except Exception as exc:
            row = dict(case, ok=False, rel_err=float("inf"), error=f"{type(exc).__name__}: {exc}"[:400])
        runner.results.append(row)
        print(f"{case['kind']} {case['module']}: err {row['rel_err']:.1e}" + (f" {row['ms']:.3f} ms" if "ms" in row
              else "") + (f" ERROR {row['error']}" if "error" in row else "") + f" ({time.time() - t0:.1f} s)",
              flush=True)
        info["skipped_for_budget"] = skipped
        runner.save(info)
    print_table(runner.results, info)
    runner.save(info)


def print_table(results: list[dict], info: dict) -> None:
    print(f"\n{'check case':<72} {'rel err':>9} {'empty 0':>7} ok")
    for r in results:
        if r["kind"] == "check":
            print(f"{r['module']:<72} {r['rel_err']:9.2e} {str(r.get('empty_rows_zero')):>7} {r['ok']}")
    print(f"\nT5 shape (B=16, S=2048, H=12, D=64, BigBird, fp16): ms (median), effective TFLOP/s, rel err vs torch fp32")
    print(f"{'variant':<44} {'bias':<16} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9} {'vs best torch':>13}")
    for r in results:
        if r["kind"] != "time" or "ms" not in r:
            continue
        bias = "x".join(map(str, r["bias"])) if r["bias"] else "none"
        base = [b["ms"] for b in (r.get("baselines") or {}).values() if "ms" in b]
        cfg = "x".join(map(str, r["config"])) if r["config"] else "default"
        ratio = f"{min(base) / r['ms']:.2f}x" if base else ""
        print(f"{r['family'] + ' ' + cfg:<44} {bias:<16} {r['ms']:8.3f} {r['tflops']:8.1f} "
              f"{max(r['rel_err'], r['rel_err_after_timing']):9.2e} {ratio:>13}")
    seen = set()
    for r in results:
        key = str(r.get("bias"))
        if r["kind"] == "time" and r.get("baselines") and key not in seen:
            seen.add(key)
            for name, b in r["baselines"].items():
                text = (f"{b['ms']:8.3f} {b['tflops']:8.1f} {b['rel_err']:9.2e}" if "ms" in b else b["error"])
                print(f"{name:<44} {'x'.join(map(str, r['bias'])):<16} {text}")
    if isinstance(info.get("sass"), dict):
        print("\nSASS: registers, spills, HMMA / LDL / STL counts")
        for key, s in info["sass"].items():
            print(f"  {key:<72} regs {s['registers']:>3} spill {s['spill_stores']}/{s['spill_loads']} "
                  f"HMMA {s['HMMA']} LDL {s['LDL']} STL {s['STL']}")
    bad = [r["module"] for r in results if not r["ok"]]
    print(f"\n{len(results) - len(bad)}/{len(results)} ok; skipped for budget: {info.get('skipped_for_budget', 0)}"
          + (f"; FAILED: {bad}" if bad else "") + f"; {info['device']}, torch {info['torch']}, commit {info['commit']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the kernels for sm_90 (needs the TVM compiler and nvcc)")
    b.add_argument("--out", default="out/bias")
    r = sub.add_parser("run", help="check and time on the GPU (needs torch, triton and the TVM runtime)")
    r.add_argument("--out", default="out/bias")
    r.add_argument("--json", default=None, help="write results here (rewritten after every case)")
    r.add_argument("--budget", type=float, default=420.0, help="seconds after which no new case starts")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
