"""Hugging Face transformers models built from config objects (no downloads) and exported to ONNX by torch.

These are the graphs users bring: ``torch.onnx.export`` of a transformers model, by the TorchScript exporter
(``dynamo=False``) or the dynamo exporter, with eager or SDPA attention. The test corpus
(tests/test_hf_exports.py) and the end-to-end benchmarks build their models here.

- :func:`build_model` ``(family, size, attn, seed)``: a seeded model in eval mode whose weights are drawn with a
  larger spread than the published initialisation (``initializer_range`` 0.02 -> :data:`INIT_RANGE`), so that
  attention is far from uniform and a wrong rewrite of the scores shows well above 1e-3;
- :func:`example_inputs` ``(family, batch, seq_len, padded_rows, seed)``: int64 token ids and an attention
  mask whose last ``padded_rows`` rows are padded (the padding at the right end of the row, ids set to the
  model's pad token); ViT: float32 pixel values (no mask, its length is fixed by the image size);
- :func:`export` ``(model_or_family, path, exporter=..., opset=..., batch=..., seq_len=..., dynamic=...)``:
  one ONNX file, inputs named ``input_ids`` / ``attention_mask`` (``pixel_values``), one output
  ``last_hidden_state``; dynamic axes named ``batch`` and ``sequence``;
- :func:`torch_outputs`: the torch model's ``last_hidden_state`` in float32 on the CPU;
- :func:`cached_export`: :func:`export` through a disk cache keyed by the torch and transformers versions, this
  module's source and every export parameter (exports take seconds each; the corpus makes dozens).

Families (:data:`FAMILIES`): ``bert``, ``roberta``, ``distilbert``, ``gpt2``, ``vit``, ``t5`` (T5EncoderModel),
``bigbird`` (original_full attention), ``bigbird-sparse`` (block_sparse), ``longformer``, ``deberta`` (DeBERTa-v3:
relative attention with both position terms); at size ``tiny`` only (:data:`TINY_ONLY`): ``bloom`` (ALiBi, the
position term computed from the attention mask), ``phi`` (head_dim 80 as in Phi-2, partial rotary), ``gemma``
(head_dim 256, one key/value head), ``mistral`` (sliding-window causal attention, grouped keys/values), ``gptneox``
(Pythia: partial rotary, parallel residual), ``bart`` (BartModel's encoder), ``clip`` (CLIPTextModel: causal
attention and padding), ``modernbert`` (a global and a sliding-window layer: masks that differ between layers),
``gemma2`` (logit soft-capping, a sliding-window and a global layer; it compiles through TVM's default pipeline,
with a warning saying why), ``qwen2`` (biased Q, K and V projections, one key/value head), ``opt`` (ReLU, learned
positions counted from the attention mask, pre-LayerNorm), ``llama`` (grouped keys/values: twice the heads of the
tiny shape, 4 of 32, sharing 2 key/value heads) and ``phi3`` (the same heads through one fused QKV projection split
unevenly, and one fused gate/up projection split in halves). Sizes (:data:`SIZES`): ``tiny`` (2 layers, hidden 128,
head_dim 64), ``tiny-d32`` (the same with 4 heads of 32), ``base`` (the published base model's shape: bert-base,
roberta-base, distilbert-base, gpt2, vit-base, t5-base encoder, bigbird-roberta-base, longformer-base,
deberta-v3-base), ``large`` (bert-large), ``360m`` (llama only: SmolLM2-360M's published config) and ``500m``
(qwen2 only: Qwen2.5-0.5B's). Attention ``sdpa`` exists where transformers implements it (:func:`attention_kinds`).

torch and transformers are imported when a function needs them: they are test extras, not stof-tvm
dependencies.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

FAMILIES = ("bert", "roberta", "distilbert", "gpt2", "vit", "t5", "bigbird", "bigbird-sparse", "longformer",
            "deberta", "bloom", "phi", "gemma", "mistral", "gptneox", "bart", "clip", "modernbert", "gemma2", "qwen2",
            "opt", "llama", "phi3")
# families built at the tiny size only (the decoder-only ones' published sizes are billions of weights)
TINY_ONLY = ("bloom", "phi", "gemma", "mistral", "gptneox", "bart", "clip", "modernbert", "gemma2", "qwen2", "opt",
             "llama", "phi3")
SIZES = ("tiny", "tiny-d32", "tiny-w768", "base", "large", "360m", "500m")
# sizes one family has only: bert-large; the grouped-query decoders the end-to-end benchmark times beside the
# encoders, at published shapes: SmolLM2-360M for llama (15 query heads of 64 on 5 key/value heads, hidden 960, 32
# layers) and Qwen2.5-0.5B for qwen2 (14 on 2, biased Q, K and V, hidden 896, 24 layers)
FAMILY_SIZES = {"large": "bert", "360m": "llama", "500m": "qwen2"}
EXPORTERS = ("torchscript", "dynamo")
ATTENTIONS = ("eager", "sdpa")
INIT_RANGE = 0.15                # standard deviation of the random weights (published models: 0.02)
VOCAB_TINY = 1000
OUTPUT = "last_hidden_state"

# (hidden, layers, heads, ffn) per size; "large" exists for bert only; "tiny-w768": one layer of the base widths
# with the tiny vocabulary (what the base models' GEMM shapes do, at a tiny model's export cost)
_SHAPES = {"tiny": (128, 2, 2, 256), "tiny-d32": (128, 2, 4, 256), "tiny-w768": (768, 1, 12, 3072),
           "base": (768, 12, 12, 3072), "large": (1024, 24, 16, 4096)}
_NO_SDPA = ("bigbird", "bigbird-sparse", "longformer", "deberta", "bloom", "gemma2")
# tiny ViT: 64x64 images in 8x8 patches (64 patches + the class token); base: 224x224 in 16x16 (197 tokens)
_VIT_IMAGE = {"tiny": (64, 8), "tiny-d32": (64, 8), "tiny-w768": (64, 8), "base": (224, 16)}
# BigBird's block-sparse attention needs seq_len > (5 + 2 * random blocks) * block: 7 * 8 = 56 tokens when tiny
BIGBIRD_BLOCK = {"tiny": (8, 1), "tiny-d32": (8, 1), "tiny-w768": (8, 1), "base": (64, 3)}   # block, random blocks
LONGFORMER_WINDOW = {"tiny": 16, "tiny-d32": 16, "tiny-w768": 16, "base": 512}
# DeBERTa-v3's relative positions: log buckets of the distance (256 in the published base model)
DEBERTA_BUCKETS = {"tiny": 32, "tiny-d32": 32, "tiny-w768": 32, "base": 256}
TINY_WINDOW = 16            # tiny Mistral's, ModernBERT's and Gemma 2's sliding windows: narrower than the test
                            # sequences


def attention_kinds(family: str) -> tuple[str, ...]:
    """The ``attn_implementation`` values transformers offers for ``family``."""
    _check_family(family)
    return ("eager",) if family in _NO_SDPA else ATTENTIONS


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")


def _check_size(family: str, size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"size: expected one of {SIZES}, got {size!r}")
    if size in FAMILY_SIZES and family != FAMILY_SIZES[size]:
        raise ValueError(f"size: {size!r} exists for {FAMILY_SIZES[size]} only, not {family!r}")
    own = ("tiny",) + tuple(s for s, f in FAMILY_SIZES.items() if f == family)
    if family in TINY_ONLY and size not in own:
        raise ValueError(f"size: {family} exists at sizes {own} only, not {size!r}")


def make_config(family: str, size: str = "tiny", attn: str = "eager"):
    """The transformers config object of ``family`` at ``size`` with ``attn_implementation=attn``."""
    import transformers as tf

    _check_family(family)
    _check_size(family, size)
    if attn not in attention_kinds(family):
        raise ValueError(f"attn: {family} offers {attention_kinds(family)}, got {attn!r}")
    if (family, size) == ("llama", "360m"):
        return _smollm2_360m_config(tf, attn)
    if (family, size) == ("qwen2", "500m"):
        return _qwen25_05b_config(tf, attn)
    hidden, layers, heads, ffn = _SHAPES[size]
    tiny = size.startswith("tiny")
    vocab = {"vocab_size": VOCAB_TINY} if tiny else {}
    common = dict(attn_implementation=attn, initializer_range=INIT_RANGE)
    bert_like = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=ffn, **vocab, **common)
    if family == "bert":
        return tf.BertConfig(**bert_like, **({"max_position_embeddings": 512} if tiny else {}))
    if family == "roberta":
        return tf.RobertaConfig(**bert_like, max_position_embeddings=514)
    if family == "distilbert":
        return tf.DistilBertConfig(dim=hidden, n_layers=layers, n_heads=heads, hidden_dim=ffn, **vocab, **common)
    if family == "gpt2":
        special = {"bos_token_id": VOCAB_TINY - 1, "eos_token_id": VOCAB_TINY - 1} if tiny else {}
        return tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn, **vocab, **special,
                             use_cache=False, **({"n_positions": 512} if tiny else {}), **common)
    if family == "vit":
        image, patch = _VIT_IMAGE[size]
        return tf.ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=ffn, image_size=image, patch_size=patch, **common)
    if family == "t5":
        # T5 draws its weights from initializer_factor (1.0 = the published scales, already far from uniform)
        return tf.T5Config(d_model=hidden, num_layers=layers, num_heads=heads, d_kv=hidden // heads, d_ff=ffn,
                           feed_forward_proj="relu", **vocab, use_cache=False, attn_implementation=attn)
    if family in ("bigbird", "bigbird-sparse"):
        block, randoms = BIGBIRD_BLOCK[size]
        kind = "block_sparse" if family == "bigbird-sparse" else "original_full"
        return tf.BigBirdConfig(**bert_like, attention_type=kind, block_size=block, num_random_blocks=randoms,
                                **({"max_position_embeddings": 512} if tiny else {}))
    if family == "deberta":
        # DeBERTa-v3 (DebertaV2Model): disentangled attention, the scores plus content-to-position and
        # position-to-content terms gathered from shared relative embeddings
        return tf.DebertaV2Config(**bert_like, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                  position_buckets=DEBERTA_BUCKETS[size], max_relative_positions=-1,
                                  norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False,
                                  type_vocab_size=0, layer_norm_eps=1e-7)
    if family in TINY_ONLY:
        return _tiny_only_config(tf, family, hidden, layers, heads, ffn, common)
    window = LONGFORMER_WINDOW[size]
    return tf.LongformerConfig(**bert_like, attention_window=[window] * layers, max_position_embeddings=514)


def _tiny_only_config(tf, family: str, hidden: int, layers: int, heads: int, ffn: int, common: dict):
    """The tiny config of a :data:`TINY_ONLY` family (padding id 0, ids 1 and 2 the other special tokens)."""
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    llama_like = dict(vocab_size=VOCAB_TINY, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, max_position_embeddings=512, **special, **common)
    if family == "bloom":
        return tf.BloomConfig(vocab_size=VOCAB_TINY, hidden_size=hidden, n_layer=layers, n_head=heads, **special,
                              **common)
    if family == "phi":          # Phi-2's head_dim 80 (2 heads of 80), rotary on 32 of them
        return tf.PhiConfig(**{**llama_like, "hidden_size": 80 * heads}, partial_rotary_factor=0.4)
    if family == "gemma":        # Gemma's head_dim 256 (wider than the hidden size), one key/value head
        return tf.GemmaConfig(**llama_like, num_key_value_heads=1, head_dim=256)
    if family == "mistral":
        return tf.MistralConfig(**llama_like, num_key_value_heads=1, sliding_window=TINY_WINDOW)
    if family == "gptneox":
        return tf.GPTNeoXConfig(**llama_like, rotary_pct=0.25, use_parallel_residual=True)
    if family == "gemma2":       # tanh(scores / 50) * 50 before the softmax; layer 0 sliding-window, layer 1 global
        return tf.Gemma2Config(**llama_like, num_key_value_heads=1, head_dim=hidden // heads,
                               sliding_window=TINY_WINDOW, attn_logit_softcapping=50.0)
    if family == "modernbert":   # layer 0 global, layer 1 local (a window of TINY_WINDOW tokens around each)
        return tf.ModernBertConfig(**llama_like, local_attention=TINY_WINDOW, cls_token_id=1, sep_token_id=2,
                                   layer_types=["full_attention", "sliding_attention"] * (layers // 2))
    if family == "qwen2":        # Q, K and V projections with biases, grouped keys/values (one head)
        return tf.Qwen2Config(**llama_like, num_key_value_heads=1)
    if family == "llama":        # grouped-query attention with groups of two: 4 query heads of 32, 2 key/value heads
        return tf.LlamaConfig(**{**llama_like, "num_attention_heads": 2 * heads}, num_key_value_heads=heads)
    if family == "phi3":         # one fused QKV projection split unevenly (grouped K and V), one fused gate_up split
        return tf.Phi3Config(**{**llama_like, "num_attention_heads": 2 * heads}, num_key_value_heads=heads)
    if family == "opt":          # ReLU, learned positions from the attention mask's cumulative sum (offset 2)
        return tf.OPTConfig(vocab_size=VOCAB_TINY, hidden_size=hidden, num_hidden_layers=layers, ffn_dim=ffn,
                            num_attention_heads=heads, word_embed_proj_dim=hidden, max_position_embeddings=512,
                            init_std=INIT_RANGE, attn_implementation=common["attn_implementation"], **special)
    if family == "bart":
        return tf.BartConfig(vocab_size=VOCAB_TINY, d_model=hidden, encoder_layers=layers, decoder_layers=1,
                             encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                             decoder_ffn_dim=ffn, max_position_embeddings=512, **special,
                             attn_implementation=common["attn_implementation"], init_std=INIT_RANGE)
    return tf.CLIPTextConfig(vocab_size=VOCAB_TINY, hidden_size=hidden, intermediate_size=ffn,
                             num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=128,
                             **special, **common)


def _smollm2_360m_config(tf, attn: str):
    """SmolLM2-360M's published Llama config (hidden 960, 32 layers, 15 heads on 5 key/value heads, SwiGLU of
    2560, RMSNorm eps 1e-5, rotary theta 100000, 49152 tokens), its ``initializer_range`` 0.02 kept: 362M weights,
    a 1.45 GB float32 export, under protobuf's 2 GB."""
    return tf.LlamaConfig(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                          num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=8192,
                          rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.02,
                          pad_token_id=2, bos_token_id=1, eos_token_id=2, use_cache=False,
                          attn_implementation=attn)


