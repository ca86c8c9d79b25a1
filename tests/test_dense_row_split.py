"""The dense-row split on the CPU twins (llvm): the block-wise kernel on the mask with its dense query rows
emptied, then the dense rows gathered, the wgmma kernel's twin on them as a dense problem of G queries and the
rows scattered back (pad slots skipped), against the float64 reference of the whole mask; and the wgmma kernel of
such a packed problem (seq_q = G != seq_k) through nvcc / ptxas for sm_90a with no spills."""
import math
import re
import shutil

import numpy as np
import pytest
import tvm

from stof_tvm import normalize_mask
from stof_tvm.schedules.attention_blockwise import BlockConfig, blockwise_attention_primfunc
from stof_tvm.schedules.attention_wgmma import WgmmaAttentionConfig, cpu_twin_primfunc, wgmma_attention_primfunc
from stof_tvm.sparse_formats import build_tiled
from stof_tvm.sparse_formats.row_classes import pack_dense_rows, split_dense_rows

from attention_reference import assert_attention_close, numpy_dtype, random_qkv, reference_attention

LLVM = tvm.target.Target({"kind": "llvm"})


def _format(mask4, block_m, block_n):
    fmt = build_tiled(mask4, block_m, block_n)
    return [fmt.full_indptr, fmt.full_indices if fmt.full_indices.size else np.zeros(1, np.int32),
            fmt.part_indptr, fmt.part_indices if fmt.part_indices.size else np.zeros(1, np.int32),
            fmt.part_bitmaps if fmt.part_bitmaps.size else np.zeros((1, block_m // 8, block_n // 8), np.uint64)]


def _run(func, symbol, q, k, v, arrays, out):
    fn = tvm.compile(func, target=LLVM)[symbol]
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in (q, k, v, *arrays, out)]
    fn(*args)
    return args[-1].numpy()


def _per_head_mask(batch, heads, seq, rng):
    """Random per-head mask with dense rows (a different number a head, none in head 0) and empty rows."""
    mask = rng.random((batch, heads, seq, seq)) < 0.15
    dense = rng.random((batch, heads, seq)) < 0.08
    dense[:, 0] = False
    mask[dense] = True
    mask[(rng.random((batch, heads, seq)) < 0.1) & ~dense] = False
    return mask


@pytest.mark.parametrize("mask_name, dtype, consumers", [("longformer", "float16", 3), ("per_head", "bfloat16", 2),
                                                         ("bigbird", "float16", 2)])
def test_split_on_the_cpu_twins_matches_the_whole_mask(mask_name, dtype, consumers):
    batch, heads, seq, head_dim = 2, 3, 136, 64
    rng = np.random.default_rng(5)
    mask = _per_head_mask(batch, heads, seq, rng) if mask_name == "per_head" else mask_name
    mask4 = normalize_mask(mask, batch=batch, heads=heads, seq_q=seq)
    groups = dict(mask_batch=mask4.shape[0], mask_heads=mask4.shape[1])
    q, k, v = random_qkv(batch, heads, seq, seq, head_dim, dtype, seed=3)
    scale = 1 / math.sqrt(head_dim)
    _, sparse = split_dense_rows(mask4)
    row_ids, packed = pack_dense_rows(mask4)
    count = row_ids.shape[2]
    block = BlockConfig(block_m=32, block_n=32, num_warps=2)
    out = np.full(q.shape, np.nan, dtype=numpy_dtype(dtype))
    out = _run(blockwise_attention_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim,
                                            dtype=dtype, scale=scale, config=block, target_kind="llvm", **groups),
               "blockwise_attention", q, k, v, _format(sparse, 32, 32), out)
    ids = np.broadcast_to(row_ids, (batch, heads, count))
    q_packed = np.take_along_axis(q, np.where(ids >= 0, ids, 0)[..., None], axis=2)
    dense_cfg = WgmmaAttentionConfig(consumers=consumers)
    out_packed = _run(cpu_twin_primfunc(batch=batch, heads=heads, seq_q=count, seq_k=seq, head_dim=head_dim,
                                        dtype=dtype, scale=scale, config=dense_cfg, **groups),
                      "blockwise_attention", q_packed, k, v, _format(packed, dense_cfg.block_m, dense_cfg.block_n),
                      np.full(q_packed.shape, np.nan, dtype=numpy_dtype(dtype)))
    for b, h, i in zip(*np.nonzero(ids >= 0)):
        out[b, h, ids[b, h, i]] = out_packed[b, h, i]
    if mask_name == "per_head":
        assert (row_ids[:, 0] == -1).all() and (row_ids[:, 1:] >= 0).any()     # pad-only heads, others with rows
    assert not np.isnan(out.astype(np.float32)).any()
    assert_attention_close(out, reference_attention(q, k, v, mask4, scale), mask4, dtype)


@pytest.mark.parametrize("count, config", [(64, WgmmaAttentionConfig(stages=3, consumers=3, persistent=True,
                                                                     loads="tma")),
                                           (32, WgmmaAttentionConfig(stages=3, loads="cp.async"))])
def test_packed_dense_rows_kernel_compiles_for_sm90a_without_spills(count, config, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    from hopper_checks import sm90a_sass

    from stof_tvm.schedules.templates.build import cuda_source, cuda_target

    func = wgmma_attention_primfunc(batch=16, heads=12, seq_q=count, seq_k=4096, head_dim=64, dtype="float16",
                                    mask_batch=1, mask_heads=1, config=config)
    src = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=cuda_target("sm_90a")))
    sass = sm90a_sass(src, tmp_path)            # no spills, no stack frame, no serialised wgmma
    if sass is not None:
        assert "HGMMA" in sass and not re.search(r"\b(LDL|STL)\b", sass)
