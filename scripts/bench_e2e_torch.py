"""End-to-end benchmark on PyTorch-exported models (GPT-2, T5 encoder, ViT-Base, BERT-Base): stof-tvm vs
PyTorch eager, PyTorch + FlexAttention and TVM's default pipeline, on the same ONNX graph and the same mask.

Three steps on two machines, because the CPU machine's TVM compiler and torch live in different virtual
environments and the GPU machine has torch and TVM's runtime but no TVM compiler:

    # 1. here, with torch (a separate venv: torch is not a stof-tvm dependency): export the ONNX graphs with
    #    torch.onnx (seeded random weights) and write, per graph, the map from each ONNX initializer to the
    #    torch state_dict entry it came from (maybe transposed; checked array by array)
    /work/torchvenv/bin/python scripts/bench_e2e_torch.py export --models gpt2 t5-base-encoder vit-base bert-base
    # 2. here, with TVM (.venv): compile every variant of every model and shape, without weights (small)
    .venv/bin/python scripts/bench_e2e_torch.py build --models gpt2 t5-base-encoder vit-base bert-base
    # 3. on the GPU machine (device tool): rebuild each torch model from its seed, feed its parameters to the
    #    artifacts through the maps, check everything against torch float32 and time it
    python3 scripts/bench_e2e_torch.py run --json $OUT/e2e_torch.json

The artifacts travel packed (``build`` writes ``out/e2e_torch.tar.xz``; ``run`` unpacks it over
``out/e2e_torch`` when present). The mask is BigBird (``stof_tvm.make_mask("bigbird", S)``) for every model,
combined with what the model imposes itself:

- GPT-2: its causal mask AND BigBird (the exported graph's causal ``where`` over the registered bool buffer is
  folded into the sparse format at compile time, so the sparse kernels see causal AND BigBird); the torch
  baselines and the float32 reference use the same combined mask;
- T5 encoder: its relative position bias is added to the scores, a real bias: ``ours`` passes it to the sparse
  kernel (the block-wise one on the GPU), which adds it at each kept key; its bias-free linears
  run on the GEMM templates (ReLU and QKV with a zero bias), its RMSNorms on the ``rmsnorm`` template (each
  residual add fused into the next one: ``residual_rmsnorm``) (the bias, a constant of the weights, is folded into
  the module: ~190 MB at S = 2048, 0.2 MB packed);
- ViT: the sequence is the patch grid (no class token: ``torch_models.Vit`` takes ``S`` patches, the image
  is ``rows*16 x cols*16`` with ``rows*cols == S`` as square as possible: 8x16, 16x32, 32x64 patches for
  S = 128, 512, 2048); one export per S (its position table has S rows);
- BERT: the HF-style additive padding mask, all ones here.

Variants compiled per model and (B, S) (fp16, sm_90; by default all but ``templates``): ``ours`` (attention
kernel chosen from the mask, dlight for the rest), ``templates`` (the same plus the fusion templates on
mma.sync), ``wgmma`` (the fusion templates on Hopper wgmma: ``stof_tvm.compile``'s default for sm_90),
``wgmma-graph`` (the same with CUDA graphs), ``dense`` (TVM's default pipeline: dense attention with the
mask as an input, dlight). A variant whose module would equal another's is not saved. Baselines on the GPU, the same torch module
with its attention replaced (fp16): ``torch-eager`` (SDPA with the boolean mask, plus T5's bias as a float
mask) and ``torch-flex`` (``torch.compile(flex_attention, dynamic=False)`` with a BlockMask of the same mask;
T5's bias through a ``score_mod``) and ``torch-compile`` (the whole FlexAttention forward through
``torch.compile(dynamic=False)``; ``--no-torch-compile`` leaves it out). The reference is the same torch module in
float32 with SDPA (TF32 off).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join("out", "e2e_torch")
PACKED = OUT + ".tar.xz"
ONNX_DIR = os.path.join("out", "e2e_torch_onnx")        # exported graphs (with weights): never carried
MASK = "bigbird"
SEED = 0
MODELS = ("gpt2", "t5-base-encoder", "vit-base", "bert-base")
SHAPES = ((1, 128), (8, 512), (16, 2048))
VARIANTS = {             # compile options besides the mask, shape, target and dtype (as scripts/bench_e2e.py)
    "ours": {"kernel": "auto", "templates": False},
    "templates": {"kernel": "auto", "templates": True, "gemm": "mma"},
    "wgmma": {"kernel": "auto", "templates": True, "gemm": "wgmma"},
    "wgmma-graph": {"kernel": "auto", "templates": True, "gemm": "wgmma", "cuda_graph": True},
    "dense": {"kernel": "dense", "templates": False},
}
DEFAULT_VARIANTS = ("ours", "wgmma", "wgmma-graph", "dense")
LABELS = {"ours": "ours", "templates": "ours+templates", "wgmma": "ours+templates-wgmma",
          "wgmma-graph": "ours+templates-wgmma+graph", "dense": "tvm-dense"}
OURS = tuple(label for variant, label in LABELS.items() if variant != "dense")
BASELINES = ("torch-eager", "torch-flex", "torch-compile")
# label -> (attention, whole forward through torch.compile): the last is the strongest torch form of the model
BASELINE_FORMS = {"torch-eager": ("sdpa", False), "torch-flex": ("flex", False), "torch-compile": ("flex", True)}


def _from_file(name: str, *path: str):
    """Module ``path`` loaded from its file: importing the ``stof_tvm`` package would import TVM, which the
    export venv does not have (the modules loaded so import only numpy, onnx and torch)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_BENCH_E2E = _from_file("stof_bench_e2e", "scripts", "bench_e2e.py")   # the built-in models' benchmark
