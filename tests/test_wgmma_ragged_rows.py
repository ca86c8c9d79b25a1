"""wgmma GEMMs whose m is not a multiple of their row tile (ViT's 197 tokens a sequence; issue 17): the last row tile
is partial, its rows past m loaded as zeros (TMA: A's map has m rows; cp.async: 0 bytes read from a row clamped to
m - 1) and never stored, so the compile path sends such GEMMs to wgmma with no pad before them and no slice after.
Kernels build for sm_90a without spills, whole tiles build the older kernels, the definitions match numpy on llvm,
and a ViT export's GEMMs take their rows as they are. Numerics of the kernels need an H200:
``scripts/bench_wgmma_small_k.py --plan s10ragged``."""
from __future__ import annotations

import numpy as np
import pytest
import tvm

from stof_tvm.compiler import front_end, linear_match
from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel
from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig, row_tiles, wgmma_gemm_primfunc

from hopper_checks import sm90a_sass


def _script(m, knobs, heads=None):
    n = 3 * heads[2] * heads[3] if heads else 256
    return wgmma_gemm_primfunc(m, n, 128 if heads is None else heads[2] * heads[3], "float16", bias=heads is not None,
                               act="none", config=WgmmaConfig(**knobs), heads=heads).script()


@pytest.mark.parametrize("knobs", [{"block_n": 128, "stages": 2, "loads": "tma"},
                                   {"block_n": 128, "stages": 2, "persistent": False, "split_k": 2},
                                   {"block_n": 128, "stages": 2, "staged": True}])
def test_a_partial_row_tile_is_computed_whole_and_stored_up_to_m(knobs):
    """m = 200: two 128-row tiles, the stores guarded by row < 200 (direct, staged and split-K epilogues); cp.async
    reads 0 bytes past the last row, TMA relies on its map's 200 rows; m = 256 builds no guard at all."""
    ragged, whole = _script(200, knobs), _script(256, knobs)
    assert "< 200" in ragged and "< 256" not in whole and "T.min(" not in whole
    assert ("T.Select(" in ragged and "T.min(" in ragged) == (knobs.get("loads") != "tma")
    assert row_tiles(200, 128) == 2 == row_tiles(256, 128)


VIT = {"heads": 12, "head_dim": 64, "seq": 197}


@pytest.mark.parametrize("name, shape", [
    ("gemm_wgmma", {"m": 197, "n": 768, "k": 768}),                   # split-K, cp.async
    ("qkv_projection_wgmma", dict(VIT, batch=1)),                     # split-K, the heads layout
    ("qkv_projection_wgmma", dict(VIT, batch=32)),                    # 6304 rows: 128 x 192 staged, TMA
    ("gemm_bias_gelu_erf_wgmma", {"m": 6304, "n": 3072, "k": 768}),   # 128 x 192 ping-pong, fast_gelu
])
def test_ragged_default_kernels_build_for_sm90a_without_spills(name, shape, tmp_path):
    """ViT-Base's GEMMs at 1 x 197 and 32 x 197 tokens, each template's first knob set."""
    src = cuda_source(build_kernel(name, shape, "float16"))
    sm90a_sass(src, tmp_path)


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_guarded_qkv_stores_leave_out_the_192_accumulator_staged_sets(batch):
    """256 x 192 cooperative and 128 x 192 ping-pong staged spilled 56 bytes with the QKV projection's guarded
    head-major stores (batch * 197 rows): not in its space there; at 8 x 512 (no guard) the ping-pong set leads."""
    t = get_template("qkv_projection_wgmma")
    for kn in t.knob_space(dict(VIT, batch=batch), "float16"):
        config = t.config(kn)
        assert not (config.staged and config.acc_registers >= 192), kn
    first = t.knob_space(dict(VIT, batch=8, seq=512), "float16")[0]
    assert first["pingpong"] and first["block_m"] == 256 and first["block_n"] == 192


def test_the_definition_takes_any_m_on_llvm():
    """The knob-free definition (the kernel's CPU reference) at m = 40 against numpy float64."""
    t = get_template("gemm_bias_wgmma")
    shape = {"m": 40, "n": 128, "k": 64}
    rng = np.random.default_rng(0)
    a = rng.standard_normal((40, 64)).astype("float16")
    w = (rng.standard_normal((128, 64)) / 8).astype("float16")
    bias = rng.standard_normal(128).astype("float16")
    lib = tvm.compile(tvm.IRModule({"main": t.primfunc(shape, "float16")}), target="llvm")
    out = tvm.runtime.empty((40, 128), "float16", tvm.cpu())
    lib["main"](*(tvm.runtime.tensor(x) for x in (a, w, bias)), out)
    ref = a.astype(np.float64) @ w.astype(np.float64).T + bias
    np.testing.assert_allclose(out.numpy().astype(np.float64), ref, rtol=2e-2, atol=2e-2)


def test_wgmma_takes_the_rows_as_they_are():
    """No padding where the GEMM goes to wgmma (its tiles or split-K blocks enough: ViT-Base at 1 x 197 is 2 row
    tiles, split-K); mma.sync's 16-row padding where it does not."""
    assert linear_match.padded_rows(197, 2304, 768, "wgmma") == 197
    assert linear_match.padded_rows(197, 768, 128, "wgmma") == 208      # 12 tiles, 2 k steps: mma.sync
    assert linear_match.wgmma_misfit(197, 768, 768) is None


