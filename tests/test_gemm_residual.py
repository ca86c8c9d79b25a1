"""The wgmma GEMM with the residual added in its epilogue (``gemm_bias_residual_wgmma``, kernel option ``residual``):
the definition against float64 on llvm, the knob space (that of ``gemm_bias_wgmma``), the CUDA kernels compiled for
sm_90a without spills or stack, where the residual is read, and the refused forms.

The kernel's numerics need an H200: scripts/bench_gemm_residual.py (--plan s12epi)."""
from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import tvm

from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel
from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig, wgmma_gemm_primfunc

from hopper_checks import sm90a_sass

NAME = "gemm_bias_residual_wgmma"
NP = {"float16": np.float16, "bfloat16": "bfloat16"}
RES_LOAD = re.compile(r"\(\(uint\*\)res_ptr\)\[")      # a 4-byte load of a residual pair (the staged epilogue)
TALL_PINGPONG = {"block_n": 192, "stages": 4, "persistent": True, "pingpong": True, "staged": True, "loads": "tma",
                 "block_m": 256}


def test_arguments_definition_and_reference():
    t = get_template(NAME)
    shape = {"m": 256, "n": 128, "k": 64}
    assert [a for a, _, _ in t.arguments(shape)] == ["A", "W", "bias", "residual", "out"]
    assert t.arguments(shape)[3][1] == (256, 128)
    assert t.kernel_options(shape) == {"bias": True, "act": "none", "residual": True, "residual_ahead": "next"}


@pytest.mark.parametrize("dtype, shape", [("float16", {"m": 128, "n": 128, "k": 64}),
                                          ("bfloat16", {"m": 256, "n": 256, "k": 128})])
def test_definition_adds_the_residual_like_float64_on_llvm(dtype, shape):
    """``primfunc`` (the kernel's signature and semantics) built for llvm against the float64 reference, output
    poisoned; the residual is large against the GEMM so that leaving it out would fail."""
    t = get_template(NAME)
    rng = np.random.default_rng(5)
    inputs = {n: (rng.standard_normal(s) * (4.0 if n == "residual" else 1.0)).astype(NP[dt])
              for n, s, dt in t.arguments(shape, dtype)[:-1]}
    out = tvm.runtime.tensor(np.full((shape["m"], shape["n"]), np.nan, dtype=NP[dtype]))
    ex = tvm.compile(t.primfunc(shape, dtype), target=tvm.target.Target({"kind": "llvm"}))
    ex["main"](*[tvm.runtime.tensor(inputs[n]) for n, _, _ in t.arguments(shape, dtype)[:-1]], out)
    got = out.numpy().astype(np.float64)
    (ref,) = t.reference(shape, inputs)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (1e-2 if dtype == "float16" else 3e-2)
    without = ref - np.asarray(inputs["residual"], np.float64)
    assert np.linalg.norm(got - without) / np.linalg.norm(ref) > 0.3


@pytest.mark.parametrize("shape", [{"m": 32768, "n": 768, "k": 768}, {"m": 4096, "n": 1024, "k": 4096},
                                   {"m": 128, "n": 768, "k": 768}, {"m": 1576, "n": 768, "k": 3072}])
def test_knob_space_is_the_bias_gemms(shape):
    """Same tiles, order and resources as ``gemm_bias_wgmma`` (the compile path's first set unchanged); the cost model
    prices the residual among the arguments' bytes."""
    from stof_tvm.cost_model.templates import _invariants

    t, bias = get_template(NAME), get_template("gemm_bias_wgmma")
    assert t.knob_space(shape, "float16") == bias.knob_space(shape, "float16")
    first = t.knob_space(shape, "float16")[0]
    assert t.resources(shape, "float16", first) == bias.resources(shape, "float16", first)
    extra = _invariants(t, shape, "float16")[1] - _invariants(bias, shape, "float16")[1]
    assert extra == 2 * shape["m"] * shape["n"]