_rel_err, _cuda_time = _BENCH_E2E._rel_err, _BENCH_E2E._cuda_time     # its error and timing helpers


def torch_models():
    """``stof_tvm.models.torch_models`` (the PyTorch models and their export)."""
    return _from_file("stof_torch_models", "stof_tvm", "models", "torch_models.py")


def _shape_arg(text: str) -> tuple[int, int]:
    b, s = text.lower().split("x")
    return int(b), int(s)


def is_vit(name: str) -> bool:
    return "vit" in name


def export_seq(name: str, seq_len: int) -> int:
    """The sequence length ``name``'s ONNX graph is exported at: ViT's graph is fixed to its patch grid (one
    export per S), the token models' graphs take any S (one export, at 128)."""
    return seq_len if is_vit(name) else 128


def onnx_path(name: str, seq_len: int, onnx_dir: str = ONNX_DIR) -> str:
    return os.path.join(onnx_dir, f"{name}_s{export_seq(name, seq_len)}.onnx")


def map_path(name: str, seq_len: int, out: str = OUT) -> str:
    return os.path.join(out, "maps", f"{name}_s{export_seq(name, seq_len)}.json")


def artifact_dir(name: str, batch: int, seq_len: int, variant: str, out: str = OUT) -> str:
    return os.path.join(out, f"{name}_{batch}x{seq_len}_{variant}")


