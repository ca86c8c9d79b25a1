"""The analytical model: known cases, monotonicity in work, feasibility limits, and its mask statistics."""
from __future__ import annotations

import math

import numpy as np
import pytest

from stof_tvm.cost_model import (AttentionCandidate, AttentionProblem, Calibration, DEFAULT_CALIBRATION, KernelWork,
                                 MaskProfile, attention_candidates, attention_work, choose_attention, occupancy,
                                 predict, rank_attention)
from stof_tvm.cost_model.attention import block_candidates, block_registers
from stof_tvm.cost_model.core import occupancy_many, predict_uniform
from stof_tvm.cost_model.explain import explain_prediction, explain_ranking
from stof_tvm.cost_model.templates import rank_template, template_work
from stof_tvm.hardware import A100, H200, detect, get_profile, profile_for_target
from stof_tvm.schedules.attention_blockwise import BlockConfig
from stof_tvm.schedules.attention_rowwise import RowConfig
from stof_tvm.sparse_formats import build_tiled, normalize_mask


def problem(mask, batch=2, heads=4, seq=512, head_dim=64):
    return AttentionProblem.build(mask, batch=batch, heads=heads, seq_len=seq, head_dim=head_dim)


def time_of(prob, kind, config):
    return predict(attention_work(prob, AttentionCandidate(kind, config)), H200).time_s


def random_mask(seq, density, seed=0):
    return np.random.default_rng(seed).random((seq, seq)) < density


# -- occupancy and the launch model ---------------------------------------------------------------------------

def test_occupancy_known_cases():
    # 128 threads x 64 registers = 8192 registers a block -> 8 blocks in 64 Ki registers.
    assert occupancy(128, 0, 64, H200) == (8, "registers")
    # 48 KiB of shared memory (+1 KiB reserved) -> 4 blocks in 228 KiB.
    assert occupancy(128, 48 * 1024, 32, H200) == (4, "shared memory")
    # 1024 threads -> 2 blocks by the thread limit.
    assert occupancy(1024, 0, 32, H200) == (2, "threads")
    assert occupancy(32, 0, 16, H200) == (32, "blocks")


@pytest.mark.parametrize("threads, smem, regs, word", [(2048, 0, 32, "threads"), (128, 300 * 1024, 32, "shared"),
                                                       (128, 0, 300, "registers")])
def test_occupancy_rejects_per_block_limits(threads, smem, regs, word):
    occ, reason = occupancy(threads, smem, regs, H200)
    assert occ == 0 and word in reason


def _uniform_work(blocks, cycles, threads=128, smem=0, regs=32):
    return KernelWork("uniform", threads, smem, regs, count=np.array([float(blocks)]), tc_flops=np.zeros(1),
                      cuda_ops=np.zeros(1), latency_cycles=np.array([float(cycles)]), dram_bytes=0.0, l2_bytes=0.0)


def test_waves_of_identical_blocks():
    cal = DEFAULT_CALIBRATION.replace(tail=1.0, launch_s=0.0)
    occ, _ = occupancy(128, 0, 32, H200)
    slots = occ * H200.sm_count
    block_s = 1e5 / H200.clock_hz
    two_waves = predict(_uniform_work(2 * slots, 1e5), H200, cal)
    assert two_waves.terms["waves"] == pytest.approx(2.0)
    assert two_waves.time_s == pytest.approx(2 * block_s, rel=1e-9)
    # One block more starts a third wave: the whole wave's time is paid.
    assert predict(_uniform_work(2 * slots + 1, 1e5), H200, cal).time_s == pytest.approx(3 * block_s, rel=1e-9)
    # Fewer blocks than SMs: one block's time.
    assert predict(_uniform_work(10, 1e5), H200, cal).time_s == pytest.approx(block_s, rel=1e-9)


