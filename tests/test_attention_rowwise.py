"""Row-wise sparse attention kernel: CPU (llvm) builds against a float64 dense reference, CUDA code generation.

The CPU schedule runs the same PrimFunc the GPU runs; the CUDA-shaped configurations (several key groups per
row, several keys per step) are run on the CPU too, so the split-K online softmax and its merge are checked
here, not only on the GPU.
"""
import math
import shutil
import subprocess

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_reference import assert_attention_close, numpy_dtype, random_qkv, reference_attention
from stof_tvm import normalize_mask
from stof_tvm.schedules.attention_rowwise import (ROWWISE_SYMBOL, SUPPORTED_HEAD_DIMS, RowConfig, cuda_config_fits,
                                                  cuda_lanes, default_row_config, rowwise_attention_primfunc)
from stof_tvm.sparse_formats import MASK_NAMES, build_rows

LLVM = tvm.target.Target({"kind": "llvm"})
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
                          "max_shared_memory_per_block": 232448}, host={"kind": "llvm"})
_BUILT = {}


def run_rowwise(mask, batch, heads, seq_q, head_dim, dtype, *, seq_k=None, config=None, scale=None, seed=0):
    """Build (once per problem) and run the llvm kernel on random inputs; check it against the reference."""
    seq_k = seq_q if seq_k is None else seq_k
    mask4 = np.ascontiguousarray(normalize_mask(mask, batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k))
    key = (batch, heads, seq_q, seq_k, head_dim, dtype, mask4.shape[:2], config, scale)
    if key not in _BUILT:
        func = rowwise_attention_primfunc(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                                          dtype=dtype, mask_batch=mask4.shape[0], mask_heads=mask4.shape[1],
                                          scale=scale, config=config, target_kind="llvm")
        _BUILT[key] = tvm.compile(func, target=LLVM)[ROWWISE_SYMBOL]
    fmt = build_rows(mask4)
    indices = fmt.indices if fmt.nnz else np.zeros(1, np.int32)      # an empty list still needs a buffer
    q, k, v = random_qkv(batch, heads, seq_q, seq_k, head_dim, dtype, seed)
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, numpy_dtype(dtype)))   # poisoned: unwritten -> NaN
    _BUILT[key](*(tvm.runtime.tensor(a) for a in (q, k, v, fmt.indptr, indices)), out)
    ref = reference_attention(q, k, v, mask4, 1 / math.sqrt(head_dim) if scale is None else scale)
    assert_attention_close(out.numpy(), ref, mask4, dtype)
    return out.numpy()


@pytest.mark.parametrize("bias_layout, mask_layout", [((1, 1), (1, 1)), ((2, 3), (1, 1)), ((1, 3), (2, 1)),
                                                       ((2, 1), (2, 3))])
@pytest.mark.parametrize("dtype, config", [("float16", RowConfig(key_groups=2, keys_per_step=3)),
                                           ("float32", None)])
def test_additive_score_bias(bias_layout, mask_layout, dtype, config):
    """A T5-style bias added to the kept scores; read only where the mask keeps a key (NaN elsewhere)."""
    batch, heads, seq, head_dim = 2, 3, 40, 64
    rng = np.random.default_rng(21)
    mask4 = rng.random(mask_layout + (seq, seq)) < 0.3
    mask4[..., 4, :] = False                               # an empty row
    bias = rng.standard_normal(bias_layout + (seq, seq)).astype(np.float32) * 2
    poisoned = np.where(np.broadcast_to(mask4.any(axis=(0, 1)), (seq, seq)), bias, np.nan).astype(np.float32)
    func = rowwise_attention_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim,
                                      dtype=dtype, mask_batch=mask_layout[0], mask_heads=mask_layout[1],
                                      config=config, target_kind="llvm", bias=bias_layout + ("float32",))
    fn = tvm.compile(func, target=LLVM)[ROWWISE_SYMBOL]
    fmt = build_rows(mask4)
    q, k, v = random_qkv(batch, heads, seq, seq, head_dim, dtype, 5)
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, numpy_dtype(dtype)))
    fn(*(tvm.runtime.tensor(a) for a in (q, k, v, fmt.indptr, fmt.indices, poisoned)), out)
    ref = reference_attention(q, k, v, mask4, 1 / math.sqrt(head_dim), bias=bias)
    assert_attention_close(out.numpy(), ref, mask4, dtype)
    unbiased = reference_attention(q, k, v, mask4, 1 / math.sqrt(head_dim))
    assert np.abs(unbiased - ref).max() > 0.1                # the bias matters: the check can fail


