"""Grouped-query attention in the sparse kernels: K and V with fewer heads than Q (``kv_heads``), query head ``h``
reading key/value head ``h // (heads / kv_heads)`` (Llama, Qwen2, Mistral). The CPU kernels against a float64
reference on the repeated heads; the CUDA kernels built through nvcc, their default form unchanged."""
from __future__ import annotations

import math

import numpy as np
import pytest
import tvm

from stof_tvm.schedules.attention_blockwise import BlockConfig, blockwise_attention_primfunc
from stof_tvm.schedules.attention_rowwise import ROWWISE_SYMBOL, rowwise_attention_primfunc
from stof_tvm.schedules.attention_wgmma import default_config, wgmma_attention_primfunc
from stof_tvm.schedules.templates.build import cuda_source, cuda_target
from stof_tvm.sparse_formats import build_rows, build_tiled, normalize_mask

from attention_reference import assert_attention_close, numpy_dtype, reference_attention
from hopper_checks import sm90a_sass

LLVM = tvm.target.Target({"kind": "llvm"})
BATCH, HEADS, SEQ, HEAD_DIM = 2, 6, 70, 32


def grouped_inputs(kv_heads: int, dtype: str, seed: int = 0):
    """Q with HEADS heads, K and V with ``kv_heads``, and K and V repeated to every query head (the reference's)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, HEADS, SEQ, HEAD_DIM)).astype(numpy_dtype(dtype))
    k, v = (rng.standard_normal((BATCH, kv_heads, SEQ, HEAD_DIM)).astype(numpy_dtype(dtype)) for _ in range(2))
    group = HEADS // kv_heads
    return q, k, v, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)


def tiled_args(mask4, config):
    fmt = build_tiled(mask4, config.block_m, config.block_n)
    return [fmt.full_indptr, fmt.full_indices if fmt.full_indices.size else np.zeros(1, np.int32),
            fmt.part_indptr, fmt.part_indices if fmt.part_indices.size else np.zeros(1, np.int32),
            fmt.part_bitmaps if fmt.part_bitmaps.size else np.zeros((1, config.block_m // 8, config.block_n // 8),
                                                                    np.uint64)]


def per_head_mask():
    """A different random mask per head (so a head reading the wrong K/V or mask group shows), one empty row."""
    rng = np.random.default_rng(3)
    mask = rng.random((1, HEADS, SEQ, SEQ)) < 0.3
    mask[:, :, 5, :] = False
    return normalize_mask(mask, batch=BATCH, heads=HEADS, seq_q=SEQ)


@pytest.mark.parametrize("kv_heads", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_blockwise_cpu_kernel_reads_each_query_heads_kv_group(kv_heads, dtype):
    mask4 = per_head_mask()
    config = BlockConfig(block_m=32, block_n=32, num_warps=2)
    func = blockwise_attention_primfunc(batch=BATCH, heads=HEADS, seq_q=SEQ, seq_k=SEQ, head_dim=HEAD_DIM,
                                        dtype=dtype, mask_batch=1, mask_heads=HEADS, config=config,
                                        target_kind="llvm", kv_heads=kv_heads)
    assert [int(x) for x in func.params[1].shape] == [BATCH, kv_heads, SEQ, HEAD_DIM]
    fn = tvm.compile(func, target=LLVM)["blockwise_attention"]
    q, k, v, k_full, v_full = grouped_inputs(kv_heads, dtype)
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, numpy_dtype(dtype)))
    fn(*(tvm.runtime.tensor(np.ascontiguousarray(a)) for a in (q, k, v, *tiled_args(mask4, config))), out)
    ref = reference_attention(q, k_full, v_full, mask4, 1 / math.sqrt(HEAD_DIM))
    assert_attention_close(out.numpy(), ref, mask4, dtype)
    # the grouping matters: the first key/value head for every query head is another function
    wrong = reference_attention(q, np.repeat(k[:, :1], HEADS, 1), np.repeat(v[:, :1], HEADS, 1), mask4,
                                1 / math.sqrt(HEAD_DIM))
    assert kv_heads == 1 or np.abs(wrong - ref).max() > 0.1


@pytest.mark.parametrize("kv_heads", [1, 3])
def test_rowwise_cpu_kernel_reads_each_query_heads_kv_group(kv_heads):
    mask4 = per_head_mask()
    func = rowwise_attention_primfunc(batch=BATCH, heads=HEADS, seq_q=SEQ, seq_k=SEQ, head_dim=HEAD_DIM,
                                      dtype="float16", mask_batch=1, mask_heads=HEADS, target_kind="llvm",
                                      kv_heads=kv_heads)
    fn = tvm.compile(func, target=LLVM)[ROWWISE_SYMBOL]
    fmt = build_rows(mask4)
    q, k, v, k_full, v_full = grouped_inputs(kv_heads, "float16", seed=1)
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, np.float16))
    fn(*(tvm.runtime.tensor(a) for a in (q, k, v, fmt.indptr, fmt.indices)), out)
    assert_attention_close(out.numpy(), reference_attention(q, k_full, v_full, mask4, 1 / math.sqrt(HEAD_DIM)),
                           mask4, "float16")


@pytest.mark.parametrize("kv_heads", [0, 4, 12, 2.0, True])
def test_kv_heads_must_divide_the_query_heads(kv_heads):
    with pytest.raises(ValueError, match="kv_heads"):
        blockwise_attention_primfunc(batch=BATCH, heads=HEADS, seq_q=SEQ, seq_k=SEQ, head_dim=HEAD_DIM,
                                     dtype="float16", mask_batch=1, mask_heads=1, target_kind="llvm",
                                     kv_heads=kv_heads)


def _cuda(func, arch: str) -> str:
    return cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=cuda_target(arch)))


def test_cuda_kernels_with_grouped_kv_heads_build_and_keep_their_default_form(tmp_path):
    """Block-wise (mma.sync) and wgmma kernels with two query heads a key/value head: built by nvcc (wgmma: no
    spill, HGMMA, clean SASS); with ``kv_heads == heads`` each is the kernel it was (same CUDA source)."""
    shape = dict(batch=2, heads=4, seq_q=256, seq_k=256, head_dim=64, dtype="float16", mask_batch=1, mask_heads=1)
    block = dict(config=BlockConfig(block_m=64, block_n=64, num_warps=4), target_kind="cuda")
    grouped = _cuda(blockwise_attention_primfunc(**shape, **block, kv_heads=2), "sm_90")
    assert _cuda(blockwise_attention_primfunc(**shape, **block, kv_heads=4), "sm_90") == \
        _cuda(blockwise_attention_primfunc(**shape, **block), "sm_90")
    assert "mma.sync" in grouped
    wgmma = dict(config=default_config(64))
    source = _cuda(wgmma_attention_primfunc(**shape, **wgmma, kv_heads=2), "sm_90a")
    assert _cuda(wgmma_attention_primfunc(**shape, **wgmma, kv_heads=4), "sm_90a") == \
        _cuda(wgmma_attention_primfunc(**shape, **wgmma), "sm_90a")
    sm90a_sass(source, tmp_path)


@pytest.mark.parametrize("kernel", ["row", "block"])
def test_sparse_attention_takes_kv_with_fewer_heads(kernel, tmp_path):
    """The Python API: ``sparse_attention`` with K and V of fewer heads than Q plans grouped-query attention (kv
    heads from K's shape); ``AttentionPlan(kv_heads=...)`` checks K and V against them and survives save / load."""
    import stof_tvm

    q, k, v, k_full, v_full = grouped_inputs(2, "float16", seed=4)
    mask4 = normalize_mask("bigbird", batch=BATCH, heads=HEADS, seq_q=SEQ)
    ref = reference_attention(q, k_full, v_full, mask4, 1 / math.sqrt(HEAD_DIM))
    out = stof_tvm.sparse_attention(q, k, v, "bigbird", kernel=kernel, target="llvm")
    assert_attention_close(out, ref, mask4, "float16")
    plan = stof_tvm.AttentionPlan("bigbird", q.shape, "float16", kernel=kernel, target="llvm", kv_heads=2)
    with pytest.raises(ValueError, match=r"k must have shape \(2, 2, 70, 32\)"):
        plan.run(q, k_full, v_full)
    loaded = stof_tvm.AttentionPlan.load(plan.save(tmp_path / "plan"))
    assert loaded.problem.kv_heads == 2
    np.testing.assert_array_equal(loaded.run(q, k, v), plan.run(q, k, v))
    with pytest.raises(ValueError, match="kv_heads"):
        stof_tvm.AttentionPlan("bigbird", q.shape, "float16", kernel=kernel, target="llvm", kv_heads=4)