# ---------------------------------------------------------------------------------------- weight maps (torch)
def _numpy(value) -> np.ndarray:
    """A numpy array of a numpy array or a torch tensor (on any device)."""
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def weight_map(onnx_model, state_dict: dict) -> dict:
    """For each float ONNX initializer, the state_dict entry holding the same array, directly or transposed
    (the exporter stores ``nn.Linear`` weights transposed for MatMul and deduplicates equal initializers, so
    the match is by value: a same-named entry first, then any entry). Returns ``{"initializers": {name: {"key",
    "transpose"}}, "unmatched": [names]}``; the unmatched are the exporter's own constants."""
    from onnx import numpy_helper

    arrays = {k: _numpy(v) for k, v in state_dict.items()}
    by_shape: dict[tuple, list[tuple[str, bool]]] = {}
    for key, value in arrays.items():
        by_shape.setdefault(value.shape, []).append((key, False))
        if value.ndim == 2:
            by_shape.setdefault(value.shape[::-1], []).append((key, True))
    found, unmatched = {}, []
    for tensor in onnx_model.graph.initializer:
        value = numpy_helper.to_array(tensor)
        if value.dtype.kind != "f":
            continue
        candidates = sorted(by_shape.get(value.shape, []), key=lambda c: c[0] != tensor.name)
        match = next(((key, t) for key, t in candidates if arrays[key].dtype == value.dtype
                      and np.array_equal(arrays[key].T if t else arrays[key], value)), None)
        if match is None:
            unmatched.append(tensor.name)
        else:
            found[tensor.name] = {"key": match[0], "transpose": match[1]}
    return {"initializers": found, "unmatched": unmatched}


def state_checksums(state_dict: dict) -> dict:
    """float64 sum and sum of squares of every state_dict entry: the GPU side checks that its rebuilt model
    (another torch version, same seed) has the same weights before blaming a kernel for a mismatch."""
    return {k: [float(v.double().sum()), float(v.double().square().sum())] for k, v in state_dict.items()}


