"""End-to-end benchmark: stof-tvm vs PyTorch and TVM's default pipeline on whole models, same mask.

Two steps, because the GPU machine has TVM's runtime only (artifacts are built here, without weights; the
GPU machine regenerates the weights from the built-in models' seed):

    # 1. here (CPU, TVM compiler + nvcc): every variant of BERT-Base and BERT-Large at the three shapes
    rm -rf out/e2e && .venv/bin/python scripts/bench_e2e.py build --models bert-base bert-large \
        --shapes 1x128 8x512 16x2048      # ~1.2 MB per artifact, 30 artifacts, a few minutes
    du -sh out/e2e          # must stay under the device tool's 64 MiB carry limit (with .devkit/runtime.tar.xz)

    # 2. the GPU call (device tool), one run for everything:
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/bench_e2e.py run --models bert-base bert-large "
                "--json $OUT/e2e.json",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/e2e"], timeout_s=600)

If the carry is too large, build and run one model per call (``--models bert-base``, then ``bert-large``).
For each model and (B, S), ``build`` compiles these artifacts from the same ONNX graph with the BigBird mask
(fp16; ``--variants`` picks a subset):

- ``ours``: attention kernel chosen from the mask, TVM's dlight schedules for the rest;
- ``templates``: the same plus the fusion templates on mma.sync (``gemm="mma"``) for every chain (QKV projection into heads,
  GEMM + bias/residual/LayerNorm, GEMM + bias + GELU; knobs: stage 1's top-ranked set, the manifest lists them);
- ``graph``: ``templates`` with CUDA graphs over the static regions between attention calls;
- ``wgmma``: ``templates`` with the Hopper wgmma GEMM and QKV kernels (sm_90a cubins prebuilt here by nvcc and
  carried in the artifact; what ``compile`` does by default for an sm_90 target), ``wgmma-graph`` the same with
  CUDA graphs;
- ``dense``: TVM's default pipeline (dense attention with the mask applied as an input, dlight schedules).

``run`` regenerates the model's weights (seeded, the same numpy generator as the build) and times, with fresh
random token ids and CUDA-event / time_evaluator medians after warm-up:

- every artifact above (module time, time_evaluator; a variant that fails to load or run is reported, not fatal);
- ``torch-eager``: a PyTorch BERT with the same weights, fp16, SDPA with the boolean mask;
- ``torch-flex``: the same model with FlexAttention (compiled, BlockMask built from the same mask);
- ``torch-compile`` and ``torch-compile-graph`` (``--baselines``): the whole FlexAttention forward through
  ``torch.compile`` (``dynamic=False``), then the same captured into a CUDA graph and replayed.

Every output is checked against the PyTorch model in float32 (relative Frobenius error) in the same run; only
variants within ``--tolerance`` count towards "ours best". GPT-2, the T5 encoder and ViT need torch's ONNX
exporter to build their artifacts (``stof_tvm.models.torch_models``), which this CPU machine does not have;
they are not in this script.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

OUT = os.path.join("out", "e2e")
MASK = "bigbird"
# artifact variant -> compile options (besides the mask, shape, target and dtype)
VARIANTS = {
    "ours": {"kernel": "auto", "templates": False},
    "templates": {"kernel": "auto", "templates": True, "gemm": "mma"},
    "graph": {"kernel": "auto", "templates": True, "gemm": "mma", "cuda_graph": True},
    "wgmma": {"kernel": "auto", "templates": True, "gemm": "wgmma"},
    "wgmma-graph": {"kernel": "auto", "templates": True, "gemm": "wgmma", "cuda_graph": True},
    "dense": {"kernel": "dense", "templates": False},
}
LABELS = {"ours": "ours", "templates": "ours+templates", "graph": "ours+templates+graph",
          "wgmma": "ours+templates-wgmma", "wgmma-graph": "ours+templates-wgmma+graph", "dense": "tvm-dense"}
# torch baselines: label, attention, whole forward through torch.compile, captured in a CUDA graph
BASELINES = [("torch-eager", "sdpa", False, False), ("torch-flex", "flex", False, False),
             ("torch-compile", "flex", True, False), ("torch-compile-graph", "flex", True, True)]
OURS = tuple(label for variant, label in LABELS.items() if variant != "dense")


def _shape_arg(text: str) -> tuple[int, int]:
    b, s = text.lower().split("x")
    return int(b), int(s)


def _artifact_dir(model: str, batch: int, seq_len: int, variant: str) -> str:
    return os.path.join(OUT, f"{model}_{batch}x{seq_len}_{variant}")


# ------------------------------------------------------------------------------------------------ build (CPU)
def build(args) -> None:
    import stof_tvm
    from stof_tvm.models import builtin_model

    for name in args.models:
        model = builtin_model(name)
        for batch, seq_len in args.shapes:
            for variant in args.variants:
                options = dict(VARIANTS[variant])
                if options["kernel"] == "auto":
                    options["kernel"] = args.kernel
                start = time.time()
                art = stof_tvm.compile(model, mask=MASK, batch=batch, seq_len=seq_len, target="cuda",
                                       dtype="float16", **options)
                art.manifest["source"] = {"builtin": name, "seed": 0}
                path = art.save(_artifact_dir(name, batch, seq_len, variant), weights=False)
                kernel_info = art.manifest["attention"]["kernel"]
                calls = art.manifest["templates"].get("calls", {})
                print(f"{path}: kernel {kernel_info['kind']} {kernel_info['config']}, templates {calls} "
                      f"({time.time() - start:.0f} s)", flush=True)


# ------------------------------------------------------------------------------------------- torch reference
def torch_bert(weights: dict, cfg, mask_bool, dtype, attention: str, dev: str = "cuda"):
    """A PyTorch BERT encoder computing what stof_tvm.models.bert builds, from the same weights.

    ``mask_bool``: [B or 1, 1, S, S] boolean (sparse mask AND padding); ``attention``: "sdpa" or "flex".
    """
    import torch
    import torch.nn.functional as F

    w = {k: torch.tensor(v, device=dev, dtype=dtype) for k, v in weights.items()}
    heads, head_dim = cfg.heads, cfg.head_dim
    block_mask = None
    if attention == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        dense = mask_bool.to(dev)

        def mask_mod(b, h, q_idx, kv_idx):
            return dense[b if dense.shape[0] > 1 else 0, 0, q_idx, kv_idx]

        seq = mask_bool.shape[-1]
        block_mask = create_block_mask(mask_mod, B=dense.shape[0] if dense.shape[0] > 1 else None, H=None,
                                       Q_LEN=seq, KV_LEN=seq, device=dev)
        flex = torch.compile(flex_attention, dynamic=False)

    def attend(q, k, v):
        if attention == "flex":
            return flex(q, k, v, block_mask=block_mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_bool.to(dev))

    def forward(ids, names):
        hidden = F.embedding(ids, w[names["word"]]) + w[names["pos"]][: ids.shape[1]][None]
        hidden = F.layer_norm(hidden, (cfg.hidden,), w[names["emb_ln"][0]], w[names["emb_ln"][1]], cfg.eps)
        bsz, seq = ids.shape
        for layer in names["layers"]:
            def split(x):
                return x.view(bsz, seq, heads, head_dim).transpose(1, 2)

            q, k, v = (split(hidden @ w[layer[t][0]] + w[layer[t][1]]) for t in ("q", "k", "v"))
            ctx = attend(q, k, v).transpose(1, 2).reshape(bsz, seq, cfg.hidden)
            hidden = F.layer_norm(ctx @ w[layer["out"][0]] + w[layer["out"][1]] + hidden, (cfg.hidden,),
                                  w[layer["ln1"][0]], w[layer["ln1"][1]], cfg.eps)
            ff = F.gelu(hidden @ w[layer["ffn1"][0]] + w[layer["ffn1"][1]])
            hidden = F.layer_norm(ff @ w[layer["ffn2"][0]] + w[layer["ffn2"][1]] + hidden, (cfg.hidden,),
                                  w[layer["ln2"][0]], w[layer["ln2"][1]], cfg.eps)
        return hidden

    return forward


def weight_names(initializers: list[str], layers: int) -> dict:
    """Map the built-in BERT's initializer names (``<hint>_<counter>``) to their roles."""
    def find(prefix):
        return next(n for n in initializers if n.rsplit("_", 1)[0] == prefix)

    names = {"word": find("word_embeddings"), "pos": find("position_embeddings"),
             "emb_ln": (find("embeddings.LayerNorm.gamma"), find("embeddings.LayerNorm.beta")), "layers": []}
    for i in range(layers):
        p = f"layer{i}"
        layer = {t: (find(f"{p}.{t}.weight"), find(f"{p}.{t}.bias")) for t in ("q", "k", "v", "out", "ffn1", "ffn2")}
        layer["ln1"] = (find(f"{p}.ln1.gamma"), find(f"{p}.ln1.beta"))
        layer["ln2"] = (find(f"{p}.ln2.gamma"), find(f"{p}.ln2.beta"))
        names["layers"].append(layer)
    return names


