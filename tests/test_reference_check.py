"""``stof-tvm run --check``'s reference (:mod:`stof_tvm.models.reference`): onnx's reference evaluator with the ops
it gets wrong replaced, the sparse mask folded into opset 23's ``Attention`` op, and the check on models as users
export them: a Hugging Face BERT with its pooler (two outputs) through the dynamo exporter, whose token-type lookup
is a ``GatherElements`` that onnx's own evaluator cannot run, at opset 18 (attention as Softmax) and 23 (the
``Attention`` op)."""
from __future__ import annotations

import itertools
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from stof_tvm.models.reference import evaluate, masked_model


def gather_elements_model(data_shape, index_shape, axis) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("GatherElements", ["data", "indices"], ["out"], axis=axis)], "gather",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, data_shape),
         helper.make_tensor_value_info("indices", TensorProto.INT64, index_shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, index_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def gather_elements_by_definition(data, indices, axis):
    """ONNX's definition, element by element: out[i] = data[i with i[axis] replaced by indices[i]]."""
    out = np.empty(indices.shape, data.dtype)
    for position in itertools.product(*map(range, indices.shape)):
        source = list(position)
        source[axis] = indices[position] % data.shape[axis]
        out[position] = data[tuple(source)]
    return out


@pytest.mark.parametrize("data_shape, index_shape, axis", [
    ((1, 512), (1, 64), 1),        # BERT's token types through the dynamo exporter: what onnx's own version fails
    ((4, 5), (2, 3), 1),           # indices shorter along the other axis too
    ((3, 4, 5), (3, 2, 5), 1),
    ((6, 2), (3, 2), 0),
    ((2, 3, 4), (2, 3, 4), -1),
])
def test_gather_elements_follows_the_onnx_definition(data_shape, index_shape, axis):
    rng = np.random.default_rng(0)
    data = rng.standard_normal(data_shape).astype(np.float32)
    size = data_shape[axis]
    indices = rng.integers(-size, size, index_shape)        # negative indices count from the end
    out = evaluate(gather_elements_model(data_shape, index_shape, axis), {"data": data, "indices": indices})["out"]
    np.testing.assert_array_equal(out, gather_elements_by_definition(data, indices, axis % len(data_shape)))


B, H, S, D = 2, 2, 8, 4


def attention_model(mask_type) -> onnx.ModelProto:
    """One opset-23 ``Attention`` over [B, H, S, D] inputs, with a ``mask`` input of ``mask_type`` (None: none)."""
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, (B, H, S, D)) for name in "qkv"]
    names = ["q", "k", "v"]
    if mask_type is not None:
        inputs.append(helper.make_tensor_value_info("mask", mask_type, (B, 1, S, S)))
        names.append("mask")
    graph = helper.make_graph([helper.make_node("Attention", names, ["out"], scale=0.5)], "attention", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, (B, H, S, D))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def attention_by_definition(q, k, v, allowed, additive):
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * 0.5 + additive
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", probs / probs.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("mask_type", [None, TensorProto.BOOL, TensorProto.FLOAT])
def test_the_sparse_mask_folds_into_the_attention_op(mask_type):
    """The keep-mask goes into ``Attention``'s own mask: as the mask where there is none, AND a boolean one, the
    lowest float where an additive one is not kept; the result is attention under both."""
    rng = np.random.default_rng(1)
    feeds = {name: rng.standard_normal((B, H, S, D)).astype(np.float32) for name in "qkv"}
    keep = np.tril(np.ones((S, S), bool)) & ~np.tril(np.ones((S, S), bool), -3)     # a window of 3, diagonal kept
    own = rng.random((B, 1, S, S)) < 0.7
    own[..., np.arange(S), np.arange(S)] = True
    allowed, additive = keep, 0.0
    if mask_type == TensorProto.BOOL:
        feeds["mask"], allowed = own, keep & own
    elif mask_type == TensorProto.FLOAT:
        feeds["mask"] = additive = rng.standard_normal((B, 1, S, S)).astype(np.float32)
    out = evaluate(masked_model(attention_model(mask_type), keep, feeds), feeds)["out"]
    np.testing.assert_allclose(out, attention_by_definition(feeds["q"], feeds["k"], feeds["v"], allowed, additive),
                               rtol=1e-5, atol=1e-6)
    unmasked = evaluate(attention_model(mask_type), feeds)["out"]
    assert not np.allclose(out, unmasked, atol=1e-3)                  # the fold changed the result