def rename_initializers(model) -> None:
    """Rename ``onnx::``-prefixed initializers (the TorchScript exporter's transposed MatMul weights) to
    ``onnx_...`` in place. TVM's importer strips the prefix from parameter names, which
    ``stof_tvm.compiler.onnx_import`` then rejects as a name mismatch."""
    renamed = {t.name: "onnx_" + t.name.removeprefix("onnx::") for t in model.graph.initializer
               if t.name.startswith("onnx::")}
    taken = {t.name for t in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
    clash = sorted(set(renamed.values()) & taken)
    if clash:
        raise ValueError(f"model: renamed initializers {clash[:3]} clash with existing names")
    for tensor in model.graph.initializer:
        tensor.name = renamed.get(tensor.name, tensor.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
    for value in model.graph.input:
        value.name = renamed.get(value.name, value.name)


def export(args) -> None:
    """Export each model's ONNX graph(s) and write their weight maps (needs torch)."""
    import onnx
    import torch

    tm = torch_models()
    os.makedirs(ONNX_DIR, exist_ok=True)
    os.makedirs(os.path.join(OUT, "maps"), exist_ok=True)
    for name in args.models:
        for seq in sorted({export_seq(name, s) for _, s in args.shapes}):
            start = time.time()
            model = tm.export(name, seq_len=seq, seed=SEED)
            rename_initializers(model)
            onnx.save(model, onnx_path(name, seq))
            state = tm.build(name, seq, SEED).state_dict()
            entry = weight_map(model, state)
            entry.update({"model": name, "seq_len": seq, "seed": SEED, "torch": torch.__version__,
                          "checksums": state_checksums(state)})
            with open(map_path(name, seq), "w") as f:
                json.dump(entry, f, indent=1)
            print(f"{onnx_path(name, seq)}: {len(entry['initializers'])} initializers mapped, "
                  f"{len(entry['unmatched'])} exporter constants ({time.time() - start:.0f} s)", flush=True)


# --------------------------------------------------------------------------------------------- build (TVM)
def kernel_kind(art) -> str:
    return art.manifest["attention"]["kernel"]["kind"]


def build(args) -> None:
    """Compile every variant (TVM compiler, no torch); check that every weight of every artifact is mapped."""
    import onnx

    import stof_tvm

    for name in args.models:
        for batch, seq_len in args.shapes:
            with open(map_path(name, seq_len)) as f:
                mapped = json.load(f)["initializers"]
            model = onnx.load(onnx_path(name, seq_len))
            for variant in args.variants:
                start = time.time()
                try:
                    art = stof_tvm.compile(model, mask=MASK, batch=batch, seq_len=seq_len, target="cuda",
                                           dtype="float16", **VARIANTS[variant])
                except Exception as err:       # report a model/shape the compile path refuses, go on
                    print(f"{name} {batch}x{seq_len} {variant}: FAILED {type(err).__name__}: {str(err)[:300]}",
                          flush=True)
                    continue
                calls = art.manifest["templates"].get("calls", {}) if art.manifest["templates"] else {}
                if variant == "ours" and kernel_kind(art) == "dense":
                    print(f"{name} {batch}x{seq_len} ours: the model's masking keeps attention dense, the same module "
                          f"as tvm-dense: not saved", flush=True)
                    continue
                if VARIANTS[variant].get("templates") and not calls:
                    print(f"{name} {batch}x{seq_len} {variant}: no chain matched the templates (same module as "
                          f"ours), not saved", flush=True)
                    continue
                missing = [w["name"] for w in art.manifest["weights"] if w["name"] not in mapped]
                if missing:
                    raise ValueError(f"{name}: weights {missing[:4]} have no torch state_dict entry in the map")
                art.manifest["source"] = {"torch_model": name, "seed": SEED,
                                          "map": os.path.basename(map_path(name, seq_len))}
                path = art.save(artifact_dir(name, batch, seq_len, variant), weights=False)
                kernel = art.manifest["attention"]["kernel"]
                print(f"{path}: kernel {kernel['kind']}, templates {calls} ({time.time() - start:.0f} s)", flush=True)
    subprocess.run(["tar", "-cJf", PACKED, "-C", os.path.dirname(OUT), os.path.basename(OUT)], check=True)
    print(f"{PACKED}: {os.path.getsize(PACKED) / 2**20:.1f} MiB", flush=True)


# --------------------------------------------------------------------------------------- torch side (GPU/CPU)
def artifact_weights(manifest: dict, mapping: dict, state_dict: dict) -> dict[str, np.ndarray]:
    """The weights an artifact takes (by ONNX initializer name) from the torch state_dict, through the map."""
    weights = {}
    for spec in manifest["weights"]:
        entry = mapping["initializers"][spec["name"]]
        value = _numpy(state_dict[entry["key"]]).astype(np.float32)
        weights[spec["name"]] = np.ascontiguousarray(value.T if entry["transpose"] else value)
    return weights


def model_inputs(name: str, batch: int, seq_len: int, seed: int) -> dict[str, np.ndarray]:
    """Fresh random inputs: token ids (and an all-ones attention_mask) or ViT pixels."""
    rng = np.random.default_rng(seed)
    if is_vit(name):
        rows = max(r for r in range(1, int(np.sqrt(seq_len)) + 1) if seq_len % r == 0)
        cols = seq_len // rows
        return {"pixel_values": rng.standard_normal((batch, 3, rows * 16, cols * 16)).astype(np.float32)}
    vocab = 1000 if name.startswith("tiny-") else 30000
    return {"input_ids": rng.integers(0, vocab, (batch, seq_len)).astype(np.int64),
            "attention_mask": np.ones((batch, seq_len), np.int64)}


def combined_keep(name: str, seq_len: int) -> np.ndarray:
    """[S, S] boolean mask the model computes under: BigBird, AND causal for GPT-2."""
    make_mask = _from_file("stof_masks", "sparse_formats", "masks.py").make_mask
    keep = make_mask(MASK, seq_len)
    if "gpt2" in name:
        keep = keep & make_mask("causal", seq_len)
    return np.ascontiguousarray(keep)


def patch_attention(tm, model, keep, attention: str, compiled: bool = True):
    """Replace the attention of torch model ``model`` (built by ``torch_models``) by SDPA with the boolean
    mask ``keep`` ([S, S] torch bool on the model's device) or by FlexAttention with a BlockMask of it.

    ``attention``: "sdpa" or "flex"; ``compiled``: FlexAttention through ``torch.compile`` (False: its eager
    form, for CPU checks). T5's relative position bias is computed once per forward, as the model does, and
    enters SDPA as a float mask (-inf where ``keep`` is false) and FlexAttention as a ``score_mod``. The
    padding mask is not applied: this benchmark's padding is all ones (the model's additive term is 0; the
    runner checks that), so the baselines pay nothing for it. GPT-2's and T5's forwards are replaced by the
    same computation with their position tensors made on the model's device (the originals make them on the
    CPU, which only works there). Masked probabilities are 0, as in stof-tvm; no row of these masks is empty.
    """
    import math

    import torch
    import torch.nn.functional as F

    seq = keep.shape[-1]
    flex = block_mask = None
    if attention == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, q_idx, kv_idx):
            return keep[q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=keep.device)
        flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    bias = {}                   # T5: this forward's position bias, [H, S, S] (flex) or the SDPA float mask

    def attend(q, k, v, scale):
        """q, k, v: [B, H, S, D]."""
        if attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.get("value", keep), scale=scale)
        if "value" not in bias:
            return flex(q, k, v, block_mask=block_mask, scale=scale)
        table = bias["value"]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx, kv_idx]
        return flex(q, k, v, block_mask=block_mask, score_mod=score_mod, scale=scale)

    def merge(ctx):
        b, h, s, d = ctx.shape
        return ctx.transpose(1, 2).reshape(b, s, h * d)

    def separate(self, x, additive=None):           # torch_models._Attention.forward
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        return self.o(merge(attend(q, k, v, 1.0 / math.sqrt(self.head_dim) if self.scale else 1.0)))

    def gpt2_attention(block, x, padding):          # torch_models.Gpt2._attention
        b, s, hidden = x.shape
        q, k, v = (t.view(b, s, model.heads, model.head_dim).transpose(1, 2)
                   for t in block["c_attn"](x).split(hidden, dim=2))
        return block["c_proj"](merge(attend(q, k, v, 1.0 / math.sqrt(model.head_dim))))

    def gpt2_forward(input_ids, attention_mask):     # torch_models.Gpt2.forward, positions on the device
        s = input_ids.shape[1]
        h = model.wte(input_ids) + model.wpe(torch.arange(s, device=input_ids.device)[None])
        for block in model.blocks:
            h = h + gpt2_attention(block, block["ln1"](h), None)
            h = h + block["proj"](F.gelu(block["fc"](block["ln2"](h)), approximate="tanh"))
        return model.ln_f(h)

    def t5_forward(input_ids, attention_mask):       # torch_models.T5Encoder.forward, positions on the device
        s = input_ids.shape[1]
        positions = torch.arange(s, device=input_ids.device)
        table = model.relative_bias(model._bucket(positions[None, :] - positions[:, None])).permute(2, 0, 1)
        bias["value"] = table.contiguous() if attention == "flex" else table[None].masked_fill(~keep, float("-inf"))
        h = model.embed(input_ids)
        for block in model.blocks:
            h = h + block["attn"](block["ln1"](h))
            h = h + block["wo"](F.relu(block["wi"](block["ln2"](h))))
        return model.ln_f(h)

    if isinstance(model, tm.Gpt2):
        model.forward = gpt2_forward
    if isinstance(model, tm.T5Encoder):
        model.forward = t5_forward
    for module in model.modules():
        if isinstance(module, tm._Attention):
            module.forward = separate.__get__(module)
    return model


