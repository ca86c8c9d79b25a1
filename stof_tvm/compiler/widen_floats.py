"""16-bit float models (``model.to(torch.bfloat16)`` or ``model.half()`` before ``torch.onnx.export``) widened to
float32 at the ONNX level, before import.

- bfloat16, always: TVM 0.27 cannot build a bfloat16 LayerNorm (``topi::nn::layer_norm``: "only support float32
  and float16") and its mixed-precision pass starts from float32, so such a model failed with an internal error.
- float16, where the build computes in float32 (``dtype="float32"``, llvm's default) and the model's float weights
  are all float16 (an export of a half model, not a float32 model that casts a few tensors to float16 on purpose):
  left as it is, the model computed in float16 with float16 accumulation (4.8e-3 from torch float32 for the tiny
  BERT; widened, 1.9e-5 from its widened reference).

Every 16-bit value is exactly a float32 value: weights, constants, casts and declared tensor types become float32
(subgraphs too). The model then compiles like a float32 export (in float16 with ``dtype="float16"``), and its float
inputs and outputs are float32 or float16. ``run --check``'s reference widens the same way (:func:`reference_types`).
"""
from __future__ import annotations

import onnx
from onnx import numpy_helper

FLOAT, FLOAT16, BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16
NAMES = {FLOAT16: "float16", BFLOAT16: "bfloat16"}


def float16_weights(model: onnx.ModelProto) -> bool:
    """Whether every float initializer of ``model`` is float16 (and there is one): a half model's export."""
    floats = {init.data_type for init in model.graph.initializer
              if init.data_type in (FLOAT, FLOAT16, BFLOAT16, onnx.TensorProto.DOUBLE)}
    return floats == {FLOAT16}


def types_to_widen(model: onnx.ModelProto, dtype: str) -> frozenset:
    """The element types a build computing in ``dtype`` widens (see the module docstring)."""
    return frozenset({BFLOAT16} | ({FLOAT16} if dtype == "float32" and float16_weights(model) else set()))


def reference_types(model: onnx.ModelProto) -> frozenset:
    """The element types ``run --check``'s reference widens: the model's own 16-bit weights computed in float32."""
    return types_to_widen(model, "float32")


def _widened_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """``tensor`` as float32, same name and values."""
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype("float32"), tensor.name)


def _typed_places(graph: onnx.GraphProto):
    """Every place of ``graph`` (and of its nodes' subgraphs) that names an element type, as ``(type, widen)``:
    ``widen()`` rewrites that place to float32. Read-only until a ``widen`` is called."""
    for init in graph.initializer:
        yield init.data_type, lambda init=init: init.CopyFrom(_widened_tensor(init))
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        ttype = value.type.tensor_type
        yield ttype.elem_type, lambda ttype=ttype: setattr(ttype, "elem_type", FLOAT)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t.data_type, lambda t=attr.t: t.CopyFrom(_widened_tensor(t))
            elif attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype"):
                yield attr.i, lambda attr=attr: setattr(attr, "i", FLOAT)
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from _typed_places(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _typed_places(sub)


def widen(model: onnx.ModelProto, types: frozenset) -> tuple[onnx.ModelProto, frozenset]:
    """``(model, {})`` where nothing has one of ``types``, else ``(a copy with them widened to float32, the types
    found)``; the caller's model is left as it is, and is copied only when something is widened."""
    found = frozenset(elem_type for elem_type, _ in _typed_places(model.graph) if elem_type in types)
    if not found:
        return model, found
    widened = onnx.ModelProto()
    widened.CopyFrom(model)
    for elem_type, widen_place in _typed_places(widened.graph):
        if elem_type in found:
            widen_place()
    return widened, found


__all__ = ["widen", "types_to_widen", "reference_types", "float16_weights", "NAMES"]
