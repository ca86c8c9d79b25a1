"""stof_tvm.compile on the CPU: built-in BERT models against onnx's reference evaluator, every kernel,
the model's padding folded in, masks changed at run time, and bad input."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import stof_tvm
from stof_tvm import make_mask
from stof_tvm.models import builtin_model
from stof_tvm.models.bert import BertConfig, make_bert
from stof_tvm.models.reference import random_inputs, reference_outputs

from attention_reference import relative_error

B, S = 2, 128


@pytest.fixture(scope="module")
def feeds(tiny):
    data = random_inputs(tiny, {"input_ids": (B, S), "attention_mask": (B, S)}, seed=1)
    data["attention_mask"][1, 97:] = 0          # batch 1 is padded: the model's own mask must keep working
    return data


@pytest.fixture(scope="module")
def row_fp32(tiny):
    return stof_tvm.compile(tiny, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype="float32")


def test_auto_picks_row_for_fp32_and_matches_reference(tiny, feeds, row_fp32):
    assert row_fp32.manifest["attention"]["kernel"]["kind"] == "row"
    assert row_fp32.manifest["attention"]["sites"] == 2
    out = row_fp32.load()(feeds)["last_hidden_state"]
    ref = reference_outputs(tiny, make_mask("bigbird", S)[None, None], feeds)["last_hidden_state"]
    assert out.shape == (B, S, 128)
    assert relative_error(out, ref) < 1e-5


def test_padding_changes_the_padded_batch_only(row_fp32, feeds):
    model = row_fp32.load()
    padded = model(feeds)["last_hidden_state"]
    unpadded = model({**feeds, "attention_mask": np.ones((B, S), np.int64)})["last_hidden_state"]
    np.testing.assert_allclose(padded[0], unpadded[0], rtol=1e-6, atol=1e-6)
    assert np.abs(padded[1] - unpadded[1]).max() > 1e-3


def test_one_compile_serves_other_masks(tiny, feeds, row_fp32):
    model = row_fp32.load()
    for spec in ("sliding", "longformer", make_mask("causal", S)):
        out = model(feeds, mask=spec)["last_hidden_state"]
        keep = make_mask(spec, S) if isinstance(spec, str) else spec
        ref = reference_outputs(tiny, keep[None, None], feeds)["last_hidden_state"]
        assert relative_error(out, ref) < 1e-5, spec


@pytest.mark.parametrize("kernel", ["block", "dense"])
def test_float16_kernels_match_reference(tiny, feeds, kernel):
    art = stof_tvm.compile(tiny, mask="longformer", batch=B, seq_len=S, target="llvm", dtype="float16",
                           kernel=kernel)
    assert art.manifest["attention"]["kernel"]["kind"] == kernel
    assert art.manifest["attention"]["dtype"] == "float16"
    # sparse kernels apply the per-batch padding on the device and dense keeps it in the graph: one shared format
    assert art.manifest["attention"]["kernel"]["mask_batch"] == 1
    assert art.manifest["attention"]["kernel"]["padding"] == (kernel != "dense")
    out = art.load()(feeds)["last_hidden_state"]
    ref = reference_outputs(tiny, make_mask("longformer", S)[None, None], feeds)["last_hidden_state"]
    assert relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("head_dim", [32, 80])
def test_head_dims_other_than_64_and_128(head_dim):
    """A BERT with head dim 32 (two 32-wide heads, small BERTs) or 80 (Phi's) compiles onto the block-wise kernel
    (auto on llvm: STOF's rule picks it for longformer) and matches onnx's reference."""
    model = make_bert(BertConfig(hidden=2 * head_dim, layers=1, heads=2, ffn=128, vocab=100, max_positions=256))
    data = random_inputs(model, {"input_ids": (1, 64), "attention_mask": (1, 64)}, seed=5)
    art = stof_tvm.compile(model, mask="longformer:window=8,globals=4", batch=1, seq_len=64, target="llvm",
                           dtype="float16", kernel="block")
    assert art.manifest["attention"]["kernel"]["kind"] == "block"
    out = art.load()(data)["last_hidden_state"]
    ref = reference_outputs(model, make_mask("longformer:window=8,globals=4", 64)[None, None], data)
    assert relative_error(out, ref["last_hidden_state"]) < 2e-2


def test_unsupported_head_dim_falls_back_to_dense_with_a_reason():
    """Head dim 72 (not a multiple of 16): auto keeps the dense attention and says why; a sparse kernel asked for
    by name is refused with the model's head dim."""
    model = make_bert(BertConfig(hidden=144, layers=1, heads=2, ffn=128, vocab=100, max_positions=256))
    art = stof_tvm.compile(model, mask="sliding", batch=1, seq_len=32, target="llvm", dtype="float32")
    kernel = art.manifest["attention"]["kernel"]
    assert kernel["kind"] == "dense" and "head dim 72" in kernel["reason"]
    data = random_inputs(model, {"input_ids": (1, 32), "attention_mask": (1, 32)}, seed=6)
    ref = reference_outputs(model, make_mask("sliding", 32)[None, None], data)["last_hidden_state"]
    assert relative_error(art.load()(data)["last_hidden_state"], ref) < 1e-4
    with pytest.raises(ValueError, match="head dims that are multiples of 16 from 32 to 256, the model's is 72"):
        stof_tvm.compile(model, mask="sliding", batch=1, seq_len=32, target="llvm", dtype="float32", kernel="row")


def test_per_head_mask_array(tiny, feeds):
    rng = np.random.default_rng(3)
    mask = rng.random((1, 2, S, S)) < 0.3
    art = stof_tvm.compile(tiny, mask=mask, batch=B, seq_len=S, target="llvm", dtype="float32", kernel="row")
    assert art.manifest["attention"]["kernel"]["mask_heads"] == 2
    assert "mask.npy" in art.arrays
    out = art.load()(feeds)["last_hidden_state"]
    ref = reference_outputs(tiny, mask, feeds)["last_hidden_state"]
    assert relative_error(out, ref) < 1e-5


@pytest.mark.slow
def test_bert_base_small_sequence():
    model = builtin_model("bert-base")
    art = stof_tvm.compile(model, mask="bigbird", batch=1, seq_len=64, target="llvm", dtype="float32")
    assert art.manifest["attention"]["sites"] == 12
    assert art.manifest["attention"]["heads"] == 12
    data = random_inputs(model, {"input_ids": (1, 64), "attention_mask": (1, 64)}, seed=2)
    out = art.load()(data)["last_hidden_state"]
    ref = reference_outputs(model, make_mask("bigbird", 64)[None, None], data)["last_hidden_state"]
    assert relative_error(out, ref) < 1e-4


def _with_node(model, node):
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    bad.graph.node.append(node)
    return bad


def test_unsupported_operator_is_named(tiny):
    bad = _with_node(tiny, helper.make_node("Celu", ["last_hidden_state"], ["celu_out"], name="my_celu"))
    with pytest.raises(ValueError, match=r"Celu .*my_celu"):
        stof_tvm.compile(bad, mask="bigbird", batch=1, seq_len=S, target="llvm", dtype="float32")


def test_model_without_attention_is_refused():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match="no attention subgraph"):
        stof_tvm.compile(model, mask="causal", batch=1, seq_len=16, target="llvm", dtype="float32")


@pytest.mark.parametrize("kwargs, match", [
    ({"batch": 0}, "batch"), ({"seq_len": -1}, "seq_len"), ({"dtype": "int8"}, "dtype"),
    ({"kernel": "fast"}, "kernel"), ({"target": "rocm"}, "target"), ({"mask": "nosuchmask"}, "nosuchmask"),
    ({"tune_trials": 4}, "database"), ({"seq_len": 8192}, "seq_len"), ({"narrow_bias": "yes"}, "narrow_bias"),
])
def test_bad_arguments(tiny, kwargs, match):
    args = {"mask": "bigbird", "batch": 1, "seq_len": S, "target": "llvm", "dtype": "float32", **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        stof_tvm.compile(tiny, **args)


def test_missing_model_file():
    with pytest.raises(FileNotFoundError, match="no ONNX file"):
        stof_tvm.compile("/nonexistent/model.onnx", mask="causal", batch=1, seq_len=16, target="llvm")


def test_a_file_that_is_not_onnx_is_refused_by_name(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"not a protobuf \xff\xfe")
    with pytest.raises(ValueError, match="is not an ONNX model"):
        stof_tvm.compile(path, mask="causal", batch=1, seq_len=16, target="llvm")


@pytest.mark.parametrize("batch, seq_len", [(2, 32), (1, 16)])
def test_a_fixed_shape_export_refuses_another_shape(batch, seq_len):
    """An export without dynamic axes fixes [B, S]: asking for another batch or length is an error naming the
    file's shape, not a module silently built for the file's shape."""
    graph = helper.make_graph([helper.make_node("Cast", ["input_ids"], ["y"], to=TensorProto.FLOAT)], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match=r"fixed shape \[1, 32\].*batch=%d, seq_len=%d" % (batch, seq_len)):
        stof_tvm.compile(model, mask="causal", batch=batch, seq_len=seq_len, target="llvm", dtype="float32")
    with pytest.raises(ValueError, match="no attention subgraph"):     # the file's own shape passes the check
        stof_tvm.compile(model, mask="causal", batch=1, seq_len=32, target="llvm", dtype="float32")


@pytest.mark.slow
def test_tuning_records_choose_the_kernel(tiny, tmp_path):
    """tune_trials > 0 tunes into the database; the compile then takes the measured-best attention kernel."""
    data = random_inputs(tiny, {"input_ids": (1, S), "attention_mask": (1, S)}, seed=4)
    art = stof_tvm.compile(tiny, mask="bigbird", batch=1, seq_len=S, target="llvm", dtype="float32",
                           tune_trials=2, database=str(tmp_path / "db"))
    kernel = art.manifest["attention"]["kernel"]
    assert kernel["reason"].startswith("tuned: attention_")
    tuning = art.manifest["tuning"]
    assert {k: tuning[k] for k in ("database", "applied", "missing", "unused")} == {
        "database": str(tmp_path / "db"), "applied": 1, "missing": [], "unused": []}     # the attention problem
    assert tuning["tuned"]["trials"] == 2 and tuning["tuned"]["measured"] >= 1
    out = art.load()(data)["last_hidden_state"]
    ref = reference_outputs(tiny, make_mask("bigbird", S)[None, None], data)["last_hidden_state"]
    assert relative_error(out, ref) < 1e-5


def test_fusion_templates_replace_linear_layers(tiny, feeds):
    """templates=True maps every chain of a layer to templates (QKV into heads, GEMM + bias/residual/LayerNorm
    unfused, GEMM + bias + GELU); on the CPU the templates run unscheduled, which checks the rewrite's shapes,
    layouts and epilogues against the reference (tests/test_compile_templates.py has the rest)."""
    art = stof_tvm.compile(tiny, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype="float16", templates=True)
    assert art.manifest["templates"]["calls"] == {"bias_residual_layernorm": 4, "gemm_bias_gelu_erf_kn": 2,
                                                  "gemm_kn": 4, "qkv_projection_kn": 2, "layernorm": 1}
    out = art.load()(feeds)["last_hidden_state"]
    ref = reference_outputs(tiny, make_mask("bigbird", S)[None, None], feeds)["last_hidden_state"]
    assert relative_error(out, ref) < 2e-2
    with pytest.raises(ValueError, match="templates"):
        stof_tvm.compile(tiny, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype="float32", templates=True)


def test_exporter_style_weight_names(tiny, feeds):
    """PyTorch's exporter names the weights it creates "onnx::MatMul_<n>"; TVM's importer drops that prefix, and
    the artifact still takes the weights by their initializer names."""
    model = onnx.ModelProto()
    model.CopyFrom(tiny)
    renamed = {}
    for i, init in enumerate(model.graph.initializer):
        if len(init.dims) == 2 and i % 2 == 0:
            renamed[init.name] = f"onnx::MatMul_{i}"
            init.name = renamed[init.name]
    for node in model.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    assert renamed
    art = stof_tvm.compile(model, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype="float32")
    assert set(renamed.values()) <= {w["name"] for w in art.manifest["weights"]}
    out = art.load()(feeds)["last_hidden_state"]
    ref = reference_outputs(model, make_mask("bigbird", S)[None, None], feeds)["last_hidden_state"]
    assert relative_error(out, ref) < 1e-5


def _with_position_bias(model: onnx.ModelProto, seq: int, heads: int, seed: int = 0,
                        shape: tuple | None = None) -> onnx.ModelProto:
    """``model`` with a learned T5-style bias [1, H, S, S] (or of ``shape``) added to every layer's scaled scores."""
    biased = onnx.ModelProto()
    biased.CopyFrom(model)
    bias = np.random.default_rng(seed).standard_normal(shape or (1, heads, seq, seq)).astype(np.float32)
    biased.graph.initializer.append(onnx.numpy_helper.from_array(bias, "position_bias"))
    nodes = []
    for node in biased.graph.node:
        nodes.append(node)
        if node.op_type == "Div" and node.output[0].startswith("scaled"):
            out = node.output[0]
            node.output[0] = out + "_unbiased"
            nodes.append(helper.make_node("Add", [out + "_unbiased", "position_bias"], [out]))
    del biased.graph.node[:]
    biased.graph.node.extend(nodes)
    return biased


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("float16", 2e-2)])
def test_score_bias_is_added_by_either_sparse_kernel(tiny, feeds, dtype, tolerance):
    """A real bias on the scores (not a mask) is an input of the sparse kernel "auto" picks (float32: the row-wise
    kernel, the only one), added at each kept key with the model's padding still applied; in float16 the other
    sparse kernel, requested, gives the same result."""
    model = _with_position_bias(tiny, S, heads=2)
    art = stof_tvm.compile(model, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype=dtype)
    kernel = art.manifest["attention"]["kernel"]
    assert kernel["bias"][:2] == [1, 2] and kernel["kind"] == ("row" if dtype == "float32" else kernel["kind"])
    out = art.load()(feeds)["last_hidden_state"]
    ref = reference_outputs(model, make_mask("bigbird", S)[None, None], feeds)["last_hidden_state"]
    assert relative_error(out, ref) < tolerance
    unbiased = reference_outputs(tiny, make_mask("bigbird", S)[None, None], feeds)["last_hidden_state"]
    assert relative_error(unbiased, ref) > 10 * tolerance     # the bias changes the output: the check can fail
    if dtype == "float16":
        other = "row" if kernel["kind"] == "block" else "block"
        art = stof_tvm.compile(model, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype=dtype, kernel=other)
        assert art.manifest["attention"]["kernel"]["kind"] == other
        assert relative_error(art.load()(feeds)["last_hidden_state"], ref) < tolerance


def test_lower_rank_score_bias(tiny, feeds):
    """A bias of rank 3 broadcast over the queries (ALiBi's [H, 1, Sk]) is brought to 4-D for the kernel (its
    reshape had no type yet when its dtype was read: an AttributeError before)."""
    model = _with_position_bias(tiny, S, heads=2, shape=(2, 1, S))
    art = stof_tvm.compile(model, mask="bigbird", batch=B, seq_len=S, target="llvm", dtype="float32")
    assert art.manifest["attention"]["kernel"]["bias"][:2] == [1, 2]
    out = art.load()(feeds)["last_hidden_state"]
    ref = reference_outputs(model, make_mask("bigbird", S)[None, None], feeds)["last_hidden_state"]
    assert relative_error(out, ref) < 1e-5
