"""The 128 x 192 ping-pong tiles of the wgmma GEMM kernels (``pingpong`` with ``block_m = 256``: two 128-row tiles in
flight, one per consumer warpgroup; schedules/templates/wgmma_kernel.py), measured on the H200 in session 10
(``scripts/bench_wgmma_small_k.py --plan s10gemm``: every check ok, graph replays): they lead the knob space where
the H200 measured them fastest (the QKV projection and the GELU GEMM at 4096 rows) or as fast; and the persistent
walk over the tiles covers every tile once."""
from __future__ import annotations

import pytest

from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel
from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig, grid_blocks, tile_origin

from hopper_checks import sm90a_sass

FFN_DOWN = {"m": 4096, "n": 768, "k": 3072}
SM_COUNT = 132


@pytest.mark.parametrize("m, n, block_m, block_n, persistent", [
    (4096, 768, 128, 192, False), (4096, 768, 128, 192, True), (4096, 3072, 256, 192, True),
    (4096, 2304, 128, 128, True), (32768, 3072, 256, 192, True), (512, 768, 128, 128, True)])
def test_the_walk_covers_every_tile_once(m, n, block_m, block_n, persistent):
    """Block bx's round r computes tile bx + r * grid while below the tile count: every output tile exactly once."""
    config = WgmmaConfig(block_n=block_n, stages=4, persistent=persistent, block_m=block_m, loads="tma")
    grid_n = n // block_n
    tiles = (m // config.tile_m) * grid_n
    grid = grid_blocks(config, tiles, SM_COUNT)
    origins = [tile_origin(bx + r * grid, grid_n, config.tile_m, block_n)
               for bx in range(grid) for r in range(-(-tiles // grid)) if bx + r * grid < tiles]
    assert sorted(origins) == sorted((row, col) for row in range(0, m, block_m) for col in range(0, n, block_n))


# ---- 128-row ping-pong tiles at width 192 (block_m = 256 with pingpong: two tiles in flight, one per consumer) ----

def test_tall_pingpong_gives_each_consumer_128_row_tiles_at_width_192_only():
    config = WgmmaConfig(block_n=192, stages=4, pingpong=True, block_m=256, staged=True)
    config.validate()
    assert config.tile_m == config.consumer_rows == 128 and config.acc_registers == 192
    assert WgmmaConfig(block_n=192, stages=4, pingpong=True).tile_m == 64          # the older 64-row tiles
    for block_n in (128, 256):
        with pytest.raises(ValueError, match="128-row tiles at block_n 192 only"):
            WgmmaConfig(block_n=block_n, stages=4, pingpong=True, block_m=256).validate()


@pytest.mark.parametrize("name, shape", [("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768}),
                                         ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 12,
                                                                   "head_dim": 64}),
                                         ("gemm_wgmma", FFN_DOWN)])
def test_the_knob_space_offers_tall_pingpong_twins_of_the_staged_192_wide_sets(name, shape):
    """The twins close the space (but the one that may lead it), staged only (TMA loads, the QKV projection's too:
    128-row tiles), and for the erf GELU only with ``fast_gelu`` (its ``erff`` form spilled); the model hides their
    epilogues but the last."""
    t = get_template(name)
    space = t.knob_space(shape, "float16")
    tall = [kn for kn in space[1:] if kn["pingpong"] and kn.get("block_m") == 256]
    assert tall and space[-len(tall):] == tall
    for kn in tall + space[:1]:
        if not (kn["pingpong"] and kn.get("block_m") == 256):
            continue   # the first set where no ping-pong set leads
        assert kn["block_n"] == 192 and kn["staged"] and kn["loads"] == "tma"
        assert kn.get("fast_gelu") == ("gelu" in name or None)
        res = t.resources(shape, "float16", kn)
        assert res["block_m"] == 128 and res["overlapped_epilogue"] and res["acc_registers"] == 192


@pytest.mark.parametrize("name, shape, knobs", [
    ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768},
     {"block_n": 192, "stages": 4, "persistent": True, "pingpong": True, "block_m": 256, "staged": True,
      "fast_gelu": True, "loads": "tma"}),
    ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64},
     {"block_n": 192, "stages": 4, "persistent": True, "pingpong": True, "block_m": 256, "staged": True,
      "loads": "tma"}),
])
def test_tall_pingpong_kernels_build_for_sm90a_without_spills(name, shape, knobs, tmp_path):
    """Two m64n192 wgmma per k16 step per consumer (192 accumulators), the ping-pong order barriers, the staged
    epilogue; ptxas: no spills, no stack, no wgmma serialisation."""
    src = cuda_source(build_kernel(name, shape, "float16", knobs))
    assert "wgmma.mma_async.sync.aligned.m64n192k16" in src and "bar.arrive" in src and "st.global.v4.b32" in src
    sm90a_sass(src, tmp_path)