@functools.lru_cache(maxsize=1)
def _seeded(tm, name: str, seq_len: int):
    """The seeded torch model on the CPU, built once per model (and per S for ViT) and copied for each use."""
    return tm.build(name, seq_len, SEED)


def torch_forward(tm, name: str, seq_len: int, keep_np: np.ndarray, dtype, attention: str, device: str,
                  compiled: bool = True):
    """A callable ``inputs (torch, on device) -> last hidden state`` of the seeded torch model, and the model."""
    import copy

    import torch

    model = copy.deepcopy(_seeded(tm, name, export_seq(name, seq_len))).to(device=device, dtype=dtype)
    keep = torch.from_numpy(keep_np).to(device)
    patch_attention(tm, model, keep, attention, compiled)

    def forward(inputs):
        with torch.no_grad():
            return model(*inputs)
    return forward, model


def _torch_inputs(feeds: dict, dtype, device: str) -> list:
    import torch

    out = []
    for value in feeds.values():
        tensor = torch.from_numpy(value).to(device)
        out.append(tensor.to(dtype) if tensor.is_floating_point() else tensor)
    return out


def check_checksums(mapping: dict, state_dict: dict) -> list[str]:
    """Names of state_dict entries whose float64 sums differ from the export machine's (relative 1e-6)."""
    bad = []
    for key, (total, squares) in mapping["checksums"].items():
        value = state_dict[key].double()
        if not (np.isclose(float(value.sum()), total, rtol=1e-6, atol=1e-6)
                and np.isclose(float(value.square().sum()), squares, rtol=1e-6)):
            bad.append(key)
    return bad


