"""Two forms of the wgmma GEMM kernels of issue 17 (schedules/templates/wgmma_kernel.py), measured on the H200 in
session 10 (``scripts/bench_wgmma_small_k.py --plan s10gemm``: every check ok, bitwise deterministic, graph replays):

- TMA multicast (knob ``multicast``): clusters of 2 or 4 blocks on vertically adjacent tiles of one column panel, each
  loading its own A box and a slice of the shared W box multicast into every block of the cluster. The tile walk
  covers every tile once with a cluster's blocks on the same columns; the kernels launch as clusters, multicast W's
  slices, free a slot in every block of the cluster and build for sm_90a without spills; multicast = 1 builds the
  older kernels byte for byte. Measured 1.2-2.2x slower: no knob space offers it.
- 128 x 192 ping-pong tiles (``pingpong`` with ``block_m = 256``): lead the knob space where the H200 measured them
  fastest (the QKV projection and the GELU GEMM at 4096 rows, 1.13x / 1.03x) or as fast."""
from __future__ import annotations

import re

import pytest

from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel
from stof_tvm.schedules.templates.wgmma_kernel import (ROW_BYTES, WgmmaConfig, check_wgmma_shape, grid_blocks,
                                                       tile_origin, wgmma_gemm_primfunc)

from hopper_checks import sm90a_sass

FFN_DOWN = {"m": 4096, "n": 768, "k": 3072}
SM_COUNT = 132


