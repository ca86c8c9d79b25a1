"""Key padding applied inside the sparse kernels (``padding=True``): the device summary of an ``attention_mask``
(key_padding), and both kernels on llvm against a float64 reference for right padding of every length 1..S, a
fully padded batch row, and irregular patterns (left padding, holes); CUDA code compiled for sm_90 by nvcc."""
from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
import tvm
from hypothesis import given, settings, strategies as st

from stof_tvm.schedules.attention_blockwise import BlockConfig, blockwise_attention_primfunc
from stof_tvm.schedules.attention_rowwise import rowwise_attention_primfunc
from stof_tvm.schedules.key_padding import bit_words, key_padding_primfunc
from stof_tvm.sparse_formats import build_rows, build_tiled, make_mask

from attention_reference import random_qkv, reference_attention, relative_error
from hopper_checks import sm90_ptxas_report

LLVM = tvm.target.Target({"kind": "llvm"})
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
                          "max_shared_memory_per_block": 232448}, host={"kind": "llvm"})
SMALL = BlockConfig(block_m=32, block_n=32, num_warps=2, stages=2)
_BUILT: dict = {}


def summary_reference(mask: np.ndarray):
    """pad_range and pad_bits of a [B, S] attention mask, from their definition."""
    batch, seq = mask.shape
    ranges = np.zeros((batch, 3), np.int32)
    bits = np.zeros((batch, bit_words(seq)), np.uint32)
    for b in range(batch):
        kept = np.flatnonzero(mask[b])
        if kept.size:
            lo, hi = kept[0], kept[-1] + 1
            ranges[b] = lo, hi, int(kept.size != hi - lo)
        for j in kept:
            bits[b, j // 32] |= np.uint32(1) << np.uint32(j % 32)
    return ranges, bits


def run_summary(mask: np.ndarray):
    key = ("summary", mask.shape, str(mask.dtype))
    if key not in _BUILT:
        func = key_padding_primfunc(batch=mask.shape[0], seq_k=mask.shape[1], dtype=str(mask.dtype),
                                    target_kind="llvm")
        _BUILT[key] = tvm.compile(func, target=LLVM)["stof_key_padding"]
    ranges = tvm.runtime.tensor(np.full((mask.shape[0], 3), -7, np.int32))
    bits = tvm.runtime.tensor(np.full((mask.shape[0], bit_words(mask.shape[1])), 7, np.uint32))
    _BUILT[key](tvm.runtime.tensor(mask), ranges, bits)
    return ranges.numpy(), bits.numpy()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 100), st.data())
def test_summary_matches_its_definition(batch, seq, data):
    mask = np.array(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=seq, max_size=seq),
                                       min_size=batch, max_size=batch)), np.int64)
    got_ranges, got_bits = run_summary(mask)
    want_ranges, want_bits = summary_reference(mask)
    np.testing.assert_array_equal(got_ranges, want_ranges)
    np.testing.assert_array_equal(got_bits, want_bits)