def _qwen25_05b_config(tf, attn: str):
    """Qwen2.5-0.5B's published config (hidden 896, 24 layers, 14 heads on 2 key/value heads, Q/K/V biases, SwiGLU of
    4864, RMSNorm eps 1e-6, rotary theta 1e6, 151936 tokens, embeddings tied), ``initializer_range`` 0.02: 494M
    weights, a 1.98 GB float32 export, under protobuf's 2 GiB."""
    return tf.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                          rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
                          initializer_range=0.02, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
                          attn_implementation=attn)


def _model_class(family: str):
    import transformers as tf

    return {"bert": tf.BertModel, "roberta": tf.RobertaModel, "distilbert": tf.DistilBertModel,
            "gpt2": tf.GPT2Model, "vit": tf.ViTModel, "t5": tf.T5EncoderModel, "bigbird": tf.BigBirdModel,
            "bigbird-sparse": tf.BigBirdModel, "longformer": tf.LongformerModel, "deberta": tf.DebertaV2Model,
            "bloom": tf.BloomModel, "phi": tf.PhiModel, "gemma": tf.GemmaModel, "mistral": tf.MistralModel,
            "gptneox": tf.GPTNeoXModel, "bart": _bart_encoder, "clip": tf.CLIPTextModel,
            "modernbert": tf.ModernBertModel, "gemma2": tf.Gemma2Model, "qwen2": tf.Qwen2Model,
            "opt": tf.OPTModel, "llama": tf.LlamaModel, "phi3": tf.Phi3Model}[family]


