"""The wgmma GEMM + bias + residual + LayerNorm template (``gemm_bias_residual_layernorm_wgmma``): knobs and
resources, the cluster launch (one cluster of ``n / block_n`` blocks per 128-row tile), the definition on llvm, the
CUDA kernel through nvcc for sm_90a (HGMMA, no spills), and where the compile path takes it.

The kernel's numerics need an H200: ``scripts/check_wgmma_gpu.py --suite norm``."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from stof_tvm.schedules.templates import H200, cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel, norm_widths
from stof_tvm.schedules.templates.wgmma_kernel import NORM_STATS_BYTES, WgmmaConfig

from hopper_checks import clean_sm90a_sass

NAME = "gemm_bias_residual_layernorm_wgmma"


@pytest.mark.parametrize("n, widths", [(768, [128, 192, 256]), (1024, [128, 256]), (256, [128]), (128, []),
                                       (4096, [256])])
def test_a_row_spans_two_to_sixteen_blocks(n, widths):
    assert norm_widths(n) == widths


@pytest.mark.parametrize("shape", [{"m": 4096, "n": 768, "k": 3072}, {"m": 1576, "n": 768, "k": 768},
                                   {"m": 128, "n": 1024, "k": 4096}])
def test_every_knob_set_is_one_cooperative_tile_per_block_in_row_clusters(shape):
    t = get_template(NAME)
    space = t.knob_space(shape)
    # the widest tile where it fills half the SMs (fewer blocks a cluster), else the narrowest (more blocks)
    assert space[0]["block_n"] == (256 if shape["m"] >= 4096 else 128)
    assert space[0]["staged"] and space[0]["loads"] == "tma" and space[0]["stages"] == 4
    for knobs in space:
        assert not knobs["persistent"] and not knobs["pingpong"]
        res = t.resources(shape, "float16", knobs)
        tiles = -(-shape["m"] // 128)
        assert res["grid"] == tiles * shape["n"] // knobs["block_n"]
        assert res["shared_bytes"] <= H200.max_shared_bytes_per_block
        plain = WgmmaConfig(**{key: knobs[key] for key in ("block_n", "stages", "persistent", "pingpong", "staged",
                                                           "loads")})
        # the row partials, then bias, gamma and beta of the block's columns in float32
        assert res["shared_bytes"] == plain.shared_bytes + NORM_STATS_BYTES + 3 * knobs["block_n"] * 4


def test_shapes_and_configurations_it_refuses():
    t = get_template(NAME)
    with pytest.raises(ValueError, match="2 to 16 blocks"):
        t.knob_space({"m": 4096, "n": 128, "k": 768})
    with pytest.raises(ValueError, match="multiple of 64"):
        t.knob_space({"m": 4096, "n": 768, "k": 776})
    with pytest.raises(ValueError, match="norm_rows is one cooperative"):
        WgmmaConfig(block_n=192, persistent=True, norm_rows=True).validate()
    with pytest.raises(ValueError, match="norm_rows is one cooperative"):
        WgmmaConfig(block_n=192, persistent=False, split_k=2, norm_rows=True).validate()


def test_definition_on_llvm_matches_the_float64_reference():
    """The knob-free definition (the CPU path and the tuner's reference) against :meth:`reference`, with a model's
    own epsilon."""
    t = get_template(NAME)
    shape = {"m": 64, "n": 256, "k": 128}
    rng = np.random.default_rng(3)
    args = t.arguments(shape)
    inputs = {name: (rng.standard_normal(s) * (0.1 if name == "W" else 1.0)).astype(dt) for name, s, dt in args[:-1]}
    func = t.primfunc(shape, "float16", eps=1e-12)
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(args[-1][1], "float16"))
    lib["main"](*[tvm.runtime.tensor(inputs[name]) for name, _, _ in args[:-1]], out)
    ref = t.reference(shape, inputs)[0]
    err = np.linalg.norm(out.numpy().astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err < 2e-3


def _kernel_source(shape, knobs, eps=None, name=NAME):
    options = {} if eps is None else {"eps": eps}
    kernel = get_template(name).kernel(shape, "float16", knobs, **options)
    return cuda_source(tvm.compile(tvm.IRModule({"main": kernel}),
                                   target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a",
                                                             "max_threads_per_block": 1024,
                                                             "max_shared_memory_per_block": 232448})))


@pytest.mark.parametrize("shape, index", [({"m": 4096, "n": 768, "k": 768}, 0),
                                          ({"m": 1576, "n": 768, "k": 3072}, 0),      # a partial last row tile
                                          ({"m": 4096, "n": 1024, "k": 1024}, 0)])
def test_kernel_builds_for_sm90a_without_spills(shape, index, tmp_path):
    """ptxas: HGMMA, no stack frame, no spills, no local memory (the accumulators never live where the producer's
    40 registers would have to hold them); the cluster's row partials are read through mapa + ld.shared::cluster."""
    import shutil

    from stof_tvm.schedules.templates.gemm_wgmma import nvcc_cubin

    knobs = get_template(NAME).knob_space(shape)[index]
    src = _kernel_source(shape, knobs, eps=1e-12)
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    report = nvcc_cubin(src, tmp_path / "norm.cubin")
    assert (report["stack_frame"], report["spill_stores"], report["spill_loads"], report["warnings"]) == (0, 0, 0, [])
    assert src.count("barrier_cluster_arrive_cluster_arrive_release();") >= 6   # three in each warpgroup's branch
    assert "mapa.shared::cluster" in src and "ld.shared::cluster.f32" in src
    assert "/*1.000000e-12*/));" in src                       # the model's epsilon, not the default 1e-5
    if shutil.which("cuobjdump"):
        clean_sm90a_sass(src, tmp_path)


def test_launch_is_one_cluster_per_row_tile():
    """The host launches ``row tiles x n / block_n`` blocks, ``n / block_n`` of them one cluster."""
    from stof_tvm.schedules.templates.build import cuda_target

    shape = {"m": 4096, "n": 768, "k": 768}
    knobs = get_template(NAME).knob_space(shape)[0]
    mod = tvm.IRModule({"main": get_template(NAME).kernel(shape, "float16", knobs)})
    target = tvm.target.Target(cuda_target("sm_90a"))
    with target:
        lowered = tvm.tirx.get_tir_pipeline("default")[0](tvm.tirx.transform.BindTarget(target)(mod))
    script = lowered.script()
    call = re.search(r'call_ffi_kernel\("gemm_wgmma_kernel", [^\n]*', script).group(0)
    cluster = 768 // knobs["block_n"]
    assert f", {32 * cluster}, {cluster}, 384, " in call     # 32 row tiles x the cluster's blocks; the cluster; threads


@pytest.mark.parametrize("batch, seq, fused", [(8, 512, True), (1, 128, False)])
def test_hopper_compile_path_fuses_post_ln_chains_that_fill_the_gpu(batch, seq, fused):
    """gemm="wgmma" (sm_90a) with ``norm_fusion=True``: BERT-Base's attention-output and FFN-down LayerNorm chains
    become one fused wgmma call each at 8 x 512 tokens (128 blocks), and stay a GEMM + LayerNorm pair at 1 x 128 (4
    blocks: split-K GEMMs fill the GPU there); the default (``norm_fusion`` off, measured faster) keeps the pair."""
    import stof_tvm.compiler
    from stof_tvm.models import BertConfig, make_bert

    model = make_bert(BertConfig(hidden=768, layers=1, heads=12, ffn=3072, vocab=1000), batch=batch, seq_len=seq)
    for norm_fusion in (True, False):
        options = {"norm_fusion": True} if norm_fusion else {}
        front = stof_tvm.compiler.front_end(model, mask="bigbird", batch=batch, seq_len=seq, target="cuda",
                                            dtype="float16", gemm="wgmma", schedule=False, **options)
        calls = front.template_entry["calls"]
        expect = fused and norm_fusion
        assert calls.get(NAME, 0) == (2 if expect else 0), calls
        assert calls.get("bias_residual_layernorm", 0) == (0 if expect else 2), calls


def test_keep_sum_twin_stores_the_sum_first_and_matches_the_reference_on_llvm():
    """``gemm_bias_residual_sum_layernorm_wgmma`` (pre-LN models): outputs (sum, LayerNorm of it), the sum rounded
    once; its definition against the float64 reference on llvm."""
    t = get_template("gemm_bias_residual_sum_layernorm_wgmma")
    shape = {"m": 64, "n": 256, "k": 128}
    args = t.arguments(shape)
    assert [name for name, _, _ in args[-2:]] == ["sum", "out"] and t.outputs() == 2
    rng = np.random.default_rng(5)
    inputs = {name: (rng.standard_normal(s) * (0.1 if name == "W" else 1.0)).astype(dt) for name, s, dt in args[:-2]}
    lib = tvm.compile(tvm.IRModule({"main": t.primfunc(shape, "float16")}), target="llvm")
    outs = [tvm.runtime.tensor(np.zeros(s, "float16")) for _, s, _ in args[-2:]]
    lib["main"](*[tvm.runtime.tensor(inputs[name]) for name, _, _ in args[:-2]], *outs)
    for got, ref in zip(outs, t.reference(shape, inputs)):
        assert np.linalg.norm(got.numpy().astype(np.float64) - ref) / np.linalg.norm(ref) < 2e-3
    gemm = {"m": 4096, "n": 768, "k": 768}
    knobs = t.knob_space(gemm)[0]
    # calls of the 16-byte store helper (its definition is one more occurrence): the sum's, then the LayerNorm's
    stores = [_kernel_source(gemm, knobs, name=name).count("tvm_builtin_ptx_st_vec_global_v4_b32(") - 1
              for name in (NAME, t.name)]
    assert stores[0] > 0 and stores[1] == 2 * stores[0]


def test_hopper_compile_path_fuses_gpt2_pre_ln_sums_with_their_linear(hf_export):
    """GPT-2 (pre-LN; one layer of GPT-2's widths, exported with dynamic axes) at 8 x 512 on sm_90a: a residual sum
    that a LayerNorm and the next residual add both read is made with its LayerNorm by the fused sum + LayerNorm
    template from its linear; with ``norm_fusion=False`` the linear + residual_layernorm pair comes back."""
    import warnings

    import stof_tvm.compiler

    path = hf_export("gpt2", "eager", "torchscript", 17, True, 2, 64, size="tiny-w768")
    counts = {}
    for norm_fusion in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            front = stof_tvm.compiler.front_end(path, mask="bigbird", batch=8, seq_len=512, target="cuda",
                                                dtype="float16", gemm="wgmma", schedule=False, norm_fusion=norm_fusion)
        counts[norm_fusion] = front.template_entry["calls"]
    fused, unfused = counts[True], counts[False]
    # one layer: the attention output's sum feeds ln_2 and the FFN's residual (the sum kept); the FFN down's only
    # ln_f (a post-LN-like chain, nothing kept)
    assert fused.get("gemm_bias_residual_sum_layernorm_wgmma") == 1 and fused.get(NAME) == 1, fused
    assert "residual_layernorm" not in fused and "bias_residual_layernorm" not in fused, fused
    assert unfused.get("residual_layernorm") == 1 and unfused.get("bias_residual_layernorm") == 1, unfused
    assert NAME not in unfused and "gemm_bias_residual_sum_layernorm_wgmma" not in unfused, unfused
