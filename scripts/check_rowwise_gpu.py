"""Check and time the row-wise kernel on a GPU, with plans built on a machine without one.

Two steps, because the GPU machine carries TVM's runtime only:

    python scripts/check_rowwise_gpu.py build out/rowwise      # here: compile CUDA plans, save them
    python scripts/check_rowwise_gpu.py run out/rowwise        # GPU machine (torch + TVM runtime)

``run`` loads every saved plan (:meth:`stof_tvm.AttentionPlan.load`), runs it through the public API on torch
CUDA tensors (DLPack, no copies) into NaN-poisoned outputs, and compares with a dense masked softmax reference
computed by torch on the GPU (float64 for the correctness cases, float32 for the timing cases). Timing cases
are then timed against torch SDPA with the same boolean mask and SDPA without a mask (the dense reference
speed): CUDA events around a batch of back-to-back calls after warm-up, median over repeats, inputs redrawn per
repeat. Prints a table and writes ``results.json`` into the plan folder.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)

CORRECTNESS = [
    # name, (B, H, S, D), dtype, mask maker (numpy, from B, H, S), row config (key_groups, keys_per_step, rows)
    ("perhead_rand5pct_S1000_D128_bf16", (2, 3, 1000, 128), "bfloat16", "perhead:0.05", None),
    ("causal_S7_D64_fp16", (2, 2, 7, 64), "float16", "causal", None),
    ("padding_S100_D64_fp16", (3, 2, 100, 64), "float16", "lengths:100,37,0", None),
    ("longformer_S1024_D64_bf16", (1, 4, 1024, 64), "bfloat16", "longformer", None),
    ("perbatch_rand30pct_S513_D128_kg4", (2, 2, 513, 128), "float16", "perbatch:0.3", (4, 2, 2)),
    ("causal_S1_D64_fp16", (1, 2, 1, 64), "float16", "causal", None),
    ("dilated_S256_D64_kg8_u3", (2, 2, 256, 64), "float16", "dilated", (8, 3, 2)),
]
# name, mask, (B, H, S, D), dtype, row configs (key_groups, keys_per_step, rows_per_block); None = default
TIMING = [
    ("bigbird", "bigbird", (8, 12, 4096, 64), "float16", [None, (4, 4, 4)]),
    ("sliding", "sliding", (8, 12, 4096, 64), "float16", [None, (4, 4, 4)]),
    ("random1pct", "random:0.01", (8, 12, 4096, 64), "float16", [None]),
    ("random0.1pct", "random:0.001", (8, 12, 4096, 64), "float16", [None, (4, 1, 4)]),
    ("bigbirdD128", "bigbird", (8, 12, 4096, 128), "bfloat16", [None]),
]


def _mask(spec: str, batch: int, heads: int, seq: int):
    rng = np.random.default_rng(7)
    kind, _, arg = spec.partition(":")
    if kind == "perhead":
        return rng.random((batch, heads, seq, seq)) < float(arg)
    if kind == "perbatch":
        return rng.random((batch, seq, seq)) < float(arg)
    if kind == "random":
        return rng.random((seq, seq)) < float(arg)
    if kind == "lengths":
        return np.array([int(x) for x in arg.split(",")])
    return spec


def build(folder: str) -> None:
    from stof_tvm import AttentionPlan
    from stof_tvm.schedules.attention_rowwise import RowConfig

    target = {"kind": "cuda", "arch": "sm_90"}
    for name, shape, dtype, spec, cfg in CORRECTNESS:
        config = RowConfig(*cfg) if cfg else None
        AttentionPlan(_mask(spec, *shape[:3]), shape, dtype, kernel="row", target=target,
                      config=config).save(os.path.join(folder, "check_" + name))
    for name, spec, shape, dtype, configs in TIMING:
        for cfg in configs:
            label = f"kg{cfg[0]}u{cfg[1]}r{cfg[2]}" if cfg else "default"
            AttentionPlan(_mask(spec, *shape[:3]), shape, dtype, kernel="row", target=target,
                          config=RowConfig(*cfg) if cfg else None).save(os.path.join(folder, f"time_{name}_{label}"))
    print("built", len(os.listdir(folder)), "plans into", folder)


def _dense_mask(plan, torch, device):
    """The plan's [Bm, Hm, Sq, Sk] mask rebuilt from its row-compressed format (what the kernel reads)."""
    p = plan.problem
    indptr, indices = plan.formats
    rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    dense = np.zeros((p.mask_batch * p.mask_heads * p.seq_q, p.seq_k), dtype=bool)
    dense[rows, indices[: len(rows)]] = True
    return torch.from_numpy(dense.reshape(p.mask_batch, p.mask_heads, p.seq_q, p.seq_k)).to(device)


