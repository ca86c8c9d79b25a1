"""The end-to-end benchmark's models: which Hugging Face model each name is, how it is built, fed, exported, and
how much work one forward pass is (for the fraction of the hardware limit).

Models come from :mod:`stof_tvm.models.hf_export` (config objects, seeded random weights, no downloads). A
name is a family at a size (``bert-base``, ``gpt2``, ``t5-base`` = the T5-base encoder, ``deberta-v3-base``,
``smollm2-360m`` and ``qwen2.5-0.5b`` = Llama and Qwen2 decoders with grouped-query attention at SmolLM2-360M's
and Qwen2.5-0.5B's published shapes, ``bert-tiny`` ...);
ViT's sequence is fixed by its image: ``vit-base`` is 224x224 in 16x16 patches (197 tokens), ``vit-base-384``
384x384 (577 tokens); a benchmark shape's batch applies to them and its length is replaced by theirs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OUTPUT = "last_hidden_state"


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: ``family``/``size`` as :mod:`stof_tvm.models.hf_export` names them, and for ViT the
    image side when it differs from the size's own (384 for 577 tokens)."""

    name: str
    family: str
    size: str
    image_size: int | None = None

    @property
    def is_vit(self) -> bool:
        return self.family == "vit"


MODELS = {spec.name: spec for spec in (
    ModelSpec("bert-base", "bert", "base"), ModelSpec("roberta-base", "roberta", "base"),
    ModelSpec("bert-large", "bert", "large"), ModelSpec("gpt2", "gpt2", "base"),
    ModelSpec("vit-base", "vit", "base"), ModelSpec("vit-base-384", "vit", "base", image_size=384),
    ModelSpec("t5-base", "t5", "base"), ModelSpec("deberta-v3-base", "deberta", "base"),
    ModelSpec("smollm2-360m", "llama", "360m"), ModelSpec("qwen2.5-0.5b", "qwen2", "500m"),
    # tiny ones (2 layers, hidden 128) for the CPU check of the whole flow
    ModelSpec("bert-tiny", "bert", "tiny"), ModelSpec("roberta-tiny", "roberta", "tiny"),
    ModelSpec("gpt2-tiny", "gpt2", "tiny"), ModelSpec("vit-tiny", "vit", "tiny"), ModelSpec("t5-tiny", "t5", "tiny"),
    ModelSpec("deberta-tiny", "deberta", "tiny"), ModelSpec("llama-tiny", "llama", "tiny"),
)}
GPU_MODELS = ("bert-base", "roberta-base", "bert-large", "gpt2", "vit-base", "vit-base-384", "t5-base",
              "deberta-v3-base", "smollm2-360m", "qwen2.5-0.5b")
# families whose attention is causal: the sparse mask is ANDed with causality (GPT-2; the grouped-query decoders)
CAUSAL_FAMILIES = ("gpt2", "llama", "qwen2")


def spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]


PUBLISHED_INIT_RANGE = 0.02     # initializer_range of the published BERT / RoBERTa / GPT-2 / ViT / DeBERTa checkpoints
# config attribute holding the learned position table of each family, and the rows a sequence of L tokens reads
# (RoBERTa's positions start after its padding index: L + 2). T5 and DeBERTa-v3 (position_biased_input False)
# have none: their positions are relative, log-bucketed, distances past the buckets' reach share the last
# bucket, so any length fits and their configs stay as published
POSITION_TABLES = {"bert": ("max_position_embeddings", 0), "roberta": ("max_position_embeddings", 2),
                   "gpt2": ("n_positions", 0)}


def config(model: ModelSpec, attn: str, length: int | None = None):
    """The transformers config of ``model`` with attention implementation ``attn``.

    Benchmark sizes (not ``*-tiny``) get the published initialisation: ``initializer_range`` 0.02 instead of
    hf_export's wider spread for the exactness corpus (T5 keeps its default ``initializer_factor``), so that
    float16 rounding over 12-24 layers stays well inside the benchmark's tolerance, as for real checkpoints;
    and, given ``length``, a position table at least that long (HF's 512 / 514 / 1024 rows cannot hold 2048
    tokens). Tiny models keep hf_export's config as it is (their tables are 512 rows)."""
    from stof_tvm.models import hf_export as hf

    cfg = hf.make_config(model.family, model.size, attn)
    if model.image_size is not None:
        cfg.image_size = model.image_size
    if model.size.startswith("tiny"):
        return cfg
    if hasattr(cfg, "initializer_range"):
        cfg.initializer_range = PUBLISHED_INIT_RANGE
    if length is not None and model.family in POSITION_TABLES:
        attr, offset = POSITION_TABLES[model.family]
        setattr(cfg, attr, max(getattr(cfg, attr), length + offset))
    return cfg


def check_length(model: ModelSpec, cfg, length: int) -> None:
    """Refuse a sequence length the config's position table cannot hold (on CUDA it would be a device-side
    assert in the embedding gather, which poisons the process)."""
    if model.family not in POSITION_TABLES:
        return
    attr, offset = POSITION_TABLES[model.family]
    if length + offset > getattr(cfg, attr):
        raise ValueError(f"seq_len: {model.name} has {getattr(cfg, attr)} position embeddings ({attr}), "
                         f"{length} tokens need {length + offset}")


