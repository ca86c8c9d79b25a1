"""Opt-in wgmma GEMM templates (schedules/templates/gemm_wgmma.py): registry, knobs, resources, llvm numerics
of the definition, the cooperative and ping-pong consumer schedules, and the CUDA kernel compiled for sm_90a by nvcc
(HGMMA in the SASS, no spills).

The kernel's numerics need an H200: scripts/check_wgmma_gpu.py."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import tvm

from stof_tvm.schedules.templates import H200, TEMPLATES, cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import WgmmaGemmTemplate, build_kernel

from hopper_checks import clean_sm90a_sass

NAMES = ["gemm_wgmma", "gemm_bias_wgmma", "gemm_bias_relu_wgmma", "gemm_bias_gelu_erf_wgmma",
         "gemm_bias_gelu_tanh_wgmma"]
NP = {"float16": np.float16, "bfloat16": "bfloat16"}


def test_registered_but_not_the_default_gemm():
    for name in NAMES:
        assert isinstance(TEMPLATES[name], WgmmaGemmTemplate)
        assert TEMPLATES[name].family == "gemm_wgmma"
    # the compile path maps GEMM calls to the mma.sync names; these stay theirs
    for name in ("gemm", "gemm_bias", "gemm_bias_gelu_erf"):
        assert not isinstance(TEMPLATES[name], WgmmaGemmTemplate)


@pytest.mark.parametrize("shape", [{"m": 4096, "n": 4096, "k": 4096}, {"m": 128, "n": 768, "k": 768},
                                   {"m": 32768, "n": 4096, "k": 1024}, {"m": 4096, "n": 1024, "k": 4096}])
def test_every_configuration_fits_the_h200(shape):
    t = get_template("gemm_bias_gelu_erf_wgmma")
    space = t.knob_space(shape, "float16")
    assert space
    for knobs in space:
        res = t.resources(shape, "float16", knobs)
        assert res["threads"] == 384 <= H200.max_threads_per_block
        assert res["shared_bytes"] <= H200.max_shared_bytes_per_block
        assert res["acc_registers"] + 40 <= res["max_registers_per_thread"] <= H200.max_registers_per_thread
        assert shape["n"] % res["block_n"] == 0
        # tiles: the units of work, split_k per output tile under split-K
        assert res["tiles"] * res["block_m"] * res["block_n"] == shape["m"] * shape["n"] * knobs.get("split_k", 1)
        assert res["grid"] == (min(res["tiles"], H200.sm_count) if knobs["persistent"] else res["tiles"])
        # ping-pong: persistent only; one warpgroup holds a whole tile (128 x 128, or 64 rows when wider, 128 x 192
        # with block_m 256); cooperative: 128 rows, or 256 (block_m) with 128 per consumer warpgroup
        cooperative_rows = knobs.get("block_m", 128)
        pingpong_rows = 128 if cooperative_rows == 256 else {128: 128, 192: 64, 256: 64}[knobs["block_n"]]
        assert res["block_m"] == (pingpong_rows if knobs["pingpong"] else cooperative_rows)
        assert res["acc_registers"] == res["block_m"] * res["block_n"] // (128 if knobs["pingpong"] else 256)
        assert knobs["persistent"] or not knobs["pingpong"]
        assert res["overlapped_epilogue"] == knobs["pingpong"]
    # 256-wide cooperative tiles with 5 stages need 240 KiB: never offered (ping-pong's 64 x 256 tiles fit)
    assert not [kn for kn in space if (kn["block_n"], kn["stages"], kn["pingpong"]) == (256, 5, False)]
    assert {kn["block_n"] for kn in space if kn["pingpong"]} == {kn["block_n"] for kn in space}
    # among the older direct-store knob sets (after the staged ones): cooperative first, in their measured order
    space = [kn for kn in space if "block_m" not in kn and "staged" not in kn]
    assert not space[0]["pingpong"] and space.index(next(kn for kn in space if kn["pingpong"])) == len(
        [kn for kn in space if not kn["pingpong"]])
    tiles = (shape["m"] // 128) * (shape["n"] // space[0]["block_n"])
    assert space[0]["persistent"] == (tiles >= 4 * H200.sm_count)


def _launches(template, shape, knobs):
    """``(WgmmaConfig, [(grid, threads, dynamic shared bytes)] of the lowered host's kernel launches)``."""
    from stof_tvm.schedules.templates.build import cuda_target
    from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig

    target = tvm.target.Target(cuda_target("sm_90a"))
    mod = tvm.IRModule({"main": template.kernel(shape, "float16", knobs)})
    with target:
        lowered = tvm.tirx.get_tir_pipeline("default")[0](tvm.tirx.transform.BindTarget(target)(mod))
    launches = re.findall(r'call_ffi_kernel\("gemm_wgmma_kernel", [^)]*?, (\d+), (\d+), T\.int64\((\d+)\)',
                          lowered.script())
    return WgmmaConfig(**knobs), launches


@pytest.mark.parametrize("knobs, grid, shared", [
    ({"block_n": 128, "stages": 2}, 8, 2 * 256 * 128),
    ({"block_n": 256, "stages": 4}, 4, 4 * 384 * 128),
    ({"block_n": 128, "stages": 2, "pingpong": True}, 8, 2 * 256 * 128),       # 128 x 128 tiles, one per consumer
    ({"block_n": 256, "stages": 4, "pingpong": True}, 8, 4 * (64 + 256) * 128),  # 64 x 256 tiles: smaller slots
])
def test_kernel_launch_reserves_the_whole_shared_ring(knobs, grid, shared):
    """The host launches the kernel with 384 threads, one block per tile (at most one per SM) and the ring's
    dynamic shared size (buffer compaction once cut it to 8 bytes, which only the GPU noticed, as an illegal
    address)."""
    t = get_template("gemm_wgmma")
    shape = {"m": 256, "n": 512, "k": 128}
    config, launches = _launches(t, shape, knobs)
    assert config.shared_bytes == shared + 16 * knobs["stages"] + 1024  # ring, mbarriers, alignment slack
    assert launches == [(str(grid), "384", str(config.shared_bytes))]
    assert t.resources(shape, "float16", knobs)["grid"] == grid


def _kernel_body(src: str) -> str:
    return src[src.index('extern "C" __global__'):]


@pytest.mark.parametrize("name, shape", [
    ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 768, "k": 256}),
    ("qkv_projection_wgmma", {"batch": 64, "seq": 512, "heads": 4, "head_dim": 64}),
])
@pytest.mark.parametrize("block_n", [128, 256])
def test_pingpong_knob_changes_the_consumer_schedule(name, shape, block_n):
    """Same tile width, the two schedules: ping-pong consumers own alternate rounds (each waits on its own tiles'
    full barriers and takes turns through named barriers 1 and 2), each slot's empty barrier expects one
    warpgroup, and a 128-row ping-pong tile issues two m64 wgmma per k16 step from 128 accumulators."""
    coop = _kernel_body(cuda_source(build_kernel(name, shape, "float16", {"block_n": block_n, "stages": 3})))
    pp = _kernel_body(cuda_source(build_kernel(name, shape, "float16", {"block_n": block_n, "stages": 3,
                                                                      "pingpong": True})))
    inits = lambda src: re.findall(r"mbarrier_init_init_shared__cta_b64\(.*?, \(uint\)(\d+)\);", src)  # noqa: E731
    assert inits(coop) == ["128", "256"] * 3 and inits(pp) == ["128", "128"] * 3   # (full, empty) per slot
    own_round = r"\(\(r_\d+ & 1\) == \(\(\(\(int\)threadIdx\.x\) >> 7\) - 1\)\)"
    assert re.search(own_round, pp) and not re.search(own_round, coop)
    assert "bar_sync_count_sync(((uint)(((int)threadIdx.x) >> 7)), (uint)256)" in pp      # own id: 1 or 2
    assert "bar_arrive_arrive(((uint)(3 - (((int)threadIdx.x) >> 7))), (uint)256)" in pp  # the other's
    assert "bar_sync_count" not in coop and "bar_arrive" not in coop
    halves = 2 if block_n == 128 else 1
    mma = f"_ss_mma_async_sync_aligned_m64n{block_n}k16"
    assert coop.count(mma) == 4 and pp.count(mma) == 4 * halves
    assert f"float acc_ptr[{block_n // 2}];" in coop and f"float acc_ptr[{halves * block_n // 2}];" in pp


