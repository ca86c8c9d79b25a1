"""The ONNX-level rules and folds that make real exports importable (stof_tvm/compiler/onnx_rules.py,
onnx_import.py), and the compile fallback for a valid model with no attention site.

- the opset-23 ``Attention`` operator becomes MatMul / scale / mask / Softmax / MatMul with the operator's
  semantics (boolean and additive masks, ``is_causal``, the default scale 1/sqrt(D)), checked against numpy;
  forms outside the SDPA subset are refused by name;
- ``RotaryEmbedding`` (opset 23) becomes elementwise operators with onnx's reference values, in each of its
  forms (4-D and 3-D input, partial, interleaved, position ids); an input of unknown shape is refused by name;
- ``Tile`` by constant repeats becomes Reshape / Expand / Reshape with the same values;
- folding gathers a small slice of a larger constant (BertModel's token-type buffer) correctly;
- a model without attention compiles through TVM's default pipeline with a warning and is exact; a sparse mask
  for it is refused, naming why.
"""
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import stof_tvm
from stof_tvm.compiler.onnx_import import TensorSpec, fold_shape_computations
from stof_tvm.compiler.onnx_rules import AttentionOp, TileAsExpand, apply_rules

B, H, S, D = 2, 2, 8, 16


def _attention_model(mask_type=None, past=False, **attrs) -> onnx.ModelProto:
    names = ["q", "k", "v"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H, S, D]) for n in names]
    if mask_type is not None:
        names.append("mask")
        inputs.append(helper.make_tensor_value_info("mask", mask_type, [B, 1, S, S]))
    if past:
        names += ["", "past_key", "past_value"][-(6 - len(names)):]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H, 1, D])
                   for n in ("past_key", "past_value")]
    node = helper.make_node("Attention", names, ["y"], name="sdpa", **attrs)
    graph = helper.make_graph([node], "attention", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, H, S, D])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _numpy_attention(q, k, v, scale, keep=None, bias=None):
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    return (probs / probs.sum(-1, keepdims=True)) @ v


def _run(model, feeds):
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)[0]


@pytest.mark.parametrize("form", ["bool-mask", "float-mask", "causal", "plain-scale"])
def test_attention_op_becomes_matmul_softmax_matmul(form):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(3))
    feeds = {"q": q, "k": k, "v": v}
    keep = rng.random((B, 1, S, S)) < 0.6
    keep[..., 0] = True                                  # no fully masked row
    if form == "bool-mask":
        model, expected = _attention_model(TensorProto.BOOL, scale=0.3), _numpy_attention(q, k, v, 0.3, keep)
        feeds["mask"] = keep
    elif form == "float-mask":
        bias = rng.standard_normal((B, 1, S, S)).astype(np.float32)
        model, expected = _attention_model(TensorProto.FLOAT, scale=0.3), _numpy_attention(q, k, v, 0.3, bias=bias)
        feeds["mask"] = bias
    elif form == "causal":
        model = _attention_model(is_causal=1, scale=0.3)
        expected = _numpy_attention(q, k, v, 0.3, np.tril(np.ones((S, S), bool)))
    else:                                                # no scale attribute: 1/sqrt(D)
        model, expected = _attention_model(), _numpy_attention(q, k, v, 1 / np.sqrt(D))
    rewritten, applied = apply_rules(model)
    assert applied == ["attention-op"]
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Attention" not in ops and ops.count("MatMul") == 2 and ops.count("Softmax") == 1
    onnx.checker.check_model(rewritten, full_check=True)
    np.testing.assert_allclose(_run(rewritten, feeds), expected, rtol=1e-5, atol=1e-5)


def test_attention_op_outside_the_sdpa_subset_is_refused_by_name():
    with pytest.raises(ValueError, match="KV-cache"):
        AttentionOp().apply(_attention_model(past=True))
    with pytest.raises(ValueError, match="softcap"):
        AttentionOp().apply(_attention_model(softcap=30.0))


def test_a_model_without_attention_is_untouched():
    model = _bare_model()
    assert AttentionOp().apply(model) is None and apply_rules(model) == (model, [])


@pytest.mark.parametrize("reps", [[4, 1, 1], [2, 3, 1], [1, 1, 1]])
def test_tile_becomes_reshape_expand_reshape(reps):
    """DeBERTa's ``repeat`` of its relative-position keys: the same tensor without the Tile node."""
    shape = [3, 5, 4]
    reps_init = numpy_helper.from_array(np.array(reps, np.int64), "reps")
    node = helper.make_node("Tile", ["x", "reps"], ["y"], name="tile")
    graph = helper.make_graph([node], "tile", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                             [r * d for r, d in zip(reps, shape)])],
                              initializer=[reps_init])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = TileAsExpand().apply(model)
    assert out is not None and "Tile" not in [n.op_type for n in out.graph.node]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(_run(out, {"x": x}), np.tile(x, reps))