def _bart_encoder(config):
    """BART's encoder as users take it from the full model (``BartModel(config).get_encoder()``)."""
    import transformers as tf

    return tf.BartModel(config).get_encoder()


def _wrapped(model, family: str):
    """``model`` inside a module that takes its inputs positionally and returns only ``last_hidden_state``: the
    exporters then see plain tensors in and one tensor out (no ModelOutput, no pooler, no cache)."""
    import torch

    class TextEncoder(torch.nn.Module):
        input_names = ("input_ids", "attention_mask")

        def __init__(self):
            super().__init__()
            self.model, self.family = model, family

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state

    class ImageEncoder(torch.nn.Module):
        input_names = ("pixel_values",)

        def __init__(self):
            super().__init__()
            self.model, self.family = model, family

        def forward(self, pixel_values):
            return self.model(pixel_values=pixel_values, return_dict=True).last_hidden_state

    return (ImageEncoder if family == "vit" else TextEncoder)().eval()


def build_model(family: str, size: str = "tiny", attn: str = "eager", seed: int = 0):
    """A ``family`` model at ``size`` with random weights drawn from ``seed`` (same seed, same weights), in eval
    mode, wrapped so that it takes the inputs of :func:`example_inputs` positionally and returns
    ``last_hidden_state``. ``model.family`` and ``model.input_names`` say what it is."""
    import torch

    config = make_config(family, size, attn)
    torch.manual_seed(seed)
    extra = {"add_pooling_layer": False} if family == "vit" else {}      # ViT's pooler: unused weights
    return _wrapped(_model_class(family)(config, **extra).eval(), family)