def test_cooperative_source_does_not_depend_on_the_new_knob():
    """Knob sets written before ``pingpong`` existed build the same kernel as with ``pingpong=False`` (prebuilt
    artifacts and tuning records keyed by the source stay valid)."""
    shape = {"m": 4096, "n": 768, "k": 768}
    old = cuda_source(build_kernel("gemm_bias_wgmma", shape, "float16", {"block_n": 192, "stages": 4,
                                                                         "persistent": True}))
    new = cuda_source(build_kernel("gemm_bias_wgmma", shape, "float16", {"block_n": 192, "stages": 4,
                                                                         "persistent": True, "pingpong": False}))
    assert old == new


def test_cost_model_hides_the_pingpong_epilogue():
    """The analytical model charges a ping-pong block one tile's epilogue (the rest overlaps the other consumer's
    MMAs): at equal tiles (128 x 128) and stages the SMs' time is shorter (the whole prediction is never longer:
    it may be bound by L2 instead)."""
    from stof_tvm.cost_model.core import DEFAULT_CALIBRATION, predict
    from stof_tvm.cost_model.templates import price_knobs, template_calibration, template_work
    from stof_tvm.hardware import H200 as H200_PROFILE

    t, shape = get_template("gemm_bias_gelu_erf_wgmma"), {"m": 32768, "n": 3072, "k": 768}
    coop, pp = ({"block_n": 128, "stages": 4, "persistent": True, "pingpong": p} for p in (False, True))
    work = {p: template_work(t, shape, "float16", kn) for p, kn in ((False, coop), (True, pp))}
    assert work[True].l2_bytes == work[False].l2_bytes and work[True].tc_flops == work[False].tc_flops
    assert work[True].cuda_ops < work[False].cuda_ops
    sm = {p: predict(w, H200_PROFILE, template_calibration(DEFAULT_CALIBRATION)).terms["sm_s"] for p, w in work.items()}
    assert sm[True] < sm[False]
    seconds = price_knobs(t, shape, "float16", [coop, pp])
    assert seconds[1] <= seconds[0]


