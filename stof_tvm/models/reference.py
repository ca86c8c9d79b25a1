"""Reference outputs for a compiled model: the ONNX model itself, with the sparse mask applied, evaluated
by ``onnx.reference.ReferenceEvaluator`` (numpy, in the float types of the model it is given: ``run --check`` gives
it 16-bit models widened to float32, :mod:`stof_tvm.compiler.widen_floats`).

The mask is imposed where stof-tvm imposes it: on the input and output of every attention Softmax (a
Softmax over the last axis of a rank-4 ``[B, H, Sq, Sk]`` tensor). Before it, masked scores are replaced by
the lowest float; after it, masked probabilities are zeroed, so rows with no kept key give zero output.
Exports that spell attention as the ONNX ``Attention`` op (opset 23) have no such Softmax: there the mask is
folded into the op's ``attn_mask`` (AND with a boolean one; the lowest float where an additive one is not
kept; the mask itself where it has none), which matches wherever every row keeps a key.
The model's own masking (padding, causal constants) stays as it is in the graph.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from stof_tvm.compiler.onnx_import import embedding_rows


def _static_copy(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs have the static shapes of ``feeds``, shapes inferred."""
    static = onnx.ModelProto()
    static.CopyFrom(model)
    for vi in static.graph.input:
        if vi.name in feeds:
            dims = vi.type.tensor_type.shape.dim
            for dim, size in zip(dims, feeds[vi.name].shape):
                dim.Clear()
                dim.dim_value = int(size)
    return shape_inference.infer_shapes(static)


def _rank4_softmax_inputs(model: onnx.ModelProto) -> set[str]:
    ranks = {}
    for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        if vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
    found = set()
    for node in model.graph.node:
        if node.op_type != "Softmax":
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        if ranks.get(node.input[0]) == 4 and axis in (-1, 3):
            found.add(node.output[0])
    return found


def _is_attention_op(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is the standard domain's ``Attention`` (opset 23)."""
    return node.op_type == "Attention" and not node.domain


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """ONNX element type of every tensor whose type is known (after shape inference)."""
    types = {init.name: init.data_type for init in model.graph.initializer}
    for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        types[vi.name] = vi.type.tensor_type.elem_type
    return types


def _masked_attention(node: onnx.NodeProto, mask_type: int | None, keep_name: str, low_name: str) -> list:
    """An ``Attention`` node with ``keep_name`` folded into its ``attn_mask`` (input 3), after the node that
    combines them if it has one of its own."""
    attention = onnx.NodeProto()
    attention.CopyFrom(node)
    inputs = list(node.input) + [""] * max(0, 4 - len(node.input))
    if not inputs[3]:
        inputs[3] = keep_name
        combine = []
    else:
        combined = inputs[3] + "_stof_kept"
        combine = [helper.make_node("And", [inputs[3], keep_name], [combined]) if mask_type == onnx.TensorProto.BOOL
                   else helper.make_node("Where", [keep_name, inputs[3], low_name], [combined])]
        inputs[3] = combined
    del attention.input[:]
    attention.input.extend(inputs)
    return combine + [attention]


# the float element types whose lowest value and zero the masked reference writes in that type (Where needs both
# branches of one type: a model exported in float16 has float16 scores)
_FLOAT_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
                onnx.TensorProto.DOUBLE: np.float64}


class _FillConstants:
    """The lowest value and zero of each float element type the masked graph needs, as initializers made once."""

    def __init__(self):
        self.made: dict[int, tuple[str, str]] = {}

    def names(self, elem_type: int | None) -> tuple[str, str]:
        """(lowest, zero) initializer names in ``elem_type`` (float32 where the type is not a known float)."""
        elem_type = elem_type if elem_type in _FLOAT_TYPES else onnx.TensorProto.FLOAT
        if elem_type not in self.made:
            suffix = onnx.TensorProto.DataType.Name(elem_type).lower()
            self.made[elem_type] = (f"stof_ref_lowest_{suffix}", f"stof_ref_zero_{suffix}")
        return self.made[elem_type]

    def initializers(self) -> list:
        out = []
        for elem_type, (low, zero) in self.made.items():
            dtype = _FLOAT_TYPES[elem_type]
            out += [numpy_helper.from_array(np.array(np.finfo(dtype).min, dtype), low),
                    numpy_helper.from_array(np.array(0, dtype), zero)]
        return out


