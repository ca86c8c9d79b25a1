"""Block-wise sparse attention kernel: CPU (llvm) correctness against a float64 reference, CUDA code generation
compiled to sm_90 cubin with nvcc, argument checking, and (on a GPU) the tensor-core kernel itself."""
from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
import tvm

from stof_tvm.schedules.attention_blockwise import (SUPPORTED_HEAD_DIMS, BlockConfig, blockwise_attention_primfunc,
                                                    default_block_config, shared_row_bytes)
from stof_tvm.schedules.mma import chunk_offset, chunk_stride
from stof_tvm.sparse_formats import build_tiled, normalize_mask

from attention_reference import assert_attention_close, reference_attention
from hopper_checks import sm90_ptxas_report

LLVM = tvm.target.Target({"kind": "llvm"})
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
                          "max_shared_memory_per_block": 232448}, host={"kind": "llvm"})
SMALL = BlockConfig(block_m=32, block_n=32, num_warps=2, stages=2)
TOL = {"float16": 2e-3, "bfloat16": 1e-2}


def np_dtype(dtype: str):
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def reference(q, k, v, mask4, scale):
    """Dense masked attention in float64; rows with no kept key give 0."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    s = np.where(mask4, s, -np.inf)
    peak = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(peak), peak, 0.0))
    total = p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", p, v) / np.where(total > 0, total, 1.0)


def format_args(mask4, config):
    """The five format arrays of the kernel; an empty tile list is padded with one dummy entry."""
    fmt = build_tiled(mask4, config.block_m, config.block_n)
    dummy_bitmap = np.zeros((1, config.block_m // 8, config.block_n // 8), np.uint64)
    return [fmt.full_indptr, fmt.full_indices if fmt.full_indices.size else np.zeros(1, np.int32),
            fmt.part_indptr, fmt.part_indices if fmt.part_indices.size else np.zeros(1, np.int32),
            fmt.part_bitmaps if fmt.part_bitmaps.size else dummy_bitmap]


_BUILT = {}


def build_cpu(batch, heads, seq, head_dim, dtype, mask_batch, mask_heads, config, scale=None):
    key = (batch, heads, seq, head_dim, dtype, mask_batch, mask_heads, config, scale)
    if key not in _BUILT:
        func = blockwise_attention_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim,
                                            dtype=dtype, mask_batch=mask_batch, mask_heads=mask_heads,
                                            scale=scale, config=config, target_kind="llvm")
        _BUILT[key] = tvm.compile(func, target=LLVM)["blockwise_attention"]
    return _BUILT[key]


def run_and_check(mask, *, batch=2, heads=3, seq=100, head_dim=64, dtype="float16", config=SMALL, scale=None,
                  seed=0):
    mask4 = normalize_mask(mask, batch=batch, heads=heads, seq_q=seq)
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((batch, heads, seq, head_dim)).astype(np_dtype(dtype)) for _ in range(3))
    out = np.full(q.shape, np.nan, dtype=np_dtype(dtype))            # poisoned: every element must be written
    fn = build_cpu(batch, heads, seq, head_dim, dtype, mask4.shape[0], mask4.shape[1], config, scale)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in (q, k, v, *format_args(mask4, config), out)]
    fn(*args)
    got = args[-1].numpy().astype(np.float64)
    ref = reference(q, k, v, mask4, 1 / math.sqrt(head_dim) if scale is None else scale)
    assert np.isfinite(got).all(), "kernel left unwritten (NaN) or non-finite outputs"
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= TOL[dtype], f"relative Frobenius error {err:.3e} > {TOL[dtype]}"
    empty_rows = ~np.broadcast_to(mask4, (batch, heads, seq, seq)).any(axis=-1)
    assert (got[empty_rows] == 0).all(), "rows with no kept key must be exactly 0"
    return got


@pytest.mark.parametrize("mask", ["causal", "sliding", "longformer", "bigbird", "dense", "dilated"])
def test_named_masks(mask):
    run_and_check(mask, seq=130)                      # 130: not a multiple of the 32x32 tile


def test_random_masks_of_several_densities():
    rng = np.random.default_rng(7)
    for density in (0.01, 0.3, 0.9):
        run_and_check(rng.random((100, 100)) < density, seed=int(density * 100))


def test_per_batch_and_per_head_masks_with_empty_rows():
    rng = np.random.default_rng(3)
    mask = rng.random((2, 3, 100, 100)) < 0.2
    mask[0, 1, 10:40] = False                          # whole empty query rows
    mask[1, :, :, 50:] = False
    run_and_check(mask)
    run_and_check(mask[:, :1], seed=1)                 # per batch: mask_batch=2, mask_heads=1
    run_and_check(mask[:1], seed=2)                    # per head: mask_batch=1, mask_heads=3


def test_padding_lengths_and_fully_masked_batch():
    run_and_check(np.array([0, 37]), seq=64)


def test_one_build_serves_masks_with_different_tile_counts():
    """n_full / n_part are symbolic: a second mask with other list lengths reuses the same compiled kernel."""
    run_and_check("sliding", seq=96)
    before = len(_BUILT)
    run_and_check("bigbird", seq=96)
    run_and_check(np.zeros((96, 96), bool), seq=96)  # no tile at all: every output row is 0
    assert len(_BUILT) == before


def packed_views(q, k, v, dev):
    """Q, K, V as views into one [3, B, H, S, D] tensor (what the fused QKV projection writes), at nonzero
    offsets; the packed tensor is returned too, since the views do not own their memory."""
    packed = tvm.runtime.tensor(np.ascontiguousarray(np.stack([q, k, v])), dev)
    step = q.size * q.itemsize
    return packed, [packed._create_view(q.shape, relative_byte_offset=i * step) for i in range(3)]


@pytest.mark.parametrize("mask", ["bigbird", "causal"])
def test_rows_then_heads_output_from_packed_qkv_views(mask):
    """out_layout="bshd" writes [B, S, H, D] (the output projection's layout), reading Q/K/V as offset views."""
    batch, heads, seq, head_dim, dtype = 2, 3, 100, 64, "float16"
    mask4 = normalize_mask(mask, batch=batch, heads=heads, seq_q=seq)
    func = blockwise_attention_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim,
                                        dtype=dtype, mask_batch=1, mask_heads=1, config=SMALL, target_kind="llvm",
                                        out_layout="bshd")
    assert [int(x) for x in func.params[-1].shape] == [batch, seq, heads, head_dim]
    fn = tvm.compile(func, target=LLVM)["blockwise_attention"]
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((batch, heads, seq, head_dim)).astype(np.float16) for _ in range(3))
    dev = tvm.cpu()
    packed, views = packed_views(q, k, v, dev)
    out = tvm.runtime.tensor(np.full((batch, seq, heads, head_dim), np.nan, np.float16), dev)
    fn(*views, *[tvm.runtime.tensor(a, dev) for a in format_args(mask4, SMALL)], out)
    got = out.numpy().astype(np.float64).transpose(0, 2, 1, 3)
    ref = reference(q, k, v, mask4, 1 / math.sqrt(head_dim))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOL[dtype]


def test_unknown_out_layout_is_refused():
    with pytest.raises(ValueError, match="out_layout"):
        blockwise_attention_primfunc(batch=1, heads=1, seq_q=64, seq_k=64, head_dim=64, dtype="float16",
                                     mask_batch=1, mask_heads=1, target_kind="llvm", out_layout="sbhd")


def poisoned_bias(bias, mask4, batch, heads, seed=0):
    """``bias`` with every element no (batch, head) reading it keeps replaced by NaN or +-inf: a kernel that
    reads (or adds) the bias at a dropped key produces non-finite outputs."""
    keep = np.broadcast_to(mask4, (batch, heads) + mask4.shape[2:])
    keep = keep.any(axis=tuple(a for a in (0, 1) if bias.shape[a] == 1), keepdims=True)
    junk = np.random.default_rng(seed).choice(np.array([np.nan, np.inf, -np.inf], np.float32), size=bias.shape)
    return np.where(keep, bias, junk).astype(bias.dtype)


@pytest.mark.parametrize("mask, bias_layout, bias_dtype, config, seq", [
    ("per_batch_random", (1, 3), "float16", SMALL, 70),           # T5's layout: [1, H, S, S]
    ("bigbird", (2, 3), "float32", SMALL, 100),
    ("per_head_random", (2, 1), "bfloat16", BlockConfig(64, 32, 4, 2, heavy_first=True), 99),   # odd Sk
    ("padding", (1, 1), "float16", BlockConfig(16, 16, 1, 2), 40),
])
def test_additive_score_bias(mask, bias_layout, bias_dtype, config, seq):
    """scores * scale + bias at kept keys (llvm), for bias layouts, masks with partial and edge tiles and empty
    rows; the bias is poisoned wherever the mask drops the key, so it must be read at kept keys only."""
    batch, heads, head_dim, dtype = 2, 3, 64, "float16"
    rng = np.random.default_rng(17)
    if mask == "per_batch_random":
        mask = rng.random((batch, seq, seq)) < 0.25
    elif mask == "per_head_random":
        mask = rng.random((1, heads, seq, seq)) < 0.15
        mask[..., 5:9, :] = False                                     # empty rows
    elif mask == "padding":
        mask = np.array([seq, 23])
    mask4 = normalize_mask(mask, batch=batch, heads=heads, seq_q=seq)
    bias = (rng.standard_normal(bias_layout + (seq, seq)) * 2).astype(np_dtype(bias_dtype))
    func = blockwise_attention_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim,
                                        dtype=dtype, mask_batch=mask4.shape[0], mask_heads=mask4.shape[1],
                                        config=config, target_kind="llvm", bias=bias_layout + (bias_dtype,))
    assert [p.name for p in func.params][-2:] == ["bias", "out"]
    fn = tvm.compile(func, target=LLVM)["blockwise_attention"]
    q, k, v = (rng.standard_normal((batch, heads, seq, head_dim)).astype(np.float16) for _ in range(3))
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, np.float16))
    fn(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in (q, k, v, *format_args(mask4, config),
                                                               poisoned_bias(bias, mask4, batch, heads))], out)
    scale = 1 / math.sqrt(head_dim)
    ref = reference_attention(q, k, v, mask4, scale, bias=bias.astype(np.float64))
    assert_attention_close(out.numpy(), ref, mask4, dtype)
    assert np.abs(reference_attention(q, k, v, mask4, scale) - ref).max() > 0.1     # the bias matters


def test_bad_bias_is_refused():
    common = dict(batch=2, heads=3, seq_q=64, seq_k=64, head_dim=64, dtype="float16", mask_batch=1, mask_heads=1,
                  target_kind="llvm")
    with pytest.raises(ValueError, match="bias_batch"):
        blockwise_attention_primfunc(bias=(3, 1, "float16"), **common)
    with pytest.raises(TypeError, match="bias dtype"):
        blockwise_attention_primfunc(bias=(1, 1, "int8"), **common)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        blockwise_attention_primfunc(**{**common, "batch": 16, "heads": 16, "seq_q": 4096, "seq_k": 4096,
                                        "bias": (16, 16, "float16")})


@pytest.mark.parametrize("config", [BlockConfig(64, 64, 4, 2), BlockConfig(128, 64, 4, 2),
                                    BlockConfig(16, 16, 1, 2), BlockConfig(64, 32, 2, 3, heavy_first=True)])
def test_tile_shapes(config):
    run_and_check("bigbird", seq=200, heads=2, config=config)


def test_head_dim_128_and_custom_scale():
    run_and_check("longformer", head_dim=128, heads=2, seq=72)
    run_and_check("causal", scale=0.05, seq=72, heads=1)


def _per_head_random(batch, heads, seq, seed=5):
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, heads, seq, seq)) < 0.15
    mask[:, :, 3:9] = False                          # empty rows in every head
    return mask


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
@pytest.mark.parametrize("mask", ["sliding", "bigbird", "causal", "per_head_random"])
def test_head_dims_beyond_64_and_128(head_dim, mask):
    """Every supported head dim computes the same function (llvm twin): here the widths of real models
    (32: small BERTs, Swin; 80: Phi; 96; 256: Gemma) under each mask kind, at the dense and sparse defaults'
    tile shapes."""
    batch, heads, seq = 1, 2, 70
    sparse = mask != "causal"
    mask = _per_head_random(batch, heads, seq) if mask == "per_head_random" else mask
    run_and_check(mask, batch=batch, heads=heads, seq=seq, head_dim=head_dim,
                  config=default_block_config(head_dim, "float16", seq, sparse=sparse))


def test_head_dim_80_bfloat16_with_padding_lengths():
    run_and_check(np.array([61]), batch=1, heads=2, seq=61, head_dim=80, dtype="bfloat16")


@pytest.mark.parametrize("chunks", sorted({d // 8 for d in SUPPORTED_HEAD_DIMS} | {1, 2, 3, 5, 7}))
def test_shared_row_layout_is_a_conflict_free_permutation(chunks):
    """chunk_offset places every (row, 16-byte chunk) of a tile at its own aligned slot inside the tile's rows,
    and the eight rows an ldmatrix 8x8 matrix reads at one chunk (rows 8i..8i+7; any eight consecutive rows when
    the stride is odd) land in the eight different 16-byte bank groups of a 128-byte line."""
    rows, stride = 32, chunk_stride(chunks)
    offsets = np.array([[chunk_offset(r, c, chunks) for c in range(chunks)] for r in range(rows)])
    assert len(set(offsets.ravel().tolist())) == rows * chunks
    assert (offsets % 16 == 0).all() and offsets.min() == 0 and offsets.max() < rows * stride * 16
    assert stride == chunks if chunks % 8 == 0 else (stride % 2 == 1 and stride - chunks <= 1)
    starts = range(0, rows - 7) if stride % 2 else range(0, rows - 7, 8)
    for start in starts:
        for c in range(chunks):
            banks = offsets[start:start + 8, c] // 16 % 8
            assert len(set(banks.tolist())) == 8, (start, c, banks)


def test_resources_of_every_head_dim():
    """The defaults of every supported head dim fit sm_90 (shared memory, register estimate), rows padded to
    an odd chunk count only where an XOR swizzle cannot work (not a multiple of 8 chunks)."""
    assert SUPPORTED_HEAD_DIMS == tuple(range(32, 257, 16))
    for head_dim in SUPPORTED_HEAD_DIMS:
        assert shared_row_bytes(head_dim) == (2 * head_dim if head_dim % 64 == 0 else 2 * head_dim + 16)
        for sparse in (False, True):
            config = default_block_config(head_dim, "float16", 4096, sparse=sparse)
            config.validate(head_dim)
            assert config.registers(head_dim) <= 255
            assert config.shared_bytes(head_dim) <= 227 * 1024
    # Q is reloaded from shared memory only above D=128, where keeping it would take too many registers.
    assert [d for d in SUPPORTED_HEAD_DIMS if not default_block_config(d, "float16", 4096).q_in_registers(d)] == \
        [192, 208, 224, 240, 256]
    assert all(BlockConfig(bm, bn, w).q_in_registers(d) for d in (64, 128) for bm, bn, w in
               ((128, 128, 8), (64, 128, 4), (128, 64, 4), (64, 32, 2)))


def test_split_kv_config_computes_the_same_function_on_the_cpu():
    """The llvm twin takes split-KV configurations (their format is the same; the split is a CUDA launch shape)."""
    config = BlockConfig(32, 32, 2, 2, heavy_first=True, kv_splits=4, split_rows=2)
    run_and_check("longformer:window=8,globals=8", batch=1, heads=2, seq=100, config=config)


def test_bfloat16():
    run_and_check("bigbird", dtype="bfloat16", seq=90)
    run_and_check(np.array([5, 90]), dtype="bfloat16", seq=90, head_dim=128)


def test_single_row_and_tiny_sequences():
    run_and_check("causal", seq=1, batch=1, heads=1)
    run_and_check("sliding", seq=7, batch=1, heads=2)


def test_default_config():
    assert default_block_config(64, "float16", 4096) == BlockConfig(128, 64, 4, 2)
    assert default_block_config(128, "bfloat16", 4096).num_warps == 8
    assert default_block_config(64, "float16", 4096, sparse=True) == BlockConfig(64, 32, 4, 2, heavy_first=True,
                                                                                 reverse_full=True)
    assert default_block_config(80, "float16", 4096) == BlockConfig(128, 64, 8, 2)
    assert default_block_config(32, "float16", 4096) == BlockConfig(128, 64, 4, 2)
    for head_dim in SUPPORTED_HEAD_DIMS:
        for seq in (7, 64, 4096):
            for sparse in (False, True):
                default_block_config(head_dim, "float16", seq, sparse=sparse).validate(head_dim)


@pytest.mark.parametrize("kwargs, error", [
    (dict(head_dim=72), ValueError),
    (dict(head_dim=16), ValueError),
    (dict(head_dim=272), ValueError),
    (dict(dtype="float32"), ValueError),
    (dict(mask_batch=3), ValueError),
    (dict(mask_heads=2), ValueError),
    (dict(scale=-1.0), ValueError),
    (dict(seq_q=0), ValueError),
    (dict(target_kind="rocm"), ValueError),
    (dict(config=(64, 64, 4, 2)), TypeError),
    (dict(config=BlockConfig(block_m=48, block_n=64, num_warps=4)), ValueError),
    (dict(config=BlockConfig(block_m=64, block_n=24, num_warps=2)), ValueError),
    (dict(config=BlockConfig(block_m=64, block_n=64, num_warps=4, stages=1)), ValueError),
    (dict(config=BlockConfig(64, 32, 4, 2, kv_splits=4)), ValueError),             # split-KV needs heavy_first
    (dict(config=BlockConfig(64, 32, 4, 2, heavy_first=True, kv_splits=0)), ValueError),
    (dict(config=BlockConfig(64, 32, 4, 2, heavy_first=True, kv_splits=4, split_rows=0)), ValueError),
    (dict(config=BlockConfig(64, 32, 4, 2, min_blocks=-1)), ValueError),
    (dict(config=BlockConfig(64, 32, 4, 2, min_blocks=True)), ValueError),
    (dict(config=BlockConfig(64, 32, 4, 2, row_sums="alu")), ValueError),
    (dict(config=BlockConfig(64, 32, 4, 2, reverse_full=1)), ValueError),
])
def test_bad_arguments(kwargs, error):
    args = dict(batch=2, heads=4, seq_q=64, seq_k=64, head_dim=64, dtype="float16", mask_batch=1, mask_heads=1,
                scale=None, config=None, target_kind="llvm")
    args.update(kwargs)
    with pytest.raises(error):
        blockwise_attention_primfunc(**args)


@pytest.mark.parametrize("target_kind", ["cuda", "llvm"])
def test_signature_and_symbolic_tile_counts(target_kind):
    func = blockwise_attention_primfunc(batch=2, heads=3, seq_q=100, seq_k=100, head_dim=64, dtype="float16",
                                        mask_batch=2, mask_heads=1, scale=None, config=SMALL,
                                        target_kind=target_kind)
    got = [(p.name, [str(x) for x in p.shape], p.dtype) for p in func.params]
    assert got == [("q", ["2", "3", "100", "64"], "float16"), ("k", ["2", "3", "100", "64"], "float16"),
                   ("v", ["2", "3", "100", "64"], "float16"), ("full_indptr", ["9"], "int32"),
                   ("full_indices", ["n_full"], "int32"), ("part_indptr", ["9"], "int32"),
                   ("part_indices", ["n_part"], "int32"), ("part_bitmaps", ["n_part", "4", "4"], "uint64"),
                   ("out", ["2", "3", "100", "64"], "float16")]


# ------------------------------------------------------------------------------------------------------------
# CUDA code generation (no GPU needed): the tensor-core kernel compiles for sm_90 without local-memory spills
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, head_dim, config, out_layout, seq, bias", [
    ("float16", 64, BlockConfig(128, 64, 4, 2), "bhsd", 1000, None),
    ("bfloat16", 128, BlockConfig(128, 64, 8, 3), "bhsd", 1000, None),
    ("float16", 64, BlockConfig(64, 32, 4, 2, heavy_first=True), "bshd", 1000, None),
    # score bias: 16-bit pairs (even Sk), one element at a time (odd Sk, float32)
    ("float16", 64, BlockConfig(64, 32, 4, 2, heavy_first=True), "bshd", 1000, (1, 4, "float16")),
    ("bfloat16", 128, BlockConfig(128, 64, 8, 2), "bhsd", 1000, (2, 1, "bfloat16")),
    ("float16", 64, BlockConfig(128, 64, 4, 2), "bshd", 999, (2, 4, "float16")),
    ("float16", 64, BlockConfig(64, 32, 4, 2), "bhsd", 1000, (1, 1, "float32")),
])
def test_cuda_source_compiles_for_sm90(dtype, head_dim, config, out_layout, seq, bias, tmp_path):
    func = blockwise_attention_primfunc(batch=2, heads=4, seq_q=seq, seq_k=seq, head_dim=head_dim, dtype=dtype,
                                        mask_batch=2, mask_heads=4, scale=None, config=config, target_kind="cuda",
                                        out_layout=out_layout, bias=bias)
    ex = tvm.compile(func, target=CUDA)
    assert [m.kind for m in ex.mod.imports] == ["cuda"]
    src = ex.mod.imports[0].inspect_source()
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    for needle in (f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32", "ldmatrix.sync.aligned.m8n8.x4.shared",
                   "ldmatrix.sync.aligned.m8n8.x4.trans.shared", "cp.async.cg.shared.global", "cp.async.wait_group",
                   "ex2.approx.ftz.f32", "st.global.v4.b32"):
        assert needle in src, needle
    report = sm90_ptxas_report(src, tmp_path)
    assert (tmp_path / "kernel.cubin").stat().st_size > 0
    assert_no_spills(report)
    if bias is not None:         # 16-bit biases with an even Sk load two columns per 32-bit word
        pair = bias[2] != "float32" and seq % 2 == 0
        assert ("((uint*)bias_ptr)[" in src) == pair


def assert_no_spills(report: str) -> None:
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and spills.groups() == ("0", "0"), report
    assert "0 bytes stack frame" in report, report


@pytest.mark.parametrize("config, registers", [(BlockConfig(64, 32, 4, 2, heavy_first=True, min_blocks=5), 96),
                                               (BlockConfig(32, 32, 2, 2, heavy_first=True, min_blocks=10), 96),
                                               (BlockConfig(32, 16, 2, 2, heavy_first=True, min_blocks=10), 96)])
def test_min_blocks_bounds_the_registers_without_spills(config, registers, tmp_path):
    """``min_blocks`` becomes ``__launch_bounds__(threads, min_blocks)``: ptxas keeps to 65536 / (threads *
    min_blocks) registers (96 here: five 4-warp or ten 2-warp blocks an SM) and spills nothing; the model's
    register estimate is capped there. These are shapes the model offers bounded (heavy-first; the default order
    of 64x32x4x2 spills a word at 96 since the one-load skip vote). The tile loop keeps its lazy rescaling (a warp
    vote before O is scaled) and the row sums on the tensor cores (an mma with a B operand of ones)."""
    assert config.register_limit == registers and config.registers(64) <= registers
    assert BlockConfig(64, 32, 4, 2).register_limit == 255
    func = blockwise_attention_primfunc(batch=16, heads=12, seq_q=4096, seq_k=4096, head_dim=64, dtype="float16",
                                        mask_batch=1, mask_heads=1, config=config, target_kind="cuda")
    src = tvm.compile(func, target=CUDA).mod.imports[0].inspect_source()
    assert f"__launch_bounds__({config.threads}, {config.min_blocks})" in src
    assert "__any_sync" in src and "(uint)1006648320" in src           # 0x3C003C00: a pair of fp16 ones
    report = sm90_ptxas_report(src, tmp_path)
    assert_no_spills(report)
    used = int(re.search(r"Used (\d+) registers", report).group(1))
    assert used <= registers, report


@pytest.mark.parametrize("config", [BlockConfig(32, 32, 2, 2, heavy_first=True, min_blocks=10),
                                    BlockConfig(32, 16, 2, 2, heavy_first=True, kv_splits=4)])
def test_row_sums_by_float_adds_build_without_spills(config, tmp_path):
    """``row_sums="fadd"``: the tile loop sums P with float adds (no mma on a B operand of ones: MT * BN / 16
    fewer mma per tile; each row's four quad partial sums reduced by two shuffles at the end) and both forms build
    for sm_90 with 0 spills (within the launch bounds where ``min_blocks`` sets them); the CPU loop nest has one form
    (float32 sums). Not every configuration: a word spills in the fadd form at 32x32x1x2 (ptxas's own choice of
    168 registers) and 64x32x4x2 with min_blocks 5 (96 registers; the tensor-core form fits)."""
    def source(row_sums):
        func = blockwise_attention_primfunc(batch=4, heads=12, seq_q=2048, seq_k=2048, head_dim=64,
                                            dtype="float16", mask_batch=1, mask_heads=1,
                                            config=replace(config, row_sums=row_sums), target_kind="cuda")
        return tvm.compile(func, target=CUDA).mod.imports[0].inspect_source()

    mma, fadd = source("mma"), source("fadd")
    assert source("mma") == mma and "(uint)1006648320" in mma and "(uint)1006648320" not in fadd
    mt = config.m_tiles_per_warp
    call = "tvm_builtin_ptx_mma_sync_aligned_m16n8k16_row_col_f32_f16_f16_f32("      # the kernel is unrolled
    assert mma.count(call) - fadd.count(call) == mt * config.block_n // 16
    assert fadd.count("__shfl_xor_sync(") == mma.count("__shfl_xor_sync(") + 4 * mt     # 2 rows per m-tile
    for src in (mma, fadd):
        report = sm90_ptxas_report(src, tmp_path)
        assert_no_spills(report)
        assert max(int(r) for r in re.findall(r"Used (\d+) registers", report)) <= config.register_limit, report


@pytest.mark.parametrize("config", [BlockConfig(32, 32, 2, 2, heavy_first=True, min_blocks=10, reverse_full=True),
                                    BlockConfig(32, 32, 2, 2, heavy_first=True, kv_splits=4, split_rows=2,
                                                min_blocks=10, reverse_full=True)])
def test_reverse_full_walks_the_full_tiles_last_column_first_without_spills(config, tmp_path):
    """``reverse_full``: the CUDA kernel reads the row's full tiles from the end of its list (``f0 + row_tiles - 1
    - t``; partial tiles keep their order), the default builds the same source as before the knob existed (no
    reversal term), and both build for sm_90 with 0 spills within the launch bounds; the CPU loop nest computes
    one function for both orders (the order does not change the result)."""
    def source(reverse):
        func = blockwise_attention_primfunc(batch=16, heads=12, seq_q=4096, seq_k=4096, head_dim=64, dtype="float16",
                                            mask_batch=1, mask_heads=1, config=replace(config, reverse_full=reverse),
                                            target_kind="cuda")
        return tvm.compile(func, target=CUDA).mod.imports[0].inspect_source()

    reversed_src, plain = source(True), source(False)
    assert reversed_src != plain
    from_end = r"full_indices_ptr\[\(+f0 \+ n_tiles\) - "           # f0 + row_tiles - 1 - t: from the list's end
    assert re.search(from_end, reversed_src) and not re.search(from_end, plain)
    for src in (reversed_src, plain):
        report = sm90_ptxas_report(src, tmp_path)
        assert_no_spills(report)
        assert max(int(r) for r in re.findall(r"Used (\d+) registers", report)) <= config.register_limit, report
    cpu = [blockwise_attention_primfunc(batch=1, heads=2, seq_q=64, seq_k=64, head_dim=64, dtype="float16",
                                        mask_batch=1, mask_heads=1, config=replace(config, reverse_full=reverse),
                                        target_kind="llvm") for reverse in (False, True)]
    tvm.ir.assert_structural_equal(cpu[0], cpu[1])


@pytest.mark.parametrize("head_dim, out_layout, splits, rows, padding", [(64, "bshd", 16, 2, True),
                                                                          (128, "bhsd", 4, 1, False),
                                                                          (80, "bshd", 8, 3, True)])
def test_split_kv_cuda_source_compiles_without_spills(head_dim, out_layout, splits, rows, padding, tmp_path):
    """Split-KV: the tile-row kernel (grid TR + rows*(splits-1) per head) and the merge kernel (one block per
    split row and head) build for sm_90 with 0 spill bytes; the workspace is float32 partial rows and log-sum-exps.
    With the key padding inputs (the compile path's models) the slices read them too. Without splits no workspace
    and no second kernel exist."""
    config = BlockConfig(64, 32, 4, 2, heavy_first=True, kv_splits=splits, split_rows=rows)
    func = blockwise_attention_primfunc(batch=1, heads=12, seq_q=4000, seq_k=4000, head_dim=head_dim,
                                        dtype="float16", mask_batch=1, mask_heads=1, config=config,
                                        target_kind="cuda", out_layout=out_layout, padding=padding)
    assert ("pad_range" in [param.name for param in func.params]) == padding
    src = tvm.compile(func, target=CUDA).mod.imports[0].inspect_source()
    kernels = re.findall(r"__global__ void __launch_bounds__\((\d+)\) (\w+)\(", src)
    assert sorted(set(kernels)) == [("128", "blockwise_attention_kernel"), ("128", "blockwise_attention_kernel_1")]
    assert "float* __restrict__ ws_o_ptr" in src and "float* __restrict__ ws_lse_ptr" in src
    assert ("pad_range" in src) == padding
    assert "exp2f(" in src and "log2f(" in src
    report = sm90_ptxas_report(src, tmp_path)
    assert report.count("0 bytes spill stores") == 2, report
    assert_no_spills(report)
    plain = blockwise_attention_primfunc(batch=1, heads=12, seq_q=4000, seq_k=4000, head_dim=head_dim,
                                         dtype="float16", mask_batch=1, mask_heads=1,
                                         config=BlockConfig(64, 32, 4, 2, heavy_first=True), target_kind="cuda")
    plain_src = tvm.compile(plain, target=CUDA).mod.imports[0].inspect_source()
    assert "ws_o" not in plain_src and "blockwise_attention_kernel_1" not in plain_src


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
@pytest.mark.parametrize("sparse", [False, True])
def test_cuda_source_of_every_head_dim_compiles_without_spills(head_dim, sparse, tmp_path):
    """nvcc sm_90 builds the tensor-core kernel of the widths real models use at both default tile shapes with
    0 spill bytes (ptxas -v); at D=256 Q's fragments are reloaded from shared memory at every tile."""
    config = default_block_config(head_dim, "float16", 4096, sparse=sparse)
    func = blockwise_attention_primfunc(batch=2, heads=4, seq_q=1000, seq_k=1000, head_dim=head_dim,
                                        dtype="bfloat16" if sparse else "float16", mask_batch=1, mask_heads=4,
                                        config=config, target_kind="cuda", out_layout="bshd")
    mod = tvm.compile(func, target=CUDA)
    src = mod.mod.imports[0].inspect_source()
    assert "mma.sync.aligned.m16n8k16" in src and "ldmatrix.sync.aligned.m8n8.x4.trans.shared" in src
    assert_no_spills(sm90_ptxas_report(src, tmp_path))
    # Q's A fragments: all k16 steps of every m-tile kept, or one m-tile's worth reloaded per k16 step (D=256).
    kept = config.m_tiles_per_warp * (head_dim // 16 if config.q_in_registers(head_dim) else 1) * 4
    assert f"uint q_frag_ptr[{kept}];" in src
    assert config.q_in_registers(head_dim) == (head_dim != 256)


# ------------------------------------------------------------------------------------------------------------
# GPU (skipped without one): the tensor-core kernel against the same float64 reference
# ------------------------------------------------------------------------------------------------------------

def _has_gpu() -> bool:
    try:
        return tvm.cuda(0).exist
    except Exception:  # a TVM build without the CUDA runtime
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype, head_dim, config", [
    ("float16", 64, BlockConfig(128, 64, 4, 2)), ("bfloat16", 128, BlockConfig(128, 64, 8, 2)),
    ("float16", 64, BlockConfig(64, 32, 4, 2, heavy_first=True)),
])
@pytest.mark.parametrize("mask", ["causal", "bigbird", "per_head_random"])
@pytest.mark.parametrize("out_layout", ["bhsd", "bshd"])
def test_cuda_kernel_matches_reference(dtype, head_dim, config, mask, out_layout):
    """bshd also reads Q/K/V as offset views of one packed tensor, as the compiled models do."""
    batch, heads, seq = 2, 3, 300
    if mask == "per_head_random":
        rng = np.random.default_rng(5)
        mask = rng.random((batch, heads, seq, seq)) < 0.1
        mask[:, :, 7:19] = False
    mask4 = normalize_mask(mask, batch=batch, heads=heads, seq_q=seq)
    func = blockwise_attention_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim,
                                        dtype=dtype, mask_batch=mask4.shape[0], mask_heads=mask4.shape[1],
                                        scale=None, config=config, target_kind="cuda", out_layout=out_layout)
    fn = tvm.compile(func, target=CUDA)["blockwise_attention"]
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((batch, heads, seq, head_dim)).astype(np_dtype(dtype)) for _ in range(3))
    dev = tvm.cuda(0)
    formats = [tvm.runtime.tensor(a, dev) for a in format_args(mask4, config)]
    if out_layout == "bshd":
        packed, qkv = packed_views(q, k, v, dev)
        out = tvm.runtime.tensor(np.full((batch, seq, heads, head_dim), np.nan, np_dtype(dtype)), dev)
        fn(*qkv, *formats, out)
        got = out.numpy().astype(np.float64).transpose(0, 2, 1, 3)
    else:
        out = tvm.runtime.tensor(np.full(q.shape, np.nan, dtype=np_dtype(dtype)), dev)
        fn(*[tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in (q, k, v)], *formats, out)
        got = out.numpy().astype(np.float64)
    ref = reference(q, k, v, mask4, 1 / math.sqrt(head_dim))
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bias_dtype, config, seq", [
    ("float16", BlockConfig(64, 32, 4, 2, heavy_first=True), 300),     # staged 32-bit pairs
    ("float16", BlockConfig(128, 64, 4, 2), 299),                      # bias as the accumulators' start, halves
    ("float32", BlockConfig(64, 32, 4, 2), 300),
])
def test_cuda_kernel_with_score_bias(bias_dtype, config, seq):
    """The tensor-core kernel adds a [1, H, S, S] bias at kept keys; NaN/inf where the mask drops the key."""
    batch, heads, head_dim, dtype = 2, 3, 64, "float16"
    rng = np.random.default_rng(9)
    mask4 = normalize_mask(rng.random((batch, seq, seq)) < 0.2, batch=batch, heads=heads, seq_q=seq)
    bias = (rng.standard_normal((1, heads, seq, seq)) * 2).astype(bias_dtype)
    func = blockwise_attention_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim,
                                        dtype=dtype, mask_batch=batch, mask_heads=1, config=config,
                                        target_kind="cuda", bias=(1, heads, bias_dtype))
    fn = tvm.compile(func, target=CUDA)["blockwise_attention"]
    q, k, v = (rng.standard_normal((batch, heads, seq, head_dim)).astype(np.float16) for _ in range(3))
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, np.float16), dev)
    fn(*[tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in (q, k, v, *format_args(mask4, config),
                                                                    poisoned_bias(bias, mask4, batch, heads))], out)
    ref = reference_attention(q, k, v, mask4, 1 / math.sqrt(head_dim), bias=bias.astype(np.float64))
    assert_attention_close(out.numpy(), ref, mask4, dtype)