@pytest.mark.parametrize("call, message", [
    (lambda t: t.kernel({"m": 0, "n": 256, "k": 64}), "must be a positive int"),
    (lambda t: t.kernel({"m": 100, "n": 200, "k": 64}), "multiple of one of the tile widths"),
    (lambda t: t.kernel({"m": 128, "n": 256, "k": 48}), "multiple of 64"),
    (lambda t: t.kernel({"m": 128, "n": 384, "k": 64}, knobs={"block_n": 256, "stages": 3}), "multiple of 256"),
    (lambda t: t.kernel({"m": 128, "n": 256, "k": 64}, knobs={"block_n": 96, "stages": 3}), "block_n"),
    (lambda t: t.kernel({"m": 128, "n": 256, "k": 64}, knobs={"block_n": 128, "stages": 1}), "stages"),
    (lambda t: t.kernel({"m": 128, "n": 256, "k": 64}, knobs={"block_n": 128}), "knobs missing"),
    (lambda t: t.kernel({"m": 128, "n": 256, "k": 64}, knobs={"block_n": 128, "stages": 2, "persistent": False,
                                                             "pingpong": True}), "pingpong needs persistent"),
    (lambda t: t.kernel({"m": 128, "n": 256, "k": 64}, knobs={"block_n": 128, "stages": 2, "pingpong": "yes"}),
     "pingpong must be a bool"),
    (lambda t: t.kernel({"m": 128, "n": 256, "k": 64}, "float32"), "dtype"),
    (lambda t: t.schedule({"m": 128, "n": 256, "k": 64}), "thread-level kernel"),
    (lambda t: build_kernel("gemm_bias", {"m": 128, "n": 256, "k": 64}), "not a wgmma template"),
])
def test_bad_input_raises_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(get_template("gemm_bias_wgmma"))


@pytest.mark.parametrize("name, dtype, shape", [
    ("gemm_bias_gelu_tanh_wgmma", "float16", {"m": 128, "n": 128, "k": 64}),
    ("gemm_wgmma", "bfloat16", {"m": 128, "n": 128, "k": 64}),
    ("qkv_projection_wgmma", "float16", {"batch": 2, "seq": 64, "heads": 2, "head_dim": 64}),
    ("qkv_projection_wgmma", "float16", {"batch": 2, "seq": 13, "heads": 2, "head_dim": 64}),   # 26 rows of 128
])
def test_definition_matches_numpy_float64_on_llvm(name, dtype, shape):
    """``primfunc`` (the kernel's signature and semantics) built for llvm against float64, poisoned output."""
    t = get_template(name)
    rng = np.random.default_rng(3)
    inputs = {n: rng.standard_normal(s).astype(NP[dt]) for n, s, dt in t.arguments(shape, dtype)[:-1]}
    out_shape = t.arguments(shape, dtype)[-1][1]
    out = tvm.runtime.tensor(np.full(out_shape, np.nan, dtype=NP[dtype]))
    ex = tvm.compile(t.primfunc(shape, dtype), target=tvm.target.Target({"kind": "llvm"}))
    ex["main"](*[tvm.runtime.tensor(inputs[n]) for n, _, _ in t.arguments(shape, dtype)[:-1]], out)
    got = out.numpy().astype(np.float64)
    (ref,) = t.reference(shape, inputs)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (1e-2 if dtype == "float16" else 3e-2)


