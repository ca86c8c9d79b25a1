"""The vectorised knob spaces and stage-1 ranking equal a one-configuration-at-a-time Python reference exactly.

:func:`mainloop_space`, :meth:`Template.knob_space` and :func:`rank_template` compute over numpy columns; the
references below are the plain per-configuration formulas (Python ints and floats, ``math.ceil``, ``min``/``max``),
so any slip in the array translation, the enumeration order or the tie-breaking changes a list and fails.
"""
import math

import numpy as np
import pytest

from stof_tvm.cost_model.core import DEFAULT_CALIBRATION, predict, predict_uniform
from stof_tvm.cost_model.templates import rank_template, template_calibration, template_hardware, template_work
from stof_tvm.hardware import H200
from stof_tvm.schedules.templates import TEMPLATES
from stof_tvm.schedules.templates import gemm
from stof_tvm.schedules.templates.mainloop import ACC_PAD, COPY_BYTES, PAD


def _reference_resources(m, n, k, kn):
    bm, bn, bk = 16 * kn["warps_m"] * kn["frag_m"], 16 * kn["warps_n"] * kn["frag_n"], 16 * kn["k_frags"]
    threads = 32 * kn["warps_m"] * kn["warps_n"]
    return bm, bn, bk, threads, max(kn["stages"] * (bm + bn) * (bk + PAD) * 2, bm * (bn + ACC_PAD) * 4)


