"""A BERT encoder written directly as an ONNX graph with ``onnx.helper``.

The node sequence follows what ``torch.onnx.export`` produces for a Hugging Face ``BertModel``:

- ``input_ids`` and ``attention_mask`` (int64, ``[batch, sequence]``, symbolic dims) as inputs;
- position ids sliced from a constant table with ``Shape -> Gather -> Slice``;
- the extended mask ``(1 - Cast(Unsqueeze(attention_mask))) * finfo(float32).min`` added to the scores;
- per layer: ``MatMul + Add`` projections, ``Reshape [0, 0, H, D]`` + ``Transpose`` head split (K transposed
  straight to ``[B, H, D, S]``), ``MatMul``, ``Div`` by sqrt(D), ``Add`` mask, ``Softmax``, ``MatMul``,
  ``Transpose + Reshape`` head merge, output projection, residual, ``LayerNormalization``, erf GELU FFN.

Weights are random (seeded) and scaled so that activations stay in a well-conditioned range in float16.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Sizes of a BERT encoder."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int = 30522
    max_positions: int = 512
    eps: float = 1e-12

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} is not a multiple of heads={self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


BERT_CONFIGS = {
    "tiny-bert": BertConfig(hidden=128, layers=2, heads=2, ffn=512, vocab=1000, max_positions=4096),
    "bert-base": BertConfig(hidden=768, layers=12, heads=12, ffn=3072, max_positions=4096),
    "bert-large": BertConfig(hidden=1024, layers=24, heads=16, ffn=4096, max_positions=4096),
}


class _Graph:
    """Accumulates nodes and initializers with unique names."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, value, hint: str, dtype=None) -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(self, shape, hint: str, std: float) -> str:
        return self.const(self.rng.standard_normal(shape) * std, hint, np.float32)

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, **attrs) -> str:
        out = self.name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out + "_node", **attrs))
        return out


def _linear(g: _Graph, x: str, fan_in: int, fan_out: int, hint: str) -> str:
    w = g.weight((fan_in, fan_out), hint + ".weight", 1.0 / np.sqrt(fan_in))
    b = g.weight((fan_out,), hint + ".bias", 0.02)
    return g.op("Add", [g.op("MatMul", [x, w], hint + "_mm"), b], hint)


def _layer_norm(g: _Graph, x: str, width: int, eps: float, hint: str) -> str:
    gamma = g.const(1.0 + 0.1 * g.rng.standard_normal(width), hint + ".gamma", np.float32)
    beta = g.weight((width,), hint + ".beta", 0.02)
    return g.op("LayerNormalization", [x, gamma, beta], hint, axis=-1, epsilon=eps)


def _gelu_erf(g: _Graph, x: str) -> str:
    t = g.op("Erf", [g.op("Div", [x, g.const(np.sqrt(2.0), "sqrt2", np.float32)])])
    t = g.op("Add", [t, g.const(1.0, "one", np.float32)])
    return g.op("Mul", [g.op("Mul", [x, t]), g.const(0.5, "half", np.float32)], "gelu")


def _attention(g: _Graph, x: str, ext_mask: str, cfg: BertConfig, hint: str) -> str:
    heads_shape = g.const([0, 0, cfg.heads, cfg.head_dim], "heads_shape", np.int64)
    q, k, v = (g.op("Reshape", [_linear(g, x, cfg.hidden, cfg.hidden, f"{hint}.{t}"), heads_shape])
               for t in "qkv")
    q = g.op("Transpose", [q], "q_heads", perm=[0, 2, 1, 3])
    k = g.op("Transpose", [k], "k_heads_t", perm=[0, 2, 3, 1])
    v = g.op("Transpose", [v], "v_heads", perm=[0, 2, 1, 3])
    scores = g.op("MatMul", [q, k], "scores")
    scores = g.op("Div", [scores, g.const(np.sqrt(cfg.head_dim), "sqrt_d", np.float32)], "scaled")
    scores = g.op("Add", [scores, ext_mask], "masked")
    probs = g.op("Softmax", [scores], "probs", axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [probs, v], "context")], "context_t", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.const([0, 0, cfg.hidden], "merge_shape", np.int64)], "context_merged")
    return _linear(g, ctx, cfg.hidden, cfg.hidden, f"{hint}.out")


def make_bert(cfg: BertConfig, *, batch: int | None = None, seq_len: int | None = None,
              seed: int = 0) -> onnx.ModelProto:
    """Build a BERT encoder with random weights; dims are symbolic unless ``batch``/``seq_len`` are given.

    Inputs: ``input_ids`` and ``attention_mask`` (int64 ``[batch, sequence]``, 1 = keep, 0 = padding).
    Output: ``last_hidden_state`` (float32 ``[batch, sequence, hidden]``).
    """
    if seq_len is not None and not 1 <= seq_len <= cfg.max_positions:
        raise ValueError(f"seq_len: expected 1..{cfg.max_positions}, got {seq_len}")
    g = _Graph(np.random.default_rng(seed))
    dims = [batch if batch is not None else "batch", seq_len if seq_len is not None else "sequence"]

    word = g.weight((cfg.vocab, cfg.hidden), "word_embeddings", 1.0)
    pos_table = g.const(np.arange(cfg.max_positions)[None, :], "position_ids_buffer", np.int64)
    seq = g.op("Unsqueeze", [g.op("Gather", [g.op("Shape", ["input_ids"]), g.const(1, "one_i", np.int64)],
                                  axis=0), g.const([0], "axes0", np.int64)], "seq_len")
    pos_ids = g.op("Slice", [pos_table, g.const([0], "zero_i", np.int64), seq, g.const([1], "axis1", np.int64)],
                   "position_ids")
    emb = g.op("Add", [g.op("Gather", [word, "input_ids"], "tok_emb"),
                       g.op("Gather", [g.weight((cfg.max_positions, cfg.hidden), "position_embeddings", 0.5),
                                       pos_ids], "pos_emb")])
    h = _layer_norm(g, emb, cfg.hidden, cfg.eps, "embeddings.LayerNorm")

    ext = g.op("Unsqueeze", ["attention_mask", g.const([1, 2], "axes12", np.int64)], "mask_4d")
    ext = g.op("Sub", [g.const(1.0, "one_f", np.float32), g.op("Cast", [ext], to=TensorProto.FLOAT)])
    ext = g.op("Mul", [ext, g.const(np.finfo(np.float32).min, "neg_min", np.float32)], "extended_mask")

    for layer in range(cfg.layers):
        p = f"layer{layer}"
        h = _layer_norm(g, g.op("Add", [_attention(g, h, ext, cfg, p), h]), cfg.hidden, cfg.eps, p + ".ln1")
        ff = _linear(g, _gelu_erf(g, _linear(g, h, cfg.hidden, cfg.ffn, p + ".ffn1")), cfg.ffn, cfg.hidden,
                     p + ".ffn2")
        h = _layer_norm(g, g.op("Add", [ff, h]), cfg.hidden, cfg.eps, p + ".ln2")
    g.nodes.append(helper.make_node("Identity", [h], ["last_hidden_state"], name="output_node"))

    graph = helper.make_graph(
        g.nodes, "bert",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, dims)],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, dims + [cfg.hidden])],
        initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="stof-tvm")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
