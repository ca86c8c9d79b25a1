"""The fused relative-position bias (``schedules/relative_bias.py``) on the GPU against the graph's own kernels.

DeBERTa-v3-base's bias, as its exports reach the compiler (:func:`graph_form`: each layer's position projections
repeated over the batch, the two products, their gathers by the flat position tables, the transpose, the scales,
the sum, the cast to float16), is built twice for CUDA through the compile path's pipeline: as the graph computes
it (the product kernels of ``schedules/batched_nt_matmul.py`` and the staged bias kernel) and with
:func:`stof_tvm.compiler.relative_bias_match.fuse_relative_biases` (one kernel). On the GPU both run on the same
random inputs, NaN-poisoned outputs first, each checked against the graph's arithmetic in float32 on the device
(products rounded to float16 as the graph rounds them) and timed with CUDA events (median of 20 samples after
warm-up, inputs cycled from a pool).

Two steps, so the GPU machine needs the TVM runtime alone:

    python scripts/check_relative_bias_gpu.py build --out out/relbias                    # here (nvcc)
    python3 scripts/check_relative_bias_gpu.py run --out out/relbias --json $OUT/relbias.json   # GPU machine
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

import numpy as np  # noqa: E402

import benchlib as bl  # noqa: E402

# (batch, heads, seq, head dim, buckets): DeBERTa-v3-base at 8 x 512 and 1 x 128 tokens
SHAPES = [(8, 12, 512, 64, 256), (1, 12, 128, 64, 256)]
SCALE = 13.856406211853027       # sqrt(64 * 3): DeBERTa-v3's score scale with both position terms
TOLERANCE = 2e-3
POOL = 3
FORMS = ("graph", "fused")


def log_bucket_positions(seq: int, buckets: int, max_distance: int) -> np.ndarray:
    """DeBERTa-v3's position index ``[i, j]``: the relative position ``i - j`` exact below ``buckets / 2`` in
    magnitude, log-spaced above it up to ``max_distance``, shifted into ``[0, 2 * buckets)``."""
    rel = np.arange(seq)[:, None] - np.arange(seq)[None, :]
    mid = buckets // 2
    magnitude = np.abs(rel)
    far = np.ceil(np.log(np.maximum(magnitude, 1) / mid) / np.log((max_distance - 1) / mid) * (mid - 1)) + mid
    bucket = np.where(magnitude <= mid, rel, np.sign(rel) * far).astype(np.int64)
    return np.clip(bucket + buckets, 0, 2 * buckets - 1)


def graph_form(batch: int, heads: int, seq: int, depth: int, buckets: int, scale: float = SCALE):
    """The bias as DeBERTa-v3-base's exports reach the fusion (weights as inputs ``q, k [B*H, S, D]``, ``pk, pq
    [H, 2 * buckets, D]``): each projection repeated over the batch (``reshape(broadcast_to(reshape))``),
    transposed into its product, the products rounded to float16 and gathered by flat tables (the second
    transposed), divided by ``scale``, summed and cast to float16 ([B, H, S, S])."""
    from tvm import relax

    n, positions = batch * heads, 2 * buckets
    index = log_bucket_positions(seq, buckets, 2 * buckets)
    table = relax.const((np.arange(seq)[:, None] * positions + index).astype("int32"))
    bb = relax.BlockBuilder()
    q, k = (relax.Var(name, relax.TensorType((n, seq, depth), "float16")) for name in ("q", "k"))
    pk, pq = (relax.Var(name, relax.TensorType((heads, positions, depth), "float16")) for name in ("pk", "pq"))
    with bb.function("main", [q, k, pk, pq]):
        with bb.dataflow():
            def term(a, p, transposed):
                rows = bb.emit(relax.op.reshape(p, (1, heads, 1, positions, 1, depth)))
                rows = bb.emit(relax.op.broadcast_to(rows, (batch, heads, 1, positions, 1, depth)))
                rows = bb.emit(relax.op.reshape(rows, (n, positions, depth)))
                product = bb.emit(relax.op.matmul(a, bb.emit(relax.op.permute_dims(rows, [0, 2, 1])),
                                                  out_dtype="float32"))
                flat = bb.emit(relax.op.reshape(bb.emit(relax.op.astype(product, "float16")), (n, seq * positions)))
                gathered = bb.emit(relax.op.take(bb.emit(relax.op.astype(flat, "float32")), table, axis=1))
                if transposed:
                    gathered = bb.emit(relax.op.permute_dims(gathered, [0, 2, 1]))
                return bb.emit(relax.op.divide(gathered, relax.const(scale, "float32")))

            total = bb.emit(relax.op.add(term(q, pk, False), term(k, pq, True)))
            out = bb.emit_output(relax.op.astype(bb.emit(relax.op.reshape(total, (batch, heads, seq, seq))),
                                                 "float16"))
        bb.emit_func_output(out)
    return bb.get(), index


def _name(shape, form: str) -> str:
    return "b{}h{}s{}d{}k{}_{}".format(*shape, form)


def build(out: str) -> None:
    """Both forms of every shape, built for CUDA and exported under ``out`` with a manifest."""
    from stof_tvm.compiler.pipeline import CUDA_DEFAULTS, build as build_module, make_target, optimize
    from stof_tvm.compiler.relative_bias_match import fuse_relative_biases

    os.makedirs(out, exist_ok=True)
    target = make_target(dict(CUDA_DEFAULTS))
    manifest = []
    for shape in SHAPES:
        graph, _ = graph_form(*shape)
        fused, count = fuse_relative_biases(graph, "cuda")
        assert count == 1, "the graph form was not fused"
        for form, mod in zip(FORMS, (graph, fused)):
            path = os.path.join(out, _name(shape, form) + ".so")
            build_module(optimize(mod, target, None), target).export_library(path)
            manifest.append({"shape": list(shape), "form": form, "library": os.path.basename(path)})
            print(f"built {path}", flush=True)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


def reference(q, k, pk, pq, index, batch: int, heads: int):
    """The graph's arithmetic in float32 on the device: products rounded to float16, gathered, scaled, summed."""
    import torch

    rows = torch.arange(index.shape[0], device=q.device)[:, None]
    table = torch.as_tensor(index, device=q.device)
    c2p = torch.matmul(q.float(), pk.float().repeat(batch, 1, 1).transpose(1, 2)).half().float()
    p2c = torch.matmul(k.float(), pq.float().repeat(batch, 1, 1).transpose(1, 2)).half().float()
    total = c2p[:, rows, table] / SCALE + p2c[:, rows, table].transpose(1, 2) / SCALE
    return total.reshape(batch, heads, *total.shape[1:])