# --------------------------------------------------------------------------------------------------- run (GPU)
def _cuda_time(fn, warmup: int, iters: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def _torch_variant(torch, forward, ids, names, compiled: bool, graphed: bool):
    """``forward`` as a no-argument callable: optionally the whole forward through ``torch.compile``
    (``dynamic=False``; inductor's fused kernels), optionally captured once into a CUDA graph and replayed
    (no launch overhead: the strongest form for small shapes)."""
    fn = torch.compile(forward, dynamic=False) if compiled else forward
    if compiled:
        start = time.time()
        fn(ids, names)
        torch.cuda.synchronize()
        print(f"  torch.compile: first call {time.time() - start:.0f} s", flush=True)
    if not graphed:
        return lambda: fn(ids, names)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as capture requires
        for _ in range(3):
            fn(ids, names)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(ids, names)

    def replay():
        graph.replay()
        return out
    return replay


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def run(args) -> None:
    import torch
    from onnx import numpy_helper

    from stof_tvm import make_mask, runtime
    from stof_tvm.models import BERT_CONFIGS, builtin_model

    torch._dynamo.config.cache_size_limit = 64
    results = []
    for name in args.models:
        cfg = BERT_CONFIGS[name]
        start = time.time()
        model = builtin_model(name)
        all_weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        names = weight_names(list(all_weights), cfg.layers)
        float_weights = {k: v for k, v in all_weights.items() if v.dtype == np.float32}
        print(f"{name}: weights regenerated in {time.time() - start:.1f} s", flush=True)
        for batch, seq_len in args.shapes:
            rng = np.random.default_rng(batch * 100003 + seq_len)
            ids = rng.integers(0, cfg.vocab, (batch, seq_len)).astype(np.int64)
            pad = np.ones((batch, seq_len), np.int64)
            keep = torch.from_numpy(make_mask(MASK, seq_len)[None, None].copy())
            ids_t = torch.from_numpy(ids).cuda()
            row = {"model": name, "batch": batch, "seq_len": seq_len, "mask": MASK}
            with torch.no_grad():
                ref = torch_bert(float_weights, cfg, keep, torch.float32, "sdpa")(ids_t, names).cpu().numpy()
                baselines = [b for b in BASELINES if b[0] in args.baselines]
                for label, attention, compiled, graphed in baselines:
                    try:
                        fwd = _torch_variant(torch, torch_bert(float_weights, cfg, keep, torch.float16, attention),
                                             ids_t, names, compiled, graphed)
                        out = fwd()
                        row[label + "_err"] = _rel_err(out.float().cpu().numpy(), ref)
                        row[label + "_ms"] = _cuda_time(fwd, args.warmup, args.iters)
                        del fwd, out
                    except Exception as err:  # a baseline that cannot run is reported, not fatal
                        row[label + "_failed"] = f"{type(err).__name__}: {err}"[:400]
                        print(f"  {label} failed: {row[label + '_failed']}", flush=True)
            for variant, label in LABELS.items():
                if variant not in args.variants:
                    continue
                path = _artifact_dir(name, batch, seq_len, variant)
                if not os.path.isdir(path):
                    print(f"  skip {label}: no artifact at {path}", flush=True)
                    continue
                try:
                    _time_artifact(row, label, path, runtime, all_weights, ids, pad, ref, args)
                except Exception as err:     # one broken variant must not cost the rest of the run
                    row[label + "_failed"] = f"{type(err).__name__}: {err}"[:400]
                    print(f"  {label} failed: {row[label + '_failed']}", flush=True)
            torch_best = min((row[label + "_ms"] for label, *_ in baselines if label + "_ms" in row), default=None)
            ours = min((row[k + "_ms"] for k in OURS if k + "_ms" in row and row[k + "_err"] < args.tolerance),
                       default=None)
            if ours is not None and torch_best is not None:
                row["speedup_vs_best_torch"] = torch_best / ours
                if "tvm-dense_ms" in row:
                    row["speedup_vs_tvm_dense"] = row["tvm-dense_ms"] / ours
            results.append(row)
            print(json.dumps(row), flush=True)
    _print_table(results)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=2)