def test_a_long_block_launched_last_costs_more_than_launched_first():
    slots = occupancy(128, 0, 32, H200)[0] * H200.sm_count
    n = 40 * slots                      # 40 waves of short blocks take about twice the long block
    classes = dict(count=np.array([n - 1.0, 1.0]), tc_flops=np.zeros(2), cuda_ops=np.zeros(2),
                   latency_cycles=np.array([1e4, 2e5]))
    last = KernelWork("late", 128, 0, 32, **classes, dram_bytes=0.0, l2_bytes=0.0,
                      order=np.r_[np.zeros(n - 1, int), 1])
    first = KernelWork("early", 128, 0, 32, **classes, dram_bytes=0.0, l2_bytes=0.0,
                       order=np.r_[1, np.zeros(n - 1, int)])
    assert predict(last, H200).time_s > 1.3 * predict(first, H200).time_s


def test_kernel_work_rejects_bad_order_and_shapes():
    with pytest.raises(ValueError, match="order"):
        KernelWork("x", 32, 0, 32, count=np.array([2.0]), tc_flops=np.zeros(1), cuda_ops=np.zeros(1),
                   latency_cycles=np.zeros(1), dram_bytes=0, l2_bytes=0, order=np.array([0]))
    with pytest.raises(ValueError, match="one shape"):
        KernelWork("x", 32, 0, 32, count=np.ones(2), tc_flops=np.zeros(1), cuda_ops=np.zeros(2),
                   latency_cycles=np.zeros(2), dram_bytes=0, l2_bytes=0)


def test_vectorised_prediction_matches_the_general_one():
    rng = np.random.default_rng(3)
    cols = []
    for _ in range(40):
        threads = int(rng.choice([32, 64, 128, 256, 512, 1024]))
        smem = int(rng.integers(0, 240 * 1024))
        regs = int(rng.integers(16, 300))
        blocks = int(rng.integers(1, 5000))
        tc, cuda, lat = rng.random(3) * [1e8, 1e6, 1e5]
        dram, l2 = rng.random(2) * [1e9, 4e9]
        cols.append((threads, smem, regs, blocks, tc, cuda, lat, dram, l2))
    fast = predict_uniform(*np.array(cols, dtype=np.float64).T, hw=H200)
    for (threads, smem, regs, blocks, tc, cuda, lat, dram, l2), t in zip(cols, fast):
        work = KernelWork("w", threads, smem, regs, count=np.array([float(blocks)]), tc_flops=np.array([tc]),
                          cuda_ops=np.array([cuda]), latency_cycles=np.array([lat]), dram_bytes=dram, l2_bytes=l2)
        assert t == pytest.approx(predict(work, H200).time_s, rel=1e-12)
    assert (occupancy_many([2048, 128], [0, 0], [32, 32], H200) == [0, 16]).all()


# -- attention: monotonic in work ------------------------------------------------------------------------------

def test_block_wise_time_grows_with_the_band():
    config = BlockConfig(block_m=64, block_n=64, num_warps=4, stages=2)
    times = [time_of(problem(f"local:window={w}", seq=2048, batch=4), "block", config) for w in (16, 128, 512, 1024)]
    assert times == sorted(times) and times[-1] > 2 * times[0]
    # With many waves the total work decides: dense visits twice the tiles of causal. (With fewer blocks than
    # SMs, the longest tile row decides and causal's last row, whose diagonal tile is partial, is the longest.)
    dense, causal = (time_of(problem(m, seq=2048, batch=8, heads=12), "block", config) for m in ("dense", "causal"))
    assert 1.5 * causal < dense < 2.5 * causal


def test_row_wise_time_grows_with_kept_keys_and_partial_tiles_cost_block_wise():
    config = RowConfig(key_groups=4, keys_per_step=2, rows_per_block=4)
    times = [time_of(problem(random_mask(1024, d), seq=1024, batch=4), "row", config) for d in (0.005, 0.05, 0.3)]
    assert times == sorted(times) and times[-1] > 5 * times[0]
    # Same number of visited 64x64 tiles, but partial instead of full: more (bitmap) work.
    full = problem("dense", seq=1024, batch=4)
    partial = problem(np.tile(np.eye(8, dtype=bool), (128, 128)), seq=1024, batch=4)
    blk = BlockConfig(block_m=64, block_n=64, num_warps=4, stages=2)
    assert time_of(partial, "block", blk) > time_of(full, "block", blk)