def test_bad_bias_is_refused():
    common = dict(batch=2, heads=3, seq_q=8, seq_k=8, head_dim=64, dtype="float16", mask_batch=1, mask_heads=1,
                  target_kind="llvm")
    with pytest.raises(ValueError, match="bias_batch"):
        rowwise_attention_primfunc(bias=(3, 1, "float32"), **common)
    with pytest.raises(TypeError, match="bias dtype"):
        rowwise_attention_primfunc(bias=(1, 1, "int8"), **common)


@pytest.mark.parametrize("name", MASK_NAMES)
def test_every_named_mask(name, tmp_path):
    spec = name
    if name == "blocksparse":                     # the only named mask that needs a tile bitmap file
        bitmap = np.random.default_rng(3).random((7, 7)) < 0.3
        np.save(tmp_path / "tiles.npy", bitmap)
        spec = f"blocksparse:file={tmp_path / 'tiles.npy'},block=16"
    run_rowwise(spec, 1, 2, 100, 64, "float16")


@pytest.mark.parametrize("seq", [1, 7, 64, 100, 128, 1000])
def test_sequence_lengths(seq):
    run_rowwise("bigbird" if seq > 64 else "causal", 1, 1, seq, 64, "float16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
def test_dtypes_and_head_dims(dtype, head_dim):
    run_rowwise("longformer:window=8,globals=4", 2, 2, 40, head_dim, dtype)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
@pytest.mark.parametrize("mask", ["sliding", "bigbird", "causal", "per_head_random"])
def test_head_dims_under_each_mask_kind(head_dim, mask):
    if mask == "per_head_random":
        mask = np.random.default_rng(head_dim).random((1, 2, 60, 60)) < 0.1
        mask[:, :, 4] = False
    run_rowwise(mask, 1, 2, 60, head_dim, "float16")


def test_cuda_lanes_and_configs_of_every_head_dim():
    """One 16-byte vector per lane, lanes a power of two (a group's shuffles stay in its warp): 80 and 96
    channels take 16 lanes, 6 or 4 of them idle; the default fills one warp per row and fits."""
    assert {d: cuda_lanes(d, "float16") for d in (32, 64, 80, 96, 128, 256)} == \
        {32: 4, 64: 8, 80: 16, 96: 16, 128: 16, 256: 32}
    for head_dim in SUPPORTED_HEAD_DIMS:
        config = default_row_config(head_dim, "float16", "cuda")
        assert cuda_lanes(head_dim, "float16") * config.key_groups == 32
        assert cuda_config_fits(config, head_dim, "float16", 1024)
    assert not cuda_config_fits(RowConfig(key_groups=8), 80, "float16", 1024)     # 128 threads > 80 channels
    assert cuda_config_fits(RowConfig(key_groups=4, rows_per_block=2), 80, "float16", 1024)


@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_mask_group_layouts_with_empty_rows(layout):
    mask = np.random.default_rng(11).random(layout + (50, 50)) < 0.1
    mask[..., 5, :] = False                                # one empty row in every group
    out = run_rowwise(mask, 2, 3, 50, 64, "float16")
    assert (out[:, :, 5] == 0).all()


def test_padding_lengths_including_zero():
    out = run_rowwise(np.array([37, 0, 64]), 3, 2, 64, 64, "float16")
    assert (out[1] == 0).all()


def test_cross_attention_lengths_and_custom_scale():
    mask = np.random.default_rng(5).random((30, 75)) < 0.4
    run_rowwise(mask, 1, 2, 30, 64, "float16", seq_k=75, scale=0.3)


@pytest.mark.parametrize("config", [RowConfig(4, 2, 4), RowConfig(2, 4, 4), RowConfig(8, 3, 2), RowConfig(3, 1, 1)])
def test_cuda_shaped_work_splits_on_cpu(config):
    """Several key groups per row (split-K online softmax + exact merge), several keys per step, remainders."""
    mask = np.random.default_rng(2).random((2, 1, 70, 70)) < 0.3
    mask[0, 0, :3] = False
    run_rowwise(mask, 2, 2, 70, 64, "float16", config=config)
    run_rowwise("sliding:window=9", 1, 1, 70, 128, "bfloat16", config=config)


@settings(max_examples=12, deadline=None)
@given(seq=st.integers(1, 130), density=st.sampled_from([0.01, 0.05, 0.2, 0.5, 0.9]),
       layout=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]), seed=st.integers(0, 2**31 - 1))
def test_random_masks(seq, density, layout, seed):
    mask = np.random.default_rng(seed).random(layout + (seq, seq)) < density
    run_rowwise(mask, 2, 2, seq, 64, "float16", config=RowConfig(2, 2, 1), seed=seed % 7)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sliding", "bigbird"])
def test_long_sequence(name):
    run_rowwise(name, 1, 1, 4096, 64, "float16")


def test_rejects_bad_arguments():
    base = dict(batch=2, heads=2, seq_q=8, seq_k=8, head_dim=64, dtype="float16", mask_batch=1, mask_heads=1)
    with pytest.raises(ValueError, match="head_dim"):
        rowwise_attention_primfunc(**{**base, "head_dim": 72}, target_kind="llvm")
    with pytest.raises(ValueError, match="head_dim"):
        rowwise_attention_primfunc(**{**base, "head_dim": 16}, target_kind="llvm")
    with pytest.raises(TypeError, match="dtype"):
        rowwise_attention_primfunc(**{**base, "dtype": "float32"}, target_kind="cuda")
    with pytest.raises(TypeError, match="dtype"):
        rowwise_attention_primfunc(**{**base, "dtype": "int8"}, target_kind="llvm")
    with pytest.raises(ValueError, match="mask_batch"):
        rowwise_attention_primfunc(**{**base, "mask_batch": 3}, target_kind="llvm")
    with pytest.raises(ValueError, match="key_groups"):       # 8 lanes x 3 groups is not whole warps
        rowwise_attention_primfunc(**base, config=RowConfig(3, 2, 4), target_kind="cuda")
    with pytest.raises(ValueError, match="target_kind"):
        rowwise_attention_primfunc(**base, target_kind="rocm")
    with pytest.raises(ValueError, match="RowConfig.key_groups"):
        RowConfig(0, 2, 4)


def _cuda_source(dtype, head_dim, layout, config=None):
    func = rowwise_attention_primfunc(batch=4, heads=12, seq_q=1000, seq_k=1000, head_dim=head_dim, dtype=dtype,
                                      mask_batch=layout[0], mask_heads=layout[1], config=config,
                                      target_kind="cuda")
    ex = tvm.compile(func, target=CUDA)
    assert [m.kind for m in ex.mod.imports] == ["cuda"]
    return ex.mod.imports[0].inspect_source()


@pytest.mark.parametrize("dtype,head_dim,layout,config", [
    ("float16", 64, (1, 1), None), ("bfloat16", 128, (4, 12), None), ("float16", 128, (4, 1), RowConfig(4, 4, 2)),
    ("float16", 32, (1, 1), None), ("bfloat16", 80, (4, 1), None), ("float16", 96, (1, 12), RowConfig(4, 2, 2)),
    ("float16", 256, (1, 1), None)])
def test_cuda_codegen_compiles_for_sm90(dtype, head_dim, layout, config, tmp_path):
    """Generated CUDA: 16-byte K/V loads, shuffles for the dot products; nvcc builds it without local memory."""
    src = _cuda_source(dtype, head_dim, layout, config)
    assert "uint4" in src and "__shfl_down_sync(" in src
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    (tmp_path / "k.cu").write_text(src)
    # TVM's own nvcc flags (tvm.support.nvcc): -O3 --use_fast_math
    log = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "--use_fast_math", "-Xptxas", "-v", "-o",
                          str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
                         capture_output=True, text=True, check=True).stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0
    assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), ("bfloat16", 128)])
def test_gpu_matches_reference(dtype, head_dim):
    batch, heads, seq = 2, 3, 333
    mask4 = np.random.default_rng(4).random((batch, heads, seq, seq)) < 0.05
    func = rowwise_attention_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim,
                                      dtype=dtype, mask_batch=batch, mask_heads=heads, target_kind="cuda")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_" + tvm.cuda(0).compute_version.replace(".", "")},
                               host={"kind": "llvm"})
    kernel = tvm.compile(func, target=target)[ROWWISE_SYMBOL]
    dev = tvm.cuda(0)
    fmt = build_rows(mask4)
    q, k, v = random_qkv(batch, heads, seq, seq, head_dim, dtype)
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, numpy_dtype(dtype)), dev)
    kernel(*(tvm.runtime.tensor(a, dev) for a in (q, k, v, fmt.indptr, fmt.indices)), out)
    assert_attention_close(out.numpy(), reference_attention(q, k, v, mask4, head_dim ** -0.5), mask4, dtype)