@pytest.mark.parametrize("shape, dtype, knobs, loads", [
    ({"m": 32768, "n": 768, "k": 768}, "float16", None, 6 * 16),          # 128 x 192 ping-pong: 6 chunks of 16 x 64
    ({"m": 32768, "n": 768, "k": 3072}, "bfloat16", None, 6 * 16),
    ({"m": 16384, "n": 1024, "k": 4096}, "float16", None, 2 * 16),        # 128 x 128 cooperative: 2 chunks a warp
    ({"m": 1576, "n": 768, "k": 3072}, "float16", None, 3 * 16),          # 64 x 192 ping-pong, the last tile partial
    ({"m": 32768, "n": 768, "k": 768}, "float16",                          # 256 x 192 cooperative, 3 stages
     {"block_n": 192, "stages": 3, "persistent": True, "pingpong": False, "block_m": 256, "staged": True,
      "loads": "tma"}, 6 * 16),
])
def test_staged_kernels_read_the_residual_a_chunk_ahead_without_spills(shape, dtype, knobs, loads, tmp_path):
    """The staged epilogue's residual: 16 four-byte loads per warp chunk (two register slots of 16 after the 4 packed
    words), every chunk's once; ptxas for sm_90a: no spills, no stack, none of the overlap warnings."""
    src = cuda_source(build_kernel(NAME, shape, dtype, knobs))
    body = src[src.index('extern "C" __global__'):]
    assert "res_ptr" in body.split("{")[0]                     # a kernel parameter
    assert len(RES_LOAD.findall(body)) == loads
    assert "uint words_ptr[36];" in body
    assert "st.global.v4.b32" in src
    if shutil.which("nvcc"):
        sm90a_sass(src, tmp_path)


@pytest.mark.parametrize("shape, knobs", [
    ({"m": 128, "n": 768, "k": 768}, None),                                          # split-K (the space's first)
    ({"m": 4096, "n": 768, "k": 768}, {"block_n": 128, "stages": 4, "persistent": True, "pingpong": False,
                                       "loads": "tma"}),                            # direct 2-byte stores
    ({"m": 1576, "n": 768, "k": 768}, {"block_n": 128, "stages": 4, "persistent": False, "pingpong": False}),
])
def test_direct_and_split_k_epilogues_add_the_residual_where_they_store(shape, knobs, tmp_path):
    """Without the staged epilogue the residual is read element by element where each output is stored (2 bytes;
    split-K: at the reduced chunk, rows past m clamped), with no register slots."""
    src = cuda_source(build_kernel(NAME, shape, "float16", knobs))
    body = src[src.index('extern "C" __global__'):]
    assert not RES_LOAD.search(body) and "res_ptr[" in body and "words_ptr[36]" not in body
    if shutil.which("nvcc"):
        sm90a_sass(src, tmp_path)


@pytest.mark.parametrize("shape", [{"m": 32768, "n": 768, "k": 768}, {"m": 32768, "n": 768, "k": 3072}])
def test_doubling_issues_the_residual_further_ahead_without_spills(shape, tmp_path):
    """``residual_ahead="doubling"`` (the bench's alternative form): the same 96 loads of a 128 x 192 ping-pong tile,
    a register slot per chunk (4 + 6 x 16 words), the slot index of ``"next"`` nowhere; no spills at RoBERTa's
    32768-row GEMMs."""
    from stof_tvm.schedules.templates.build import cuda_target
    from stof_tvm.schedules.templates.gemm_wgmma import WgmmaGemmResidualTemplate

    t = WgmmaGemmResidualTemplate("doubling")
    ex = tvm.compile(tvm.IRModule({"main": t.kernel(shape, "float16", TALL_PINGPONG)}), target=cuda_target("sm_90a"))
    src = cuda_source(ex)
    body = src[src.index('extern "C" __global__'):]
    assert len(RES_LOAD.findall(body)) == 96 and "uint words_ptr[100];" in body
    assert src != cuda_source(build_kernel(NAME, shape, "float16", TALL_PINGPONG))
    if shutil.which("nvcc"):
        sm90a_sass(src, tmp_path)


def test_residual_ahead_refuses_other_forms():
    with pytest.raises(ValueError, match="residual_ahead must be one of"):
        wgmma_gemm_primfunc(256, 384, 128, "float16", bias=True, act="none", residual=True, residual_ahead="far",
                            config=WgmmaConfig(block_n=128, stages=2, staged=True))


def test_other_templates_have_no_residual():
    """The bias GEMM's kernel takes no residual and reads none (its source is what it was before the option)."""
    src = cuda_source(build_kernel("gemm_bias_wgmma", {"m": 32768, "n": 768, "k": 768}, "float16", TALL_PINGPONG))
    assert "res_ptr" not in src and "uint words_ptr[4];" in src