def seq_len(model: ModelSpec, requested: int) -> int:
    """Tokens per sequence at a benchmark shape of length ``requested``: ViT's own length (patches + class token)."""
    if not model.is_vit:
        return requested
    cfg = config(model, "eager")
    return (cfg.image_size // cfg.patch_size) ** 2 + 1


def build(model: ModelSpec, attn: str, seed: int, length: int | None = None):
    """The seeded torch model (eval mode, float32, on the CPU) of :func:`config` (``length``: the position table
    it must hold; refused with ValueError when it cannot), wrapped as :func:`hf_export.build_model` wraps it:
    inputs positionally (``model.input_names``), ``last_hidden_state`` out."""
    import torch

    from stof_tvm.models import hf_export as hf

    cfg = config(model, attn, length)
    if length is not None:
        check_length(model, cfg, length)
    torch.manual_seed(seed)       # as build_model does, with the benchmark's config
    extra = {"add_pooling_layer": False} if model.is_vit else {}      # ViT's pooler: unused weights
    return hf._wrapped(hf._model_class(model.family)(cfg, **extra).eval(), model.family)


def inputs(model: ModelSpec, batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
    """Fresh random inputs by name, no padding (the dense baselines get the same work): token ids and an all-ones
    attention mask, or ViT pixels of the model's image size."""
    from stof_tvm.models import hf_export as hf

    if model.is_vit:
        side = config(model, "eager").image_size
        rng = np.random.default_rng(seed)
        return {"pixel_values": rng.standard_normal((batch, 3, side, side), dtype=np.float32)}
    return hf.example_inputs(model.family, batch, length, padded_rows=0, seed=seed, size=model.size)


def export(torch_model, feeds: dict[str, np.ndarray], path: str, opset: int = 17) -> str:
    """``torch.onnx.export`` (the TorchScript exporter, ``dynamo=False``) of ``torch_model`` traced on ``feeds``
    (static shapes: the graph is for this batch and length), inputs named as the model names them, one output
    ``last_hidden_state``. The model may live on any device; the feeds are moved there."""
    import torch

    device = next(torch_model.parameters()).device
    args = tuple(torch.from_numpy(feeds[name]).to(device) for name in torch_model.input_names)
    with torch.no_grad():
        torch.onnx.export(torch_model, args, path, dynamo=False, input_names=list(torch_model.input_names),
                          output_names=[OUTPUT], opset_version=opset)
    return path


def shape_info(torch_model) -> dict:
    """Heads, head dim, hidden size, layers (read from the config), the weights a forward pass must read, and
    DeBERTa's relative-position terms (:func:`relative_terms`)."""
    import torch

    cfg = torch_model.model.config
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "d_model", None) or cfg.n_embd
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "num_heads", None) or cfg.n_head
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "num_layers", None) or cfg.n_layer
    head_dim = getattr(cfg, "d_kv", None) or hidden // heads
    matmul_weights = embedding = 0
    for module in torch_model.modules():
        if isinstance(module, torch.nn.Embedding):
            embedding += module.weight.numel()
        elif isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) or type(module).__name__ == "Conv1D":
            matmul_weights += module.weight.numel()
    total = sum(p.numel() for p in torch_model.parameters())
    score_terms, relative_rows = relative_terms(torch_model)
    return {"hidden": int(hidden), "heads": int(heads), "head_dim": int(head_dim), "layers": int(layers),
            "matmul_weights": int(matmul_weights), "dense_weights": int(total - embedding),
            "score_terms": score_terms, "relative_rows": relative_rows}


def relative_terms(torch_model) -> tuple[int, int]:
    """DeBERTa's disentangled attention: how many relative-position score terms it adds to QK^T (c2p and p2c:
    2) and the rows of the relative embedding table each term projects per layer (2 x position buckets);
    ``(0, 0)`` for every other model."""
    cfg = torch_model.model.config
    if not getattr(cfg, "relative_attention", False):
        return 0, 0
    return len(cfg.pos_att_type), int(torch_model.model.encoder.rel_embeddings.num_embeddings)


def work(info: dict, batch: int, length: int, kept_pairs: int, dtype_bytes: int = 2) -> dict:
    """Useful work of one forward pass: ``flops`` = every weight matrix applied to every token (2 per
    multiply-add; a patch embedding counts as one) plus attention over the kept (query, key) pairs only
    (``kept_pairs`` per head: QK^T and PV, 2 * head_dim each); ``bytes`` = a lower bound on memory traffic:
    every non-embedding weight read once, plus each layer's input and output activations read / written once
    (the embedding rows gathered count as one activation).

    DeBERTa (``info["score_terms"]`` = 2): its c2p and p2c score terms count as one more head_dim dot product
    each per kept pair (a query against the key projection of the pair's relative bucket, and the key against
    its query projection: the least work, whatever an implementation computes densely and gathers), and their
    projections of the relative table (``relative_rows`` rows through one hidden x hidden matrix per term and
    layer, once per forward) as matrix FLOPs. The table itself (an embedding, 512 x 768 in the base model)
    is left out of ``bytes``."""
    tokens = batch * length
    terms = info.get("score_terms", 0)
    relative = 2.0 * info.get("relative_rows", 0) * info["hidden"] ** 2 * terms * info["layers"]
    gemm = 2.0 * tokens * info["matmul_weights"] + relative
    attention = (4.0 + 2.0 * terms) * batch * info["heads"] * kept_pairs * info["head_dim"] * info["layers"]
    activations = 2.0 * tokens * info["hidden"] * (info["layers"] + 1)
    return {"flops": gemm + attention, "gemm_flops": gemm, "attention_flops": attention,
            "bytes": dtype_bytes * (info["dense_weights"] + activations)}
