"""scripts/e2e_ort.py, the onnxruntime baseline's preparation: the fusions expected per family, the score-scale
rewrite ORT's fuser needs on no-mask attention (exact), the provider summary from ORT's profile, and (with
onnxruntime installed) the fused operator counts on tiny real HF exports, which the GPU machine reproduces byte
for byte (``opt_level=0``: no ORT session runs before the Python fusions)."""
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_e2e  # noqa: E402
import e2e_ort  # noqa: E402


def test_expected_and_missing_fusions_per_family():
    assert e2e_ort.expected_fusions("roberta", 12) == {("Attention", "MultiHeadAttention"): 12,
                                                       ("SkipLayerNormalization",): 24,
                                                       ("BiasGelu", "FastGelu"): 12}
    assert ("SkipSimplifiedLayerNormalization",) in e2e_ort.expected_fusions("t5", 12)
    assert ("BiasGelu", "FastGelu") not in e2e_ort.expected_fusions("t5", 12)          # T5's FFN is ReLU
    # Llama: GPT-2's fusions (RMSNorm form), grouped-query attention, a SwiGLU feed-forward (no GELU to fuse)
    assert e2e_ort.expected_fusions("llama", 32) == {("Attention", "MultiHeadAttention", "GroupQueryAttention"): 32,
                                                     ("SkipSimplifiedLayerNormalization",): 64}
    assert e2e_ort.expected_fusions("qwen2", 24) == {("Attention", "MultiHeadAttention", "GroupQueryAttention"): 24,
                                                     ("SkipSimplifiedLayerNormalization",): 48}
    assert e2e_ort.missing_fusions({"SkipSimplifiedLayerNormalization": 4}, "llama", 2) == [
        "Attention|MultiHeadAttention|GroupQueryAttention 0/2"]
    full = {"Attention": 12, "BiasGelu": 12, "SkipLayerNormalization": 24}
    assert e2e_ort.missing_fusions(full, "bert", 12) == []
    # session 5's GPU counts (MatMul + Add folded into Gemm by ORT's level-1 pass before the fusions)
    assert e2e_ort.missing_fusions({"Gelu": 12, "SkipLayerNormalization": 24}, "roberta", 12) == [
        "Attention|MultiHeadAttention 0/12", "BiasGelu|FastGelu 0/12"]
    assert e2e_ort.missing_fusions({"MultiHeadAttention": 2, "FastGelu": 2, "SkipLayerNormalization": 4},
                                   "gpt2", 2) == []


def _scores_graph(scale: float):
    """Softmax((q @ k) * scale) @ v on (2, 4, 8) float32 inputs, the scale a Constant node."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"], name="qk"),
             helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(scale, np.float32))),
             helper.make_node("Mul", ["s", "c"], ["scaled"], name="scale"),
             helper.make_node("Softmax", ["scaled"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["out"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4, 8]) for n in ("q", "v")]
    inputs.append(helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 8, 4]))
    graph = helper.make_graph(nodes, "scores", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                                                      [2, 4, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rewritten_once_exactly(model, rewrite, seed: int) -> list[str]:
    """Apply ``rewrite`` to ``model``: it rewrites one site, the outputs on random q, k, v stay bit for bit the same,
    and a second pass finds nothing left; returns the operator types after it."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(seed)
    feeds = {name: rng.standard_normal(shape, dtype=np.float32)
             for name, shape in (("q", (2, 4, 8)), ("k", (2, 8, 4)), ("v", (2, 4, 8)))}
    before = ReferenceEvaluator(model).run(None, feeds)[0]
    assert rewrite(model) == 1
    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, feeds)[0], before)
    assert rewrite(model) == 0
    return [n.op_type for n in model.graph.node]


def test_scale_as_division_is_exact_and_only_before_softmax():
    ops = _rewritten_once_exactly(_scores_graph(0.125), e2e_ort.scale_as_division, seed=0)   # 1/8 -> / 8: exact
    assert ops == ["MatMul", "Constant", "Div", "Softmax", "MatMul"]
    masked = _scores_graph(0.125)
    masked.graph.node[3].input[0] = "s"               # Softmax straight on the scores: no Mul before it
    assert e2e_ort.scale_as_division(masked) == 0