@pytest.mark.parametrize("name, shape, lead", [
    ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64}, True),   # 0.0226 vs 0.0255 ms
    ("gemm_wgmma", FFN_DOWN, True),                                                         # 0.0280 vs 0.0283
    ("gemm_wgmma", {"m": 4096, "n": 768, "k": 768}, True),                                  # 0.0105 vs 0.0104
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 3072, "k": 768}, True),                   # 0.0345 vs 0.0355
    ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768}, True),                  # 0.2710 vs 0.2740
    ("gemm_bias_gelu_tanh_wgmma", {"m": 32768, "n": 3072, "k": 768}, True),         # k = 768 (not measured)
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 768}, True),                         # 0.0589 vs 0.0677 (s11big)
    ("qkv_projection_wgmma", {"batch": 16, "seq": 2048, "heads": 12, "head_dim": 64}, True),   # 0.1789 vs 0.1800
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 3072}, True),            # 0.2374 / 0.2477 vs 0.2456 / 0.2443
    ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 16, "head_dim": 64}, True),    # BERT-large, k = 1024
    ("gemm_wgmma", {"m": 512, "n": 768, "k": 768}, False),              # split-K leads
    ("gemm_wgmma", {"m": 4096, "n": 1024, "k": 1024}, False),           # 192 divides no 1024 columns
])
def test_the_tall_pingpong_set_leads_where_the_h200_measured_it_fastest(name, shape, lead):
    """Where the measured order's lead is staged 128 x 192 or 256 x 192 cooperative, the space
    starts with the 128 x 192 ping-pong set with 4 stages (``fast_gelu`` like the set it displaces, which follows it);
    elsewhere the first set is not a ping-pong one."""
    space = get_template(name).knob_space(shape, "float16")
    first = space[0]
    assert (first["pingpong"] and first.get("block_m") == 256) == lead
    if lead:
        assert first["block_n"] == 192 and first["stages"] == 4 and first["staged"] and first["persistent"]
        assert first.get("fast_gelu") == space[1].get("fast_gelu") == ("gelu" in name or None)
        assert not space[1]["pingpong"] and (space[1].get("block_m", 128), space[1]["block_n"]) in ((128, 192),
                                                                                                   (256, 192))


@pytest.mark.parametrize("name, shape, lead, cooperative_width", [
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 4096, "k": 1024}, True, 128),   # BERT-large: 0.0606 vs 0.0680 ms
    ("gemm_bias_gelu_tanh_wgmma", {"m": 4096, "n": 4096, "k": 1024}, True, 128),
    # no GELU: no faster (s11large); one wave of 128 x 256 tiles leads there instead (test_wgmma_ragged_rows.py)
    ("gemm_wgmma", {"m": 4096, "n": 1024, "k": 4096}, False, 256),
    ("gemm_bias_gelu_erf_wgmma", {"m": 512, "n": 3072, "k": 768}, False, 128),   # 96 tiles: nothing to alternate
])
def test_a_gelu_template_leads_with_128_x_128_pingpong_where_128_x_128_cooperative_led(name, shape, lead,
                                                                                       cooperative_width):
    """With two waves of 128 x 128 tiles or more the GELU templates start with the staged 128 x 128 ping-pong set
    (4 stages, fast_gelu like the cooperative set it displaces, which follows it)."""
    space = get_template(name).knob_space(shape, "float16")
    first = space[0]
    assert (first["pingpong"] and first["block_n"] == 128) == lead
    second = space[1] if lead else first
    assert (second["block_n"], second["pingpong"], second.get("block_m", 128)) == (cooperative_width, False, 128)
    if lead:
        assert first["staged"] and first["stages"] == 4 and first.get("fast_gelu") == second.get("fast_gelu") is True