def reference(args) -> None:
    """CPU check data for tests (needs torch): per model, the exported ONNX graph (initializers renamed), its
    weight map, the torch state_dict, inputs, and the float32 outputs of the torch model with SDPA and with
    (eager) FlexAttention under the benchmark's mask, all written into ``args.dir``."""
    import onnx
    import torch

    tm = torch_models()
    os.makedirs(args.dir, exist_ok=True)
    for name in args.models:
        for batch, seq_len in args.shapes:
            model = tm.export(name, seq_len=seq_len, seed=SEED)
            rename_initializers(model)
            stem = os.path.join(args.dir, f"{name}_{batch}x{seq_len}")
            onnx.save(model, stem + ".onnx")
            state = tm.build(name, seq_len, SEED).state_dict()
            with open(stem + ".map.json", "w") as f:
                json.dump(weight_map(model, state), f)
            np.savez(stem + ".state.npz", **{k: v.numpy() for k, v in state.items()})
            feeds = model_inputs(name, batch, seq_len, seed=7)
            keep = combined_keep(name, seq_len)
            outs = {}
            for attention in ("sdpa", "flex"):
                fwd, _ = torch_forward(tm, name, seq_len, keep, torch.float32, attention, "cpu", compiled=False)
                outs[attention] = fwd(_torch_inputs(feeds, torch.float32, "cpu")).numpy()
            np.savez(stem + ".io.npz", **{"in_" + k: v for k, v in feeds.items()}, **outs)
            print(stem, flush=True)