def _reference_tiles_ok(m, n, k, kn):
    bm, bn, bk, threads, _ = _reference_resources(m, n, k, kn)
    return (m % bm == 0 and n % bn == 0 and k % bk == 0 and (bm * bk) % (threads * COPY_BYTES // 2) == 0
            and (bn * bk) % (threads * COPY_BYTES // 2) == 0 and (bm * bn) % (threads * kn["vec"]) == 0
            and 8 * kn["frag_m"] * kn["frag_n"] <= gemm.MAX_ACC_REGISTERS)


def _reference_estimate(m, n, k, kn, hw=gemm.H200):
    bm, bn, bk, threads, smem = _reference_resources(m, n, k, kn)
    grid = (m // bm) * (n // bn)
    per_sm = max(1, min(2048 // threads, hw.max_shared_bytes_per_block // max(smem, 1), math.ceil(grid / hw.sm_count)))
    waves = math.ceil(grid / (hw.sm_count * per_sm))
    fm, fn = kn["frag_m"], kn["frag_n"]
    tile_eff = min(1.0, fm * fn / (fm + fn) / 2)
    occupancy = min(1.0, per_sm * threads / 32 / 8)
    compute = per_sm * 2 * bm * bn * k / (gemm.MMA_FLOPS_PER_SM * tile_eff * occupancy)
    memory = per_sm * (bm + bn) * k * 2 / gemm.L2_BYTES_PER_SM
    return waves * max(compute, memory)


def _reference_mainloop_space(m, n, k, warps_n=gemm.WARP_CHOICES, frag_n=gemm.FRAG_CHOICES):
    space = [{"warps_m": wm, "frag_m": fm, "warps_n": wn, "frag_n": fn, "k_frags": kf, "stages": st, "vec": vec}
             for wm in gemm.WARP_CHOICES for wn in warps_n for fm in gemm.FRAG_CHOICES for fn in frag_n
             for kf in gemm.KFRAG_CHOICES for st in gemm.STAGE_CHOICES for vec in gemm.VEC_CHOICES]
    space = [kn for kn in space if _reference_tiles_ok(m, n, k, kn)]
    return sorted(space, key=lambda kn: (round(_reference_estimate(m, n, k, kn), 7), abs(kn["stages"] - 3),
                                         kn["k_frags"], -kn["vec"]))


@pytest.mark.parametrize("m, n, k, narrow", [(4096, 768, 3072, False), (4096, 3072, 768, False),
                                             (4096, 2304, 768, False), (256, 512, 128, False),
                                             (1024, 768, 768, True)])
def test_mainloop_space_equals_per_configuration_reference(m, n, k, narrow):
    choices = {"warps_n": (1, 2), "frag_n": (2, 4)} if narrow else {}
    fast = gemm.mainloop_space(m, n, k, **choices)
    reference = _reference_mainloop_space(m, n, k, **choices)
    assert len(reference) > 10
    assert fast == reference
    assert [list(kn) for kn in fast] == [list(kn) for kn in reference]  # same key order
    assert all(type(v) is int for kn in fast for v in kn.values())
    assert [gemm.mainloop_resources(m, n, k, kn)["shared_bytes"] for kn in fast] == [
        _reference_resources(m, n, k, kn)[4] for kn in fast]


def _reference_fits(res, hw):
    regs = res.get("acc_registers", 0) + res.get("operand_registers", 0) + 40
    return (res["threads"] <= hw.max_threads_per_block and res["shared_bytes"] <= hw.max_shared_bytes_per_block
            and regs <= hw.max_registers_per_thread and regs * res["threads"] <= hw.registers_per_sm)


def _reference_ranking(template, shape, dtype, space, cal=DEFAULT_CALIBRATION):
    """(knob sets, seconds) fastest first: each knob set's launch terms in Python, then :func:`predict_uniform`."""
    args = template.arguments(shape, dtype)
    sizes = [float(np.prod(s)) for _, s, _ in args]
    nbytes = [size * 2 for size in sizes]
    flops, dram, out_bytes, out_elems = float(template.flops(shape)), sum(nbytes), nbytes[-1], sizes[-1]
    rows = []
    for kn in space:
        res = template.resources(shape, dtype, kn)
        grid = max(res["grid"], 1)
        units = max(res["tiles"], 1) if "tiles" in res else grid   # persistent blocks loop over whole tiles
        rounds = math.ceil(units / grid)
        per_block = flops / units * rounds
        trips, l2, smem = 0.0, dram, 0.0
        if "block_m" in res:
            bm, bn, bk = res["block_m"], res["block_n"], res["block_k"]
            trips = per_block / (2.0 * bm * bn * bk)
            l2 = units * (flops / units / (2.0 * bm * bn * bk)) * (bm + bn) * bk * 2 + out_bytes
            smem = trips * bk * 2 * (bm + bn + bm * kn.get("warps_n", 1) + bn * kn.get("warps_m", 1))
        stages = kn.get("stages") or 0
        pipeline = 1.0 if stages < 3 else 0.5 * (1.0 + 1.0 / (stages - 1))
        latency = trips * cal.gemm_iter_cycles * pipeline + cal.gemm_block_cycles
        regs = res.get("launch_registers", res.get("acc_registers", 0) + res.get("operand_registers", 0) + 40)
        # the ping-pong wgmma kernel overlaps all but the block's last tile's epilogue with tensor-core work
        block_elems = out_elems / units * rounds
        epilogue_elems = out_elems / max(res["tiles"], 1) if res.get("overlapped_epilogue") else block_elems
        cuda_ops = (cal.epilogue_ops + res.get("activation_ops", 0.0)) * epilogue_elems + cal.smem_ops_per_byte * smem
        if res.get("narrow_stores"):   # the direct wgmma epilogue: one 2-byte store per output element
            cuda_ops += cal.narrow_store_ops * block_elems
        if res.get("wgmma"):           # wgmma's main-loop rate, in mma.sync-equivalent flops
            per_block *= cal.gemm_tc_eff / cal.wgmma_tc_eff
        rows.append((res["threads"], res["shared_bytes"], regs, grid, per_block, cuda_ops, latency, dram, l2))
    times = predict_uniform(*np.array(rows, dtype=np.float64).T, hw=H200, cal=cal.replace(tc_eff=cal.gemm_tc_eff))
    order = [i for i in np.argsort(times, kind="stable") if np.isfinite(times[i])]
    return [space[i] for i in order], [float(times[i]) for i in order]


@pytest.mark.parametrize("name, shape", [
    ("gemm_bias_kn", {"m": 4096, "n": 768, "k": 3072}),
    ("gemm_bias_gelu_erf", {"m": 4096, "n": 3072, "k": 768}),
    ("gemm", {"m": 256, "n": 512, "k": 128}),
    ("qkv_projection_kn", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64}),
    ("qkv_projection", {"batch": 2, "seq": 128, "heads": 4, "head_dim": 32}),
    ("gemm_bias_residual_layernorm", {"m": 4096, "n": 768, "k": 3072}),
    ("layernorm", {"m": 4096, "n": 768}),
    ("split_heads", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64}),
    ("gemm_bias_wgmma", {"m": 4096, "n": 768, "k": 768}),
])
def test_knob_space_and_ranking_equal_per_configuration_reference(name, shape):
    template, hw = TEMPLATES[name], template_hardware(H200)
    space = template.knob_space(shape, "float16", hw)
    if name != "gemm_bias_wgmma":  # its own limits (setmaxnreg) replace the generic register check
        reference_space = [kn for kn in template._knob_space(shape, "float16", hw)
                           if _reference_fits(template.resources(shape, "float16", kn), hw)]
        assert space == reference_space
    ranked = rank_template(template, shape, "float16")
    order, seconds = _reference_ranking(template, shape, "float16", space)
    assert len(order) > 1
    assert [r.candidate for r in ranked] == order
    assert [r.time_s for r in ranked] == seconds
    for r in ranked[:8]:  # the explained head: the full model's prediction for the same knob set
        assert r.prediction == predict(template_work(template, shape, "float16", r.candidate), H200,
                                       template_calibration(DEFAULT_CALIBRATION))
        assert r.time_s == pytest.approx(seconds[ranked.index(r)], rel=1e-12)