def kernel_args(kind: str, mask2d: np.ndarray, config):
    if kind == "row":
        fmt = build_rows(mask2d[None, None])
        return [fmt.indptr, fmt.indices if fmt.indices.size else np.zeros(1, np.int32)]
    fmt = build_tiled(mask2d[None, None], config.block_m, config.block_n)
    return [fmt.full_indptr, fmt.full_indices if fmt.full_indices.size else np.zeros(1, np.int32),
            fmt.part_indptr, fmt.part_indices if fmt.part_indices.size else np.zeros(1, np.int32),
            fmt.part_bitmaps if fmt.part_bitmaps.size
            else np.zeros((1, config.block_m // 8, config.block_n // 8), np.uint64)]


def padded_kernel(kind: str, batch: int, heads: int, seq: int, dtype: str, target_kind: str = "llvm"):
    common = dict(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=64, dtype=dtype, mask_batch=1,
                  mask_heads=1, target_kind=target_kind, padding=True)
    if kind == "row":
        return rowwise_attention_primfunc(**common)
    return blockwise_attention_primfunc(**common, config=SMALL)


def run_padded(kind: str, mask2d: np.ndarray, attention_mask: np.ndarray, heads: int = 2, dtype: str = "float16"):
    """The kernel's output for a shared sparse mask and per-batch key padding (the summary computed by
    key_padding on llvm, as the compiled module does)."""
    batch, seq = attention_mask.shape
    key = (kind, batch, heads, seq, dtype)
    if key not in _BUILT:
        symbol = "rowwise_attention" if kind == "row" else "blockwise_attention"
        _BUILT[key] = tvm.compile(padded_kernel(kind, batch, heads, seq, dtype), target=LLVM)[symbol]
    q, k, v = random_qkv(batch, heads, seq, seq, 64, dtype, seed=seq)
    ranges, bits = run_summary(attention_mask)
    out = np.full(q.shape, np.nan, q.dtype)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in
            (q, k, v, *kernel_args(kind, mask2d, SMALL), ranges, bits, out)]
    _BUILT[key](*args)
    return q, k, v, args[-1].numpy().astype(np.float64)


def expected(q, k, v, mask2d, attention_mask):
    """Reference: at every query row, the keys kept by the mask and by the padding."""
    keep = mask2d[None, None] & (attention_mask != 0)[:, None, None, :]
    return reference_attention(q, k, v, keep, 1 / math.sqrt(q.shape[-1]))


@pytest.mark.parametrize("kind", ["block", "row"])
def test_right_padding_of_every_length(kind):
    seq = 70
    lengths = np.arange(0, seq + 1)                  # 0: a fully padded batch row; seq: no padding
    attention_mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    mask2d = make_mask("bigbird:window=8,globals=4,block=8,seed=1", seq)
    q, k, v, got = run_padded(kind, mask2d, attention_mask)
    assert np.isfinite(got).all()
    assert (got[0] == 0).all(), "a fully padded batch row gives 0"
    ref = expected(q, k, v, mask2d, attention_mask)
    assert relative_error(got, ref) < 2e-3


@pytest.mark.parametrize("kind", ["block", "row"])
def test_irregular_padding_is_exact(kind):
    seq = 70
    rng = np.random.default_rng(4)
    attention_mask = np.ones((4, seq), np.int64)
    attention_mask[0, :13] = 0                       # left padding
    attention_mask[1, :5], attention_mask[1, 60:] = 0, 0
    attention_mask[2] = rng.integers(0, 2, seq)       # holes everywhere
    attention_mask[3, 31:33] = 0                      # one hole across a word boundary
    mask2d = make_mask("local:window=20", seq)
    q, k, v, got = run_padded(kind, mask2d, attention_mask)
    assert np.isfinite(got).all()
    assert relative_error(got, expected(q, k, v, mask2d, attention_mask)) < 2e-3


@pytest.mark.parametrize("kind", ["block", "row"])
def test_padded_cuda_kernels_compile_for_sm90(kind, tmp_path):
    funcs = [padded_kernel(kind, 2, 2, 200, "float16", "cuda"),
             key_padding_primfunc(batch=2, seq_k=200, dtype="int64", target_kind="cuda")]
    for index, func in enumerate(funcs):
        (tmp_path / str(index)).mkdir()
        source = tvm.compile(func, target=CUDA).mod.imports[0].inspect_source()
        report = sm90_ptxas_report(source, tmp_path / str(index))
        assert "spill" not in report or " 0 bytes spill stores" in report


def test_gpu_script_padding_inputs_match_the_device_summary():
    """scripts/bench_attention.py hands split-KV modules pad_range / pad_bits computed with numpy: they must be
    what the key_padding kernel computes from the same attention mask (every pattern of its padded checks)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_attention

    for batch, seq in ((4, 1000), (5, 64), (3, 33)):
        keep = bench_attention.padding_mask(batch, seq)
        assert keep.any(axis=1).sum() == batch - batch // 4   # every fourth batch row keeps nothing
        assert bench_attention.padding_mask(batch, seq, "ones").all()
        right = bench_attention.padding_mask(batch, seq, "right")
        assert right[0].all() and (right.sum(axis=1) >= seq // 2).all()
        assert (np.diff(right.astype(np.int8), axis=1) <= 0).all()          # kept keys first, then padding
        for pattern in (keep, right):
            ranges, bits = bench_attention.key_padding_inputs(pattern)
            device_ranges, device_bits = run_summary(pattern.astype(np.int64))
            np.testing.assert_array_equal(ranges, device_ranges)
            np.testing.assert_array_equal(bits, device_bits)


@pytest.mark.parametrize("config", [BlockConfig(32, 32, 2, 2, heavy_first=True, reverse_full=True),
                                    BlockConfig(32, 16, 2, 2, heavy_first=True, reverse_full=True),
                                    BlockConfig(64, 64, 4, 2)])
def test_lean_padding_tests_spans_only_in_rows_that_drop_keys(config, tmp_path):
    """``lean_padding``: the CUDA kernel guards its per-tile span tests with one block-uniform flag (the batch row
    drops some key), so the tile's column index is loaded again only there; the padding predicate reads the tile's
    ``ceil(block_n / 32)`` pad_bits words once instead of one per score element; without the padding inputs the
    knob changes nothing (the same source). Both forms build for sm_90 without spills (the 16x2048 pick, the
    first, in 96 registers). The CPU loop nest has one form for both."""
    def source(lean, padding=True):
        func = blockwise_attention_primfunc(batch=16, heads=12, seq_q=2048, seq_k=2048, head_dim=64, dtype="float16",
                                            mask_batch=1, mask_heads=1, config=replace(config, lean_padding=lean),
                                            target_kind="cuda", out_layout="bshd", padding=padding)
        return tvm.compile(func, target=CUDA).mod.imports[0].inspect_source()

    lean, plain = source(True), source(False)
    assert source(True, padding=False) == source(False, padding=False)
    assert "bool row_drops = " in lean and "row_drops" not in plain
    elements = config.m_tiles_per_warp * config.block_n // 8 * 4          # the thread's scores of a tile
    assert plain.count("pad_bits_ptr[") == elements
    assert lean.count("pad_bits_ptr[") == max(1, config.block_n // 32)
    spills = []
    for index, src in enumerate((plain, lean)):
        (tmp_path / str(index)).mkdir()
        report = sm90_ptxas_report(src, tmp_path / str(index))
        spills.append(int(re.search(r"(\d+) bytes spill stores", report).group(1)))
        assert max(int(r) for r in re.findall(r"Used (\d+) registers", report)) <= config.register_limit, report
    assert spills == [0, 0]
    cpu = [blockwise_attention_primfunc(batch=2, heads=2, seq_q=70, seq_k=70, head_dim=64, dtype="float16",
                                        mask_batch=1, mask_heads=1, config=replace(config, lean_padding=lean),
                                        target_kind="llvm", padding=True) for lean in (False, True)]
    tvm.ir.assert_structural_equal(cpu[0], cpu[1])