def test_folding_gathers_a_slice_of_a_larger_buffer():
    """BertModel's token-type ids: GatherElements of a [1, 512] buffer at [1, S] positions (onnx's reference
    GatherElements raised "cannot reshape array of size 1 into shape (1,S)")."""
    buffer = np.arange(512, dtype=np.int64)[None] * 3
    positions = np.arange(5, 13, dtype=np.int64)[None]
    nodes = [helper.make_node("Constant", [], ["buffer"], value=numpy_helper.from_array(buffer, "buffer")),
             helper.make_node("Constant", [], ["positions"], value=numpy_helper.from_array(positions, "positions")),
             helper.make_node("GatherElements", ["buffer", "positions"], ["ids"], axis=1),
             helper.make_node("Add", ["x", "ids"], ["y"])]
    graph = helper.make_graph(nodes, "gather", [helper.make_tensor_value_info("x", TensorProto.INT64, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [1, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folded = fold_shape_computations(model, [TensorSpec("x", (1, 8), "int64")])
    (node,) = [n for n in folded.graph.node if n.output[0] == "ids"]
    assert node.op_type == "Constant"
    np.testing.assert_array_equal(numpy_helper.to_array(node.attribute[0].t), buffer[:, 5:13])


def _bare_model() -> onnx.ModelProto:
    """[batch, sequence, 8] -> MatMul -> Relu: valid, and no attention in it."""
    weight = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "bare",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", 8])],
        initializer=[numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_no_attention_falls_back_to_the_default_pipeline_exactly():
    model = _bare_model()
    with pytest.warns(UserWarning, match="no attention subgraph .* TVM's default pipeline"):
        art = stof_tvm.compile(model, mask="dense", batch=2, seq_len=4, target="llvm", dtype="float32")
    assert art.manifest["attention"]["kernel"]["kind"] == "none"
    assert "no attention subgraph" in art.manifest["attention"]["fallback"]
    x = np.random.default_rng(2).standard_normal((2, 4, 8)).astype(np.float32)
    weight = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(art.load()({"x": x})["y"], np.maximum(x @ weight, 0), rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"cannot apply a sparse mask to this model \(no attention"):
            stof_tvm.compile(model, mask="sliding:window=2", batch=2, seq_len=4, target="llvm", dtype="float32")


def _rotary_model(x_shape, cache_shape, positions=False, **attrs) -> onnx.ModelProto:
    names = ["x", "cos", "sin"] + (["positions"] if positions else [])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, cache_shape),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, cache_shape)]
    if positions:
        inputs.append(helper.make_tensor_value_info("positions", TensorProto.INT64, [B, S]))
    node = helper.make_node("RotaryEmbedding", names, ["y"], name="rope", **attrs)
    graph = helper.make_graph([node], "rope", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


# (x shape, cache shape, position ids, attributes): the dynamo exporter's form (4-D, the rotated slice of each head,
# caches [1, S, D/2] broadcast over the batch), a partial rotation, interleaved pairs, position ids into a longer
# cache, and the 3-D form with num_heads
ROTARY_FORMS = {
    "dynamo": ((B, H, S, D), (1, S, D // 2), False, {"interleaved": 0, "num_heads": H}),
    "partial": ((B, H, S, D), (B, S, 4), False, {"rotary_embedding_dim": 8}),
    "interleaved": ((B, H, S, D), (B, S, D // 2), False, {"interleaved": 1}),
    "positions": ((B, H, S, D), (3 * S, D // 2), True, {}),
    "3d": ((B, S, H * D), (2 * S, 4), True, {"num_heads": H, "rotary_embedding_dim": 8, "interleaved": 1}),
}


@pytest.mark.parametrize("form", list(ROTARY_FORMS))
def test_rotary_embedding_op_becomes_elementwise_operators(form):
    """opset 23's RotaryEmbedding (every rotary model exported by dynamo at opset 23; TVM's importer lacks it)
    becomes elementwise operators computing what onnx's reference implementation of the operator computes, and
    imports into Relax (the values checked on llvm)."""
    import tvm
    from tvm import relax

    from stof_tvm.compiler.onnx_import import import_onnx
    from stof_tvm.compiler.onnx_rules import RotaryEmbeddingOp

    x_shape, cache_shape, positions, attrs = ROTARY_FORMS[form]
    model = _rotary_model(x_shape, cache_shape, positions, **attrs)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
             "cos": rng.standard_normal(cache_shape).astype(np.float32),
             "sin": rng.standard_normal(cache_shape).astype(np.float32)}
    if positions:
        feeds["positions"] = rng.integers(0, cache_shape[0], (B, S)).astype(np.int64)
    rewritten = RotaryEmbeddingOp().apply(model)
    assert "RotaryEmbedding" not in {n.op_type for n in rewritten.graph.node}
    want = _run(model, feeds)
    np.testing.assert_allclose(_run(rewritten, feeds), want, rtol=1e-6, atol=1e-6)
    mod, specs, _ = import_onnx(model, B, S)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(feeds[spec.name]) for spec in specs]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rotary_embedding_op_of_unknown_shape_is_refused_by_name():
    model = _rotary_model((B, H, S, D), (1, S, D // 2))
    del model.graph.input[0].type.tensor_type.shape.dim[:]
    with pytest.raises(ValueError, match="RotaryEmbedding operator at node 'rope'"):
        apply_rules(model)