def masked_model(model: onnx.ModelProto, keep: np.ndarray, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with the boolean ``keep`` mask (broadcastable to [B, H, Sq, Sk]) applied at every attention
    Softmax, or folded into every ``Attention`` op's mask, in the scores' own float type; raises ValueError if the
    model has neither."""
    static = _static_copy(model, feeds)
    targets = _rank4_softmax_inputs(static)
    if not targets and not any(map(_is_attention_op, static.graph.node)):
        raise ValueError("model: no attention Softmax over a rank-4 tensor, nor an Attention op, found for the "
                         "reference")
    keep_name = "stof_ref_keep"
    constants = _FillConstants()
    types = _elem_types(static)
    nodes = []
    for node in static.graph.node:
        if _is_attention_op(node):
            mask = node.input[3] if len(node.input) > 3 else ""
            low_name = constants.names(types.get(mask))[0]
            nodes.extend(_masked_attention(node, types.get(mask), keep_name, low_name))
        elif node.op_type == "Softmax" and node.output[0] in targets:
            low_name, zero_name = constants.names(types.get(node.input[0]))
            masked_in, raw_out = node.input[0] + "_stof_masked", node.output[0] + "_stof_raw"
            nodes.append(helper.make_node("Where", [keep_name, node.input[0], low_name], [masked_in]))
            softmax = onnx.NodeProto()
            softmax.CopyFrom(node)
            softmax.input[0], softmax.output[0] = masked_in, raw_out
            nodes.append(softmax)
            nodes.append(helper.make_node("Where", [keep_name, raw_out, zero_name], [node.output[0]]))
        else:
            nodes.append(node)
    del static.graph.node[:]
    static.graph.node.extend(nodes)
    static.graph.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(keep, dtype=bool), keep_name)]
                                    + constants.initializers())
    return static


def _gather_elements():
    """onnx's reference ``GatherElements``, corrected: onnx 1.x's numpy version fails where ``indices`` is shorter than
    ``data`` along the gathered axis (transformers' BERT exported by the dynamo exporter gathers 64 token types from
    a [1, 512] buffer: "cannot reshape array of size 1 into shape (1,64)"). ``out[..., j, ...] = data[..., indices[...,
    j, ...], ...]`` along ``axis``, over the leading part of ``data`` that ``indices`` covers in the other axes."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        def _run(self, data, indices, axis=None):
            axis = (axis or 0) % data.ndim
            covered = tuple(slice(None) if d == axis else slice(0, size) for d, size in enumerate(indices.shape))
            index = np.where(indices < 0, indices + data.shape[axis], indices)
            return (np.take_along_axis(data[covered], index, axis=axis),)

    return GatherElements


def evaluate(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict:
    """``{output name: value}`` of ``model`` for ``feeds``, from onnx's reference evaluator (with the ops it gets
    wrong replaced: :func:`_gather_elements`)."""
    from onnx.reference import ReferenceEvaluator

    values = ReferenceEvaluator(model, new_ops=[_gather_elements()]).run(None, feeds)
    return dict(zip([o.name for o in model.graph.output], values))


def reference_outputs(model: onnx.ModelProto, keep: np.ndarray, feeds: dict[str, np.ndarray]) -> dict:
    """Outputs of ``model`` under ``keep`` for ``feeds``, from onnx's reference evaluator."""
    return evaluate(masked_model(model, keep, feeds), feeds)


def random_inputs(model: onnx.ModelProto, shapes: dict[str, tuple], *, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds for ``model``: valid token ids for integer inputs that index an embedding, all ones for
    other integer inputs (attention masks), normal floats otherwise."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        if vi.name not in shapes:
            continue
        shape, elem = shapes[vi.name], vi.type.tensor_type.elem_type
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        if np.issubdtype(dtype, np.integer):
            rows = embedding_rows(model, vi.name)
            feeds[vi.name] = (rng.integers(0, rows, shape) if rows else np.ones(shape)).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds
