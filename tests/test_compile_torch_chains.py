"""The fusion templates on the chains of the torch-exported GPT-2 and T5 encoder (tiny versions of
``stof_tvm.models.torch_models``), beyond BERT's forms:

- pre-LN (GPT-2): the residual sum feeds the next LayerNorm and the next residual add; each linear still runs as
  ONE GEMM (template GEMM calls == the model's linears), the 16-bit sum and its LayerNorm are one
  ``residual_layernorm`` call (no add left);
- GPT-2's attention input, one linear to [.., 3 * hidden] + split: the QKV template, no split, zero-copy views
  for the block-wise kernel;
- the exported tanh GELU in the GEMM epilogue (``gemm_bias_gelu_tanh``), no tanh left;
- T5's bias-free linears on the GEMM templates (plain GEMM; ReLU with a zero bias; QKV with zero biases), no
  matmul left; its RMSNorms on the ``rmsnorm`` / ``residual_rmsnorm`` templates (each residual add fused into the
  next RMSNorm, the residual stream 16-bit);
- outputs on llvm match the exported graph under the same mask in float32 (onnx's reference evaluator); the
  tuner plans exactly the compiled calls.

The tiny models are exported by torch in this process (the tests skip without torch)."""
import os

import numpy as np
import onnx
import pytest

import stof_tvm
import stof_tvm.compiler
from stof_tvm import runtime
from stof_tvm.compiler import cubins, linear_match
from stof_tvm.models.reference import reference_outputs
from stof_tvm.tuning import plan

MODELS = ("tiny-gpt2", "tiny-t5-encoder")
BATCH, SEQ = 2, 128
LAYERS = 2                               # torch_models' tiny configurations
GPT2_CALLS = {"qkv_projection_kn": 2, "gemm_bias_kn": 3, "gemm_bias_gelu_tanh_kn": 2, "gemm_kn": 1,
              "layernorm": 1, "residual_layernorm": 3, "bias_residual_layernorm": 1}
# the last block's sum feeds only the final LN; layernorm: the embeddings' ln_1 (a plain LayerNorm); residual_layernorm:
# the three pre-LN sums
T5_CALLS = {"qkv_projection_kn": 2, "gemm_kn": 4, "gemm_bias_relu_kn": 2,
            "rmsnorm": 1, "residual_rmsnorm": 2 * LAYERS}     # the embeddings' RMSNorm; every later one with its sum
GEMMS = ("qkv_projection", "gemm")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``{model: stem}``: ``stem.onnx`` (the torch export, weights included) and ``stem.npz`` (inputs)."""
    tm = pytest.importorskip("stof_tvm.models.torch_models", reason="the torch exports need torch")
    out = tmp_path_factory.mktemp("torch_exports")
    stems = {}
    for name in MODELS:
        stems[name] = stem = os.path.join(out, f"{name}_{BATCH}x{SEQ}")
        tm.export(name, stem + ".onnx", seq_len=SEQ)
        np.savez(stem + ".npz", **{k: v.numpy() for k, v in tm.example_inputs(name, BATCH, SEQ, seed=7).items()})
    return stems


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _inputs_and_reference(stem) -> tuple[dict, np.ndarray]:
    """The inputs and the exported graph's float32 output under the BigBird mask (and the model's own masks)."""
    with np.load(stem + ".npz") as data:
        feeds = {k: data[k] for k in data.files}
    keep = stof_tvm.make_mask("bigbird", SEQ)[None, None]
    return feeds, reference_outputs(onnx.load(stem + ".onnx"), keep, feeds)["last_hidden_state"]


def _front(stem, **kwargs):
    args = dict(mask="bigbird", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16", gemm="mma",
                schedule=False, kernel="block" if "gpt2" in stem else "row")
    return stof_tvm.compiler.front_end(onnx.load(stem + ".onnx"), **{**args, **kwargs})


def _ops(front) -> list[str]:
    """Operators (call_tir: the callee) of the rewritten ``main``, in binding order."""
    names = []
    for block in front.mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if hasattr(value, "op") and hasattr(value.op, "name"):
                names.append(value.args[0].name_hint if value.op.name == "relax.call_tir" else value.op.name)
    return names


def _linears(stem) -> int:
    """The model's linear layers: matmuls by a 2-D weight in the module without templates."""
    func = _front(stem, templates=False).mod["main"]
    return sum(1 for block in func.body.blocks for b in block.bindings
               if getattr(getattr(b.value, "op", None), "name", None) == "relax.matmul"
               and len(b.value.args[1].ty.shape) == 2)


def _gemm_calls(calls: dict) -> int:
    return sum(count for name, count in calls.items() if name.startswith(GEMMS))


def test_gpt2_one_gemm_per_linear_fused_qkv_and_tanh_gelu(exported):
    front = _front(exported["tiny-gpt2"])
    calls = front.template_entry["calls"]
    assert calls == GPT2_CALLS
    assert _gemm_calls(calls) == _linears(exported["tiny-gpt2"]) == 4 * LAYERS     # no GEMM runs twice
    ops = _ops(front)
    for absent in ("relax.split", "relax.tanh", "relax.matmul", "relax.permute_dims"):
        assert absent not in ops, absent
    assert ops.count("relax.memory.view") == 3 * LAYERS                           # Q, K, V read in place
    assert "relax.nn.layer_norm" not in ops                                        # the embeddings' ln_1 too
    chains = {site["chain"] for site in front.template_entry["sites"]}
    assert {"qkv", "linear_gelu_tanh", "residual_sum_ln", "linear"} <= chains
    # the residual stream is 16-bit (each sum made by residual_layernorm, no float32 round trip): the embeddings'
    # float32 add before layer 0 is the only add left
    adds = [b.var.ty.dtype for block in front.mod["main"].body.blocks for b in block.bindings
            if getattr(getattr(b.value, "op", None), "name", None) == "relax.add" and len(b.var.ty.shape) == 3]
    assert adds == ["float32"]


