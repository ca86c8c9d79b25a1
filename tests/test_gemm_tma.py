"""TMA loads of the wgmma GEMM kernels (``loads="tma"``, schedules/templates/wgmma_kernel.py): the default of the
knob spaces since the H200 measured them faster (issue 17; tests/test_gemm_split_k.py checks where) and the older
kernels are unchanged; the host encodes A's and W's maps
(:func:`stof_tvm.schedules.tensor_maps.matrix_map`) from their first elements; the sm_90a builds issue TMA boxes
(UTMALDG) on transaction-count mbarriers, with no cp.async (LDGSTS) and no consumer proxy fence (MEMBAR), no spills;
and a whole tiny RoBERTa export compiled for CUDA with graphs and the knob forced on passes the maps to every GEMM
kernel inside the captured graph.

The kernels' numerics need an H200: ``scripts/bench_wgmma_small_k.py --plan s8tma``."""
from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import pytest

from stof_tvm.schedules.tensor_maps import matrix_map
from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import WgmmaKernelMixin, build_kernel
from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig

from hopper_checks import sm90a_sass

GEMMS = ["gemm_wgmma", "gemm_bias_wgmma", "gemm_bias_relu_wgmma", "gemm_bias_gelu_erf_wgmma",
         "gemm_bias_gelu_tanh_wgmma"]
QKV = {"batch": 3, "seq": 197, "heads": 4, "head_dim": 64}      # 591 rows in 5 row tiles: the stores are guarded


@pytest.mark.parametrize("name, shape", [(name, {"m": 4096, "n": 3072, "k": 768}) for name in GEMMS]
                         + [("qkv_projection_wgmma", {"batch": 16, "seq": 2048, "heads": 12, "head_dim": 64})])
def test_tma_is_the_default_loads(name, shape):
    """Measured faster on the H200: every knob set names its loads, and the compile path's default is TMA except for
    the QKV projection's 256-row cooperative tiles (cp.async measured faster there; at 32768 rows the 128 x 192
    ping-pong set, TMA, leads)."""
    t = get_template(name)
    space = t.knob_space(shape, "float16")
    assert space and all(kn["loads"] in ("tma", "cp.async") for kn in space)
    first = t.default_knobs(shape, "float16")
    tall_qkv = name == "qkv_projection_wgmma" and first.get("block_m") == 256 and not first["pingpong"]
    assert first["loads"] == ("cp.async" if tall_qkv else "tma")


def test_cp_async_written_out_builds_the_same_kernel():
    """``loads="cp.async"`` written out is the knob set without it, byte for byte (names, records and prebuilt
    cubins keyed by the source stay valid); ``tma`` changes it."""
    shape = {"m": 512, "n": 256, "k": 128}
    for knobs in ({"block_n": 128, "stages": 4, "persistent": True, "pingpong": True},
                  {"block_n": 256, "stages": 2, "persistent": False, "pingpong": False, "staged": True}):
        plain = cuda_source(build_kernel("gemm_bias_gelu_erf_wgmma", shape, "float16", knobs))
        assert plain == cuda_source(build_kernel("gemm_bias_gelu_erf_wgmma", shape, "float16",
                                                 dict(knobs, loads="cp.async")))
        tma = cuda_source(build_kernel("gemm_bias_gelu_erf_wgmma", shape, "float16", dict(knobs, loads="tma")))
        assert tma != plain


@pytest.mark.parametrize("loads", ["bulk", None, 1])
def test_bad_loads_values_are_refused(loads):
    with pytest.raises(ValueError, match="loads must be one of"):
        get_template("gemm_wgmma").kernel({"m": 384, "n": 256, "k": 64}, knobs={"block_n": 128, "stages": 3,
                                                                                "loads": loads})
    with pytest.raises(ValueError, match="loads must be one of"):
        WgmmaConfig(loads=loads).validate()


ENCODE = re.compile(r'T\.tensormap_encode_tiled\((\w+), T\.address_of\((\w+)\[0, 0\]\), ([\d, ]+), '
                    r'descriptor_dtype="(\w+)", rank=(\d), interleave=0, swizzle=(\d)')


def _encodes(func):
    """(map, operand, the integer operands, dtype, rank, swizzle) of each host-side encode in ``func``'s script."""
    return [(m[1], m[2], [int(x) for x in m[3].split(", ")], m[4], int(m[5]), int(m[6]))
            for m in ENCODE.finditer(func.script())]


