"""Split-K in the wgmma GEMM kernels (knob ``split_k``, schedules/templates/wgmma_kernel.py) and the knob order of
issue 17: where a GEMM's tiles leave most SMs idle (RoBERTa-base at 1 x 128 and 1 x 512 tokens) the knob space leads
with split-K sets that fill the SMs in one wave and the cost model ranks them first; the kernels launch as clusters,
reduce their float32 partials through distributed shared memory and build for sm_90a without spills; split_k = 1
builds the older kernels byte for byte. Also the shape-aware order of the measured tiles (128 x 128 first where
256 x 192 fills the waves worse) and TMA loads by default.

The kernels' numerics need an H200: ``scripts/bench_wgmma_small_k.py --plan s9splitk``."""
from __future__ import annotations

import pytest

from stof_tvm.compiler import linear_match
from stof_tvm.cost_model.templates import rank_template
from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import (SPLIT_K_MAX_SHARE, SPLIT_K_MIN_STEPS, build_kernel,
                                                     measured_order, split_k_blocks, split_k_tilings)
from stof_tvm.schedules.templates.registry import H200
from stof_tvm.schedules.templates.wgmma_kernel import BLOCK_K, WgmmaConfig, wgmma_gemm_primfunc

from hopper_checks import sm90a_sass

# RoBERTa-base's GEMMs (the compile path's forms) at 128 and 512 rows
SMALL = [(name, shape) for rows, (batch, seq) in ((128, (1, 128)), (512, (1, 512))) for name, shape in (
    ("qkv_projection_wgmma", {"batch": batch, "seq": seq, "heads": 12, "head_dim": 64}),
    ("gemm_bias_gelu_erf_wgmma", {"m": rows, "n": 3072, "k": 768}),
    ("gemm_wgmma", {"m": rows, "n": 768, "k": 3072}),
    ("gemm_wgmma", {"m": rows, "n": 768, "k": 768}))]


def _blocks(template, shape, knobs):
    return template.resources(shape, "float16", knobs)["grid"]


@pytest.mark.parametrize("name, shape", SMALL)
def test_split_k_sets_lead_where_the_tiles_leave_the_sms_idle(name, shape):
    """The first knob set of a GEMM whose first unsplit set has fewer tiles than half the SMs is split-K: one cluster
    of ``split_k`` blocks per 128-row tile, each on an equal k slice of at least 3 steps, all in one wave (96 blocks
    at most: what the H200 placed at once); no other split tiling gives a block less work (columns x k steps). These
    are the sets measured fastest (--plan s9splitk)."""
    t = get_template(name)
    space = t.knob_space(shape, "float16")
    m, n, k = t.gemm_dims(shape)
    unsplit = next(kn for kn in space if "split_k" not in kn and not kn["pingpong"])   # the measured order's lead
    tiles = _blocks(t, shape, dict(unsplit, persistent=False))
    first = space[0]
    assert (first.get("split_k", 1) > 1) == (tiles < H200.sm_count / 2)
    if first.get("split_k", 1) == 1:
        return
    split, bn = first["split_k"], first["block_n"]
    steps = k // BLOCK_K
    assert steps % split == 0 and steps // split >= SPLIT_K_MIN_STEPS
    assert _blocks(t, shape, first) == (m // 128) * (n // bn) * split <= SPLIT_K_MAX_SHARE * H200.sm_count == 96
    assert not first["persistent"] and not first["pingpong"] and not first.get("staged")
    work = lambda b, s: b * steps // s  # noqa: E731
    assert work(bn, split) == min(work(b, s) for b, s in split_k_tilings(m, n, k, H200.sm_count))


@pytest.mark.parametrize("name, shape", SMALL[:4])
def test_the_model_ranks_split_k_first_at_128_rows(name, shape):
    """The analytical model prices split-K (a block's share of the k steps, the reduction's operations) and ranks a
    split set first at 128 rows, predicted faster than every unsplit set."""
    ranked = rank_template(get_template(name), shape)
    assert ranked[0].candidate.get("split_k", 1) > 1
    best_unsplit = next(r for r in ranked if r.candidate.get("split_k", 1) == 1)
    assert ranked[0].time_s < best_unsplit.time_s


@pytest.mark.parametrize("name, shape", [
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 768}), ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 3072, "k": 768}),
    ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64})])
