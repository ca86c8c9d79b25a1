"""The fused FFN template on wgmma (schedules/templates/ffn_wgmma.py): registry, knobs and budgets, shape refusals,
llvm numerics of the definition against float64 numpy, and the CUDA kernel compiled for sm_90a by nvcc
(register-A wgmma in the source, HGMMA in the SASS, no spills, no ptxas performance warnings).

The kernel's numerics need an H200: scripts/check_wgmma_gpu.py (``--only ffn``)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from stof_tvm.schedules.templates import CHAINS, H200, TEMPLATES, chain_stages, cuda_source, get_template
from stof_tvm.schedules.templates.ffn_kernel import FfnConfig, check_ffn_shape
from stof_tvm.schedules.templates.ffn_wgmma import FfnWgmmaTemplate
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel

from hopper_checks import clean_sm90a_sass

NP = {"float16": np.float16, "bfloat16": "bfloat16"}
TINY = {"m": 4096, "hidden": 128, "ffn": 512}


def test_registered_with_every_activation_and_both_bias_forms():
    for act in ("relu", "gelu_erf", "gelu_tanh"):
        for suffix in ("", "_bias"):
            t = TEMPLATES[f"ffn_{act}{suffix}_wgmma"]
            assert isinstance(t, FfnWgmmaTemplate) and t.family == "ffn_wgmma" and t.fused
            assert [name for name, _, _ in t.arguments(TINY)] == ["x", "W1", "b1", "W2"] + (["b2"] if suffix else []) + ["out"]
    assert get_template("ffn_gelu_erf_bias_wgmma").flops(TINY) == 4 * 4096 * 128 * 512


@pytest.mark.parametrize("shape", [TINY, {"m": 32768, "hidden": 256, "ffn": 1024}, {"m": 128, "hidden": 192, "ffn": 768}])
def test_every_configuration_fits_the_budgets(shape):
    t = get_template("ffn_gelu_erf_wgmma")
    space = t.knob_space(shape, "float16")
    assert space
    for knobs in space:
        res = t.resources(shape, "float16", knobs)
        assert res["threads"] == 384
        assert res["shared_bytes"] <= H200.max_shared_bytes_per_block
        assert res["acc_registers"] + res["operand_registers"] + 40 <= res["max_registers_per_thread"] == 232
        assert res["grid"] * 128 == shape["m"] and res["chunks"] * knobs["chunk_f"] == shape["ffn"]
        check_ffn_shape(shape["m"], shape["hidden"], shape["ffn"], t.config(knobs))
    if shape["hidden"] == 256:   # 128 + 64 + 32 fragment registers with chunk_f 128: never offered
        assert {kn["chunk_f"] for kn in space} == {64}
        assert {kn["stages"] for kn in space} == {2}   # the 64 KiB x tile + 64 KiB per slot


@pytest.mark.parametrize("shape", [TINY, {"m": 32768, "hidden": 128, "ffn": 512}, {"m": 32768, "hidden": 256, "ffn": 1024}])
def test_the_model_prices_every_offered_configuration(shape):
    """Every knob set the space offers is feasible to the analytical model too: the kernel launches with 168
    registers per thread (setmaxnreg then redistributes them), not the consumers' 232, which would leave no room
    for one 384-thread block and made the model reject the only configuration at hidden 256."""
    from stof_tvm.cost_model.templates import price_knobs

    t = get_template("ffn_gelu_erf_wgmma")
    space = t.knob_space(shape, "float16")
    seconds = price_knobs(t, shape, "float16", space)
    assert np.isfinite(seconds).all() and (seconds > 0).all()


@pytest.mark.parametrize("call, message", [
    (lambda t: t.kernel({"m": 100, "hidden": 128, "ffn": 512}), "multiple of 128"),
    (lambda t: t.kernel({"m": 128, "hidden": 768, "ffn": 3072}), r"in \[128, 256\]"),
    (lambda t: t.kernel({"m": 128, "hidden": 64, "ffn": 256}), r"in \[128, 256\]"),
    (lambda t: t.kernel({"m": 128, "hidden": 160, "ffn": 512}), "multiple of 64"),
    (lambda t: t.kernel({"m": 128, "hidden": 128, "ffn": 96}), "multiple of 64"),
    (lambda t: t.kernel({"m": 128, "hidden": 128, "ffn": 192}, knobs={"chunk_f": 128, "stages": 2}), "chunk_f = 128"),
    (lambda t: t.kernel({"m": 128, "hidden": 256, "ffn": 512}, knobs={"chunk_f": 128, "stages": 2}), "registers"),
    (lambda t: t.kernel({"m": 128, "hidden": 256, "ffn": 512}, knobs={"chunk_f": 64, "stages": 3}), "shared memory"),
    (lambda t: t.kernel(TINY, knobs={"chunk_f": 32, "stages": 2}), "chunk_f must be one of"),
    (lambda t: t.kernel(TINY, knobs={"chunk_f": 64, "stages": 1}), "stages must be one of"),
    (lambda t: t.kernel(TINY, knobs={"chunk_f": 64}), "knobs missing"),
    (lambda t: t.kernel(TINY, "float32"), "dtype"),
    (lambda t: t.knob_space({"m": 4096, "hidden": 768, "ffn": 3072}), "hidden"),
    (lambda t: t.schedule(TINY), "thread-level kernel"),
    (lambda t: FfnWgmmaTemplate("none", True), "act must be one of"),
])
def test_bad_input_raises_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(get_template("ffn_gelu_erf_bias_wgmma"))


def test_chain_offers_the_fused_form_only_where_it_fits():
    tiny = {"tokens": 4096, "hidden": 128, "ffn": 512, "heads": 2, "batch": 8, "seq": 512}
    assert CHAINS["ffn"].has_fused
    assert chain_stages("ffn", tiny, True) == [("ffn_gelu_erf_bias_wgmma", TINY)]
    base = dict(tiny, hidden=768, ffn=3072, heads=12)
    with pytest.raises(ValueError, match="fused form of chain 'ffn' does not fit"):
        chain_stages("ffn", base, True)
    assert [name for name, _ in chain_stages("ffn", base, False)] == ["gemm_bias_gelu_erf", "gemm_bias"]


@pytest.mark.parametrize("name, dtype, shape", [
    ("ffn_gelu_erf_bias_wgmma", "float16", {"m": 128, "hidden": 128, "ffn": 128}),
    ("ffn_relu_wgmma", "bfloat16", {"m": 128, "hidden": 128, "ffn": 64}),
])
def test_definition_matches_numpy_float64_on_llvm(name, dtype, shape):
    """``primfunc`` (the kernel's signature and semantics) built for llvm against float64, poisoned output."""
    t = get_template(name)
    rng = np.random.default_rng(5)
    args = t.arguments(shape, dtype)
    scale = {"W1": shape["hidden"] ** -0.5, "W2": shape["ffn"] ** -0.5}
    inputs = {n: (rng.standard_normal(s) * scale.get(n, 1.0)).astype(NP[dt]) for n, s, dt in args[:-1]}
    out = tvm.runtime.tensor(np.full(args[-1][1], np.nan, dtype=NP[dtype]))
    ex = tvm.compile(t.primfunc(shape, dtype), target=tvm.target.Target({"kind": "llvm"}))
    ex["main"](*[tvm.runtime.tensor(inputs[n]) for n, _, _ in args[:-1]], out)
    got = out.numpy().astype(np.float64)
    (ref,) = t.reference(shape, inputs)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (1e-2 if dtype == "float16" else 3e-2)


@pytest.mark.parametrize("name, shape, dtype, knobs", [
    ("ffn_gelu_erf_bias_wgmma", TINY, "float16", {"chunk_f": 128, "stages": 3}),
    ("ffn_gelu_erf_wgmma", {"m": 32768, "hidden": 256, "ffn": 1024}, "bfloat16", {"chunk_f": 64, "stages": 2}),
])
def test_kernel_compiles_for_sm90a_with_register_a_wgmma_and_no_spills(name, shape, dtype, knobs, tmp_path):

    ex = build_kernel(name, shape, dtype, knobs)
    assert "cuda" in [m.kind for m in ex.mod.imports]
    src = cuda_source(ex)
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    h, cf = shape["hidden"], knobs["chunk_f"]
    for text in (f"wgmma.mma_async.sync.aligned.m64n{cf}k16.f32.{ab}.{ab}",    # x @ W1_chunk^T, from shared
                 f"wgmma_{ab}_rs_mma_async_sync_aligned_m64n{h}k16",  # act @ W2_chunk^T, A in registers
                 f"cvt.rn.{ab}x2.f32", "mbarrier.try_wait.parity", "cp.async.mbarrier.arrive.noinc",
                 "fence.proxy.async.shared::cta", "setmaxnreg.inc.sync.aligned.u32 232",
                 "setmaxnreg.dec.sync.aligned.u32 40"):
        assert text in src, text
    sass = clean_sm90a_sass(src, tmp_path)
    assert re.search(rf"HGMMA\.64x{cf}x16\.F32", sass) and re.search(rf"HGMMA\.64x{h}x16\.F32", sass), "no HGMMA"
    assert "USETMAXREG" in sass


# ---- the compile path -------------------------------------------------------------------------------------

def _chains(entry) -> dict:
    return {site["chain"]: [stage["template"] for stage in site["stages"]] for site in entry["sites"]}


@pytest.mark.parametrize("arch, shape, fused, why", [
    ("sm_90a", {"m": 32768, "hidden": 128, "ffn": 512}, True, "256 blocks of 128 rows >= 132"),
    ("sm_90a", {"m": 4096, "hidden": 128, "ffn": 512}, False, "32 blocks of 128 rows < 132"),
    ("sm_90a", {"m": 32768, "hidden": 768, "ffn": 3072}, False, "does not fit"),
    ("sm_90", {"m": 32768, "hidden": 128, "ffn": 512}, False, "Hopper kernel"),
])
def test_chooser_takes_the_fused_ffn_only_on_hopper_where_it_fits_and_fills_the_gpu(arch, shape, fused, why):
    from stof_tvm.compiler.pipeline import CUDA_DEFAULTS, make_target
    from stof_tvm.compiler.template_choice import TemplateChooser

    chooser = TemplateChooser(make_target(dict(CUDA_DEFAULTS, arch=arch)), None)
    m, h, f = shape["m"], shape["hidden"], shape["ffn"]
    got, reason = chooser.fused_ffn(get_template("ffn_gelu_erf_wgmma"),
                                    [get_template("gemm_bias_gelu_erf_wgmma"), get_template("gemm_wgmma")], shape,
                                    [{"m": m, "n": f, "k": h}, {"m": m, "n": h, "k": f}], "float16")
    assert got == fused and why in reason


def test_hopper_front_end_fuses_the_tiny_bert_ffn_at_32768_tokens(tiny):
    """gemm="wgmma" (sm_90a): each layer's FFN becomes ffn_gelu_erf_wgmma + bias_residual_layernorm, the GELU
    linear is gone, and the manifest says why."""
    import stof_tvm.compiler

    front = stof_tvm.compiler.front_end(tiny, mask="bigbird", batch=64, seq_len=512, target="cuda", dtype="float16",
                                        gemm="wgmma", schedule=False)
    entry = front.template_entry
    assert _chains(entry)["ffn_ln"] == ["ffn_gelu_erf_wgmma", "bias_residual_layernorm"]
    assert "linear_gelu" not in _chains(entry) and "ffn_down_ln" not in _chains(entry)
    assert entry["calls"]["ffn_gelu_erf_wgmma"] == 2      # two layers
    assert any("fused: predicted faster" in note for note in entry["notes"])


def test_fused_ffn_rewrite_matches_the_reference_on_cpu(tiny, monkeypatch):
    """The rewrite's wiring (weights transposed to [ffn, hidden] and [hidden, ffn], biases, the second bias into
    the LayerNorm template) checked numerically: the chooser is made to pick the fused form on llvm, where the
    template's definition runs."""
    import stof_tvm
    from stof_tvm import make_mask
    from stof_tvm.compiler.template_choice import TemplateChooser
    from stof_tvm.models.reference import random_inputs, reference_outputs
    from attention_reference import relative_error

    monkeypatch.setattr(TemplateChooser, "fused_ffn", lambda self, *args: (True, "fused: forced by the test"))
    art = stof_tvm.compile(tiny, mask="bigbird", batch=1, seq_len=128, target="llvm", dtype="float16",
                           templates=True)
    chains = _chains(art.manifest["templates"])
    assert chains["ffn_ln"] == ["ffn_gelu_erf_wgmma", "bias_residual_layernorm"] and "linear_gelu" not in chains
    data = random_inputs(tiny, {"input_ids": (1, 128), "attention_mask": (1, 128)}, seed=7)
    data["attention_mask"][0, 100:] = 0
    out = art.load()(data)["last_hidden_state"]
    ref = reference_outputs(tiny, make_mask("bigbird", 128)[None, None], data)["last_hidden_state"]
    assert relative_error(out, ref) < 2e-2
