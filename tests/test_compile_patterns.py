"""Attention pattern matching on the forms exporters emit: scale as Div / Mul / on Q / split over Q and K,
K transposed in one or two steps, masks as HF additive padding, constant causal Where or Add, both, and a
real additive bias (which must keep the dense path). Each compiled model is checked against onnx.reference."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import stof_tvm
from stof_tvm import make_mask
from stof_tvm.models.reference import reference_outputs

B, S, H, D = 2, 64, 2, 64
HIDDEN = H * D
LOWEST = np.finfo(np.float32).min


def _attention_model(scale_form: str, k_form: str, mask_form: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    inits, nodes = {}, []

    def const(name, value, dtype=np.float32):
        inits[name] = numpy_helper.from_array(np.asarray(value, dtype=dtype), name)
        return name

    def node(op, inputs, out, **attrs):
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    heads = const("heads_shape", [B, S, H, D], np.int64)
    proj = {}
    for t in "qkv":
        w = const("W" + t, rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN))
        proj[t] = node("Reshape", [node("MatMul", ["x", w], t + "_mm"), heads], t + "_r")
    q = node("Transpose", [proj["q"]], "q", perm=[0, 2, 1, 3])
    v = node("Transpose", [proj["v"]], "v", perm=[0, 2, 1, 3])
    if k_form == "direct":
        k_t = node("Transpose", [proj["k"]], "k_t", perm=[0, 2, 3, 1])
    else:
        k_t = node("Transpose", [node("Transpose", [proj["k"]], "k", perm=[0, 2, 1, 3])], "k_t", perm=[0, 1, 3, 2])
    if scale_form == "on_q":
        q = node("Mul", [q, const("q_scale", D ** -0.5)], "q_scaled")
    if scale_form == "split":
        q = node("Mul", [q, const("q_scale", D ** -0.25)], "q_scaled")
        k_t = node("Mul", [k_t, const("k_scale", D ** -0.25)], "k_scaled")
    scores = node("MatMul", [q, k_t], "scores")
    if scale_form == "div":
        scores = node("Div", [scores, const("sqrt_d", np.sqrt(D))], "scaled")
    elif scale_form == "mul":
        scores = node("Mul", [const("inv_sqrt_d", D ** -0.5), scores], "scaled")
    causal = np.tril(np.ones((S, S), bool))[None, None]
    if mask_form in ("where_causal", "where_then_pad"):
        scores = node("Where", [const("causal", causal, bool), scores, const("low", LOWEST)], "causal_masked")
    if mask_form == "add_causal":
        scores = node("Add", [scores, const("causal_bias", np.where(causal, 0.0, -10000.0))], "causal_masked")
    if mask_form in ("hf_pad", "where_then_pad"):
        ext = node("Cast", [node("Unsqueeze", ["attention_mask", const("axes", [1, 2], np.int64)], "m4")], "mf",
                   to=TensorProto.FLOAT)
        ext = node("Mul", [node("Sub", [const("one", 1.0), ext], "inv"), const("neg", LOWEST)], "ext")
        scores = node("Add", [scores, ext], "pad_masked")
    if mask_form == "bias":
        scores = node("Add", [scores, const("pos_bias", rng.standard_normal((1, H, S, S)))], "biased")
    probs = node("Softmax", [scores], "probs", axis=-1)
    ctx = node("Transpose", [node("MatMul", [probs, v], "ctx")], "ctx_t", perm=[0, 2, 1, 3])
    node("Reshape", [ctx, const("merge", [B, S, HIDDEN], np.int64)], "y")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, HIDDEN])]
    if mask_form in ("hf_pad", "where_then_pad"):
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [B, S]))
    graph = helper.make_graph(nodes, "attention", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, HIDDEN])],
                              initializer=list(inits.values()))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(model, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((B, S, HIDDEN)).astype(np.float32)}
    if any(i.name == "attention_mask" for i in model.graph.input):
        pad = np.ones((B, S), np.int64)
        pad[1, 40:] = 0
        feeds["attention_mask"] = pad
    return feeds


@pytest.mark.parametrize("scale_form, k_form, mask_form, kernel", [
    ("div", "direct", "hf_pad", "row"),
    ("mul", "two_step", "none", "row"),
    ("on_q", "direct", "where_causal", "row"),
    ("split", "two_step", "add_causal", "row"),
    ("div", "two_step", "where_then_pad", "row"),
    ("div", "direct", "where_then_pad", "dense"),
])
def test_forms_match_reference(scale_form, k_form, mask_form, kernel):
    model = _attention_model(scale_form, k_form, mask_form)
    art = stof_tvm.compile(model, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype="float32",
                           kernel=kernel)
    att = art.manifest["attention"]
    assert att["sites"] == 1 and att["kernel"]["kind"] == kernel
    # the canonical form moves a scale on Q, or split over Q and K, onto the scores: the kernel applies it
    assert att["scale"] == pytest.approx(D ** -0.5, rel=1e-6)
    if kernel != "dense" and mask_form in ("where_causal", "add_causal", "where_then_pad"):
        assert art.manifest["mask"]["model_keep"] == "model_keep.npy"
        np.testing.assert_array_equal(art.arrays["model_keep.npy"][0, 0], make_mask("causal", S))
    feeds = _feeds(model)
    out = art.load()(feeds)["y"]
    ref = reference_outputs(model, make_mask("bigbird", S)[None, None], feeds)["y"]
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("kernel, expected", [("auto", "row"), ("row", "row"), ("dense", "dense")])
def test_real_bias_is_added_by_the_row_kernel_or_kept_dense(kernel, expected):
    model = _attention_model("div", "direct", "bias")
    art = stof_tvm.compile(model, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype="float32", kernel=kernel)
    choice = art.manifest["attention"]["kernel"]
    assert choice["kind"] == expected and (choice["bias"] is not None) == (expected == "row")
    feeds = _feeds(model)
    ref = reference_outputs(model, make_mask("bigbird", S)[None, None], feeds)["y"]
    np.testing.assert_allclose(art.load()(feeds)["y"], ref, rtol=2e-4, atol=2e-5)


def test_real_bias_is_added_by_the_block_kernel_on_request():
    """kernel="block" takes the bias as an input after the format arrays (fp16: the block kernel's dtypes)."""
    model = _attention_model("div", "direct", "bias")
    art = stof_tvm.compile(model, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype="float16",
                           kernel="block")
    choice = art.manifest["attention"]["kernel"]
    assert choice["kind"] == "block" and choice["bias"] is not None and choice["reason"] == "requested"
    feeds = _feeds(model)
    ref = reference_outputs(model, make_mask("bigbird", S)[None, None], feeds)["y"]
    out = art.load()(feeds)["y"]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-3