@pytest.mark.parametrize("name, shape, knobs, gemm", [
    ("gemm_bias_wgmma", {"m": 1024, "n": 768, "k": 320}, {"block_n": 192, "stages": 3, "block_m": 256},
     (1024, 768, 320)),
    ("gemm_wgmma", {"m": 512, "n": 512, "k": 128}, {"block_n": 256, "stages": 4, "pingpong": True}, (512, 512, 128)),
    ("qkv_projection_wgmma", QKV, {"block_n": 128, "stages": 4, "staged": True}, (591, 768, 256)),
])
def test_host_encodes_the_a_and_w_maps(name, shape, knobs, gemm):
    """Two host-side encodes per kernel, from A's and W's first elements, with :func:`matrix_map`'s parameters: boxes
    of ``tile_m`` rows of A (256 for 256-row tiles, 64 for a 64 x 256 ping-pong tile) from a map of its real rows
    (the QKV projection's 591: the box past them reads zeros) and ``block_n`` rows of W, 64 columns each."""
    m, n, k = gemm
    dtype = "bfloat16" if name == "gemm_wgmma" else "float16"
    knobs = dict(knobs, loads="tma")
    func = get_template(name).kernel(shape, dtype, knobs)
    tile_m = WgmmaConfig(**knobs).tile_m
    expected = [("a_map", "A", matrix_map(m, k, tile_m, dtype)),
                ("w_map", "W", matrix_map(n, k, knobs["block_n"], dtype))]
    calls = _encodes(func)
    assert [(c[0], c[1]) for c in calls] == [(e[0], e[1]) for e in expected]
    for (_, _, numbers, map_dtype, rank, swizzle), (_, _, params) in zip(calls, expected):
        assert numbers == [*params.dims, *params.strides, *params.box, *params.element_strides]
        assert (map_dtype, rank, swizzle) == (dtype, 2, params.swizzle)
    assert _encodes(get_template(name).kernel(shape, dtype, dict(knobs, loads="cp.async"))) == []


def _kernel_body(src: str) -> str:
    return src[src.index('extern "C" __global__'):]