def test_gpt2_wgmma_takes_the_gelu_tanh_and_qkv_kernels(exported, monkeypatch):
    monkeypatch.setattr(cubins, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(linear_match, "WGMMA_MIN_TILES", 1)
    calls = _front(exported["tiny-gpt2"], gemm="wgmma", batch=4).template_entry["calls"]
    assert calls["gemm_bias_gelu_tanh_wgmma"] == LAYERS and calls["qkv_projection_wgmma"] == LAYERS
    assert _gemm_calls(calls) == 4 * LAYERS


def test_t5_bias_free_linears_on_templates(exported):
    front = _front(exported["tiny-t5-encoder"])
    assert front.template_entry["calls"] == T5_CALLS
    assert _gemm_calls(T5_CALLS) == _linears(exported["tiny-t5-encoder"]) - 2 * LAYERS    # q, k, v: one call
    ops = _ops(front)
    assert "relax.matmul" not in ops and "relax.nn.relu" not in ops


def test_t5_rmsnorms_on_the_templates_for_cuda(exported):
    """Every RMSNorm on the RMSNorm templates (the embeddings' plain, each later one with its residual add): nothing
    of the normalisation and no residual add left in the graph; the CUDA build (not run) carries their kernels,
    scheduled with the cost model's knobs."""
    from stof_tvm.schedules.templates import get_template
    from stof_tvm.schedules.templates.build import cuda_source

    stem = exported["tiny-t5-encoder"]
    front = _front(stem, schedule=True)
    assert front.template_entry["calls"] == T5_CALLS
    ops = _ops(front)
    for absent in ("relax.mean", "relax.sqrt", "relax.rsqrt", "relax.divide"):
        assert absent not in ops, absent
    adds = [b for block in front.mod["main"].body.blocks for b in block.bindings
            if getattr(getattr(b.value, "op", None), "name", None) == "relax.add" and len(b.var.ty.shape) == 3]
    assert not adds                                       # the residual sums are made by residual_rmsnorm
    art = stof_tvm.compile(onnx.load(stem + ".onnx"), mask="bigbird", batch=BATCH, seq_len=SEQ, target="cuda",
                           dtype="float16", gemm="mma", kernel="row")
    for site in art.manifest["templates"]["sites"]:
        if site["chain"] in ("rmsnorm", "residual_rmsnorm"):
            (stage,) = site["stages"]
            assert stage["knobs"] in get_template(stage["template"]).knob_space(stage["shape"])
    src = cuda_source(art.executable)
    for name in ("rmsnorm", "residual_rmsnorm"):
        assert f"stof_{name}_m{BATCH * SEQ}_n128_kernel(" in src, name


@pytest.mark.parametrize("name", MODELS)
def test_templates_match_float32(exported, tmp_path, name):
    """fp16 with every chain on templates vs the exported graph in float32 (same mask), within fp16 rounding (the
    rewrite gives 5e-4 here)."""
    stem = exported[name]
    feeds, expected = _inputs_and_reference(stem)
    art = stof_tvm.compile(onnx.load(stem + ".onnx"), mask="bigbird", batch=BATCH, seq_len=SEQ, target="llvm",
                           dtype="float16", templates=True)
    assert art.manifest["templates"]["calls"] == (GPT2_CALLS if "gpt2" in name else T5_CALLS)
    out = runtime.load(art.save(tmp_path / "artifact"))(feeds)
    assert _rel(out["last_hidden_state"], expected) < 1.5e-3


def test_t5_position_bias_on_the_block_kernel_matches_float32(exported, tmp_path):
    """kernel="block": the block-wise kernel adds T5's position bias (an input after the format arrays)."""
    stem = exported["tiny-t5-encoder"]
    feeds, expected = _inputs_and_reference(stem)
    art = stof_tvm.compile(onnx.load(stem + ".onnx"), mask="bigbird", batch=BATCH, seq_len=SEQ, target="llvm",
                           dtype="float16", kernel="block")
    kernel = art.manifest["attention"]["kernel"]
    assert kernel["kind"] == "block" and kernel["bias"] is not None
    out = runtime.load(art.save(tmp_path / "artifact"))(feeds)
    assert _rel(out["last_hidden_state"], expected) < 1.5e-3


def test_t5_padding_goes_to_the_mask_and_the_position_bias_stays_per_head(exported, tmp_path):
    """T5 adds ``position_bias + padding`` to its scores as one tensor; compiled, the padding is a run-time mask
    term of the sparse format and the bias input is the position bias alone ([1, H, S, S]), and a padded batch
    still matches the exported graph under the same mask."""
    stem = exported["tiny-t5-encoder"]
    model = onnx.load(stem + ".onnx")
    feeds, _ = _inputs_and_reference(stem)
    feeds["attention_mask"] = feeds["attention_mask"].copy()
    feeds["attention_mask"][1, 90:] = 0
    art = stof_tvm.compile(model, mask="bigbird", batch=BATCH, seq_len=SEQ, target="llvm", dtype="float32")
    kernel = art.manifest["attention"]["kernel"]
    assert kernel["kind"] == "row" and kernel["bias"][:2] == [1, kernel["bias"][1]] and kernel["bias"][1] > 1
    out = runtime.load(art.save(tmp_path / "t5"))(feeds)
    ref = reference_outputs(model, stof_tvm.make_mask("bigbird", SEQ)[None, None], feeds)["last_hidden_state"]
    assert _rel(out["last_hidden_state"], ref) < 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_tuner_plans_the_compiled_calls(exported, name):
    from test_tuning_plan import manifest_calls, planned_calls

    model = onnx.load(exported[name] + ".onnx")
    stage1 = plan(model, mask="bigbird", batch=BATCH, seq_len=SEQ, target="cuda", gemm="mma", top_k=1)
    assert planned_calls(stage1) == manifest_calls({"templates": _front(exported[name]).template_entry})
