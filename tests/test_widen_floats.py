"""16-bit float models widened to float32 before import (stof_tvm/compiler/widen_floats.py): every weight, constant,
cast and declared type of the widened types, in subgraphs too, and nothing else; bfloat16 always, float16 where the
build computes in float32 and the model's float weights are all float16."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from stof_tvm.compiler.widen_floats import float16_weights, reference_types, types_to_widen, widen

BF16, F16, F32 = TensorProto.BFLOAT16, TensorProto.FLOAT16, TensorProto.FLOAT


def _bf16_tensor(name, values):
    return helper.make_tensor(name, BF16, [len(values)], values)


def _model() -> onnx.ModelProto:
    """x (bfloat16) * w + c, a Cast to bfloat16 of an int input, a ConstantOfShape in bfloat16, and an If whose
    branch holds a bfloat16 constant."""
    branch = helper.make_graph([helper.make_node("Constant", [], ["k"], value=_bf16_tensor("kv", [0.5]))],
                               "branch", [], [helper.make_tensor_value_info("k", BF16, [1])])
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("Constant", [], ["c"], value=_bf16_tensor("cv", [1.25, -3.0])),
             helper.make_node("Add", ["xw", "c"], ["y"]),
             helper.make_node("Cast", ["ids"], ["ids_b"], to=BF16),
             helper.make_node("ConstantOfShape", ["shape"], ["fill"], value=_bf16_tensor("fv", [2.0])),
             helper.make_node("If", ["flag"], ["branch_out"], then_branch=branch, else_branch=branch)]
    inputs = [helper.make_tensor_value_info("x", BF16, [2]),
              helper.make_tensor_value_info("ids", TensorProto.INT64, [2]),
              helper.make_tensor_value_info("flag", TensorProto.BOOL, [])]
    graph = helper.make_graph(
        nodes, "g", inputs,
        [helper.make_tensor_value_info(name, BF16, None) for name in ("y", "ids_b", "fill", "branch_out")],
        [_bf16_tensor("w", [0.1, 3.0]), numpy_helper.from_array(np.array([2], np.int64), "shape")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _bfloat16_places(graph: onnx.GraphProto) -> int:
    count = sum(init.data_type == BF16 for init in graph.initializer)
    count += sum(v.type.tensor_type.elem_type == BF16 for v in list(graph.input) + list(graph.output))
    for node in graph.node:
        for attr in node.attribute:
            count += attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == BF16
            count += attr.name == "to" and attr.i == BF16
            count += _bfloat16_places(attr.g) if attr.type == onnx.AttributeProto.GRAPH else 0
    return count


def test_every_bfloat16_place_becomes_float32_with_its_values():
    model = _model()
    assert _bfloat16_places(model.graph) == 13
    assert types_to_widen(model, "float16") == types_to_widen(model, "float32") == {BF16}
    widened, found = widen(model, frozenset({BF16}))
    assert found == {BF16} and _bfloat16_places(widened.graph) == 0
    assert _bfloat16_places(model.graph) == 13                      # the caller's model is left as it was
    weight = numpy_helper.to_array(widened.graph.initializer[0])
    assert weight.dtype == np.float32
    np.testing.assert_array_equal(weight, numpy_helper.to_array(model.graph.initializer[0]).astype(np.float32))
    assert numpy_helper.to_array(widened.graph.initializer[1]).dtype == np.int64
    cast = next(node for node in widened.graph.node if node.op_type == "Cast")
    assert cast.attribute[0].i == F32
    branch_value = widened.graph.node[-1].attribute[0].g.node[0].attribute[0].t
    assert numpy_helper.to_array(branch_value).tolist() == [0.5]


def test_a_model_without_bfloat16_is_returned_as_it_is():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", F32, [2])],
                              [helper.make_tensor_value_info("y", F32, [2])])
    model = helper.make_model(graph)
    assert widen(model, frozenset({BF16, F16})) == (model, frozenset())


def _weights_model(*dtypes) -> onnx.ModelProto:
    """A graph with one [2] weight of each of ``dtypes``, added up."""
    inits = [helper.make_tensor(f"w{i}", dtype, [2], [1.0, 2.0]) for i, dtype in enumerate(dtypes)]
    nodes = [helper.make_node("Cast", [f"w{i}"], [f"c{i}"], to=F32) for i in range(len(dtypes))]
    nodes.append(helper.make_node("Sum", [f"c{i}" for i in range(len(dtypes))], ["y"]))
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", F32, [2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_float16_is_widened_only_for_a_float32_build_of_a_half_model():
    """A half model (every float weight float16) is widened for ``dtype="float32"`` (and for ``run --check``'s
    reference), kept for ``dtype="float16"``; a float32 model that holds a float16 weight on purpose is never."""
    half, mixed = _weights_model(F16, F16), _weights_model(F32, F16)
    assert float16_weights(half) and not float16_weights(mixed)
    assert types_to_widen(half, "float32") == reference_types(half) == {BF16, F16}
    assert types_to_widen(half, "float16") == {BF16}
    assert types_to_widen(mixed, "float32") == {BF16}
    widened, found = widen(half, types_to_widen(half, "float32"))
    assert found == {F16} and {init.data_type for init in widened.graph.initializer} == {F32}
