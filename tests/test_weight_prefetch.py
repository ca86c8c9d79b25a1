"""The wgmma kernels' ``weight_prefetch`` knob (schedules/templates/wgmma_kernel.py) and the compile option that sets
it: before its own programmatic dependent launch wait, the producer warpgroup asks L2 for the W rows of the block's
first tile; off, the kernels are byte for byte the ones without the knob. Timings need an H200
(scripts/bench_e2e.py --ours-variants)."""
from __future__ import annotations

import re
import shutil
import warnings

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


def test_the_compile_option_reaches_every_wgmma_gemm_of_a_real_export(hf_export):
    """A tiny HF RoBERTa (TorchScript, opset 17) for sm_90 with ``weight_prefetch=True``: every wgmma stage's knobs
    carry it and each of the four GEMM kernels asks for its weights before its one wait; the option is refused
    without dependent launches and for a non-bool."""
    import stof_tvm
    from stof_tvm.compiler import front_end, lower

    path = hf_export("roberta", "eager", "torchscript", 17, True, 2, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        front = front_end(path, mask="bigbird", batch=48, seq_len=256, target="cuda", dtype="float16", gemm="wgmma",
                          weight_prefetch=True)
    stages = [stage for site in front.template_entry["sites"] for stage in site["stages"]]
    wgmma = [stage for stage in stages if stage["template"].endswith("_wgmma")]
    assert {stage["template"] for stage in wgmma} == {"qkv_projection_wgmma", "gemm_wgmma", "gemm_bias_gelu_erf_wgmma"}
    assert all(stage["knobs"]["weight_prefetch"] is True for stage in wgmma)
    _, executable = lower(front, None, cuda_graph=True, dependent_launch=True)
    (src,) = cuda_sources(executable)
    gemms = {name: body for name, body in kernel_bodies(src).items() if "wgmma" in name and "attention" not in name}
    assert len(gemms) == 4
    for name, body in gemms.items():
        assert body.count(WAIT) == 1 and PREFETCH.search(body).end() < body.index(WAIT), name
    with pytest.raises(ValueError, match="dependent launch"):
        stof_tvm.compile(path, mask="bigbird", batch=2, seq_len=64, target="cuda", weight_prefetch=True,
                         dependent_launch=False)
    with pytest.raises(TypeError, match="weight_prefetch"):
        stof_tvm.compile(path, mask="bigbird", batch=2, seq_len=64, target="cuda", weight_prefetch="yes")
