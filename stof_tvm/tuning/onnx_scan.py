"""What a whole model computes: the distinct attention problems and template calls of its layers.

An ONNX graph (a built-in model from :mod:`stof_tvm.models` or a file) is scanned for what stage 1 and stage 2
need, without importing it into Relax:

- every ``MatMul`` whose right operand is a 2-D initializer ``[K, N]`` is a GEMM of ``tokens x N x K``; an
  ``Add`` of a 1-D initializer right after it is its bias, and an erf GELU (``Div -> Erf``) or ``Relu`` after
  that its activation. It maps to the GEMM template of that epilogue (``gemm_bias_gelu_erf_kn`` and so on;
  ONNX weights are ``[K, N]``);
- every ``Softmax`` is an attention site; the head count and head dimension come from the ``Reshape`` to
  ``[0, 0, H, D]`` that splits the heads.

Identical calls (every layer of a BERT) are counted, so that each becomes one task whose weight is how often
the model makes the call (the task scheduler then spends trials where the time is).
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

__all__ = ["ModelCalls", "scan_onnx", "load_model"]


@dataclass
class ModelCalls:
    """What a model computes per forward pass: GEMMs ``(template, n, k) -> count`` and attention
    ``(heads, head_dim) -> count``."""

    gemms: Counter
    attention: Counter


def load_model(model):
    """An ``onnx.ModelProto`` from a built-in model name (``bert-base``, ``tiny-bert``, ...), a path or a proto."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a built-in model name, an ONNX file path or an onnx.ModelProto, "
                        f"got {type(model).__name__}")
    from ..models import BUILTIN, builtin_model

    if str(model) in BUILTIN:
        return builtin_model(str(model))
    if not os.path.isfile(model):
        raise FileNotFoundError(f"model: {model!r} is neither a built-in model ({', '.join(sorted(BUILTIN))}) "
                                f"nor an ONNX file")
    return onnx.load(os.fspath(model))


def scan_onnx(model) -> ModelCalls:
    """The GEMM and attention calls of an ONNX transformer (see the module docstring)."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def value(name):
        if name in inits:
            return numpy_helper.to_array(inits[name])
        return consts.get(name)

    def only_consumer(name, op_type):
        nodes = consumers.get(name, [])
        return nodes[0] if len(nodes) == 1 and nodes[0].op_type == op_type else None

    def consumer(name, op_type):
        return next((n for n in consumers.get(name, []) if n.op_type == op_type), None)

    gemms, attention = Counter(), Counter()
    for node in graph.node:
        if node.op_type == "MatMul":
            weight = value(node.input[1])
            if weight is None or weight.ndim != 2:
                continue
            k, n = (int(s) for s in weight.shape)
            name, out = "gemm", node.output[0]
            add = only_consumer(out, "Add")
            bias = None
            if add is not None:
                bias = value(add.input[1] if add.input[0] == out else add.input[0])
            if bias is not None and bias.ndim == 1 and bias.shape[0] == n:
                name, out = "gemm_bias", add.output[0]
                if consumer(out, "Relu") is not None:
                    name += "_relu"
                elif (div := consumer(out, "Div")) is not None and consumer(div.output[0], "Erf") is not None:
                    name += "_gelu_erf"
            gemms[(name + "_kn", n, k)] += 1
        elif node.op_type == "Softmax":
            attention["site"] += 1
    heads = [tuple(int(x) for x in value(n.input[1])[2:]) for n in graph.node if n.op_type == "Reshape"
             and value(n.input[1]) is not None and value(n.input[1]).shape == (4,) and value(n.input[1])[0] == 0]
    sites = attention.pop("site", 0)
    if sites:
        if not heads:
            raise ValueError("model: attention found (Softmax) but no Reshape to [0, 0, heads, head_dim] to read "
                             "the head split from")
        attention[Counter(heads).most_common(1)[0][0]] = sites
    return ModelCalls(gemms, attention)