def test_large_gemms_keep_unsplit_sets_first(name, shape):
    space = get_template(name).knob_space(shape, "float16")
    assert "split_k" not in space[0]


def test_split_k_blocks_counts_what_the_knob_space_offers():
    """The compile path's gate counts the most blocks a split set launches: RoBERTa-base's QKV at 128 rows 18 tiles
    x 4 (x 6 would leave 2 k steps a block), its attention output 6 tiles x 4; none where the tiles alone pass 96."""
    assert split_k_blocks(128, 2304, 768) == 72
    assert split_k_blocks(128, 768, 768) == 24
    assert split_k_blocks(128, 768, 3072) == 48          # 6 tiles x 8, the portable cluster size
    assert split_k_blocks(4096, 768, 3072) == 0
    assert split_k_blocks(128, 768, 128) == 0            # two k steps: nothing to split


def test_the_gate_sends_split_k_gemms_to_wgmma(monkeypatch):
    """Measured faster than mma.sync at RoBERTa-base's four GEMMs at 128 rows (24-96 blocks): they go to wgmma;
    without split-K (the flag off, or too few k steps) 18 tiles stay on mma.sync."""
    for m, n, k in ((128, 2304, 768), (128, 3072, 768), (128, 768, 3072), (128, 768, 768), (4096, 768, 768)):
        assert linear_match.wgmma_misfit(m, n, k) is None
    assert "6 wgmma tiles" in linear_match.wgmma_misfit(128, 768, 128)
    monkeypatch.setattr(linear_match, "SPLIT_K_GATE", False)
    assert "18 wgmma tiles" in linear_match.wgmma_misfit(128, 2304, 768)


@pytest.mark.parametrize("knobs, message", [
    ({"block_n": 128, "stages": 2, "persistent": False, "split_k": 5}, "split_k must be one of"),
    ({"block_n": 128, "stages": 2, "persistent": True, "split_k": 2}, "persistent, pingpong, staged must be False"),
    ({"block_n": 128, "stages": 2, "persistent": False, "staged": True, "split_k": 2}, "staged must be False"),
    ({"block_n": 128, "stages": 2, "persistent": False, "block_m": 256, "split_k": 2}, "block_m 128"),
    ({"block_n": 128, "stages": 2, "persistent": False, "split_k": 4}, "must divide the 6 k steps"),
])
def test_split_k_refuses_bad_values(knobs, message):
    with pytest.raises(ValueError, match=message):
        get_template("gemm_wgmma").kernel({"m": 256, "n": 256, "k": 384}, knobs=knobs)


def test_split_k_qkv_kernel_needs_head_dim_a_multiple_of_4():
    """The reduction stores 4 adjacent columns at once: they must stay in one head (the QKV template's head dims are
    multiples of 16; the kernel itself refuses others)."""
    config = WgmmaConfig(block_n=128, stages=2, persistent=False, split_k=2)
    with pytest.raises(ValueError, match="multiple of 4"):
        wgmma_gemm_primfunc(128, 3 * 64 * 34, 64 * 34, "float16", bias=True, act="none", config=config,
                            heads=(1, 128, 64, 34))