def run(out: str, json_path: str | None) -> None:
    import torch
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    if not ensure_cuda_runtime():
        raise SystemExit("TVM's CUDA runtime library could not be loaded")
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    rows = []
    for shape in SHAPES:
        batch, heads, seq, depth, buckets = shape
        index = log_bucket_positions(seq, buckets, 2 * buckets)
        gen = torch.Generator(device="cuda").manual_seed(0)
        pool = [[torch.randn(s, device="cuda", dtype=torch.float16, generator=gen)
                 for s in ((batch * heads, seq, depth),) * 2 + ((heads, 2 * buckets, depth),) * 2]
                for _ in range(POOL)]
        expected = [reference(*inputs, index, batch, heads) for inputs in pool[:2]]
        moved = 2.0 * batch * heads * seq * seq          # the bias written once, in float16
        for entry in (e for e in manifest if tuple(e["shape"]) == shape):
            vm = VirtualMachine(tvm.runtime.load_module(os.path.join(out, entry["library"])), tvm.cuda())

            def call(*inputs, vm=vm):
                return vm["main"](*[tvm.runtime.from_dlpack(t) for t in inputs])

            row = {"shape": "x".join(map(str, shape[:3])), "form": entry["form"]}
            checks = []
            for inputs, ref in zip(pool, expected):
                got = torch.from_dlpack(call(*inputs))
                torch.cuda.synchronize()
                checks.append(bl.errors(got, ref))
            row.update(max(checks, key=lambda c: c["rel"]))
            row["ok"] = "yes" if all(bl.within(c, TOLERANCE) for c in checks) else "NO"
            timing = bl.time_ms(call, inputs=pool, warmup=5, samples=20)
            row["us"] = 1e3 * timing.median_ms
            row["tbps"] = moved / (timing.median_ms * 1e-3) / 1e12
            rows.append(row)
        graph_us = next(r["us"] for r in rows if r["shape"] == "x".join(map(str, shape[:3])) and r["form"] == "graph")
        for r in rows[-len(FORMS):]:
            r["speedup"] = graph_us / r["us"]
        if json_path:
            bl.write_json(json_path, {"environment": bl.environment(), "rows": rows})
    bl.print_table(rows, [("shape", "B x H x S", "s"), ("form", "form", "s"), ("us", "us", ".1f"),
                          ("tbps", "bias TB/s", ".2f"), ("speedup", "vs graph", ".2f"), ("rel", "rel err", ".1e"),
                          ("ok", "ok", "s")],
                   title="DeBERTa-v3 relative-position bias, float16 (CUDA events, median of 20)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("build", "run"))
    parser.add_argument("--out", default="out/relbias", help="built modules and their manifest")
    parser.add_argument("--json", help="run: write the rows here")
    args = parser.parse_args()
    if args.step == "build":
        build(args.out)
    else:
        run(args.out, args.json)


if __name__ == "__main__":
    main()
