"""Built-in transformer models as ONNX graphs (random weights, no downloads).

``BUILTIN`` maps a model name to a function ``(batch=None, seq_len=None, seed=0) -> onnx.ModelProto``. The
graphs use the operator forms that PyTorch's ONNX exporter emits for Hugging Face style models (MatMul + Add
projections, Reshape/Transpose head splits, Div scaling, an additive mask derived from ``attention_mask``,
Softmax, erf GELU, LayerNormalization), so they exercise the same pattern matching as exported models.
"""
from __future__ import annotations

from .bert import BERT_CONFIGS, BertConfig, make_bert

BUILTIN = {name: (lambda cfg: (lambda **kw: make_bert(cfg, **kw)))(cfg) for name, cfg in BERT_CONFIGS.items()}


def builtin_model(name: str, **kwargs):
    """Return the ONNX model of the built-in ``name`` (see ``BUILTIN``)."""
    if name not in BUILTIN:
        raise ValueError(f"model: unknown built-in model {name!r}; expected one of {sorted(BUILTIN)}")
    return BUILTIN[name](**kwargs)


__all__ = ["BUILTIN", "BERT_CONFIGS", "BertConfig", "builtin_model", "make_bert"]