def test_kind_choice_on_clear_cases():
    assert choose_attention(problem("dense", seq=1024, batch=8)).candidate.kind == "block"
    # 3 keys a row scattered over 4096: tiles are nearly all partial and nearly empty; gather the rows.
    sparse = problem(random_mask(4096, 0.0008), seq=4096, batch=8, heads=12)
    assert choose_attention(sparse).candidate.kind == "row"


def test_useful_flops_and_bound_reported():
    prob = problem("causal", seq=1024, batch=8)
    best = choose_attention(prob)
    kept = int(normalize_mask("causal", seq_q=1024).sum())
    assert prob.useful_flops == 4.0 * kept * 8 * 4 * 64
    assert best.prediction.terms["useful_tflops"] == pytest.approx(prob.useful_flops / best.time_s / 1e12)
    assert best.prediction.bound in ("sm", "l2", "dram")


# -- feasibility ----------------------------------------------------------------------------------------------

def test_no_survivor_exceeds_shared_memory_or_registers():
    small = H200.replace(smem_per_block=24 * 1024, smem_per_sm=48 * 1024)
    prob = problem("sliding", seq=1024, head_dim=128)
    everything = rank_attention(prob, small, keep_infeasible=True)
    survivors = rank_attention(prob, small)
    assert survivors and len(survivors) < len(everything)
    for entry in survivors:
        assert entry.prediction.terms["smem_bytes"] <= small.smem_per_block
        assert entry.prediction.terms["regs_per_thread"] <= small.regs_per_thread
    dropped = [e for e in everything if not e.prediction.feasible]
    assert dropped and all(math.isinf(e.time_s) for e in dropped)
    # The candidate space itself never offers a tile over the per-block shared memory.
    for cand in attention_candidates(prob, small):
        if cand.kind == "block":
            assert cand.config.shared_bytes(128) <= small.smem_per_block


def test_configurations_that_would_spill_are_infeasible():
    prob = problem("sliding", seq=1024, head_dim=128)
    everything = rank_attention(prob, H200, keep_infeasible=True)
    spilling = [e for e in everything if "spills" in e.prediction.reason]
    # 32 query rows a warp at D=128 holds 2 x (64 + 32 + ...) fragment registers: more than 255.
    assert spilling and all(e.candidate.kind == "block" and e.candidate.config.m_tiles_per_warp == 2
                            for e in spilling)
    assert all(e.prediction.terms["regs_per_thread"] <= 255 for e in rank_attention(prob, H200))


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_every_head_dim_has_feasible_candidates_of_both_kinds(head_dim):
    """Head dims beyond 64/128 are priced: both kinds offer feasible configurations (within the register and
    shared-memory limits, Q reloaded per tile where D=256 needs it), and the choice is one of them."""
    prob = problem("bigbird", seq=1024, head_dim=head_dim)
    ranked = rank_attention(prob, H200)
    kinds = {r.candidate.kind for r in ranked}
    assert kinds == {"block", "row"}
    for r in ranked:
        assert r.prediction.terms["regs_per_thread"] <= 255 and r.prediction.terms["smem_bytes"] <= H200.smem_per_block
        if r.candidate.kind == "block":
            assert r.prediction.terms["regs_per_thread"] == r.candidate.config.registers(head_dim)
    assert choose_attention(prob).candidate == ranked[0].candidate


def test_wider_heads_cost_more():
    config = BlockConfig(64, 32, 4, 2)
    times = [time_of(problem("bigbird", seq=1024, head_dim=d), "block", config) for d in (32, 80, 96, 256)]
    assert all(a < b for a, b in zip(times, times[1:])), times