def run(args) -> None:
    import torch

    if os.path.isfile(PACKED):        # the carried artifacts (a machine kept warm may hold older ones)
        subprocess.run(["tar", "-xJf", PACKED, "-C", os.path.dirname(OUT)], check=True)
    import tvm  # noqa: F401  (the runtime: stof_tvm.runtime needs it, CUDA loaders registered next)
    from stof_tvm.cuda_runtime import ensure_cuda_runtime
    from stof_tvm import runtime

    ensure_cuda_runtime()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = 64
    tm = torch_models()
    results, started = [], time.time()
    for name in args.models:
        for batch, seq_len in args.shapes:
            if time.time() - started > args.time_budget:
                print(f"  {name} {batch}x{seq_len}: skipped (past --time-budget {args.time_budget:.0f} s)", flush=True)
                continue
            row = {"model": name, "batch": batch, "seq_len": seq_len,
                   "mask": MASK + (" AND causal" if "gpt2" in name else "")}
            t0 = time.time()
            with open(map_path(name, seq_len)) as f:
                mapping = json.load(f)
            keep = combined_keep(name, seq_len)
            feeds = model_inputs(name, batch, seq_len, seed=batch * 100003 + seq_len)
            if "attention_mask" in feeds and not feeds["attention_mask"].all():
                raise ValueError("the torch baselines leave padding out: the benchmark's padding must be all ones")
            ref_fwd, ref_model = torch_forward(tm, name, seq_len, keep, torch.float32, "sdpa", "cuda")
            state = {k: v.cpu() for k, v in ref_model.state_dict().items()}
            bad = check_checksums(mapping, state)
            if bad:
                row["weights_differ"] = bad[:5]
                print(f"  {name}: rebuilt weights differ from the export's: {bad[:5]}", flush=True)
            ref = ref_fwd(_torch_inputs(feeds, torch.float32, "cuda")).cpu().numpy()
            del ref_fwd, ref_model
            for label in BASELINES if args.baselines else ():
                if label == "torch-compile" and not args.torch_compile:
                    continue
                attention, whole = BASELINE_FORMS[label]
                fwd, _ = torch_forward(tm, name, seq_len, keep, torch.float16, attention, "cuda", compiled=not whole)
                if whole:
                    fwd = torch.compile(fwd, dynamic=False)
                inputs = _torch_inputs(feeds, torch.float16, "cuda")
                try:
                    row[label + "_err"] = _rel_err(fwd(inputs).float().cpu().numpy(), ref)
                    row[label + "_ms"] = _cuda_time(lambda: fwd(inputs), args.warmup, args.iters)
                except Exception as err:     # one broken baseline must not cost the rest of the run
                    row[label + "_failed"] = f"{type(err).__name__}: {err}"[:400]
                    print(f"  {label} failed: {row[label + '_failed']}", flush=True)
                del fwd
            for variant, label in LABELS.items():
                path = artifact_dir(name, batch, seq_len, variant)
                if variant not in args.variants or not os.path.isdir(path):
                    continue
                if variant in args.isolate:
                    _run_in_child(row, name, batch, seq_len, variant, args)
                    continue
                try:
                    _time_artifact(row, label, path, runtime, mapping, state, feeds, ref, args)
                except Exception as err:
                    row[label + "_failed"] = f"{type(err).__name__}: {err}"[:400]
                    print(f"  {label} failed: {row[label + '_failed']}", flush=True)
            torch.cuda.empty_cache()
            _speedups(row, args.tolerance)
            row["wall_s"] = time.time() - t0
            results.append(row)
            print(json.dumps(row), flush=True)
            if args.json:           # after every row: a run cut short still leaves its results
                os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "results": results}, f, indent=2)
    print_table(results)


def _run_in_child(row, name, batch, seq_len, variant, args) -> None:
    """Time one variant in a child process and merge its figures into ``row``: a CUDA error inside a module is
    sticky (every later CUDA call of the process fails, and TVM may abort it), so a variant that can fault runs
    where it cannot take the rest of the run with it. On GPT-2, TVM's default pipeline (``dense``) faulted with a
    misaligned address on the H200."""
    label = LABELS[variant]
    with tempfile.TemporaryDirectory(prefix="stof-e2e-child-") as tmp:
        out = os.path.join(tmp, "row.json")
        command = [sys.executable, os.path.abspath(__file__), "run", "--models", name, "--shapes",
                   f"{batch}x{seq_len}", "--variants", variant, "--no-baselines", "--isolate",
                   "--warmup", str(args.warmup), "--iters", str(args.iters), "--json", out]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode or not os.path.isfile(out):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            row[label + "_failed"] = f"child process exit {proc.returncode}: {' | '.join(tail)}"[:400]
            print(f"  {label} failed: {row[label + '_failed']}", flush=True)
            return
        with open(out) as f:
            (child,) = json.load(f)["results"]
    row.update({key: value for key, value in child.items() if key.startswith(label + "_")})


