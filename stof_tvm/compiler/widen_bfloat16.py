"""A model exported in bfloat16 (``model.to(torch.bfloat16)`` before ``torch.onnx.export``), computed as float32.

TVM 0.27 cannot build a bfloat16 LayerNorm (``topi::nn::layer_norm``: "only support float32 and float16") and its
mixed-precision pass starts from float32, so such a model failed with an internal error. Every bfloat16 value is
exactly a float32 value, so the graph is rewritten at the ONNX level before import: bfloat16 weights, constants,
casts and declared tensor types become float32. The model then compiles like any float32 export (in float16 with
``dtype="float16"``), and its float outputs are float32 or float16 instead of bfloat16.
"""
from __future__ import annotations

import onnx
from onnx import numpy_helper

BFLOAT16, FLOAT = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT


def _widened_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """``tensor`` (bfloat16) as float32, same name and values."""
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype("float32"), tensor.name)


def _widen_graph(graph: onnx.GraphProto) -> int:
    """Rewrite ``graph`` (and the subgraphs of its nodes) in place; returns how many things were bfloat16."""
    count = 0
    for i, init in enumerate(graph.initializer):
        if init.data_type == BFLOAT16:
            graph.initializer[i].CopyFrom(_widened_tensor(init))
            count += 1
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        if value.type.tensor_type.elem_type == BFLOAT16:
            value.type.tensor_type.elem_type = FLOAT
            count += 1
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == BFLOAT16:
                attr.t.CopyFrom(_widened_tensor(attr.t))
                count += 1
            elif attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype") and attr.i == BFLOAT16:
                attr.i = FLOAT
                count += 1
            elif attr.type == onnx.AttributeProto.GRAPH:
                count += _widen_graph(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                count += sum(_widen_graph(g) for g in attr.graphs)
    return count


def widen_bfloat16(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """``(model, False)`` where nothing is bfloat16, else ``(a copy computed in float32, True)``."""
    widened = onnx.ModelProto()
    widened.CopyFrom(model)
    return (widened, True) if _widen_graph(widened.graph) else (model, False)


__all__ = ["widen_bfloat16"]