@pytest.mark.parametrize("name, shape, dtype, knobs", [
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 3072, "k": 768}, "float16", {"block_n": 256, "stages": 4}),
    ("gemm_wgmma", {"m": 4096, "n": 4096, "k": 4096}, "bfloat16", {"block_n": 128, "stages": 5}),
    ("gemm_bias_wgmma", {"m": 4096, "n": 768, "k": 3072}, "float16", {"block_n": 128, "stages": 4,
                                                                      "persistent": False}),
    ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64}, "float16",
     {"block_n": 256, "stages": 4, "persistent": True}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768}, "float16",
     {"block_n": 128, "stages": 4, "persistent": True, "pingpong": True}),
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 768}, "bfloat16",
     {"block_n": 192, "stages": 5, "persistent": True, "pingpong": True}),
    ("qkv_projection_wgmma", {"batch": 64, "seq": 512, "heads": 12, "head_dim": 64}, "float16",
     {"block_n": 256, "stages": 4, "persistent": True, "pingpong": True}),
    ("qkv_projection_wgmma", {"batch": 8, "seq": 197, "heads": 12, "head_dim": 64}, "float16",   # ViT: rows padded
     {"block_n": 128, "stages": 4, "persistent": True, "staged": True}),
])
def test_kernel_compiles_for_sm90a_with_hgmma_and_no_spills(name, shape, dtype, knobs, tmp_path):
    ex = build_kernel(name, shape, dtype, knobs)
    assert "cuda" in [m.kind for m in ex.mod.imports]
    src = cuda_source(ex)
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    for text in (f"wgmma.mma_async.sync.aligned.m64n{knobs['block_n']}k16.f32.{ab}.{ab}", "wgmma.wait_group",
                 "mbarrier.try_wait.parity", "cp.async.mbarrier.arrive.noinc", "fence.proxy.async.shared::cta",
                 "setmaxnreg.inc.sync.aligned.u32 232", "setmaxnreg.dec.sync.aligned.u32 40"):
        assert text in src, text
    sass = clean_sm90a_sass(src, tmp_path)
    assert re.search(rf"HGMMA\.64x{knobs['block_n']}x16\.F32", sass), "no HGMMA of the tile's width in the SASS"
    if knobs.get("pingpong"):  # the consumers' turns: named barriers with the id in a register, 256 threads
        assert re.search(r"BAR\.SYNC\S* R\d+, 0x100", sass) and re.search(r"BAR\.ARV R\d+, 0x100", sass)
    assert "HMMA" not in sass.replace("HGMMA", "")
    assert "USETMAXREG" in sass


# ---- 256-row cooperative tiles and the staged epilogue (knobs block_m, staged) ------------------------------------

SMALL_K = {"m": 32768, "n": 768, "k": 768}


MEASURED_FIRST = {  # the fastest knob set per BERT-Base GEMM at 32768 tokens (out/results/wgmma_small_k_s4.json)
    ("gemm_wgmma", "32768x768x768"): {"block_n": 192, "stages": 3, "block_m": 256},
    ("gemm_wgmma", "32768x768x3072"): {"block_n": 192, "stages": 3, "block_m": 256},
    ("gemm_bias_gelu_erf_wgmma", "32768x3072x768"): {"block_n": 128, "stages": 4},
    ("qkv_projection_wgmma", "16x2048x12x64"): {"block_n": 192, "stages": 3, "block_m": 256},
}


@pytest.mark.parametrize("name, label", list(MEASURED_FIRST))
def test_staged_knob_sets_come_first_led_by_the_measured_best(name, label):
    """The staged sets lead the space (the compile path's untuned choice), the H200's fastest at the shape first;
    the direct-store sets follow, the older ones in their older order and with their older keys, then the 256-row
    ones. 256-row tiles: width 128 and 192, cooperative; staged at both widths except with the erf GELU (width 128
    only: ptxas spilled at 192)."""
    t = get_template(name)
    shape = dict(zip(t.shape_keys, map(int, label.split("x"))))
    space = tile_knobs(t.knob_space(shape, "float16"))
    fast = [kn for kn in space if kn.get("fast_gelu")]
    assert space[:len(fast)] == fast and bool(fast) == ("gelu" in name)   # the GELU's fast twins lead (own test)
    space = space[len(fast):]
    assert space[0] == dict(MEASURED_FIRST[name, label], persistent=True, pingpong=False, staged=True)
    n_staged = sum(bool(kn.get("staged")) for kn in space)
    staged, direct = space[:n_staged], space[n_staged:]
    assert staged and direct and not any(kn.get("staged") for kn in direct)
    pingpong = [kn["pingpong"] for kn in staged]
    assert pingpong == sorted(pingpong)                          # cooperative before ping-pong
    older = [kn for kn in direct if "block_m" not in kn]
    assert direct[:len(older)] == older and all(set(kn) == {"block_n", "stages", "persistent", "pingpong"}
                                                for kn in older)
    spills = lambda kn: "gelu_erf" in name and kn.get("block_m") == 256 and kn["block_n"] == 192  # noqa: E731
    key = lambda kn: json.dumps(kn, sort_keys=True)  # noqa: E731
    twins = [dict(kn, staged=True) for kn in direct if not spills(kn)]
    fits = lambda kn: t.resources(shape, "float16", kn)["shared_bytes"] <= H200.max_shared_bytes_per_block  # noqa: E731
    assert sorted(map(key, staged)) == sorted(key(kn) for kn in twins if fits(kn))   # the 16 KiB buffer must fit
    tall = [kn for kn in space if kn.get("block_m") == 256]
    assert {kn["block_n"] for kn in tall} == {128, 192} and not any(kn["pingpong"] for kn in tall)
    assert {kn["block_n"] for kn in tall if kn.get("staged")} == ({128} if "gelu_erf" in name else {128, 192})
    for knobs in space:
        res = t.resources(shape, "float16", knobs)
        assert res["shared_bytes"] <= H200.max_shared_bytes_per_block
        assert res["acc_registers"] + 40 <= res["max_registers_per_thread"]


