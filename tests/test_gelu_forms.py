"""The ``gelu_form`` of the wgmma GELU epilogue (schedules/templates/fast_gelu.py, wgmma_kernel.py): GELU as
``0.5 y (1 + tanh(u(y)))`` from one tanh.approx.f32 (``"tanh"``, the tanh GELU's knob sets) instead of the exp2 tail
polynomial (``"tail"``, the default). Here: the fitted erf argument against the float64 GELU
(tanh evaluated exactly: MUFU.TANH's own error, up to 2^-11 relative, needs an H200: ``scripts/bench_wgmma_small_k.py
--plan s12gelu``), the argument growing past its clamp, the knob's validation, the kernels' PTX and SASS, the default
kernel unchanged, and the GPU plan's knob sets. And ``"half"`` (the erf GELU's float16 knob sets): the tail form in
float16 pairs, its arithmetic emulated in numpy (each fma rounded once to float16; ``exp2`` exact then rounded:
MUFU.EX2's own f16 error, up to 2^-9.9 relative, needs the GPU, ``--plan s21gelu``)."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import tvm
from tvm import te

from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.epilogue import activation_np
from stof_tvm.schedules.templates.fast_gelu import (ERF_TANH_ARGUMENT, ERF_TANH_CLAMP, GELU_FORMS, HALF_SIGN_BITS,
                                                    HALF_TAIL_POLYNOMIALS, check_gelu_form, gelu_from_tanh,
                                                    half_pair, half_tail_words, tanh_argument)
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel
from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig

from hopper_checks import sm90a_sass
from test_gemm_tma import _bench_module

PICK = {"block_n": 192, "stages": 4, "persistent": True, "pingpong": True, "block_m": 256, "staged": True,
        "fast_gelu": True, "loads": "tma"}
SHAPE = {"m": 4096, "n": 3072, "k": 768}


def _tanh_gelu_float64(act: str, x: np.ndarray) -> np.ndarray:
    """The forms' GELU with their float32 argument (compiled for llvm from :func:`tanh_argument`) and an exact tanh."""
    inp = te.placeholder((x.size,), "float32", name="x")
    out = te.compute((x.size,), lambda i: tanh_argument(act, inp[i]), name="u")
    lib = tvm.compile(te.create_prim_func([inp, out]), target="llvm")
    res = tvm.runtime.empty((x.size,), "float32", tvm.cpu())
    lib(tvm.runtime.tensor(x.astype(np.float32), tvm.cpu()), res)
    y = x.astype(np.float64)
    return 0.5 * y * (1.0 + np.tanh(res.numpy().astype(np.float64)))


@pytest.mark.parametrize("act, bound", [("gelu_erf", 2.6e-5), ("gelu_tanh", 2e-6)])
def test_tanh_argument_gives_the_gelu_within_a_tenth_of_float16_rounding(act, bound):
    """Absolute output error (the fit's, for erf) over every finite float16 and a fine grid: a tenth of float16's
    half-ulp at 1 (2.4e-4), relative within 1e-4 wherever |GELU| > 0.5 (near GELU's minimum, -0.17, the erf fit's
    2.6e-5 is about one float16 half-ulp; MUFU.TANH's 2^-11 relative error on t is ten times the fit's there)."""
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    x = np.concatenate([halves[np.isfinite(halves)].astype(np.float32), np.linspace(-12, 12, 240001, dtype=np.float32)])
    got, ref = _tanh_gelu_float64(act, x), activation_np(act, x)
    err = np.abs(got - ref)
    assert np.isfinite(got).all() and err.max() <= bound, err.max()
    big = np.abs(ref) > 0.5
    assert (err[big] / np.abs(ref[big])).max() < 1e-4


def test_erf_argument_grows_past_its_clamp_where_tanh_is_one():
    """u(y) increases with y up to the clamp (the fit's c5 < 0 turns it round only at y ~ 8.3) and is past 9 there, so
    tanh(u) = 1 in float32 for every larger y (the clamp keeps s, so u = y p(clamp) keeps growing)."""
    c1, c3, c5 = ERF_TANH_ARGUMENT
    y = np.linspace(0.0, math.sqrt(ERF_TANH_CLAMP), 100001)
    s = y * y
    u = y * (c1 + s * (c3 + s * c5))
    assert (np.diff(u) > 0).all() and u[-1] > 9.0 and c1 + ERF_TANH_CLAMP * (c3 + ERF_TANH_CLAMP * c5) > 0
    assert np.float32(np.tanh(np.float64(u[-1]))) == np.float32(1.0)


