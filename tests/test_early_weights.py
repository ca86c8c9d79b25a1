"""The wgmma kernels' ``early_weights`` knob (schedules/templates/wgmma_kernel.py): the W part of the ring's first
slots is loaded into shared memory before the kernel's own programmatic dependent launch wait (W is a weight: the
kernel before cannot write it), and A after it. Off, the kernels are byte for byte the ones without the knob; on,
every thread that reads A or writes the output runs the wait first, and the dependent-launch pass adds none. The
unsplit knob sets of the spaces take it (measured on whole models, BENCHMARKS.md sessions 16 and 21); the split-K sets
prefetch their weights into L2 instead."""
from __future__ import annotations

import re
import shutil

import pytest
import tvm

from stof_tvm.compiler import compile as stof_compile
from stof_tvm.compiler.cubins import cuda_sources
from stof_tvm.schedules import dependent_launch as dl
from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel

from hopper_checks import clean_sm90a_sass
from test_dependent_launch import SIGNAL, WAIT, kernel_bodies

# RoBERTa-base's FFN down-projection at 1 x 128 tokens: a split-K cp.async set (6 k steps a block, 4 slots) and a
# persistent TMA set (48 k steps, 4 slots)
FFN_DOWN = {"m": 128, "n": 768, "k": 3072}
SPLIT = {"block_n": 128, "stages": 4, "persistent": False, "pingpong": False, "split_k": 8, "loads": "cp.async"}
TMA = {"block_n": 192, "stages": 4, "persistent": True, "pingpong": False, "staged": True, "loads": "tma"}
W_COPY = re.compile(r"cp_async_cg\w*\([^;]*&\(W_ptr\[")
A_COPY = re.compile(r"cp_async_cg\w*\([^;]*&\(A_ptr\[")
TMA_BOX = re.compile(r"tensor_2d\w*\([^;]*\);")
EXPECT = r"expect_tx\w*\("


def _body(knobs) -> str:
    (body,) = kernel_bodies(cuda_source(build_kernel("gemm_bias_wgmma", FFN_DOWN, "float16", knobs))).values()
    return body


@pytest.mark.parametrize("knobs", [SPLIT, TMA])
def test_off_builds_the_kernels_without_the_knob(knobs):
    assert _body(knobs) == _body(dict(knobs, early_weights=False))


def test_cp_async_loads_the_first_slots_weights_before_the_wait():
    """All four slots' W pieces (8 a thread each) before the producer's wait, every A piece after it; the consumers
    wait too (they store the output), so two waits in the source and none before the early loads."""
    body = _body(dict(SPLIT, early_weights=True))
    first_wait = body.index(WAIT)
    early = [m for m in W_COPY.finditer(body) if m.start() < first_wait]
    assert len(early) == 4 * 8
    assert all(m.start() > first_wait for m in A_COPY.finditer(body))
    assert body.count(WAIT) == 2 and body.count(SIGNAL) == 2
    assert body.index("mbarrier_init") < early[0].start()


def test_tma_announces_the_first_slots_and_issues_their_weight_boxes_before_the_wait():
    """One thread: four expect_tx + W boxes before its wait; after it the four A boxes of those slots, then the
    rest of the ring's A + W boxes."""
    body = _body(dict(TMA, early_weights=True))
    first_wait = body.index(WAIT)
    before, boxes = body[:first_wait], TMA_BOX.findall(body[:first_wait])
    assert len(re.findall(EXPECT, before)) == 4 and len(boxes) == 4 and all("&(w_map)" in box for box in boxes), boxes
    assert any("&(a_map)" in box for box in TMA_BOX.findall(body[first_wait:]))
    assert body.count(WAIT) == 2


@pytest.mark.parametrize("knobs", [SPLIT, TMA])
def test_ptxas_reports_no_spills_and_hgmma_stays(knobs, tmp_path):
    """With the L2 prefetch as well (the split sets' knobs): no stack frame, spills or ptxas warning; HGMMA in the
    SASS where cuobjdump is present."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    src = cuda_source(build_kernel("gemm_bias_wgmma", FFN_DOWN, "float16", dict(knobs, early_weights=True,
                                                                                 weight_prefetch=True)))
    clean_sm90a_sass(src, tmp_path)


def test_the_dependent_launch_pass_adds_no_wait():
    func = get_template("gemm_bias_wgmma").kernel(FFN_DOWN, "float16", dict(SPLIT, early_weights=True))
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    executable = tvm.compile(tvm.IRModule({"main": func}), target=target, tir_pipeline=dl.PIPELINE)
    (body,) = kernel_bodies(cuda_sources(executable)[0]).values()
    assert body.count(WAIT) == 2


def test_bad_value_is_refused():
    with pytest.raises(ValueError, match="early_weights must be a bool"):
        get_template("gemm_wgmma").kernel(FFN_DOWN, knobs=dict(SPLIT, early_weights="yes"))


def test_compile_option_merges_the_knob_into_every_wgmma_gemm(hf_export):
    """``gemm_knobs`` (the compile option that measures a knob across a model): a wgmma GEMM's chosen knobs carry
    it, another template's do not; a value that is not a dict of names is refused."""
    from stof_tvm.compiler.downstream import _Templates

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a", "max_threads_per_block": 1024,
                                "max_shared_memory_per_block": 232448})
    templates = _Templates(tvm.IRModule(), target, None, "wgmma", schedule=False, gemm_knobs={"early_weights": True})
    _, gemm = templates.function("gemm_wgmma", {"m": 128, "n": 768, "k": 768}, "float16")
    _, norm = templates.function("layernorm", {"m": 128, "n": 768}, "float16")
    assert gemm.knobs["early_weights"] is True and "early_weights" not in (norm.knobs or {})
    path = hf_export("bert", "eager", "torchscript", 17, True, 2, 128)
    with pytest.raises(TypeError, match="gemm_knobs"):
        stof_compile(path, mask="bigbird", batch=1, seq_len=128, target="cuda", gemm_knobs=["early_weights"])


@pytest.mark.parametrize("name, shape", [
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 3072, "k": 768}),
    ("gemm_bias_wgmma", FFN_DOWN),
    ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64}),
    ("gemm_wgmma", {"m": 1576, "n": 768, "k": 768}),
])
def test_unsplit_knob_sets_take_it_and_split_sets_prefetch_instead(name, shape):
    """Every knob set of the spaces without split-K has ``early_weights``; every split-K set has ``weight_prefetch``
    and not ``early_weights``; the compile path's first set builds its early W loads (before the wait) where it is
    unsplit."""
    space = get_template(name).knob_space(shape, "float16")
    for knobs in space:
        split = knobs.get("split_k", 1) > 1
        assert knobs.get("early_weights", False) is not split and knobs.get("weight_prefetch", False) is split
    if "split_k" not in space[0] and space[0]["loads"] == "tma":
        (body,) = kernel_bodies(cuda_source(build_kernel(name, shape, "float16"))).values()
        assert body.index("tensor_2d") < body.index(WAIT)   # the first W box goes out before the wait