def _time_artifact(row, label, path, runtime, all_weights, ids, pad, ref, args) -> None:
    """Load one artifact (weights from the regenerated model), check it against ``ref`` and time it."""
    t0 = time.time()
    with open(os.path.join(path, "manifest.json")) as f:
        wanted = [w["name"] for w in json.load(f)["weights"]]
    compiled = runtime.load(path, weights={name: all_weights[name] for name in wanted})
    prepared = compiled.prepare({"input_ids": ids, "attention_mask": pad})
    outs = compiled.run(prepared)
    row[label + "_err"] = _rel_err(outs[0].numpy(), ref)
    row[label + "_kernel"] = compiled.kernel
    timer = compiled.vm.time_evaluator("main", compiled.device, number=args.iters, repeat=5, min_repeat_ms=0)
    compiled.run(prepared)
    row[label + "_ms"] = float(np.median(timer(*prepared, *compiled.params).results) * 1e3)
    if label in args.profile:
        from stof_tvm.profiling import profile_artifact

        profile_artifact(compiled, prepared, label, row)
    row[label + "_load_s"] = time.time() - t0


def _print_table(results: list[dict]) -> None:
    cols = list(LABELS.values()) + ["torch-eager", "torch-flex", "torch-compile", "torch-compile-graph"]
    print("\nmodel       B     S  " + "".join(f"{c + ' ms':>24}" for c in cols) + "  vs torch  vs tvm   max err")
    for row in results:
        cells = "".join(f"{row.get(c + '_ms', float('nan')):24.3f}" for c in cols)
        err = max(row.get(c + "_err", 0.0) for c in cols)
        vs_torch = row.get("speedup_vs_best_torch", float("nan"))
        vs_tvm = row.get("speedup_vs_tvm_dense", float("nan"))
        print(f"{row['model']:<10}{row['batch']:>3}{row['seq_len']:>6}  {cells}  {vs_torch:7.2f}x {vs_tvm:6.2f}x"
              f"  {err:.1e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    for step in ("build", "run"):
        p = sub.add_parser(step)
        p.add_argument("--models", nargs="+", default=["bert-base"])
        p.add_argument("--shapes", nargs="+", type=_shape_arg, default=[(1, 128), (8, 512), (16, 2048)])
        p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    sub.choices["build"].add_argument("--kernel", default="auto", choices=["auto", "block", "row"])
    sub.choices["run"].add_argument("--warmup", type=int, default=5)
    sub.choices["run"].add_argument("--iters", type=int, default=20)
    sub.choices["run"].add_argument("--json", help="write the results here")
    sub.choices["run"].add_argument("--profile", nargs="*", default=[], metavar="LABEL",
                                    help="variant labels (as in the table) whose kernel calls are also timed one by one")
    sub.choices["run"].add_argument("--baselines", nargs="*", default=["torch-eager", "torch-flex"],
                                    choices=[b[0] for b in BASELINES], help="torch baselines to time")
    sub.choices["run"].add_argument("--tolerance", type=float, default=2e-2,
                                    help="largest relative error of a variant that counts as correct")
    args = parser.parse_args(argv)
    build(args) if args.step == "build" else run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