def test_gelu_from_tanh_is_half_y_times_one_plus_t():
    inp = te.placeholder((3,), "float32", name="y")
    t = te.placeholder((3,), "float32", name="t")
    out = te.compute((3,), lambda i: gelu_from_tanh(inp[i], t[i]), name="out")
    lib = tvm.compile(te.create_prim_func([inp, t, out]), target="llvm")
    res = tvm.runtime.empty((3,), "float32", tvm.cpu())
    lib(tvm.runtime.tensor(np.array([2.0, -3.0, 5.0], np.float32)),
        tvm.runtime.tensor(np.array([0.5, -1.0, 1.0], np.float32)), res)
    assert res.numpy().tolist() == [1.5, 0.0, 5.0]


def test_bad_forms_are_refused():
    assert GELU_FORMS[0] == "tail" and WgmmaConfig().gelu_form == "tail"
    with pytest.raises(ValueError, match="gelu_form must be one of"):
        check_gelu_form("sigmoid")
    with pytest.raises(ValueError, match="needs fast_gelu=True"):
        WgmmaConfig(block_n=192, staged=True, gelu_form="tanh").validate()


@pytest.mark.parametrize("act", ["erf", "tanh"])
def test_forms_build_their_instructions_and_leave_the_default_unchanged(act, tmp_path):
    """"tail" written out is the default kernel byte for byte; "tanh" calls tanh.approx.f32 and no exp2; in SASS
    (where cuobjdump is found) one MUFU.TANH per output of a consumer thread's 128 x 192 tile (192) instead of the
    192 MUFU.EX2, fewer FFMA, no local memory."""
    name = f"gemm_bias_gelu_{act}_wgmma"
    default = cuda_source(build_kernel(name, SHAPE, "float16", PICK))
    assert cuda_source(build_kernel(name, SHAPE, "float16", dict(PICK, gelu_form="tail"))) == default
    src = cuda_source(build_kernel(name, SHAPE, "float16", dict(PICK, gelu_form="tanh")))
    assert "tanh.approx.f32" in src and "ex2.approx" not in src and "tanh.approx" not in default
    sass = sm90a_sass(src, tmp_path)
    if sass is not None:
        ops = re.findall(r"\b(MUFU\.[A-Z0-9]+|FFMA|LDL|STL)\b", sass)
        counts = {key: ops.count(key) for key in set(ops)}
        assert counts.get("MUFU.TANH", 0) == 192 and "MUFU.EX2" not in counts
        assert not {"LDL", "STL"} & set(counts)
        assert counts["FFMA"] < len(re.findall(r"\bFFMA\b", sm90a_sass(default, tmp_path)))


def test_gpu_plan_times_the_pick_its_forms_and_its_gelu_less_twin():
    """``--plan s12gelu``: per GELU case the knob space's first set in its tail form, then its tanh twin (at 32768 rows
    also the cooperative 256 x 192 set and its tanh twin); per row count the GELU-less GEMM with the erf pick's
    tiles."""
    bench = _bench_module()
    assert len(bench.S12_CASES) == 6
    for name, shape in bench.S12_CASES:
        space = get_template(name).knob_space(shape, "float16")
        sets = bench.gelu_knob_sets(name, shape, space)
        tags = [bench.knob_tag(kn) for kn in sets]
        assert len(set(tags)) == len(sets)
        if "gelu" in name:
            assert sets[0] == {key: v for key, v in space[0].items() if key != "gelu_form"}
            assert sets[1] == dict(sets[0], gelu_form="tanh")
            assert len(sets) == (4 if shape["m"] == bench.S12_COOP_ROWS else 2)
            if len(sets) == 4:
                assert sets[2] == dict(sets[2], **bench.S12_COOP) and sets[3] == dict(sets[2], gelu_form="tanh")
        else:
            pick = get_template("gemm_bias_gelu_erf_wgmma").knob_space(shape, "float16")[0]
            assert sets == [{key: v for key, v in pick.items() if key not in ("fast_gelu", "gelu_form")}]
        for knobs in sets:
            get_template(name).config(knobs)