def _family_of(model) -> str:
    return getattr(model, "family", None) or ""


def sequence_length(family: str, size: str = "tiny", seq_len: int | None = None) -> int:
    """Tokens the model sees: ``seq_len``, except ViT, whose length is fixed by its image (patches + 1)."""
    if family == "vit":
        image, patch = _VIT_IMAGE[size]
        return (image // patch) ** 2 + 1
    if seq_len is None:
        raise ValueError("seq_len: required for a text model")
    return int(seq_len)


def example_inputs(family: str, batch: int, seq_len: int, padded_rows: int = 1, seed: int = 0,
                   size: str = "tiny") -> dict[str, np.ndarray]:
    """Inputs by name. Text models: ``input_ids`` [batch, seq_len] int64 (random ids of the model's vocabulary,
    avoiding special ids) and ``attention_mask`` [batch, seq_len] int64 whose last ``padded_rows`` rows
    keep only their first ~5/8 tokens (at batch 1 the only row is padded); padded positions hold the
    pad token (RoBERTa's and Longformer's position ids depend on it). ViT: ``pixel_values`` [batch, 3, H, W]
    float32 (``seq_len`` and ``padded_rows`` do not apply)."""
    _check_family(family)
    rng = np.random.default_rng(seed)
    config = make_config(family, size)
    if family == "vit":
        return {"pixel_values": rng.standard_normal((batch, 3, config.image_size, config.image_size),
                                                    dtype=np.float32)}
    ids = rng.integers(4, config.vocab_size, (batch, seq_len), dtype=np.int64)
    mask = np.ones((batch, seq_len), np.int64)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    keep = max(1, (seq_len * 5) // 8)
    for row in range(batch - min(padded_rows, batch), batch):
        mask[row, keep:] = 0
        ids[row, keep:] = pad_id
    return {"input_ids": ids, "attention_mask": mask}


def _torch_args(model, inputs: dict) -> tuple:
    import torch

    return tuple(torch.from_numpy(np.ascontiguousarray(inputs[name])) for name in model.input_names)


def torch_outputs(model, inputs: dict) -> np.ndarray:
    """``last_hidden_state`` of the (wrapped) torch ``model`` on ``inputs``, float32, on the CPU."""
    import torch

    with torch.no_grad():
        return model.float()(*_torch_args(model, inputs)).numpy().astype(np.float32)


EXPORT_DTYPES = ("float32", "float16", "bfloat16")


def export(model_or_family, path, *, exporter: str = "torchscript", opset: int = 17, batch: int = 2,
           seq_len: int = 64, dynamic: bool = False, size: str = "tiny", attn: str = "eager",
           seed: int = 0, dtype: str = "float32"):
    """Export a model (a :func:`build_model` result, or a family name built with ``size``/``attn``/``seed``, in
    ``dtype``: ``float16`` or ``bfloat16`` export it after ``model.to(dtype)``, as users do for GPU inference) to
    ``path`` with torch's ``exporter`` at ``opset``, traced on :func:`example_inputs` of ``batch`` x ``seq_len``.
    ``dynamic``: the batch and sequence axes (ViT: the batch) become symbolic, named ``batch`` and ``sequence``.
    Returns ``path``. Raises whatever torch raises when the exporter cannot export the model (the corpus records
    those as not exportable)."""
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"exporter: expected one of {EXPORTERS}, got {exporter!r}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype: expected one of {EXPORT_DTYPES}, got {dtype!r}")
    model = build_model(model_or_family, size, attn, seed) if isinstance(model_or_family, str) else model_or_family
    model = model.to(getattr(torch, dtype))
    family = _family_of(model)
    args = _torch_args(model, example_inputs(family, batch, seq_len, seed=seed, size=size))
    names = list(model.input_names)
    axes = {"batch": 0} if family == "vit" else {"batch": 0, "sequence": 1}
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kwargs = dict(input_names=names, output_names=[OUTPUT], opset_version=opset)
    with torch.no_grad():
        if exporter == "torchscript":
            dynamic_axes = None
            if dynamic:
                dynamic_axes = {name: {axis: label for label, axis in axes.items()} for name in names}
                dynamic_axes[OUTPUT] = {axis: label for label, axis in axes.items()}
            torch.onnx.export(model, args, path, dynamo=False, dynamic_axes=dynamic_axes, **kwargs)
        else:
            shapes = None
            if dynamic:
                dims = {label: torch.export.Dim(label, min=1 if label == "batch" else 2) for label in axes}
                shapes = tuple({axis: dims[label] for label, axis in axes.items()} for _ in names)
            large = sum(p.numel() for p in model.parameters()) * 4 > (1 << 30)
            torch.onnx.export(model, args, path, dynamo=True, dynamic_shapes=shapes, external_data=large,
                              **kwargs)
    return path


def export_key(**params) -> str:
    """A short hash of the torch and transformers versions, this module's source (the configs and weights it
    builds) and the export parameters ``params``."""
    import torch
    import transformers

    with open(__file__, "rb") as f:
        source = hashlib.sha256(f.read()).hexdigest()
    text = json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "source": source,
                       **params}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_export(cache_dir, family: str, *, size: str = "tiny", attn: str = "eager", exporter: str = "torchscript",
                  opset: int = 17, batch: int = 2, seq_len: int = 64, dynamic: bool = False, seed: int = 0,
                  dtype: str = "float32") -> str:
    """:func:`export` of ``family`` into ``cache_dir`` unless an export with the same parameters (and torch and
    transformers versions) is already there; returns the ONNX path. A failed export is not cached."""
    params = dict(family=family, size=size, attn=attn, exporter=exporter, opset=opset, batch=batch,
                  seq_len=seq_len, dynamic=dynamic, seed=seed)
    tag = ""
    if dtype != "float32":          # float32 exports keep the keys they had before the parameter existed
        params["dtype"], tag = dtype, f"-{dtype}"
    stem = f"{family}-{size}-{attn}-{exporter}{opset}-{'dyn' if dynamic else 'static'}{tag}-{export_key(**params)}"
    path = os.path.join(os.fspath(cache_dir), stem, "model.onnx")
    if not os.path.isfile(path):
        tmp = os.path.join(os.fspath(cache_dir), stem + f".tmp{os.getpid()}", "model.onnx")
        export(family, tmp, exporter=exporter, opset=opset, batch=batch, seq_len=seq_len, dynamic=dynamic,
               size=size, attn=attn, seed=seed, dtype=dtype)
        try:
            os.replace(os.path.dirname(tmp), os.path.dirname(path))
        except OSError:             # another process cached it first
            pass
    return path


__all__ = ["FAMILIES", "TINY_ONLY", "SIZES", "EXPORTERS", "EXPORT_DTYPES", "ATTENTIONS", "attention_kinds",
           "make_config", "build_model", "example_inputs", "sequence_length", "torch_outputs", "export", "export_key",
           "cached_export"]