def test_a_vit_export_runs_its_gemms_without_padding(hf_export):
    """The tiny ViT (65 tokens) at batch 63: 4095 rows. Every GEMM on wgmma has no 'rows padded' note (no pad before
    it, no slice after it), and its template shape has the 4095 rows; those on mma.sync are padded to 4096. The patch
    embedding (canonical.layout.PatchEmbedding) runs on the 63 x 64 patch rows, a multiple of 16 either way."""
    path = hf_export("vit", "eager", "torchscript", 17, True)
    front = front_end(path, mask="bigbird", batch=63, seq_len=64, target="cuda", dtype="float16", schedule=False)
    sites = [site for site in front.template_entry["sites"] if site["chain"] in ("qkv", "linear", "linear_gelu",
                                                                                  "attn_out_ln", "ffn_out_ln")]
    patches = [site for site in sites if site["stages"][0]["shape"].get("m") == 63 * 64]
    assert len(patches) == 1 and "rows padded" not in patches[0].get("note", ""), patches
    sites = [site for site in sites if site not in patches]
    on_wgmma = [site for site in sites if any(st["template"].endswith("_wgmma") for st in site["stages"])]
    assert on_wgmma, sites
    for site in sites:
        wgmma = site in on_wgmma
        assert ("rows padded" in site.get("note", "")) == (not wgmma), site
        for stage in site["stages"]:
            rows = stage["shape"].get("m", stage["shape"].get("batch", 0) * stage["shape"].get("seq", 0))
            if stage["template"].endswith("_wgmma"):
                assert rows == 63 * 65, stage


@pytest.mark.parametrize("name, shape, lead", [
    ("gemm_bias_wgmma", {"m": 1576, "n": 768, "k": 3072}, True),    # ViT-Base 8 x 197: 0.0150 ms against 0.0193
    ("gemm_bias_wgmma", {"m": 1576, "n": 768, "k": 768}, True),     # its attention output: 0.0067 against 0.0075
    ("gemm_bias_wgmma", {"m": 6304, "n": 768, "k": 3072}, False),   # whole waves: 128 x 192 ping-pong keeps the lead
    ("gemm_bias_wgmma", {"m": 4096, "n": 768, "k": 3072}, False),   # 128 tiles of 128 x 192: 64-row ones, as many
    ("gemm_bias_wgmma", {"m": 1576, "n": 3072, "k": 768}, False),   # 208 tiles: more than one wave
    ("gemm_bias_gelu_erf_wgmma", {"m": 512, "n": 3072, "k": 768}, False),   # GELU: 0.0091 against 0.0084 (s11large)
])
def test_64_row_pingpong_tiles_lead_where_the_first_set_fills_less_than_a_wave(name, shape, lead):
    """The staged 64 x 192 ping-pong set leads a template without GELU where the first set's tiles leave SMs idle and
    its own leave the busiest SM fewer outputs; the set it displaces follows it."""
    space = get_template(name).knob_space(shape, "float16")
    first = space[0]
    assert (first["pingpong"] and first["block_n"] == 192 and "block_m" not in first) == lead
    if lead:
        assert first["staged"] and first["stages"] == 4 and first["loads"] == "tma" and space.count(first) == 1
        assert (space[1]["block_n"], space[1]["pingpong"]) == (128, False)


@pytest.mark.parametrize("name, shape, lead", [
    # ViT-Base 8 x 197: 117 tiles of 128 x 256 in one wave against 234 of 128 x 128, the same work on the busiest SM
    ("qkv_projection_wgmma", {"batch": 8, "seq": 197, "heads": 12, "head_dim": 64}, True),
    ("qkv_projection_wgmma", {"batch": 16, "seq": 197, "heads": 12, "head_dim": 64}, False),   # 225: two waves
    ("qkv_projection_wgmma", {"batch": 4, "seq": 197, "heads": 12, "head_dim": 64}, False),    # 126 tiles: one wave
    ("qkv_projection_wgmma", {"batch": 1, "seq": 128, "heads": 12, "head_dim": 64}, False),    # split-K
    # BERT-large 8 x 512: attention output and FFN down, 128 tiles against 256
    ("gemm_wgmma", {"m": 4096, "n": 1024, "k": 1024}, True),
    ("gemm_wgmma", {"m": 4096, "n": 1024, "k": 4096}, True),
    ("gemm_wgmma", {"m": 4096, "n": 768, "k": 3072}, False),        # 96 tiles, but 128 x 192 ping-pong does less
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 1024, "k": 1024}, False),   # GELU: not measured in it
])
def test_one_wave_of_256_wide_tiles_leads_where_they_do_the_same_work(name, shape, lead):
    """The staged 128 x 256 set with 3 stages, one block per tile, leads a template without GELU where the first set's
    tiles need more than one wave of the SMs and the 256-wide ones fit one, the busiest SM computing no more outputs;
    the set it displaces follows it."""
    space = get_template(name).knob_space(shape, "float16")
    first = space[0]
    assert (first["block_n"], first["stages"], first["persistent"]) == (256, 3, False) if lead else (
        (first["block_n"], first["stages"], first["persistent"]) != (256, 3, False))
    if lead:
        assert first["staged"] and first["loads"] == "tma" and "block_m" not in first and space.count(first) == 1
        assert (space[1]["block_n"], space[1]["stages"], space[1]["persistent"]) == (128, 4, True)