def test_gpu_plan_s21_times_both_erf_forms_and_the_gelu_less_twins():
    """``--plan s21gelu``: the erf GELU pick in its tail and half forms at 4096 and 32768 rows, its GELU-less twin at
    4096 rows, FFN down's pick; every set one the template takes."""
    bench = _bench_module()
    for name, shape in bench.S21_CASES:
        space = get_template(name).knob_space(shape, "float16")
        sets = bench.s21_knob_sets(name, shape, space)
        if "gelu" in name:
            assert [kn["gelu_form"] for kn in sets] == ["tail", "half"] and sets[1] == space[0]
        elif shape["n"] == 3072:
            assert len(sets) == 1 and "fast_gelu" not in sets[0] and "gelu_form" not in sets[0]
        else:
            assert sets == [space[0]]
        for knobs in sets:
            get_template(name).config(knobs)


# ---- gelu_form "half": the tail form on float16 pairs ------------------------------------------------------------

def _round16(x):
    return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def _half_gelu_emulated(y: np.ndarray) -> np.ndarray:
    """The kernel's pair arithmetic on float16 inputs ``y``, one lane: ``s = -|y|`` (the sign bit set), ``q`` by
    Horner on ``max(s, -T)`` with each fma rounded once, ``p = 2**q`` rounded, ``out = fma(s, p, max(y, 0))``."""
    fit_end, coefficients = HALF_TAIL_POLYNOMIALS["gelu_erf"]
    y = _round16(y)
    s = -np.abs(y)
    clamped = np.maximum(s, -fit_end)
    q = np.full_like(y, coefficients[0])
    for c in coefficients[1:]:
        q = _round16(q * clamped + c)          # a product of two float16 is exact in float64: one rounding, as fma
    p = _round16(np.exp2(q))
    with np.errstate(invalid="ignore"):
        return _round16(s * p + np.maximum(y, 0.0))


def _ordered16(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float16).view(np.int16).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFF), bits)


def test_half_form_is_about_as_accurate_as_rounding_the_gelu_to_float16():
    """On N(0, 1.5^2) activations (float16) the emulated half form's Frobenius error against the float64 GELU is
    within 10% of the correctly rounded float16 GELU's own; outputs above 1e-2 are within 8 float16 ulps of the
    correctly rounded value and most within one."""
    y = _round16(np.random.default_rng(21).standard_normal(1_000_000) * 1.5)
    got, ref = _half_gelu_emulated(y), activation_np("gelu_erf", y)
    best = _round16(ref)
    frobenius = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert frobenius <= 1.1 * np.linalg.norm(best - ref) / np.linalg.norm(ref), frobenius
    big = np.abs(ref) > 1e-2
    ulps = np.abs(_ordered16(got[big]) - _ordered16(best[big]))
    assert ulps.max() <= 8 and (ulps <= 1).mean() > 0.9


def test_half_form_over_every_float16_input():
    """Every finite float16: within 3e-3 of the GELU relative to max(|GELU|, 0.1) (the negative lobe's outputs, down
    to -0.17, carry the float16 evaluation's few ulps; everything else is float16 rounding), exactly max(y, 0) past
    the clamp (the tail 2**q(-T) flushes to zero), zeros stay zero and a NaN propagates."""
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    y = halves[np.isfinite(halves)].astype(np.float64)
    got, ref = _half_gelu_emulated(y), activation_np("gelu_erf", y)
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) / np.maximum(np.abs(ref), 0.1)).max() < 3e-3
    fit_end, _ = HALF_TAIL_POLYNOMIALS["gelu_erf"]
    far = np.abs(y) >= fit_end
    assert (got[far] == np.maximum(y[far], 0.0)).all()
    assert np.isnan(_half_gelu_emulated(np.array([np.nan]))).all()
    assert (_half_gelu_emulated(np.array([0.0, -0.0])) == 0.0).all()


