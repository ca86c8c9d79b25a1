"""The wgmma kernels' ``weight_prefetch`` knob (schedules/templates/wgmma_kernel.py), on in the split-K knob sets:
before its own programmatic dependent launch wait, the producer warpgroup asks L2 for the W rows of the block's
first tile; off, the kernels are byte for byte the ones without the knob. Timings need an H200 (BENCHMARKS.md,
session 15)."""
from __future__ import annotations

import re
import shutil

import pytest
import tvm

from stof_tvm.compiler.cubins import cuda_sources
from stof_tvm.schedules import dependent_launch as dl
from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel

from hopper_checks import sm90a_sass
from test_dependent_launch import SIGNAL, WAIT, kernel_bodies

PREFETCH = re.compile(r"prefetch_L2_global\(\(&\(W_ptr\[(?P<index>[^;]*)\]\)\), \(uint\)(?P<bytes>\d+)\);")
# RoBERTa-base's FFN down-projection at 1 x 128 tokens, its first (split-K, cp.async) knob set, and a TMA set
FFN_DOWN = {"m": 128, "n": 768, "k": 3072}
SPLIT = {"block_n": 128, "stages": 4, "persistent": False, "pingpong": False, "split_k": 8, "loads": "cp.async"}
TMA = {"block_n": 192, "stages": 4, "persistent": True, "pingpong": False, "staged": True, "loads": "tma"}


def _body(src: str) -> str:
    (body,) = kernel_bodies(src).values()
    return body


def test_off_builds_the_kernels_without_the_knob():
    for knobs in (SPLIT, TMA):
        assert (cuda_source(build_kernel("gemm_bias_wgmma", FFN_DOWN, "float16", knobs))
                == cuda_source(build_kernel("gemm_bias_wgmma", FFN_DOWN, "float16", dict(knobs, weight_prefetch=False))))


@pytest.mark.parametrize("knobs, row_bytes", [(SPLIT, 3072 // 64 // 8 * 128), (TMA, 3072 // 64 * 128)])
def test_the_first_tiles_weight_rows_are_asked_for_before_the_wait(knobs, row_bytes, tmp_path):
    """One request per W row of the block's first tile (its k slice under split-K: 6 of 48 k steps), by the producer
    warpgroup, then the wait and the signal, all before the mbarriers are set up; one wait in the kernel."""
    src = cuda_source(build_kernel("gemm_bias_wgmma", FFN_DOWN, "float16", dict(knobs, weight_prefetch=True)))
    body = _body(src)
    requests = list(PREFETCH.finditer(body))
    assert len(requests) == -(-knobs["block_n"] // 128)
    assert {int(r["bytes"]) for r in requests} == {row_bytes}
    assert "threadIdx.x) < 128" in body[:requests[0].start()]
    assert body.count(WAIT) == 1 and body.count(SIGNAL) == 1
    assert requests[-1].end() < body.index(WAIT) < body.index(SIGNAL) < body.index("mbarrier_init")
    if shutil.which("nvcc"):
        sm90a_sass(src, tmp_path, any_warning=True)      # ptxas: no spills, no stack frame, no warning


def test_the_dependent_launch_pass_keeps_the_kernels_own_wait():
    func = get_template("gemm_bias_wgmma").kernel(FFN_DOWN, "float16", dict(SPLIT, weight_prefetch=True))
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    executable = tvm.compile(tvm.IRModule({"main": func}), target=target, tir_pipeline=dl.PIPELINE)
    body = _body(cuda_sources(executable)[0])
    assert body.count(WAIT) == 1 and body.count(SIGNAL) == 1
    assert PREFETCH.search(body).end() < body.index(WAIT)


def test_bad_value_is_refused():
    with pytest.raises(ValueError, match="weight_prefetch must be a bool"):
        get_template("gemm_wgmma").kernel(FFN_DOWN, knobs=dict(SPLIT, weight_prefetch="yes"))


@pytest.mark.parametrize("name, shape", [
    ("qkv_projection_wgmma", {"batch": 1, "seq": 128, "heads": 12, "head_dim": 64}),
    ("gemm_wgmma", {"m": 128, "n": 768, "k": 768}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 128, "n": 3072, "k": 768}),
    ("gemm_bias_gelu_tanh_wgmma", {"m": 128, "n": 3072, "k": 768}),
    ("gemm_bias_wgmma", FFN_DOWN),
])
def test_the_split_k_sets_prefetch_and_lead_at_128_rows(name, shape):
    """RoBERTa-base / GPT-2 at 1 x 128 tokens: every GEMM's first knob set (the compile path's untuned choice) is a
    split-K set with ``weight_prefetch``; every split set has it, no unsplit set does."""
    space = get_template(name).knob_space(shape, "float16")
    assert space[0].get("split_k", 1) > 1 and space[0]["weight_prefetch"] is True
    assert all(kn.get("weight_prefetch") is (True if kn.get("split_k", 1) > 1 else None) for kn in space)


def test_many_rows_keep_the_kernels_without_prefetch():
    """At 4096 rows (8 x 512 tokens, where prefetching every GEMM's weights measured 0.935x) the first sets are
    unsplit and build without it."""
    for name, shape in (("gemm_bias_wgmma", {"m": 4096, "n": 768, "k": 3072}),
                        ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64})):
        first = get_template(name).knob_space(shape, "float16")[0]
        assert "weight_prefetch" not in first
        assert "prefetch_L2_global" not in cuda_source(build_kernel(name, shape, "float16", first))