def test_split_kv_is_chosen_where_a_long_row_would_run_alone():
    """B=1 BigBird at S=8192: each head's global tile row holds every column tile and runs long after the rest of
    the grid is done; splitting it over several blocks (plus a merge launch) is predicted faster than every
    unsplit configuration. At B=16, S=4096 the grid is long enough without it; masks without heavy rows (causal,
    sliding) are offered no split configuration."""
    long_row = problem("bigbird", batch=1, heads=12, seq=8192)
    ranked = rank_attention(long_row)
    best, unsplit = ranked[0], next(r for r in ranked if r.candidate.config.kv_splits == 1)
    assert best.candidate.kind == "block" and best.candidate.config.kv_splits > 1
    assert best.candidate.config.split_rows == 1                 # one heavy (global) tile row per head
    assert best.time_s < 0.8 * unsplit.time_s
    work = attention_work(long_row, best.candidate)
    config = best.candidate.config
    rows = -(-8192 // config.block_m)
    # every tile row once, the split row kv_splits times, plus one merge block per head
    assert work.blocks == 12 * (rows + config.kv_splits - 1) + 12
    assert choose_attention(problem("bigbird", batch=16, heads=12, seq=4096)).candidate.config.kv_splits == 1
    for mask in ("causal", "sliding"):
        assert all(c.config.kv_splits == 1 for c in attention_candidates(problem(mask, seq=2048))
                   if c.kind == "block")


def test_heavy_first_is_offered_at_the_tile_shapes_that_have_heavy_rows():
    """BigBird at S = 512: a 32-row tile row of the global queries holds all 8 key tiles, twice its group's mean, so
    the heavy-first order is offered at 32-row tiles and chosen (H100, session 19, plan s19knobs: 32x64x2x2 0.0264 ms
    in the default order, 0.0243 heavy-first); 64-row tiles have no heavy row there and get no heavy-first twin; a
    sliding window has none at any shape."""
    bigbird = problem("bigbird", batch=8, heads=12, seq=512)
    offered = {(c.config.block_m, c.config.block_n) for c in attention_candidates(bigbird)
               if c.kind == "block" and c.config.heavy_first}
    assert (32, 64) in offered and not any(bm == 64 and bn == 64 for bm, bn in offered)
    pick = choose_attention(bigbird).candidate
    assert pick.kind == "block" and pick.config.heavy_first
    assert not any(c.config.heavy_first for c in attention_candidates(problem("sliding", seq=512)) if c.kind == "block")


def test_unsupported_head_dim_has_no_candidate():
    with pytest.raises(ValueError, match="no feasible attention kernel for head_dim=72"):
        choose_attention(problem("causal", seq=256, head_dim=72))


def test_register_estimate_tracks_ptxas():
    # ptxas (nvcc 13, sm_90) reported 237 registers for 128x64x4 warps and 128 for 64x64x4, D=64.
    prob = problem("causal", seq=256)
    big = attention_work(prob, AttentionCandidate("block", BlockConfig(128, 64, 4, 2))).regs_per_thread
    small = attention_work(prob, AttentionCandidate("block", BlockConfig(64, 64, 4, 2))).regs_per_thread
    assert abs(big - 237) <= 16 and abs(small - 128) <= 16


# -- templates -------------------------------------------------------------------------------------------------

class _ToyTemplate:
    """A GEMM-like template: tile t x t, one warp per 16 rows, shared memory grows with the tile."""

    name = "toy"
    shape_keys = ("m", "n", "k")

    def knob_space(self, shape, dtype, hw):
        return [{"tile": t, "stages": s} for t in (32, 64, 128, 256) for s in (2, 3)]

    def resources(self, shape, dtype, knobs):
        t = knobs["tile"]
        return {"block_m": t, "block_n": t, "block_k": 32, "threads": 2 * t, "grid": (shape["m"] // t) *
                (shape["n"] // t), "shared_bytes": knobs["stages"] * 2 * t * 32 * 2,
                "acc_registers": t // 2, "operand_registers": 8}

    def flops(self, shape):
        return 2 * shape["m"] * shape["n"] * shape["k"]

    def arguments(self, shape, dtype):
        m, n, k = shape["m"], shape["n"], shape["k"]
        return [("A", (m, k), dtype), ("W", (k, n), dtype), ("out", (m, n), dtype)]

    def outputs(self):
        return 1


def test_template_ranking_prunes_and_orders():
    toy, shape = _ToyTemplate(), {"m": 4096, "n": 4096, "k": 1024}
    tight = H200.replace(smem_per_block=40 * 1024)
    ranked = rank_template(toy, shape, hw=tight, knob_space=toy.knob_space(shape, "float16", None))
    assert all(toy.resources(shape, "float16", r.candidate)["shared_bytes"] <= tight.smem_per_block for r in ranked)
    assert len(ranked) < 8 and [r.time_s for r in ranked] == sorted(r.time_s for r in ranked)
    assert ranked[0].prediction.terms                                  # the head comes with its terms
    # More K means more work for the same knobs.
    knobs = {"tile": 64, "stages": 2}
    short = predict(template_work(toy, shape, "float16", knobs), H200).time_s
    long_ = predict(template_work(toy, dict(shape, k=4096), "float16", knobs), H200).time_s
    assert long_ > 2 * short


# -- mask profile ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tile", [(8, 8), (16, 16), (32, 64), (64, 32), (24, 40), (128, 128)])
def test_tile_counts_match_the_tiled_format(tile):
    rng = np.random.default_rng(1)
    for mask in (normalize_mask("bigbird", seq_q=300), (rng.random((2, 3, 100, 77)) < 0.3)):
        prof = MaskProfile(mask)
        fmt = build_tiled(mask, *tile)
        full, part = prof.tile_counts(*tile)
        assert (np.diff(fmt.full_indptr).reshape(full.shape) == full).all()
        assert (np.diff(fmt.part_indptr).reshape(part.shape) == part).all()


def test_block_union_counts_distinct_keys():
    mask = normalize_mask("sliding:window=4", seq_q=64)
    prof = MaskProfile(mask)
    union = prof.block_union(4)
    expect = [np.count_nonzero(mask[0, 0, r:r + 4].any(axis=0)) for r in range(0, 64, 4)]
    assert union[0].tolist() == expect
    assert prof.block_union(1)[0].tolist() == mask[0, 0].sum(axis=1).tolist()
    with pytest.raises(ValueError):
        prof.block_union(0)


def test_profile_rejects_non_masks():
    with pytest.raises(TypeError):
        MaskProfile(np.zeros((4, 4)))
    with pytest.raises(ValueError, match="broadcast"):
        AttentionProblem(batch=2, heads=2, head_dim=64, dtype="float16",
                         mask=MaskProfile(np.ones((3, 1, 8, 8), dtype=bool)))


# -- hardware, calibration, reports -----------------------------------------------------------------------------

def test_hardware_profiles():
    import tvm

    assert get_profile("H200") is H200 and get_profile("a100") is A100
    with pytest.raises(ValueError, match="unknown hardware"):
        get_profile("tpu")
    if not tvm.cuda(0).exist:
        assert detect() is H200
        sm80 = profile_for_target(tvm.target.Target({"kind": "cuda", "arch": "sm_80",
                                                     "max_shared_memory_per_block": 49152}))
        assert sm80.sm_count == A100.sm_count and sm80.smem_per_block == 49152
    with pytest.raises(ValueError, match="positive"):
        H200.replace(sm_count=0)


def test_detect_keeps_the_opt_in_shared_memory_limit(monkeypatch):
    """An H200 as its driver reports it (48 KiB shared memory per block: the default, not the opt-in limit)."""
    import tvm

    class FakeH200:
        exist, compute_version, total_global_memory = True, "9.0", 143 * 10**9
        multi_processor_count, max_clock_rate, max_threads_per_block = 132, 1980000, 1024
        max_shared_memory_per_block, l2_cache_size_bytes, device_name = 49152, 60 * 2**20, "NVIDIA H200"

    monkeypatch.setattr(tvm, "cuda", lambda index=0: FakeH200())
    found = detect()
    assert found.name == "NVIDIA H200" and found.sm_count == 132
    assert found.smem_per_block == H200.smem_per_block > 49152


def test_calibration_file_round_trip(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(DEFAULT_CALIBRATION.replace(tc_eff=0.5).to_json())
    assert Calibration.load(str(path)).tc_eff == 0.5
    path.write_text('{"tc_eff": 0.5, "bogus": 1}')
    with pytest.raises(ValueError, match="bogus"):
        Calibration.load(str(path))
    with pytest.raises(ValueError, match="tc_eff"):
        Calibration(tc_eff=-1)


def test_explain_reports_terms():
    ranked = rank_attention(problem("longformer", seq=512))
    text = explain_ranking("longformer", ranked, top=3)
    assert "occupancy" in text and "L2 time" in text and "DRAM time" in text and str(ranked[0].candidate) in text
    tight = H200.replace(smem_per_block=4096)
    bad = rank_attention(problem("causal", seq=256), tight, keep_infeasible=True)[-1]
    assert "infeasible" in explain_prediction(bad.prediction)


def test_attention_api_uses_the_model_on_cuda():
    from stof_tvm.attention import choose_kernel_config

    mask = normalize_mask("bigbird", seq_q=1024)
    kind, config = choose_kernel_config(mask, batch=8, heads=12, head_dim=64, dtype="float16", target_kind="cuda")
    best = choose_attention(AttentionProblem(batch=8, heads=12, head_dim=64, dtype="float16", mask=MaskProfile(mask)))
    assert (kind, config) == (best.candidate.kind, best.candidate.config)
    config.validate(64)                                   # a configuration the kernel accepts
    # On the CPU the model does not apply: STOF's rule and the kernel's default configuration.
    assert choose_kernel_config(mask, batch=8, heads=12, head_dim=64, dtype="float16", target_kind="llvm")[1] is None


def test_sparse_block_picks_follow_the_h200_where_bounds_tie():
    """Issue 16's sparse shapes (B16 H12 S4096 D64): every 32-row block configuration is predicted at the same L2
    or DRAM bound, so the ranking breaks the tie by the SM term, then by co-resident warps. Session 9's H200 run
    (s9sparse) measured the resulting picks fastest or within 5%: BigBird and Longformer on two-warp 32x32 tiles at
    96 registers (0.196 / 0.262 ms vs 0.240 / 0.274 for the earlier one-warp picks). Sliding, where the SM term ranks
    the one-warp 32x32 tile first, takes its two-warp twin, priced the same (session 36, s36wide, H100, interleaved:
    0.1464 against 0.1512 ms median). The heavy-first D64 forms with one m16 tile a warp are priced at the 96 registers
    ptxas gives them without launch bounds (session 30; bounded, the padded forms spilled and ran slower), others at
    the kernel's estimate. Heavy-first candidates walk their full tiles last column first (session 10, s10sparse:
    BigBird 0.1970 -> 0.1863 ms, Longformer 0.2399 -> 0.2376 at the pick), split-KV ones too; default-order ones do
    not."""
    picks = {}
    for mask in ("bigbird", "longformer", "sliding"):
        ranked = [r for r in rank_attention(problem(mask, batch=16, heads=12, seq=4096)) if r.candidate.kind == "block"]
        picks[mask] = ranked[0].candidate.config
        assert ranked[0].time_s == ranked[1].time_s            # the tie the key breaks
    assert picks["bigbird"] == picks["longformer"] == BlockConfig(32, 32, 2, 2, heavy_first=True, reverse_full=True)
    assert picks["sliding"] == BlockConfig(32, 32, 2, 2)
    ranked = rank_attention(problem("sliding", batch=16, heads=12, seq=4096))
    one_warp = next(r for r in ranked if r.candidate.config == BlockConfig(32, 32, 1, 2))
    terms = one_warp.prediction.terms, ranked[0].prediction.terms
    assert one_warp.time_s == ranked[0].time_s and terms[0]["sm_s"] < terms[1]["sm_s"]
    candidates = [c.config for c in block_candidates(64, H200, (False, True))]
    assert not [c for c in candidates if c.min_blocks]
    assert block_registers(picks["bigbird"], 64) == 96 < picks["bigbird"].registers(64)
    assert block_registers(BlockConfig(32, 32, 2, 2), 64) == BlockConfig(32, 32, 2, 2).registers(64)
    assert block_registers(BlockConfig(64, 64, 4, 2, heavy_first=True), 128) == \
        BlockConfig(64, 64, 4, 2, heavy_first=True).registers(128)
    every = [r.candidate.config for r in rank_attention(problem("longformer", batch=1, heads=12, seq=8192))
             if r.candidate.kind == "block"]
    assert any(c.kv_splits > 1 for c in every)
    assert all(c.reverse_full == c.heavy_first for c in every)


def test_key_padded_ties_go_to_more_co_resident_warps():
    """GPT-2 16x2048's attention (BigBird AND causal, B16 H12 S2048 D64, the HF export's key padding): one- and two-warp
    32x32 tiles tie at the DRAM bound; padded, the two-warp tile goes first (session 11 call 7: 0.064 ms vs 0.075 for
    the one-warp tile) by the key itself; unpadded the key ranks the one-warp tile first on its SM term and the
    two-warp twin is then moved ahead of it (sliding's measured pick, above)."""
    from stof_tvm.cost_model import MaskProfile
    from stof_tvm.sparse_formats import make_mask

    seq = 2048
    keep = make_mask("bigbird", seq) & np.tril(np.ones((seq, seq), dtype=bool))
    picks = {}
    for padding in (False, True):
        prob = AttentionProblem(batch=16, heads=12, head_dim=64, dtype="float16", padding=padding,
                                mask=MaskProfile(normalize_mask(keep, batch=16, heads=12, seq_q=seq)))
        ranked = [r for r in rank_attention(prob) if r.candidate.kind == "block"]
        assert ranked[0].time_s == ranked[1].time_s
        picks[padding] = ranked[0].candidate.config
    assert picks[True] == picks[False] == BlockConfig(32, 32, 2, 2)


def test_grouped_query_attention_reads_each_key_value_head_once():
    """kv_heads: K and V of a key/value head are read from DRAM once for the query heads that share it, so the
    floor drops from Q, K, V and O of every head to Q and O of every head plus K and V of the key/value heads, and
    a memory-bound sparse mask is predicted faster; a kv_heads that does not divide heads is refused."""
    mask = MaskProfile.from_spec("sliding", seq_q=4096, batch=1, heads=1)
    full = AttentionProblem(batch=4, heads=32, head_dim=128, dtype="float16", mask=mask)
    grouped = AttentionProblem(batch=4, heads=32, head_dim=128, dtype="float16", mask=mask, kv_heads=8)
    per_row = 4 * 128 * 2 * 4096
    assert full.dram_floor_bytes() == per_row * 2 * (32 + 32)
    assert grouped.dram_floor_bytes() == per_row * 2 * (32 + 8)
    assert rank_attention(grouped)[0].time_s < rank_attention(full)[0].time_s
    with pytest.raises(ValueError, match="kv_heads"):
        AttentionProblem(batch=4, heads=32, head_dim=128, dtype="float16", mask=mask, kv_heads=5)