def test_half_form_words_are_the_float16_coefficients_in_both_halves():
    fit_end, coefficients = HALF_TAIL_POLYNOMIALS["gelu_erf"]
    neg_end, words = half_tail_words("gelu_erf")
    assert all(float(np.float16(c)) == c for c in coefficients) and coefficients[-1] == -1.0   # Phi(0) = 1/2
    for value, word in zip((-fit_end, *coefficients), (neg_end, *words)):
        low = np.array([word & 0xFFFF], np.uint16).view(np.float16)[0]
        assert word >> 16 == word & 0xFFFF and float(low) == value
    assert half_pair(-2.0) | HALF_SIGN_BITS == half_pair(-2.0) and half_pair(2.0) | HALF_SIGN_BITS == half_pair(-2.0)


def test_half_form_builds_pair_instructions_and_is_refused_where_it_does_not_apply(tmp_path):
    """The kernel's epilogue uses fma.rn.f16x2 / ex2.approx.f16x2 and no float32 exp2; ptxas builds it for sm_90a
    without spills; in SASS (where cuobjdump is found) its exponentials are 16-bit MUFU.EX2.F16, as many as the
    float32 tail form's MUFU.EX2: nvcc 13.0 splits each pair instruction in two (session 33), so the half form
    saves no MUFU instructions. The tanh GELU and bfloat16 outputs are refused (the fit is the erf GELU's; bfloat16
    would lose the tail's digits)."""
    from stof_tvm.schedules.templates.gemm_wgmma import nvcc_cubin

    name = "gemm_bias_gelu_erf_wgmma"
    src = cuda_source(build_kernel(name, SHAPE, "float16", dict(PICK, gelu_form="half")))
    assert "fma.rn.f16x2" in src and "ex2.approx.f16x2" in src and "ex2.approx.ftz.f32" not in src
    report = nvcc_cubin(src, tmp_path / "half.cubin")
    assert not (report["spill_stores"] or report["spill_loads"] or report["stack_frame"] or report["warnings"])
    sass = sm90a_sass(src, tmp_path)
    if sass is not None:
        tail = sm90a_sass(cuda_source(build_kernel(name, SHAPE, "float16", dict(PICK, gelu_form="tail"))), tmp_path)
        half_ex2 = re.findall(r"\bMUFU\.EX2\S*", sass)
        assert half_ex2 and set(half_ex2) == {"MUFU.EX2.F16"}
        assert len(half_ex2) == len(re.findall(r"\bMUFU\.EX2\b(?!\.)", tail))
    with pytest.raises(ValueError, match="fitted for"):
        build_kernel("gemm_bias_gelu_tanh_wgmma", SHAPE, "float16", dict(PICK, gelu_form="half"))
    with pytest.raises(ValueError, match="float16 outputs only"):
        build_kernel(name, SHAPE, "bfloat16", dict(PICK, gelu_form="half"))


def test_gemm_knobs_give_gelu_form_only_to_the_fast_gelu_sets():
    """``gemm_knobs={"gelu_form": ...}`` (a compile option, to measure the form across a model) changes the GELU
    GEMMs' fast_gelu sets and leaves every other GEMM's chosen set as it is."""
    from stof_tvm.compiler.downstream import _merged_gemm_knobs

    knobs = {"gelu_form": "tail", "stages": 3}
    assert _merged_gemm_knobs(dict(PICK), knobs) == knobs
    assert _merged_gemm_knobs({"block_n": 192, "staged": True}, knobs) == {"stages": 3}


def test_gemm_knobs_entry_named_after_a_template_goes_to_that_template_alone():
    """``gemm_knobs={"qkv_projection_wgmma": {...}}`` changes the QKV projection's chosen set only (what an in-model
    A/B of one GEMM needs), after the plain knobs every wgmma GEMM takes."""
    from stof_tvm.compiler.downstream import _merged_gemm_knobs

    knobs = {"stages": 3, "qkv_projection_wgmma": {"block_n": 256, "stages": 2}}
    assert _merged_gemm_knobs({"block_n": 128}, knobs, "qkv_projection_wgmma") == {"stages": 2, "block_n": 256}
    assert _merged_gemm_knobs({"block_n": 128}, knobs, "gemm_bias_wgmma") == {"stages": 3}