@pytest.mark.parametrize("name, shape, dtype", [
    ("gemm_wgmma", SMALL_K, "float16"),
    ("gemm_bias_gelu_tanh_wgmma", {"m": 32768, "n": 3072, "k": 768}, "bfloat16"),
    ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768}, "float16"),
    ("qkv_projection_wgmma", {"batch": 16, "seq": 2048, "heads": 12, "head_dim": 64}, "bfloat16"),
])
def test_default_knob_sets_compile_without_spills(name, shape, dtype, tmp_path):
    """The untuned kernels (each template's first knob set: staged, 256 x 192, the GELU ones with ``fast_gelu``) in
    both dtypes: ptxas reports no spills, no stack frame and no warning; the staged stores are 16 bytes wide."""
    src = cuda_source(build_kernel(name, shape, dtype))
    assert "st.global.v4.b32" in src
    # the GELU's form: the erf GELU's tail on float16 pairs ("half") for float16, in float32 for bfloat16
    gelu = {"gemm_bias_gelu_erf_wgmma": "ex2.approx.f16x2" if dtype == "float16" else "ex2.approx.ftz.f32",
            "gemm_bias_gelu_tanh_wgmma": "tanh.approx.f32"}
    for form in ("ex2.approx.f16x2", "ex2.approx.ftz.f32", "tanh.approx.f32"):
        assert (form in src) == (form == gelu.get(name)), form
    assert "erff(" not in src and "tanhf(" not in src
    sass = clean_sm90a_sass(src, tmp_path)
    assert "STG.E.128" in sass and "STG.E.U16" not in sass