def compile_and_check(path: str, tmp_path, capsys) -> str:
    """``stof-tvm compile`` of the export at 1 x 32 under a sliding window for llvm, then ``run --check`` (both
    must succeed); what the run printed."""
    from stof_tvm.cli import main as cli_main

    out = str(tmp_path / "art")
    assert cli_main(["compile", path, "--mask", "sliding:window=8", "--batch", "1", "--seq-len", "32",
                     "--target", "llvm", "-o", out]) == 0
    capsys.readouterr()
    assert cli_main(["run", out, "--check"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("opset", [18, 23])
def test_bert_with_its_pooler_through_the_dynamo_exporter_checks(tmp_path, capsys, opset):
    """The export users make (``torch.onnx.export(model, (input_ids,), kwargs={"attention_mask": ...},
    dynamo=True)``, ``last_hidden_state`` and ``pooler_output``) compiles, runs and passes ``--check`` under a
    sliding window, at opset 18 (attention spelled with Softmax) and 23 (the ``Attention`` op)."""
    torch = pytest.importorskip("torch", reason="the export needs torch (pip install -e '.[test]')")
    transformers = pytest.importorskip("transformers", reason="the export needs transformers")
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    from stof_tvm.models.hf_export import make_config

    torch.manual_seed(0)
    model = transformers.BertModel(make_config("bert", "tiny", "sdpa")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 32))
    path = str(tmp_path / "bert_pooler.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids,), path, kwargs={"attention_mask": torch.ones_like(ids)},
                          input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state", "pooler_output"], opset_version=opset, dynamo=True)
    ops = {node.op_type for node in onnx.load(path).graph.node}
    assert "GatherElements" in ops and ("Attention" in ops) == (opset == 23)
    printed = compile_and_check(path, tmp_path, capsys)
    for name in ("last_hidden_state", "pooler_output"):
        assert f"check {name}: relative error" in printed
    assert printed.count("PASS") == 2 and "FAIL" not in printed


def tiny_bert_export(tmp_path, dtype: str) -> str:
    """The corpus's tiny BERT exported by TorchScript at 1 x 32 after ``model.to(dtype)``; its path."""
    pytest.importorskip("torch", reason="the export needs torch (pip install -e '.[test]')")
    pytest.importorskip("transformers", reason="the export needs transformers")
    from stof_tvm.models.hf_export import export

    path = str(tmp_path / f"bert_{dtype}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export("bert", path, batch=1, seq_len=32, dtype=dtype)


def test_a_model_exported_in_float16_checks(tmp_path, capsys):
    """A model users exported after ``model.half()`` (TorchScript, opset 17). The masked reference writes the mask's
    lowest value and zero in the scores' own type (onnx's ``Where`` refuses mixed types: "x and y should share the
    same dtype float16 != float32"); ``run --check`` widens the model to float32 as a float32 build (llvm's default)
    does, with a warning, and holds it to float32's tolerance."""
    path = tiny_bert_export(tmp_path, "float16")
    model = onnx.load(path)
    assert {init.data_type for init in model.graph.initializer} >= {TensorProto.FLOAT16}
    masked = masked_model(model, np.tril(np.ones((32, 32), bool)),
                          {"input_ids": np.ones((1, 32), np.int64), "attention_mask": np.ones((1, 32), np.int64)})
    lowest = [init for init in masked.graph.initializer if init.name.startswith("stof_ref_lowest")]
    assert [init.data_type for init in lowest] == [TensorProto.FLOAT16]
    with pytest.warns(UserWarning, match="float16 tensors are widened to float32"):
        printed = compile_and_check(path, tmp_path, capsys)
    assert "float32" in printed and "tolerance 0.0001" in printed and "PASS" in printed


def test_a_model_exported_in_bfloat16_checks_against_its_weights_in_float32(tmp_path, capsys):
    """A model exported after ``model.to(torch.bfloat16)``: the compiler widens it to float32 (with a warning), and
    ``--check``'s reference is the same widened model, so a float32 build on llvm is held to float32's tolerance."""
    path = tiny_bert_export(tmp_path, "bfloat16")
    with pytest.warns(UserWarning, match="bfloat16 tensors are widened to float32"):
        printed = compile_and_check(path, tmp_path, capsys)
    assert "float32" in printed and "tolerance 0.0001" in printed and "PASS" in printed