def _reference(q, k, v, mask, scale, dtype, torch):
    scores = torch.einsum("bhid,bhjd->bhij", q.to(dtype), k.to(dtype)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)          # rows with no kept key -> 0
    return probs @ v.to(dtype)


def _time(fn, inputs, torch, repeats=7, calls=20):
    """Median ms per call: CUDA events around ``calls`` back-to-back calls, ``repeats`` times, fresh inputs."""
    return bl.time_ms(fn, inputs=inputs, warmup=2, samples=repeats, number=calls).median_ms


def run(folder: str) -> None:
    import torch
    import torch.nn.functional as F
    from stof_tvm import AttentionPlan

    dev = torch.device("cuda")
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(0), "checks": [], "timing": []}
    print(f"{'case':42s} {'rel err':>9s} {'nan':>4s} {'empty rows 0':>12s}")
    for name in sorted(n for n in os.listdir(folder) if n.startswith("check_")):
        plan = AttentionPlan.load(os.path.join(folder, name))
        p = plan.problem
        dtype = getattr(torch, p.dtype)
        q = torch.randn(p.batch, p.heads, p.seq_q, p.head_dim, device=dev, dtype=dtype)
        k, v = (torch.randn(p.batch, p.heads, p.seq_k, p.head_dim, device=dev, dtype=dtype) for _ in range(2))
        out = torch.full_like(q, float("nan"))
        plan.run(q, k, v, out=out)
        mask = _dense_mask(plan, torch, dev)
        ref = _reference(q, k, v, mask, p.scale, torch.float64, torch)
        err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        empty = ~mask.any(-1).expand(p.batch, p.heads, p.seq_q)
        zeros_ok = bool((out[empty] == 0).all().item()) if empty.any() else None
        results["checks"].append({"case": name, "rel_err": err, "nan": int(out.isnan().sum()),
                                  "empty_rows_zero": zeros_ok})
        print(f"{name:42s} {err:9.2e} {int(out.isnan().sum()):4d} {str(zeros_ok):>12s}")

    print(f"\n{'timing':42s} {'ms':>8s} {'TFLOP/s':>8s} {'rel err':>9s}")
    sdpa_done = set()
    for name in sorted(n for n in os.listdir(folder) if n.startswith("time_")):
        plan = AttentionPlan.load(os.path.join(folder, name))
        p = plan.problem
        mask = _dense_mask(plan, torch, dev)
        kept = int(mask.sum()) * p.batch * p.heads // (p.mask_batch * p.mask_heads)
        dtype = getattr(torch, p.dtype)
        inputs = [tuple(torch.randn(p.batch, p.heads, p.seq_q, p.head_dim, device=dev, dtype=dtype)
                        for _ in range(3)) for _ in range(3)]
        q, k, v = inputs[0]
        out = torch.full_like(q, float("nan"))
        plan.run(q, k, v, out=out)
        ref = _reference(q, k, v, mask, p.scale, torch.float32, torch)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        del ref
        mask_name = name.split("_")[1]
        rows = [(name.removeprefix("time_"), lambda a, b, c: plan.run(a, b, c), err)]
        if mask_name not in sdpa_done:
            sdpa_done.add(mask_name)
            rows.append((f"{mask_name}_sdpa_bool_mask", lambda a, b, c: F.scaled_dot_product_attention(
                a, b, c, attn_mask=mask, scale=p.scale), None))
            rows.append((f"{mask_name}_sdpa_dense_nomask", lambda a, b, c: F.scaled_dot_product_attention(
                a, b, c, scale=p.scale), None))
        for label, fn, row_err in rows:
            ms = _time(fn, inputs, torch)
            tflops = 4 * kept * p.head_dim / (ms * 1e-3) / 1e12
            results["timing"].append({"case": label, "ms": ms, "useful_tflops": tflops, "rel_err": row_err,
                                      "kept_pairs": kept})
            err_text = f"{row_err:9.2e}" if row_err is not None else ""
            print(f"{label:42s} {ms:8.3f} {tflops:8.1f} {err_text:>9s}")
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(results, f, indent=2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["build", "run"])
    parser.add_argument("folder")
    args = parser.parse_args(argv)
    (build if args.step == "build" else run)(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