def test_split_k_1_builds_the_older_kernel():
    """``split_k = 1`` written out is the knob set without it, byte for byte (records and prebuilt cubins keyed by
    the source stay valid)."""
    shape = {"m": 512, "n": 256, "k": 128}
    for knobs in ({"block_n": 128, "stages": 4, "persistent": True, "pingpong": True},
                  {"block_n": 256, "stages": 2, "persistent": False, "pingpong": False, "staged": True,
                   "loads": "tma"}):
        plain = cuda_source(build_kernel("gemm_bias_gelu_erf_wgmma", shape, "float16", knobs))
        assert plain == cuda_source(build_kernel("gemm_bias_gelu_erf_wgmma", shape, "float16",
                                                 dict(knobs, split_k=1)))


def test_split_k_reserves_the_partial_tile_over_the_ring():
    """The float32 partial tile (rows padded by 32 bytes) reuses the ring; shared memory covers the larger."""
    two = WgmmaConfig(block_n=256, stages=2, persistent=False, split_k=2)
    assert two.partial_bytes == 128 * (256 * 4 + 32) > two.stages * two.stage_bytes
    assert two.ring_bytes == two.partial_bytes
    four = WgmmaConfig(block_n=128, stages=4, persistent=False, split_k=2)
    assert four.ring_bytes == 4 * four.stage_bytes > four.partial_bytes
    assert WgmmaConfig(block_n=128, stages=4).partial_bytes == 0


@pytest.mark.parametrize("name, shape, knobs", [
    ("gemm_bias_gelu_erf_wgmma", {"m": 128, "n": 3072, "k": 768},
     {"block_n": 128, "stages": 3, "persistent": False, "pingpong": False, "split_k": 4, "loads": "tma"}),
    ("qkv_projection_wgmma", {"batch": 1, "seq": 128, "heads": 12, "head_dim": 64},
     {"block_n": 128, "stages": 2, "persistent": False, "pingpong": False, "split_k": 6}),
    ("gemm_wgmma", {"m": 512, "n": 768, "k": 3072},
     {"block_n": 192, "stages": 4, "persistent": False, "pingpong": False, "split_k": 8, "loads": "tma"}),
])
def test_split_k_kernels_build_for_sm90a_as_clusters(name, shape, knobs, tmp_path):
    """A split-K kernel launches tiles x split_k blocks in clusters of split_k (TVM's ``clusterCtaIdx`` launch
    parameter), reads its rank's k slice, writes its partial tile to shared memory, meets the cluster at a barrier,
    sums the cluster's partials through ``mapa`` + ``ld.shared::cluster`` and stores 8 bytes per 4 outputs; ptxas:
    no spills, no stack, no wgmma serialisation."""
    t = get_template(name)
    ex = build_kernel(name, shape, "float16", knobs)
    src = cuda_source(ex)
    for text in ("%cluster_ctarank", "mapa.shared::cluster.u32", "ld.shared::cluster.v4.f32",
                 "barrier.cluster.arrive.release", "barrier.cluster.wait.acquire", "st.shared.v2.f32",
                 "st.global.v2.b32"):
        assert text in src, text
    assert src.count("barrier_cluster_arrive_cluster_arrive_release();") == 2   # partials written; partials read
    library = tmp_path / "kernel.so"
    ex.export_library(str(library))
    assert b"clusterCtaIdx.x" in library.read_bytes()               # the launch parameter the runtime reads
    assert t.resources(shape, "float16", knobs)["grid"] % knobs["split_k"] == 0
    sm90a_sass(src, tmp_path)


def test_the_busiest_sm_orders_the_measured_tiles():
    """256 x 192 leads where its tiles leave the busiest SM about as few outputs as the best measured tile's (the H200
    measured it faster at all four RoBERTa GEMMs at 32768 rows and the FFN up at 4096); 128 x 192 leads at QKV, FFN
    down and attention output at 4096 rows (measured 1.15-1.28x faster than 128 x 128 there, session 10), then 128 x
    128 (measured 1.17-1.37x faster than 256 x 192 there); 128 x 128 where 192 does not divide the columns or below
    one wave (512 rows, 384 rows: more tiles, less on each SM)."""
    tall, wide, base = (256, 192, 3, True), (128, 192, 4, True), (128, 128, 4, True)
    for n in (2304, 3072, 768):
        assert measured_order(32768, n, 132)[0] == tall
    assert measured_order(4096, 3072, 132)[0] == tall
    for n in (2304, 768):
        assert measured_order(4096, n, 132) == (wide, base, tall)
    assert measured_order(4096, 1024, 132)[0] == base     # 192 divides no 1024 columns
    for m, n in ((512, 2304), (512, 3072), (384, 768)):
        assert measured_order(m, n, 132)[0] == base      # one tile an SM: the smaller one