@pytest.mark.parametrize("name, label", list(MEASURED_FIRST))
def test_cost_model_ranks_staged_sets_first(name, label):
    """Stage 1's model prices the direct epilogue's 2-byte stores (``narrow_store_ops`` per output element, fitted to
    the H200's timings) and wgmma's main-loop rate; it launches every set with the 168 registers setmaxnreg then
    redistributes (256 x 192 tiles are feasible). At the four measured shapes its top 8 are all staged, and its first
    choice is the measured best where 256 x 192 is offered."""
    from stof_tvm.cost_model.core import DEFAULT_CALIBRATION, predict
    from stof_tvm.cost_model.templates import rank_template, template_calibration, template_work
    from stof_tvm.hardware import H200 as H200_PROFILE

    t = get_template(name)
    shape = dict(zip(t.shape_keys, map(int, label.split("x"))))
    ranked = rank_template(t, shape, "float16")
    assert len(ranked) == len(t.knob_space(shape, "float16"))          # every set feasible
    assert all(r.candidate.get("staged") for r in ranked[:8])
    if "gelu_erf" not in name:   # the measured order's lead (the 128 x 192 ping-pong set measured faster precedes it)
        assert ranked[0].candidate == next(kn for kn in t.knob_space(shape, "float16")
                                           if not (kn["pingpong"] and kn.get("block_m") == 256))
    # the model prices fast_gelu like its twin: a stable ranking keeps the fast twin ahead
    for i, r in enumerate(ranked):
        if r.candidate.get("staged") and not r.candidate.get("fast_gelu") and "gelu" in name:
            twin = dict(r.candidate, fast_gelu=True, **({"gelu_form": "half"} if "erf" in name else {}))
            assert [x.candidate for x in ranked].index(twin) < i
    direct = {"block_n": 128, "stages": 4, "persistent": True, "pingpong": False}
    work = {st: template_work(t, shape, "float16", dict(direct, staged=st) if st else direct) for st in (False, True)}
    per_block = -(-t.resources(shape, "float16", direct)["tiles"] // 132) * 128 * 128
    assert work[False].cuda_ops - work[True].cuda_ops == pytest.approx(DEFAULT_CALIBRATION.narrow_store_ops
                                                                       * per_block)
    assert work[False].regs_per_thread == work[True].regs_per_thread == 168
    staged, plain = (predict(work[st], H200_PROFILE, template_calibration(DEFAULT_CALIBRATION)) for st in (True, False))
    assert staged.terms["sm_s"] < plain.terms["sm_s"] and staged.time_s <= plain.time_s   # (L2 may bound both)


@pytest.mark.parametrize("name, shape, first", [
    ("gemm_wgmma", {"m": 384, "n": 768, "k": 768}, {"block_n": 128, "stages": 4}),       # m % 256: no 256-row tiles
    ("gemm_bias_gelu_tanh_wgmma", {"m": 32768, "n": 3072, "k": 768},
     {"block_n": 192, "stages": 3, "block_m": 256, "fast_gelu": True, "gelu_form": "tanh"}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 3072, "k": 768},
     {"block_n": 192, "stages": 3, "block_m": 256, "fast_gelu": True, "gelu_form": "half"}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 384, "n": 768, "k": 768},
     {"block_n": 128, "stages": 4, "fast_gelu": True, "gelu_form": "half"}),
    ("qkv_projection_wgmma", {"batch": 1, "seq": 128, "heads": 2, "head_dim": 64}, {"block_n": 128, "stages": 4}),
])
def test_first_knob_set_where_the_measured_best_is_not_offered(name, shape, first):
    """Without 256-row tiles the 128 x 128 4-stage staged set leads (the erf GELU's measured best); the GELU
    templates lead with the ``fast_gelu`` twins, 256 x 192 staged (no spills with the exp2-polynomial GELU) where m
    allows, like the other GEMMs. A device with less shared memory gets the first staged set that fits it."""
    t = get_template(name)
    # small m: split-K first, or a 64 x 192 ping-pong set where the tiles fill less than a wave (test_wgmma_ragged_rows)
    space = [kn for kn in tile_knobs(t.knob_space(shape, "float16")) if "split_k" not in kn and not kn["pingpong"]]
    assert space[0] == dict(first, persistent=True, pingpong=False, staged=True)
    assert any("block_m" in kn for kn in space) == (t.gemm_dims(shape)[0] % 256 == 0)
    small = dataclasses.replace(H200, max_shared_bytes_per_block=100 * 1024)
    first_small = next(kn for kn in t.knob_space(shape, "float16", small) if "split_k" not in kn)
    assert first_small["staged"] and t.resources(shape, "float16", first_small)["shared_bytes"] <= 100 * 1024



def tile_knobs(space):
    """The knob sets without ``loads`` (how a set loads its tiles, tests/test_gemm_tma.py) and ``early_weights`` (when
    it loads its weights, tests/test_early_weights.py) and without the 128-row ping-pong twins
    (tests/test_gemm_tall_pingpong.py): what these tests order."""
    return [{key: v for key, v in kn.items() if key not in ("loads", "early_weights")} for kn in space
            if not (kn["pingpong"] and "block_m" in kn)]

def test_default_values_of_the_new_knobs_build_the_older_kernels():
    """``block_m = 128`` and ``staged = False`` written out build byte for byte the kernel of the knob set without them
    (prebuilt artifacts and tuning records keyed by the source stay valid)."""
    for knobs in ({"block_n": 256, "stages": 3, "persistent": True, "pingpong": False},
                  {"block_n": 128, "stages": 4, "persistent": True, "pingpong": True}):
        old = cuda_source(build_kernel("gemm_bias_gelu_erf_wgmma", SMALL_K, "float16", knobs))
        new = cuda_source(build_kernel("gemm_bias_gelu_erf_wgmma", SMALL_K, "float16",
                                       dict(knobs, block_m=128, staged=False, fast_gelu=False)))
        assert old == new