def _walk(m, n, config, sm_count=SM_COUNT):
    """(block, round) -> (first row, first column) of every tile the kernel's blocks compute, as the kernel walks
    them (block bx's round r: tile bx + r * grid, while below the tile count)."""
    grid_n = n // config.block_n
    tiles = (m // config.tile_m) * grid_n
    grid = grid_blocks(config, tiles, sm_count)
    walk = {}
    for bx in range(grid):
        for r in range(-(-tiles // grid)):
            if bx + r * grid < tiles:
                walk[bx, r] = tile_origin(bx + r * grid, grid_n, config.tile_m, config.block_n, config.multicast)
    return walk, grid


@pytest.mark.parametrize("m, n, block_m, block_n, persistent, multicast", [
    (4096, 768, 128, 192, False, 2), (4096, 768, 128, 192, True, 4), (4096, 3072, 256, 192, True, 2),
    (4096, 2304, 128, 128, True, 2), (32768, 3072, 256, 192, True, 4), (512, 768, 128, 128, True, 4),
    (4096, 768, 128, 128, True, 1)])
def test_the_walk_covers_every_tile_once_and_a_cluster_shares_its_columns(m, n, block_m, block_n, persistent,
                                                                          multicast):
    """Every output tile is computed exactly once; the blocks of one cluster (bx // multicast) compute, in every
    round, ``multicast`` vertically adjacent tiles of the same column panel, rank r (bx % multicast) the r-th, so they
    read the same W box; a persistent grid is whole clusters, so a cluster's blocks take the same rounds."""
    config = WgmmaConfig(block_n=block_n, stages=4, persistent=persistent, block_m=block_m, loads="tma",
                         multicast=multicast)
    walk, grid = _walk(m, n, config)
    assert grid % multicast == 0
    expected = {(row, col) for row in range(0, m, block_m) for col in range(0, n, block_n)}
    assert sorted(walk.values()) == sorted(expected)
    for (bx, r), (row, col) in walk.items():
        first = bx - bx % multicast
        assert (first, r) in walk, "a cluster's blocks take the same rounds"
        first_row, first_col = walk[first, r]
        assert col == first_col and row == first_row + (bx % multicast) * block_m
        assert first_row % (multicast * block_m) == 0


def test_the_w_slices_of_a_cluster_make_up_the_box():
    """Rank r loads W rows n0 + r * block_n / multicast on, into the slot's W tile r * block_n / multicast rows
    in: the slices of all ranks are the whole box, each a whole number of 1024-byte swizzle atoms."""
    for block_n in (128, 192, 256):
        for multicast in (2, 4):
            rows = block_n // multicast
            assert rows * multicast == block_n and rows * ROW_BYTES % 1024 == 0


def test_multicast_1_builds_the_older_kernel():
    """``multicast = 1`` written out is the knob set without it, byte for byte (records and prebuilt cubins keyed by
    the source stay valid)."""
    shape = {"m": 512, "n": 256, "k": 128}
    for knobs in ({"block_n": 128, "stages": 4, "persistent": True, "pingpong": True},
                  {"block_n": 256, "stages": 2, "persistent": False, "pingpong": False, "staged": True,
                   "loads": "tma"}):
        plain = cuda_source(build_kernel("gemm_bias_gelu_erf_wgmma", shape, "float16", knobs))
        assert plain == cuda_source(build_kernel("gemm_bias_gelu_erf_wgmma", shape, "float16",
                                                 dict(knobs, multicast=1)))


@pytest.mark.parametrize("knobs, message", [
    (dict(multicast=3, loads="tma"), "multicast must be one of"),
    (dict(multicast=2), "loads must be 'tma'"),
    (dict(multicast=2, loads="tma", split_k=2, persistent=False), "split_k 1"),
    (dict(multicast=2, loads="tma", pingpong=True), "pingpong False"),
])
def test_multicast_refuses_bad_values(knobs, message):
    with pytest.raises(ValueError, match=message):
        WgmmaConfig(block_n=128, stages=4, **knobs).validate()


def test_multicast_needs_row_tiles_in_whole_clusters():
    """m = 384 has 3 row tiles of 128: no clusters of 2."""
    config = WgmmaConfig(block_n=128, stages=4, loads="tma", multicast=2)
    with pytest.raises(ValueError, match="multicast=2 must divide the 3 row tiles"):
        check_wgmma_shape(384, 256, 128, config)
    with pytest.raises(ValueError, match="multicast=2 must divide"):
        wgmma_gemm_primfunc(384, 256, 128, "float16", bias=False, act="none", config=config)


@pytest.mark.parametrize("name, shape, knobs", [
    ("gemm_wgmma", FFN_DOWN,
     {"block_n": 192, "stages": 4, "persistent": False, "pingpong": False, "staged": True, "loads": "tma",
      "multicast": 2}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 3072, "k": 768},
     {"block_n": 192, "stages": 3, "persistent": True, "pingpong": False, "block_m": 256, "staged": True,
      "fast_gelu": True, "loads": "tma", "multicast": 2}),
    ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64},
     {"block_n": 128, "stages": 4, "persistent": True, "pingpong": False, "staged": True, "loads": "tma",
      "multicast": 4}),
])
def test_multicast_kernels_build_for_sm90a_as_clusters(name, shape, knobs, tmp_path):
    """A multicast kernel launches in clusters of ``multicast`` (TVM's ``clusterCtaIdx`` launch parameter), meets
    the cluster after the barriers' initialisation and before leaving, loads its A box and multicasts its W slice
    (CTA mask of all ranks) with the slot's full barrier expecting A and the whole W box, and frees each slot in every
    block of the cluster (empty barriers expecting one arrival per consumer warpgroup and block); ptxas: no spills,
    no stack, no wgmma serialisation."""
    mc = knobs["multicast"]
    config = get_template(name).config(knobs)
    ex = build_kernel(name, shape, "float16", knobs)
    src = cuda_source(ex)
    kernel = src[src.index('extern "C" __global__'):]
    for text in ("%cluster_ctarank", "mapa.shared::cluster.u32", "mbarrier.arrive.release.cluster.shared::cluster.b64",
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"):
        assert text in src, text
    assert kernel.count("barrier_cluster_arrive_cluster_arrive_release();") == 2
    assert f"(ushort){(1 << mc) - 1})" in kernel                     # every rank of the cluster
    box_bytes = (config.tile_m + config.block_n) * ROW_BYTES
    assert re.search(rf"expect_tx_shared__cta_b64\(.*\(uint\){box_bytes}\);", kernel)
    assert re.search(rf"mbarrier_init_init_shared__cta_b64\(.*\(uint\){2 * mc}\);", kernel)   # the empty barriers
    assert f"* {config.block_n // mc * ROW_BYTES}))" in kernel      # rank r's slice r * block_n / mc rows in
    library = tmp_path / "kernel.so"
    ex.export_library(str(library))
    assert b"clusterCtaIdx.x" in library.read_bytes()
    assert get_template(name).resources(shape, "float16", knobs)["grid"] % mc == 0
    if name == "gemm_wgmma":   # one ptxas run (CI time): the others built without spills in --plan s10gemm
        sm90a_sass(src, tmp_path)


@pytest.mark.parametrize("name, shape", [("gemm_wgmma", FFN_DOWN), ("gemm_bias_gelu_erf_wgmma",
                                                                    {"m": 4096, "n": 3072, "k": 768}),
                                         ("qkv_projection_wgmma", {"batch": 1, "seq": 128, "heads": 12,
                                                                   "head_dim": 64})])
def test_no_knob_space_offers_multicast(name, shape):
    """Measured slower than without at every timed set (session 10): not in the tuner's or the compile path's sets."""
    assert not any("multicast" in kn for kn in get_template(name).knob_space(shape, "float16"))


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
    ("gemm_bias_gelu_tanh_wgmma", {"m": 32768, "n": 3072, "k": 768}, False),        # not measured
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 768}, False),            # 256 x 192 leads, not measured against it
    ("qkv_projection_wgmma", {"batch": 16, "seq": 2048, "heads": 12, "head_dim": 64}, False),
    ("gemm_wgmma", {"m": 512, "n": 768, "k": 768}, False),              # split-K leads
    ("gemm_wgmma", {"m": 4096, "n": 1024, "k": 1024}, False),           # 192 divides no 1024 columns
])
def test_the_tall_pingpong_set_leads_where_the_h200_measured_it_fastest(name, shape, lead):
    """Where the measured order's lead is staged 128 x 192 cooperative, or for the erf GELU 256 x 192, the space
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