@pytest.mark.parametrize("name, shape, knobs", [
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 3072, "k": 768},
     {"block_n": 128, "stages": 4, "persistent": True, "pingpong": False, "staged": True, "fast_gelu": True}),
    ("gemm_wgmma", {"m": 4096, "n": 768, "k": 3072},
     {"block_n": 192, "stages": 3, "persistent": True, "pingpong": False, "block_m": 256, "staged": True}),
    ("gemm_bias_wgmma", {"m": 1024, "n": 512, "k": 256}, {"block_n": 256, "stages": 4, "persistent": True,
                                                           "pingpong": True}),
    ("qkv_projection_wgmma", QKV, {"block_n": 128, "stages": 4, "persistent": False, "pingpong": False,
                                   "staged": True}),
])
def test_tma_kernel_compiles_for_sm90a_with_tma_and_no_proxy_fence(name, shape, knobs, tmp_path):
    """The maps are ``__grid_constant__`` parameters (declaration and definition: 2 x 2); one producer thread
    issues an ``expect_tx`` and two 2-D boxes per slot, full barriers expect 1 arrival; no 16-byte cp.async and no
    ``fence.proxy.async`` remain (SASS: UTMALDG, no LDGSTS, no MEMBAR); no spills, no stack, no ptxas warning."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    knobs = dict(knobs, loads="tma")
    config = WgmmaConfig(**knobs)
    src = cuda_source(build_kernel(name, shape, "float16", knobs))
    body = _kernel_body(src)
    assert src.count("const __grid_constant__ CUtensorMap") == 2 * 2
    for text in ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
                 "mbarrier.arrive.expect_tx.shared::cta.b64", "prefetch.tensormap"):
        assert text in src, text
    for text in ("cp.async.cg", "cp.async.mbarrier.arrive", "fence.proxy.async"):
        assert text not in src, text
    inits = re.findall(r"mbarrier_init_init_shared__cta_b64\(.*?, \(uint\)(\d+)\);", body)
    empty = "128" if knobs.get("pingpong") else "256"
    assert inits == ["1", empty] * knobs["stages"]                           # (full, empty) per slot
    assert f"(uint){config.stage_bytes})" in body                            # the slot's bytes, announced
    sass = sm90a_sass(src, tmp_path, any_warning=True)
    if sass is None:
        return
    assert re.search(rf"HGMMA\.64x{knobs['block_n']}x16\.F32", sass)
    assert "UTMALDG.2D" in sass
    assert not re.search(r"\b(LDGSTS|MEMBAR|LDL|STL)\b", sass)


def test_tiny_roberta_with_tma_gemms_builds_for_cuda_graphs(hf_export, monkeypatch, tmp_path):
    """The compile path with the knob forced on (``TemplateChooser._wgmma`` adds ``loads="tma"`` to every wgmma
    GEMM's knobs): a tiny HF RoBERTa at 48 x 256 tokens (12288 rows: every GEMM on wgmma, the FFN unfused) for CUDA
    with graphs. Each GEMM kernel takes the A and W maps as ``__grid_constant__`` parameters instead of the
    pointers, every GEMM launch is inside the one captured graph (the graph keeps the map bytes it captured with
    the static buffers it captured), the weights arrive as parameters from ``main_transform_params``, and the host
    library calls the runtime's ``cuTensorMapEncodeTiled``."""
    from stof_tvm.compiler import front_end, lower
    from stof_tvm.compiler import template_choice as tc
    from stof_tvm.compiler.cubins import cuda_sources
    from stof_tvm.compiler.kernel_grids import kernel_grids
    from stof_tvm.vm_census import vm_census

    path = hf_export("roberta", "eager", "torchscript", 17, True, 2, 64)
    chosen = tc.TemplateChooser._wgmma

    def with_tma(self, template, shape, dtype):
        choice = chosen(self, template, shape, dtype)
        if isinstance(template, WgmmaKernelMixin):
            return tc.KnobChoice(dict(choice.knobs, loads="tma"), choice.source, choice.seconds)
        return choice

    monkeypatch.setattr(tc.TemplateChooser, "_wgmma", with_tma)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        front = front_end(path, mask="bigbird", batch=48, seq_len=256, target="cuda", dtype="float16", gemm="wgmma")
    stages = [stage for site in front.template_entry["sites"] for stage in site["stages"]]
    wgmma = {stage["template"] for stage in stages if stage["template"].endswith("_wgmma")}
    assert wgmma == {"qkv_projection_wgmma", "gemm_wgmma", "gemm_bias_gelu_erf_wgmma"}
    assert all(stage["knobs"]["loads"] == "tma" for stage in stages if stage["template"] in wgmma)
    optimized, executable = lower(front, None, cuda_graph=True)
    (src,) = cuda_sources(executable)
    kernels = dict(re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', src))
    gemms = {name: params for name, params in kernels.items() if "wgmma" in name and "attention" not in name}
    assert len(gemms) == 4                   # QKV, attention output (k 128), FFN up + GELU, FFN down (k 256)
    for name, params in gemms.items():
        assert params.count("const __grid_constant__ CUtensorMap") == 2, (name, params)
        assert re.search(r"CUtensorMap a_map\b", params) and re.search(r"CUtensorMap w_map\b", params)
    grids = kernel_grids(optimized)
    census = vm_census(executable.as_python(), {name: max(1, len(k)) for name, k in grids.items()})
    assert census.graph_launches == 1, census.table()
    assert not [name for name in census.outside if "wgmma" in name], census.outside
    calls = census.per_function()
    assert sum(n for name, n in calls.items() if "_wgmma_" in name and "attention" not in name) == 4 * 2, calls
    library = Path(tmp_path / "model.so")
    executable.export_library(str(library))
    assert b"runtime.cuTensorMapEncodeTiled" in library.read_bytes()


def _bench_module():
    """``scripts/bench_wgmma_small_k.py`` imported as a module (its own imports from scripts/ resolved)."""
    import importlib.util
    import sys

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location("bench_wgmma_small_k", scripts / "bench_wgmma_small_k.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(scripts))
    return bench


def test_gpu_plan_pairs_each_knob_set_with_both_loads():
    """``scripts/bench_wgmma_small_k.py --plan s8tma`` times, per RoBERTa-base GEMM, the compile path's first knob
    set and one more tile shape, each with cp.async and with TMA loads (the pairs its last table compares)."""
    bench = _bench_module()
    assert len(bench.TMA_CASES) == 8
    for name, shape in bench.TMA_CASES:
        space = get_template(name).knob_space(shape, "float16")
        sets = bench.tma_knob_sets(space)
        assert [kn["loads"] for kn in sets] == ["cp.async", "tma"] * (len(sets) // 2) and len(sets) == 4
        assert {key: v for key, v in sets[0].items() if key != "loads"} == {
            key: v for key, v in space[0].items() if key != "loads"}
        assert sets[0] != sets[2] and all(bench.is_new(kn) == (kn["loads"] == "tma") for kn in sets)
        tags = [bench.knob_tag(kn) for kn in sets]
        assert len(set(tags)) == 4 and tags[1] == tags[0].replace("_cpasync", "_tma")


def test_big_gpu_plan_times_the_default_first_then_each_candidate_once():
    """``--plan s11big``: per case the knob space's first set (the compile path's pick) and then its candidates, each
    once and valid for the shape (split-K ones cooperative, one tile a block); 32768-row QKV, ViT's FFN down."""
    from stof_tvm.schedules.templates.wgmma_kernel import check_wgmma_shape

    bench = _bench_module()
    cases = {bench.gemm_dims(name, shape): (name, shape) for name, shape in bench.BIG_CASES}
    assert set(cases) == set(bench.BIG_CANDIDATES) and len(cases) == 8
    for dims in ((32768, 2304, 768), (1576, 768, 3072)):
        name, shape = cases[dims]
        template = get_template(name)
        space = template.knob_space(shape, "float16")
        sets = bench.big_knob_sets(name, space, bench.BIG_CANDIDATES[dims])
        tags = [bench.knob_tag(kn) for kn in sets]
        assert sets[0] == space[0] and len(set(tags)) == len(sets) >= len(bench.BIG_CANDIDATES[dims])
        for knobs in sets:
            config = template.config(knobs)
            check_wgmma_shape(*dims, config)
            assert config.staged != (config.split_k > 1) and config.persistent == (config.split_k == 1)
    assert "n192_s4_k2_cpasync" in tags and "n192_s4_k2_cpasync" not in map(bench.knob_tag, space)