def _masked_scores_graph(mask_value: float, from_input: bool = False):
    """softmax(q @ k + mask) @ v with ``mask = Where(all-true constant, mask_value, -inf)`` (HF ViT's additive mask
    in transformers 5.17's eager attention), or a graph input ``m`` when ``from_input``."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("q", "k", "v")]
    if from_input:
        inputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, None))
    else:
        nodes.append(helper.make_node("Constant", [], ["keep"], value=numpy_helper.from_array(np.ones((4, 4), bool))))
        nodes.append(helper.make_node("Where", ["keep", "zero", "low"], ["m"]))
    nodes += [helper.make_node("Add", ["s", "m"], ["masked"]), helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["out"])]
    init = [numpy_helper.from_array(np.array(mask_value, np.float32), "zero"),
            numpy_helper.from_array(np.array(-np.inf, np.float32), "low")]
    graph = helper.make_graph(nodes, "masked", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                              initializer=init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_zero_masks_built_from_constants_are_dropped_before_softmax():
    model = _masked_scores_graph(0.0)
    ops = _rewritten_once_exactly(model, e2e_ort.drop_zero_score_masks, seed=1)
    assert ops == ["MatMul", "Constant", "Where", "Softmax", "MatMul"] and model.graph.node[3].input[0] == "s"
    assert e2e_ort.drop_zero_score_masks(_masked_scores_graph(0.5)) == 0        # a mask that changes the scores
    assert e2e_ort.drop_zero_score_masks(_masked_scores_graph(0.0, from_input=True)) == 0   # not a constant


def test_placement_summary_and_problems():
    events = [{"cat": "Session", "name": "model_run"},
              {"cat": "Node", "name": "Attention_0_kernel_time", "args": {"op_name": "Attention",
                                                                           "provider": "CUDAExecutionProvider"}},
              {"cat": "Node", "name": "Attention_0_fence_before", "args": {"op_name": "Attention"}},
              {"cat": "Node", "name": "CumSum_kernel_time", "args": {"op_name": "CumSum",
                                                                     "provider": "CPUExecutionProvider"}},
              {"cat": "Node", "name": "Memcpy_kernel_time", "args": {"op_name": "MemcpyFromHost",
                                                                     "provider": "CUDAExecutionProvider"}}]
    summary = e2e_ort.summarise_placement(events)
    assert summary["nodes"] == {"CUDAExecutionProvider": 2, "CPUExecutionProvider": 1} and summary["memcpy"] == 1
    assert e2e_ort.placement_problems(summary, "cuda") == ["1 nodes on the CPU EP (CumSum 1)",
                                                           "1 Memcpy nodes between host and device"]
    assert e2e_ort.placement_problems(summary, "cpu") == []


def test_a_weak_ort_baseline_shows_in_the_row_status():
    row = {"ort_ms": 1.0, "ort_ok": True, "ort_warnings": ["fusions missing: Attention|MultiHeadAttention 0/12"]}
    assert bench_e2e.summarise(row, 2e-3)["status"] == "weak:ort"
    assert bench_e2e.summarise({"ort_ms": 1.0, "ort_ok": True, "ort_warnings": []}, 2e-3)["status"] == "ok"


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory):
    """name -> (ONNX path, feeds, shape info, spec) of tiny HF exports, made once for this module."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("transformers")
    import e2e_models

    made = {}
    for name, length in (("roberta-tiny", 32), ("vit-tiny", 65)):
        model = e2e_models.spec(name)
        feeds = e2e_models.inputs(model, 2, length, 0)
        torch_model = e2e_models.build(model, "eager", 0, length)
        path = str(tmp_path_factory.mktemp(name) / "model.onnx")
        e2e_models.export(torch_model, feeds, path)
        made[name] = (path, feeds, e2e_models.shape_info(torch_model), model)
    return made


@pytest.mark.parametrize("name, rewrites", [("roberta-tiny", 0), ("vit-tiny", 2)])
def test_tiny_exports_fuse_fully_in_float16(tmp_path, tiny_exports, name, rewrites):
    """The harness's preparation of a tiny HF export: every layer's attention, biased GELU and both residual
    LayerNorms fused, float16 inside with no cast back to float32, and the fp16 file's session on the CPU EP
    alone (every node counted from the profile)."""
    import onnx

    source, feeds, info, model = tiny_exports[name]
    out = str(tmp_path / "ort.onnx")
    prep = e2e_ort.optimize(source, out, model.family, info["heads"], info["hidden"], info["layers"], fp16=True,
                            gpu=True)
    assert prep["fused"]["Attention"] == 2 and prep["fused"]["BiasGelu"] == 2, prep
    assert prep["fused"]["SkipLayerNormalization"] == 4 and prep["missing"] == [], prep
    assert prep["scale_rewrites"] == rewrites and prep["float32_casts"] == 0
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert "Gemm" not in ops and ops.count("MatMul") == 3 * 2      # attention output, FFN up, FFN down per layer
    summary = e2e_ort.placement(out, feeds, "cpu", 0, str(tmp_path / "profile"))
    assert set(summary["nodes"]) == {"CPUExecutionProvider"} and summary["memcpy"] == 0
    assert summary["ops"]["CPUExecutionProvider"]["Attention"] == 2


def test_attention_without_mask_input_on_request(tmp_path, tiny_exports):
    """``mask="none"``: the fused Attention nodes take no mask (ORT's flash kernels become eligible) and the
    unpadded inputs give the masked file's output."""
    import onnx
    import onnxruntime as ort

    source, feeds, info, model = tiny_exports["roberta-tiny"]
    outs = {}
    for mask in ("index", "none"):
        path = str(tmp_path / f"ort-{mask}.onnx")
        prep = e2e_ort.optimize(source, path, model.family, info["heads"], info["hidden"], info["layers"],
                                fp16=False, gpu=True, mask=mask)
        assert prep["mask"] == mask and prep["missing"] == []
        attention = [n for n in onnx.load(path).graph.node if n.op_type == "Attention"]
        assert len(attention) == 2
        assert all(bool(len(n.input) > 3 and n.input[3]) == (mask == "index") for n in attention)
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        assert ("attention_mask" in e2e_ort.session_inputs(session)) == (mask == "index")
        outs[mask] = session.run(None, {k: feeds[k] for k in e2e_ort.session_inputs(session)})[0]
    np.testing.assert_allclose(outs["none"], outs["index"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mask"):
        e2e_ort.optimize(source, str(tmp_path / "x.onnx"), model.family, 2, 128, 2, False, False, mask="causal")