@pytest.mark.parametrize("knobs, grid, shared", [
    ({"block_n": 128, "stages": 4, "block_m": 256}, 4, 4 * 384 * 128),
    ({"block_n": 128, "stages": 2, "staged": True}, 8, 2 * 256 * 128 + 8 * 2048),
    ({"block_n": 128, "stages": 2, "block_m": 256, "staged": True, "persistent": False}, 4, 2 * 384 * 128 + 8 * 2048),
])
def test_new_knobs_launch_and_reserve_their_shared_memory(knobs, grid, shared):
    """256-row tiles halve the tiles (grid) and carry 256 + block_n rows per stage; the staged epilogue adds a 2 KiB
    buffer per consumer warp after the mbarriers."""
    t = get_template("gemm_wgmma")
    shape = {"m": 512, "n": 256, "k": 128}
    config, launches = _launches(t, shape, knobs)
    assert config.shared_bytes == shared + 16 * knobs["stages"] + 1024
    assert launches == [(str(grid), "384", str(config.shared_bytes))]
    res = t.resources(shape, "float16", dict(knobs, persistent=knobs.get("persistent", True), pingpong=False))
    assert res["grid"] == grid and res["block_m"] == knobs.get("block_m", 128)
    assert res["acc_registers"] == knobs.get("block_m", 128) // 128 * knobs["block_n"] // 2


@pytest.mark.parametrize("name, shape, knobs", [
    ("gemm_wgmma", SMALL_K, {"block_n": 256, "stages": 4, "persistent": True, "pingpong": False, "staged": True}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768},
     {"block_n": 128, "stages": 4, "persistent": True, "pingpong": False, "block_m": 256, "staged": True}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768},
     {"block_n": 192, "stages": 4, "persistent": True, "pingpong": False, "block_m": 256}),
    ("qkv_projection_wgmma", {"batch": 16, "seq": 2048, "heads": 12, "head_dim": 64},
     {"block_n": 128, "stages": 4, "persistent": True, "pingpong": True, "staged": True}),
])
def test_new_knob_kernels_compile_for_sm90a_without_spills(name, shape, knobs, tmp_path):
    """256-row tiles issue two m64 wgmma per k16 step per consumer; the staged epilogue stores 16 bytes per lane
    (``STG.E.128``, no 2-byte ``STG.E.U16``) after packing pairs into shared memory, with no local memory."""
    src = cuda_source(build_kernel(name, shape, "float16", knobs))
    body = _kernel_body(src)
    bn, tall = knobs["block_n"], knobs.get("block_m") == 256
    halves = 2 if tall or (knobs["pingpong"] and bn == 128) else 1
    assert body.count(f"_ss_mma_async_sync_aligned_m64n{bn}k16") == 4 * halves
    assert f"float acc_ptr[{halves * bn // 2}];" in body
    sass = clean_sm90a_sass(src, tmp_path)
    if knobs.get("staged"):
        for text in ("st.shared.b32", "ld.shared.v4.b32", "st.global.v4.b32", "cvt.rn.f16x2.f32", "bar.warp.sync"):
            assert text in src, text
        assert "STG.E.128" in sass and "LDS.128" in sass and "STG.E.U16" not in sass
    else:
        assert "STG.E.U16" in sass and "st.global.v4.b32" not in body


@pytest.mark.parametrize("knobs, message", [
    ({"block_n": 128, "stages": 3, "block_m": 192}, "block_m must be one of"),
    ({"block_n": 128, "stages": 3, "block_m": 256, "pingpong": True}, "128-row tiles at block_n 192 only"),
    ({"block_n": 128, "stages": 3, "staged": "yes"}, "staged must be a bool"),
    ({"block_n": 128, "stages": 3, "fast_gelu": True}, "fast_gelu needs staged=True"),
    ({"block_n": 128, "stages": 3, "staged": True, "fast_gelu": True}, "fast_gelu applies to the GELU"),
    ({"block_n": 128, "stages": 3, "staged": True, "fast_gelu": "yes"}, "fast_gelu must be a bool"),
])
def test_new_knobs_refuse_bad_values(knobs, message):
    with pytest.raises(ValueError, match=message):
        get_template("gemm_wgmma").kernel({"m": 384, "n": 256, "k": 64}, knobs=knobs)


def test_qkv_rows_in_a_partial_last_tile_store_only_the_real_rows():
    """ViT's 8 x 197 tokens: x has its 1576 rows (13 tiles of 128, the last partial: no padding by the caller), the
    kernel stores rows < 1576 only; a kernel whose heads claim more rows than it computes is refused."""
    from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig, wgmma_gemm_primfunc

    t = get_template("qkv_projection_wgmma")
    vit = {"batch": 8, "seq": 197, "heads": 12, "head_dim": 64}
    assert t.rows(vit) == 1576 and t.gemm_dims(vit) == (1576, 2304, 768)
    knobs = {"block_n": 128, "stages": 4, "persistent": False}
    padded = t.kernel(vit, "float16", knobs).script()
    whole = t.kernel(dict(vit, seq=208), "float16", knobs).script()          # 1664 rows, none padded
    assert "< 1576" in padded and "< 1576" not in whole
    with pytest.raises(ValueError, match="padded rows"):
        wgmma_gemm_primfunc(1536, 2304, 768, "float16", bias=True, act="none", config=WgmmaConfig(128, 4),
                            heads=(8, 197, 12, 64))