@pytest.mark.parametrize("kwargs", [{"bias": False}, {"heads": (2, 128, 2, 64)}])
def test_residual_needs_a_bias_gemm(kwargs):
    args = dict({"bias": True, "act": "none", "config": WgmmaConfig(block_n=128, stages=2)}, **kwargs)
    with pytest.raises(ValueError, match="residual: a GEMM with bias only"):
        wgmma_gemm_primfunc(256, 384, 128, "float16", residual=True, **args)



# ---- the compile path: option residual_in_gemm ------------------------------------------------------------------

POST_LN = {"attn_out_ln", "ffn_down_ln"}


def _chains(manifest) -> dict:
    return {site["chain"]: [stage["template"] for stage in site["stages"]] for site in manifest["templates"]["sites"]}


def test_residual_in_gemm_wiring_matches_the_reference_on_llvm(tiny, monkeypatch):
    """The rewrite's wiring (bias and residual into the GEMM, the sum into ``layernorm``) on the CPU: tiny BERT with
    the wgmma templates' TensorIR definitions on llvm (the compile path's wgmma gate forced open there), option off
    and on, both within 2e-3 of onnx.reference's float32, the post-LN chains on the residual GEMM when on."""
    import dataclasses
    import warnings

    import stof_tvm.compiler as compiler
    from stof_tvm import make_mask
    from stof_tvm.compiler import linear_match
    from stof_tvm.models.reference import random_inputs, reference_outputs

    monkeypatch.setattr(linear_match, "WGMMA_MIN_TILES", 1)     # tiny BERT's GEMMs are too small for wgmma otherwise
    monkeypatch.setattr(compiler, "check_gemm", lambda gemm, templates, tspec: ("wgmma", tspec))
    front_end = compiler.front_end   # no sm_90a cubins to prebuild for llvm
    monkeypatch.setattr(compiler, "front_end", lambda *a, **kw: dataclasses.replace(front_end(*a, **kw), gemm="mma"))
    data = random_inputs(tiny, {"input_ids": (1, 128), "attention_mask": (1, 128)}, seed=2)
    ref = reference_outputs(tiny, make_mask("bigbird", 128)[None, None], data)["last_hidden_state"]
    for flag in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            art = compiler.compile(tiny, mask="bigbird", batch=1, seq_len=128, target="llvm", dtype="float16",
                                   templates=True, gemm="wgmma", residual_in_gemm=flag)
        chains = _chains(art.manifest)
        expected = ["gemm_bias_residual_wgmma", "layernorm"] if flag else ["gemm_wgmma", "bias_residual_layernorm"]
        assert all(chains[chain] == expected for chain in POST_LN)
        assert ("bias_residual_layernorm" in art.manifest["templates"]["calls"]) != flag
        out = np.asarray(art.load()(data)["last_hidden_state"], np.float64)
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-3


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_residual_in_gemm_builds_for_sm90a(tiny, monkeypatch):
    """On CUDA sm_90 (the defaults: templates, wgmma GEMMs): the post-LN chains take the residual GEMM and the plain
    LayerNorm, the module's source reads the residual, the artifact carries its sm_90a cubin."""
    import stof_tvm
    from stof_tvm.compiler import linear_match
    from stof_tvm.compiler.cubins import cuda_sources

    monkeypatch.setattr(linear_match, "WGMMA_MIN_TILES", 1)
    art = stof_tvm.compile(tiny, mask="bigbird", batch=1, seq_len=128, target="cuda", dtype="float16",
                           residual_in_gemm=True)
    chains = _chains(art.manifest)
    assert all(chains[chain] == ["gemm_bias_residual_wgmma", "layernorm"] for chain in POST_LN)
    (source,) = cuda_sources(art.executable)
    assert "res_ptr" in source and art.manifest["cuda_binaries"]["files"]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"residual_in_gemm": "yes"}, TypeError, "residual_in_gemm: expected a bool"),
    ({"residual_in_gemm": True, "tune_trials": 2, "database": "db"}, ValueError,
     "residual_in_gemm: opt-in and untuned"),
])
def test_residual_in_gemm_refuses(tiny, kwargs, error, match):
    import stof_tvm

    with pytest.raises(error, match=match):
        stof_tvm.compile(tiny, mask="bigbird", batch=1, seq_len=128, target="llvm", dtype="float16", **kwargs)
