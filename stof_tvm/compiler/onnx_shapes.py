"""onnx's shape inference on a model without its weights' bytes.

``onnx.shape_inference.infer_shapes`` serialises the whole model, parses it in C++ and hands back a full copy:
for a base model that is ~0.5 GB moved four times per call, 3-5 s of a compile's front end (which calls it once
per folding round). Shapes never depend on the values of the large float initializers (the weights), so they are
declared as typed graph inputs instead, with no data; every other initializer (shape tensors, ids, constant
masks: integer or small) stays, so data propagation folds what it folded before and every inferred shape is the
one the full model gives.
"""
from __future__ import annotations

import numpy as np
import onnx

# float initializers with at least this many elements are weights (kept as module parameters by onnx_import)
WEIGHT_MIN_ELEMENTS = 1 << 16
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def is_weight(tensor: onnx.TensorProto) -> bool:
    """A large float initializer: a weight, whose values no shape depends on."""
    size = int(np.prod(tensor.dims)) if len(tensor.dims) else 1
    return tensor.data_type in FLOAT_TYPES and size >= WEIGHT_MIN_ELEMENTS


def weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """What shape inference reads of ``model``: its graph with every weight a typed input without data."""
    light = onnx.ModelProto(ir_version=model.ir_version)
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph, source = light.graph, model.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)
    graph.sparse_initializer.extend(source.sparse_initializer)
    declared = {vi.name for vi in source.input}
    for tensor in source.initializer:
        if not is_weight(tensor):
            graph.initializer.append(tensor)
        elif tensor.name not in declared:
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return light


def infer_shapes(model: onnx.ModelProto, data_prop: bool = False) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes`` of :func:`weightless` ``(model)``: the same value infos, graph inputs
    and outputs (plus the weights as inputs), without copying the weights."""
    return onnx.shape_inference.infer_shapes(weightless(model), data_prop=data_prop)