@pytest.mark.parametrize("name, shape, first", [
    ("gemm_wgmma", {"m": 4096, "n": 768, "k": 3072}, (128, 192)),
    ("gemm_wgmma", {"m": 4096, "n": 768, "k": 768}, (128, 192)),
    ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64}, (128, 192)),
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 3072, "k": 768}, (256, 192)),
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 768}, (256, 192)),
])
def test_first_knob_sets_follow_the_wave_order(name, shape, first):
    """The first cooperative set (a 128 x 192 ping-pong set may precede it: tests/test_gemm_tall_pingpong.py)."""
    kn = next(kn for kn in get_template(name).knob_space(shape, "float16") if not kn["pingpong"])
    assert (kn.get("block_m", 128), kn["block_n"]) == first and kn["staged"]


@pytest.mark.parametrize("name, shape", SMALL + [
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 3072}),
    ("qkv_projection_wgmma", {"batch": 16, "seq": 2048, "heads": 12, "head_dim": 64})])
def test_tma_loads_by_default_except_the_qkv_256_row_tiles_and_split_k(name, shape):
    """Every knob set names its loads: TMA (measured faster on the H200 at every unsplit GEMM knob set), cp.async for
    the QKV projection's 256-row tiles (TMA measured slower at 32768 rows) and the split-K sets (cp.async measured
    faster at 128 and 512 rows)."""
    t = get_template(name)
    for kn in t.knob_space(shape, "float16"):
        tall_qkv = name == "qkv_projection_wgmma" and kn.get("block_m", 128) == 256 and not kn["pingpong"]
        assert kn["loads"] == ("cp.async" if tall_qkv or "split_k" in kn else "tma"), kn


def test_small_k_plan_s13small_times_each_pick_against_sets_that_fill_the_sms():
    """``bench_wgmma_small_k --plan s13small``: GPT-2's GEMMs at 128 rows (and two at 512), per case the knob space's
    first set (the compile path's pick: 72, 24, 96 and 48 blocks at 128 rows), then at most 3 valid sets the space
    does not offer, each launching >= 132 blocks or splitting k further than the pick; 20 modules at most."""
    from test_gemm_tma import _bench_module

    bench = _bench_module()
    total, picks = 0, []
    for name, shape in bench.S13_CASES:
        t = get_template(name)
        space = t.knob_space(shape, "float16")
        m, n, k = t.gemm_dims(shape)
        sets = bench.small_rows_knob_sets(name, shape, space)
        assert sets[0] == space[0] and 2 <= len(sets) <= 4
        assert len({bench.knob_tag(kn) for kn in sets}) == len(sets)
        pick_blocks = _blocks(t, shape, sets[0])
        if m == 128:
            picks.append(pick_blocks)
        for kn in sets[1:]:
            if "mma" in kn:
                twin = get_template(bench.mma_twin(name))
                assert kn["mma"] in twin.knob_space(shape, "float16")
                assert twin.resources(shape, "float16", kn["mma"])["grid"] >= H200.sm_count
                continue
            config = t.config(kn)
            assert kn not in space and config.split_k > sets[0].get("split_k", 1)
            assert (k // BLOCK_K) % config.split_k == 0
            assert _blocks(t, shape, kn) > pick_blocks
        total += len(sets)
    assert picks == [72, 24, 96, 48]
    assert total <= bench.S13_MAX_MODULES