def test_staged_qkv_needs_head_dim_a_multiple_of_8():
    from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig, wgmma_gemm_primfunc

    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        wgmma_gemm_primfunc(256, 3 * 32 * 4, 32 * 4, "float16", bias=True, act="none", heads=(2, 128, 32, 4),
                            config=WgmmaConfig(block_n=128, stages=2, staged=True))


# ---- the exp2-polynomial GELU epilogue (knob fast_gelu; numerics: tests/test_fast_gelu.py) -----------------------

@pytest.mark.parametrize("name", ["gemm_bias_gelu_erf_wgmma", "gemm_bias_gelu_tanh_wgmma"])
def test_fast_gelu_twins_lead_the_gelu_spaces(name):
    """Every staged set of a GELU template has its ``fast_gelu`` twin, and the twins come first in the staged sets'
    order; 256 x 192 staged is offered to the erf GELU only as a fast twin (its ``erff`` form spilled)."""
    t = get_template(name)
    shape = {"m": 32768, "n": 3072, "k": 768}
    space = tile_knobs(t.knob_space(shape, "float16"))
    fast = [kn for kn in space if kn.get("fast_gelu")]
    staged = [kn for kn in space if kn.get("staged") and not kn.get("fast_gelu")]
    assert space[:len(fast)] == fast and all(kn["staged"] for kn in fast)
    assert all(kn.get("gelu_form") == ("tanh" if "tanh" in name else "half") for kn in fast)   # measured, see there
    bf16 = [kn for kn in tile_knobs(t.knob_space(shape, "bfloat16")) if kn.get("fast_gelu")]
    assert bf16 and all(kn.get("gelu_form") == ("tanh" if "tanh" in name else None) for kn in bf16)
    plain = [{k: v for k, v in kn.items() if k not in ("fast_gelu", "gelu_form")} for kn in fast]
    tall_192 = {"block_m": 256, "block_n": 192}
    erf_only_fast = [kn for kn in plain if "erf" in name and all(kn.get(k) == v for k, v in tall_192.items())]
    assert erf_only_fast or "erf" not in name
    assert [kn for kn in plain if kn not in erf_only_fast] == staged
    assert plain[0] == {"block_n": 192, "stages": 3, "persistent": True, "pingpong": False, "block_m": 256,
                        "staged": True}
    assert "fast_gelu" not in str(get_template("gemm_bias_relu_wgmma").knob_space(shape, "float16"))
    # the model charges CUDA's GELU its extra epilogue instructions (resource activation_ops): a fast twin ranks ahead
    # (the SMs' share: the whole prediction may be bound by L2 instead)
    from stof_tvm.cost_model.templates import price_knobs, template_work

    twin = dict(staged[0], fast_gelu=True)
    assert template_work(t, shape, "float16", twin).cuda_ops < template_work(t, shape, "float16", staged[0]).cuda_ops
    seconds = price_knobs(t, shape, "float16", [twin, staged[0]])
    assert seconds[0] <= seconds[1]
    assert t.resources(shape, "float16", staged[0])["activation_ops"] > 0 == t.resources(shape, "float16",
                                                                                         fast[0])["activation_ops"]


@pytest.mark.parametrize("name, knobs", [
    ("gemm_bias_gelu_erf_wgmma", {"block_n": 128, "stages": 4, "persistent": True, "pingpong": False}),
    ("gemm_bias_gelu_erf_wgmma", {"block_n": 192, "stages": 3, "persistent": True, "pingpong": False,
                                  "block_m": 256}),
    ("gemm_bias_gelu_tanh_wgmma", {"block_n": 128, "stages": 4, "persistent": True, "pingpong": True}),
])
def test_fast_gelu_kernels_compile_for_sm90a_without_spills(name, knobs, tmp_path):
    """The fast GELU: one ``ex2.approx.ftz.f32`` per output (MUFU.EX2 in the SASS), no ``erff``/``tanhf``, and
    fewer instructions than the same kernel with CUDA's GELU; no spills, no stack, no ptxas warning."""
    shape = {"m": 32768, "n": 3072, "k": 768}
    knobs = dict(knobs, staged=True, fast_gelu=True)
    src = cuda_source(build_kernel(name, shape, "float16", knobs))
    outputs = get_template(name).resources(shape, "float16", knobs)["acc_registers"]
    assert len(re.findall(r"tvm_builtin_ptx_ex2\w*\(", _kernel_body(src))) == outputs
    assert "erff(" not in src and "tanhf(" not in src
    sass = clean_sm90a_sass(src, tmp_path)
    assert len(re.findall(r"MUFU\.EX2", sass)) == outputs
