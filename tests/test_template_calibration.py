"""The fusion-template constants of the model: their own calibration, loading, and how they move predictions."""
from __future__ import annotations

import json

import numpy as np
import pytest

from stof_tvm.cost_model import (AttentionCandidate, AttentionProblem, Calibration, DEFAULT_CALIBRATION,
                                 attention_work, predict)
from stof_tvm.cost_model.templates import price_knobs, rank_template, template_calibration
from stof_tvm.hardware import H200
from stof_tvm.schedules.attention_blockwise import BlockConfig
from stof_tvm.schedules.templates import TEMPLATES

GEMM = (TEMPLATES["gemm_kn"], {"m": 4096, "n": 768, "k": 3072})
LAYERNORM = (TEMPLATES["bias_residual_layernorm"], {"m": 4096, "n": 768})
TEMPLATE_CONSTANTS = ("gemm_tc_eff", "gemm_iter_cycles", "gemm_block_cycles", "smem_ops_per_byte", "epilogue_ops")


def _space(template, shape, n=64):
    return template.knob_space(shape, "float16")[:n]


def test_template_calibration_swaps_only_the_tensor_core_efficiency():
    cal = DEFAULT_CALIBRATION.replace(gemm_tc_eff=0.3, tc_eff=0.9)
    priced = template_calibration(cal)
    assert priced.tc_eff == 0.3
    assert priced.replace(tc_eff=0.9) == cal


def test_partial_constants_file_loads_over_the_defaults(tmp_path):
    path = tmp_path / "templates.json"
    path.write_text(json.dumps({"gemm_tc_eff": 0.41, "smem_ops_per_byte": 1.5}))
    cal = Calibration.load(str(path))
    assert (cal.gemm_tc_eff, cal.smem_ops_per_byte) == (0.41, 1.5)
    assert cal.replace(gemm_tc_eff=DEFAULT_CALIBRATION.gemm_tc_eff,
                       smem_ops_per_byte=DEFAULT_CALIBRATION.smem_ops_per_byte) == DEFAULT_CALIBRATION
    path.write_text(json.dumps({"gemm_tc_eff": 0.41, "gemm_tile_cycles": 3.0}))
    with pytest.raises(ValueError, match="gemm_tile_cycles"):
        Calibration.load(str(path))
    with pytest.raises(ValueError, match="smem_ops_per_byte"):
        Calibration(smem_ops_per_byte=-1.0)


@pytest.mark.parametrize("name, up", [("gemm_iter_cycles", True), ("gemm_block_cycles", True),
                                      ("smem_ops_per_byte", True), ("epilogue_ops", True), ("gemm_tc_eff", False)])
def test_gemm_time_is_monotonic_in_each_template_constant(name, up):
    template, shape = GEMM
    space = _space(template, shape)
    low, high = (1.0, 4.0) if name != "gemm_tc_eff" else (0.2, 0.8)
    base = DEFAULT_CALIBRATION.replace(smem_ops_per_byte=1.0)
    t_low = price_knobs(template, shape, "float16", space, cal=base.replace(**{name: low}))
    t_high = price_knobs(template, shape, "float16", space, cal=base.replace(**{name: high}))
    assert np.all(np.isfinite(t_low)) and np.all(np.isfinite(t_high))
    grows = t_high >= t_low if up else t_high <= t_low
    assert grows.all()
    assert (t_high != t_low).any()


def test_smaller_warp_tiles_cost_more_shared_memory_traffic():
    # One 128x128 block tile split over 2x2 or 4x4 warps: the same work and traffic outside the SM, but 4x4
    # warps re-read the shared panels twice as often (ldmatrix of smaller warp tiles).
    template, shape = GEMM
    common = {"k_frags": 2, "stages": 3, "vec": 8}
    wide = {"warps_m": 2, "frag_m": 4, "warps_n": 2, "frag_n": 4, **common}
    narrow = {"warps_m": 4, "frag_m": 2, "warps_n": 4, "frag_n": 2, **common}
    free = DEFAULT_CALIBRATION.replace(smem_ops_per_byte=0.0, gemm_iter_cycles=0.0, gemm_block_cycles=0.0)
    priced = free.replace(smem_ops_per_byte=8.0)
    t_free = price_knobs(template, shape, "float16", [wide, narrow], cal=free)
    t_priced = price_knobs(template, shape, "float16", [wide, narrow], cal=priced)
    assert t_priced[1] - t_free[1] > t_priced[0] - t_free[0] > 0


def test_layernorm_ignores_main_loop_constants():
    template, shape = LAYERNORM
    space = _space(template, shape)
    base = price_knobs(template, shape, "float16", space)
    moved = price_knobs(template, shape, "float16", space, cal=DEFAULT_CALIBRATION.replace(
        gemm_iter_cycles=5000.0, smem_ops_per_byte=10.0, gemm_tc_eff=0.1))
    assert np.array_equal(base, moved)


def test_attention_ignores_template_constants():
    prob = AttentionProblem.build("bigbird", batch=2, heads=4, seq_len=512, head_dim=64)
    cand = AttentionCandidate("block", BlockConfig(64, 64, 4, 2, False))
    moved = DEFAULT_CALIBRATION.replace(**{name: 2.5 for name in TEMPLATE_CONSTANTS})
    assert predict(attention_work(prob, cand, moved), H200, moved) == predict(attention_work(prob, cand), H200)


def test_price_knobs_matches_the_ranking_and_rejects_an_empty_space():
    template, shape = GEMM
    space = _space(template, shape, 200)
    times = price_knobs(template, shape, "float16", space)
    ranked = rank_template(template, shape, "float16", knob_space=space, explain_top=0)
    assert [r.time_s for r in ranked] == sorted(t for t in times.tolist() if np.isfinite(t))
    with pytest.raises(ValueError, match="space"):
        price_knobs(template, shape, "float16", [])