def _time_artifact(row, label, path, runtime, mapping, state, feeds, ref, args) -> None:
    """Load one artifact with the torch model's weights, check it against ``ref`` and time it."""
    t0 = time.time()
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    compiled = runtime.load(path, weights=artifact_weights(manifest, mapping, state))
    prepared = compiled.prepare(feeds)
    outs = compiled.run(prepared)
    row[label + "_err"] = _rel_err(outs[0].numpy(), ref)
    row[label + "_kernel"] = compiled.kernel
    timer = compiled.vm.time_evaluator("main", compiled.device, number=args.iters, repeat=3, min_repeat_ms=0)
    row[label + "_ms"] = float(np.median(timer(*prepared, *compiled.params).results) * 1e3)
    if label in args.profile:
        from stof_tvm.profiling import profile_artifact

        profile_artifact(compiled, prepared, label, row)
    row[label + "_load_s"] = time.time() - t0


def _speedups(row: dict, tolerance: float) -> None:
    """Best correct ``ours`` variant vs the best torch baseline and vs TVM's default pipeline."""
    torch_best = min((row[b + "_ms"] for b in BASELINES if b + "_ms" in row), default=None)
    ours = [(row[k + "_ms"], k) for k in OURS if k + "_ms" in row and row[k + "_err"] < tolerance]
    if not ours:
        return
    best, which = min(ours)
    row["ours_best"] = which
    if torch_best is not None:
        row["speedup_vs_best_torch"] = torch_best / best
    if "tvm-dense_ms" in row and row["tvm-dense_err"] < tolerance:
        row["speedup_vs_tvm_dense"] = row["tvm-dense_ms"] / best


def print_table(results: list[dict]) -> None:
    cols, nan = list(LABELS.values()) + list(BASELINES), float("nan")
    print("\nmodel               B     S  kernel " + "".join(f"{c + ' ms':>18}" for c in cols)
          + "  vs torch  vs tvm   max err")
    for row in results:
        cells = "".join(f"{row.get(c + '_ms', float('nan')):18.3f}" for c in cols)
        err = max((row[c + "_err"] for c in cols if c + "_err" in row), default=float("nan"))
        print(f"{row['model']:<18}{row['batch']:>3}{row['seq_len']:>6}  {row.get('ours_kernel', '-'):<6} {cells}  "
              f"{row.get('speedup_vs_best_torch', nan):7.2f}x {row.get('speedup_vs_tvm_dense', nan):6.2f}x"
              f"  {err:.1e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    for step in ("export", "build", "run", "reference"):
        p = sub.add_parser(step)
        p.add_argument("--models", nargs="+", default=list(MODELS))
        p.add_argument("--shapes", nargs="+", type=_shape_arg, default=list(SHAPES))
        if step in ("build", "run"):
            p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    sub.choices["reference"].add_argument("--dir", required=True, help="write the check data here")
    sub.choices["run"].add_argument("--warmup", type=int, default=5)
    sub.choices["run"].add_argument("--iters", type=int, default=10)
    sub.choices["run"].add_argument("--json", help="write the results here")
    sub.choices["run"].add_argument("--no-baselines", dest="baselines", action="store_false",
                                    help="time our artifacts only (no torch baselines)")
    sub.choices["run"].add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                                    help="leave out the torch.compile baseline (its first call compiles: ~1 min)")
    sub.choices["run"].add_argument("--isolate", nargs="*", default=["dense"], choices=list(VARIANTS),
                                    help="variants timed in a child process each (default: dense)")
    sub.choices["run"].add_argument("--time-budget", type=float, default=float("inf"),
                                    help="start no new (model, shape) after this many seconds (the table and JSON "
                                         "still come out before the device tool's time limit)")
    sub.choices["run"].add_argument("--profile", nargs="*", default=[], metavar="LABEL",
                                    help="variant labels (as in the table) whose kernel calls are also timed one by one")
    sub.choices["run"].add_argument("--tolerance", type=float, default=2e-2,
                                    help="largest relative error of a variant that counts as correct")
    args = parser.parse_args(argv)
    {"export": export, "build": build, "run": run, "reference": reference}[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
