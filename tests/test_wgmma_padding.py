"""The wgmma attention kernel's key padding (``padding=True``): the block-wise kernel's padded parameter list, and a
CUDA source that nvcc builds for sm_90a without spills or serialised wgmma at the configurations the model offers
padded calls (two consumers). Its numerics need an H200: scripts/bench_attention.py plan ``s8wgmma`` checks padded
calls against float32."""
from __future__ import annotations

import re
import shutil

import pytest
import tvm

from stof_tvm.schedules.attention_blockwise import BlockConfig, blockwise_attention_primfunc
from stof_tvm.schedules.attention_wgmma import WgmmaAttentionConfig, cpu_twin_primfunc, wgmma_attention_primfunc
from stof_tvm.schedules.templates.build import cuda_source, cuda_target

from hopper_checks import sm90a_sass

BASE = dict(batch=2, heads=3, seq_q=300, seq_k=300, head_dim=64, dtype="float16", mask_batch=1, mask_heads=1)


def _params(func):
    return [(p.name, [str(x) for x in p.shape], p.dtype) for p in func.params]


def test_padded_parameters_are_the_blockwise_kernels():
    config = WgmmaAttentionConfig(consumers=2)
    ours = wgmma_attention_primfunc(**BASE, config=config, out_layout="bshd", padding=True)
    theirs = blockwise_attention_primfunc(**BASE, target_kind="llvm", out_layout="bshd", padding=True,
                                          config=BlockConfig(block_m=128, block_n=128, num_warps=4))
    assert _params(ours) == _params(theirs)
    assert [p[0] for p in _params(ours)][8:] == ["pad_range", "pad_bits", "out"]
    assert _params(cpu_twin_primfunc(**BASE, config=config, out_layout="bshd", padding=True)) == _params(theirs)
    unpadded = [p[0] for p in _params(wgmma_attention_primfunc(**BASE, config=config))]
    assert "pad_range" not in unpadded and "pad_bits" not in unpadded


def test_padding_needs_self_attention():
    with pytest.raises(ValueError, match="padding"):
        wgmma_attention_primfunc(**dict(BASE, seq_k=400), padding=True)
    with pytest.raises(ValueError, match="padding"):
        wgmma_attention_primfunc(**BASE, padding="yes")


@pytest.mark.parametrize("head_dim, dtype, config", [
    (64, "float16", WgmmaAttentionConfig(block_n=128, stages=3, consumers=2)),
    (128, "bfloat16", WgmmaAttentionConfig(block_n=128, stages=2, consumers=2)),
])
def test_padded_source_builds_for_sm90a_without_spills(head_dim, dtype, config, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    func = wgmma_attention_primfunc(**dict(BASE, head_dim=head_dim, dtype=dtype), config=config, out_layout="bshd",
                                    padding=True)
    src = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=cuda_target("sm_90a")))
    assert "pad_bits" in src and "pad_range" in src
    sass = sm90a_sass(src, tmp_path)
    if sass is not None:
        assert re.search(rf"HGMMA\.64x{config.block_n}x16\.F32", sass)
        assert not re.search(r"\b(LDL|STL)\b", sass)
