"""Hopper wgmma attention kernel (schedules/attention_wgmma.py): knobs and argument checks, the parameter list
(the block-wise kernel's), the fragment -> mask-bit mapping against the tiled format's bitmaps, the CPU twin's
numerics at this kernel's tile shape, and the CUDA source compiled by nvcc for sm_90a (wgmma with P from
registers, no spills, no serialised wgmma, setmaxnreg honoured; HGMMA in the SASS where cuobjdump exists).

The kernel's numerics and speed need an H200: scripts/check_attention_wgmma_gpu.py."""
from __future__ import annotations

import math
import re
import shutil

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

from stof_tvm.schedules.attention_blockwise import BlockConfig, blockwise_attention_primfunc
from stof_tvm.schedules.attention_wgmma import (BLOCK_M, DEFAULT_LOADS, DEFAULT_PERSISTENT, LOAD_CHOICES, REGISTERS,
                                                WgmmaAttentionConfig,
                                                block_work_item, cpu_twin_primfunc, default_config,
                                                fragment_position, grid_shape, mask_bit, mask_word,
                                                wgmma_attention_primfunc)
from stof_tvm.schedules.templates.build import cuda_source, cuda_target
from stof_tvm.sparse_formats import build_tiled, normalize_mask

from attention_reference import assert_attention_close, numpy_dtype, random_qkv, reference_attention
from hopper_checks import sm90a_sass

BASE = dict(batch=2, heads=3, seq_q=300, seq_k=300, head_dim=64, dtype="float16", mask_batch=1, mask_heads=1)


def test_default_configs_fit_and_follow_the_head_dim():
    for head_dim in (64, 128):
        config = default_config(head_dim)
        config.validate(head_dim)
        assert config.shared_bytes(head_dim) <= 227 * 1024
    assert default_config(128).stages == 2 and default_config(64).stages == 3
    assert default_config(64).consumers == 3 and default_config(128).consumers == 2
    for (head_dim, padding), loads in DEFAULT_LOADS.items():          # the measured-faster producer and grid
        config = default_config(head_dim, padding)
        assert config.loads == loads in LOAD_CHOICES and config.persistent == DEFAULT_PERSISTENT[head_dim, padding]
        config.validate(head_dim)
    assert default_config(64).loads == default_config(128).loads == "tma"
    assert all(default_config(d, pad).persistent for d in (64, 128) for pad in (False, True))   # the rotated walk


@pytest.mark.parametrize("config, error", [
    (WgmmaAttentionConfig(block_n=96), "block_n"),
    (WgmmaAttentionConfig(stages=1), "stages"),
    (WgmmaAttentionConfig(stages=True), "stages"),
    (WgmmaAttentionConfig(pingpong=1), "pingpong"),
    (WgmmaAttentionConfig(persistent=0), "persistent"),
    (WgmmaAttentionConfig(block_n=128, stages=3), "shared memory"),   # at head_dim 128: 230 KiB
    (WgmmaAttentionConfig(consumers=4), "consumers"),
    (WgmmaAttentionConfig(consumers=True), "consumers"),
    (WgmmaAttentionConfig(consumers=3), "consumers=3"),                # at head_dim 128: no registers for it
    (WgmmaAttentionConfig(block_n=192), "registers"),                  # at head_dim 128: S, O and P take 208
    (WgmmaAttentionConfig(block_n=160, consumers=3), "consumers=3"),
    (WgmmaAttentionConfig(block_n=160), "loads='tma'"),                # cp.async's producer spills beside them
    (WgmmaAttentionConfig(loads="bulk"), "loads"),
    (WgmmaAttentionConfig(loads=None), "loads"),
])
def test_bad_configs_are_refused(config, error):
    with pytest.raises(ValueError, match=error):
        wgmma_attention_primfunc(**dict(BASE, head_dim=128), config=config)


@pytest.mark.parametrize("change, error", [
    ({"head_dim": 72}, "head_dim"), ({"dtype": "float32"}, "dtype"), ({"mask_batch": 3}, "mask_batch"),
    ({"mask_heads": 2}, "mask_heads"), ({"seq_q": 0}, "seq_q"), ({"scale": -1.0}, "scale"),
    ({"out_layout": "bsd"}, "out_layout"),
])
def test_bad_arguments_are_refused(change, error):
    with pytest.raises(ValueError, match=error):
        wgmma_attention_primfunc(**dict(BASE, **change))
    with pytest.raises(TypeError, match="WgmmaAttentionConfig"):
        wgmma_attention_primfunc(**BASE, config=object())


def _params(func):
    return [(p.name, [str(x) for x in p.shape], p.dtype) for p in func.params]


@pytest.mark.parametrize("out_layout", ["bhsd", "bshd"])
def test_parameters_are_the_blockwise_kernels(out_layout):
    """Same buffers, shapes (n_full / n_part symbolic) and dtypes as the block-wise kernel at 128 x block_n."""
    for config in (WgmmaAttentionConfig(block_n=128), WgmmaAttentionConfig(block_n=64)):
        ours = wgmma_attention_primfunc(**dict(BASE, mask_batch=2, mask_heads=3), config=config,
                                        out_layout=out_layout)
        theirs = blockwise_attention_primfunc(**dict(BASE, mask_batch=2, mask_heads=3), target_kind="llvm",
                                              config=BlockConfig(block_m=BLOCK_M, block_n=config.block_n,
                                                                 num_warps=4),
                                              out_layout=out_layout)
        assert _params(ours) == _params(theirs)
        assert _params(ours)[4] == ("full_indices", ["n_full"], "int32")
        assert ours.attrs["global_symbol"] == "wgmma_attention"


@pytest.mark.parametrize("block_n, consumers", [(64, 2), (128, 2), (128, 3), (160, 2), (192, 2)])
def test_fragment_registers_read_the_bits_of_their_own_elements(block_n, consumers):
    """Every accumulator register of every consumer thread, through mask_word / mask_bit, reads exactly the bit
    the tiled format stored for its (row, column) of the tile."""
    block_m = WgmmaAttentionConfig(block_n=block_n, consumers=consumers).block_m
    rng = np.random.default_rng(block_n)
    mask = rng.random((1, 1, block_m, block_n)) < 0.5
    fmt = build_tiled(mask, block_m, block_n)
    assert fmt.part_bitmaps.shape[0] == 1
    words = np.ascontiguousarray(fmt.part_bitmaps[0]).view("<u4").reshape(-1)
    seen = np.zeros((block_m, block_n), dtype=int)
    for c in range(consumers):
        for w in range(4):
            for lane in range(32):
                g, qd = lane // 4, lane % 4
                for j in range(block_n // 8):
                    for hh in range(2):
                        for e in range(2):
                            row, col = fragment_position(c, w, lane, j, hh, e)
                            bit = (int(words[mask_word(c, w, g, hh, j, block_n // 8)]) >> mask_bit(g, qd, e)) & 1
                            assert bit == mask[0, 0, row, col], (c, w, lane, j, hh, e)
                            seen[row, col] += 1
    assert (seen == 1).all()      # the fragment covers the tile once


_CPU = {}


@pytest.mark.parametrize("mask, dtype, head_dim, block_n, out_layout, consumers", [
    ("causal", "float16", 64, 128, "bhsd", 2),
    ("random_empty", "bfloat16", 128, 64, "bshd", 2),
    ("random_empty", "float16", 64, 128, "bhsd", 3),
    ("random_empty", "float16", 64, 192, "bhsd", 2),                   # the wider tiles: keys past S in a tile
    ("causal", "bfloat16", 128, 160, "bshd", 2),
])
def test_cpu_twin_computes_the_kernels_function(mask, dtype, head_dim, block_n, out_layout, consumers):
    config = WgmmaAttentionConfig(block_n=block_n, consumers=consumers)
    batch, heads, seq = 2, 2, config.block_m + 22     # two tile rows, the second partial
    rng = np.random.default_rng(1)
    if mask == "random_empty":
        dense = rng.random((batch, heads, seq, seq)) < 0.2
        dense[:, :, rng.random(seq) < 0.2, :] = False
        mask = dense
    mask4 = normalize_mask(mask, batch=batch, heads=heads, seq_q=seq)
    func = cpu_twin_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim, dtype=dtype,
                             mask_batch=mask4.shape[0], mask_heads=mask4.shape[1], config=config,
                             out_layout=out_layout)
    fn = tvm.compile(func, target=tvm.target.Target({"kind": "llvm"}))["blockwise_attention"]
    q, k, v = random_qkv(batch, heads, seq, seq, head_dim, dtype)
    fmt = build_tiled(mask4, config.block_m, block_n)
    arrays = [fmt.full_indptr, fmt.full_indices if fmt.full_indices.size else np.zeros(1, np.int32),
              fmt.part_indptr, fmt.part_indices if fmt.part_indices.size else np.zeros(1, np.int32),
              fmt.part_bitmaps if fmt.part_bitmaps.size
              else np.zeros((1, config.block_m // 8, block_n // 8), np.uint64)]
    shape = (batch, seq, heads, head_dim) if out_layout == "bshd" else q.shape
    out = np.full(shape, np.nan, dtype=numpy_dtype(dtype))
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in (q, k, v, *arrays, out)]
    fn(*args)
    got = args[-1].numpy()
    if out_layout == "bshd":
        got = got.transpose(0, 2, 1, 3)
    assert_attention_close(got, reference_attention(q, k, v, mask4, 1 / math.sqrt(head_dim)), mask4, dtype)


@pytest.mark.parametrize("head_dim, dtype, config, out_layout", [
    (64, "float16", WgmmaAttentionConfig(block_n=128, stages=3, pingpong=True), "bhsd"),
    (128, "bfloat16", WgmmaAttentionConfig(block_n=128, stages=2, pingpong=False), "bshd"),
    (128, "float16", WgmmaAttentionConfig(block_n=128, stages=2, persistent=True), "bhsd"),
    (64, "float16", WgmmaAttentionConfig(block_n=128, stages=4, persistent=True, consumers=3), "bhsd"),
    (64, "bfloat16", WgmmaAttentionConfig(block_n=128, stages=3, consumers=3), "bshd"),   # idle last-row consumers
])
def test_cuda_source_compiles_for_sm90a_without_spills(head_dim, dtype, config, out_layout, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    func = wgmma_attention_primfunc(**dict(BASE, head_dim=head_dim, dtype=dtype), config=config,
                                    out_layout=out_layout)
    src = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=cuda_target("sm_90a")))
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    for text in (f"wgmma.mma_async.sync.aligned.m64n{config.block_n}k16.f32.{ab}.{ab}",
                 f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.{ab}.{ab}", "wgmma.wait_group.sync.aligned 1",
                 "cp.async.mbarrier.arrive.noinc",
                 f"setmaxnreg.inc.sync.aligned.u32 {REGISTERS[config.consumers][1]}",
                 f"setmaxnreg.dec.sync.aligned.u32 {REGISTERS[config.consumers][0]}",
                 f"__launch_bounds__({(config.consumers + 1) * 128})"):
        assert text in src, text
    # the P V product takes A from four 32-bit registers: "{d...}, {a0, a1, a2, a3}, b_desc"
    assert re.search(rf"m64n{head_dim}k16\.f32\.{ab}\.{ab}\s+\{{[^}}]+\}},\s*\{{[^}}]+\}},", src)
    assert ("bar.sync" in src) == config.pingpong and ("bar.arrive" in src) == config.pingpong
    sass = sm90a_sass(src, tmp_path)
    if sass is None:
        return
    assert re.search(rf"HGMMA\.64x{config.block_n}x16\.F32", sass)
    assert not re.search(r"\b(LDL|STL)\b", sass)


def test_attention_plan_opt_in_kernel_builds_for_sm90a(tmp_path):
    """``AttentionPlan(kernel="wgmma")``: a CUDA sm_90 plan is built for sm_90a with the tiled format at 128 x
    block_n (here without a GPU, saved to run elsewhere); other targets are refused."""
    from stof_tvm.attention import AttentionPlan

    plan = AttentionPlan("causal", (2, 3, 300, 64), "float16", kernel="wgmma",
                         target={"kind": "cuda", "arch": "sm_90"})
    assert plan.kernel == "wgmma" and plan.target["arch"] == "sm_90a"
    assert plan.config == default_config(64)
    assert plan.formats[4].shape[1:] == (plan.config.block_m // 8, plan.config.block_n // 8)
    saved = plan.save(tmp_path / "plan")
    assert (tmp_path / "plan" / "plan.json").read_text().count('"wgmma"') == 1 and saved
    with pytest.raises(ValueError, match="sm_90"):
        AttentionPlan("causal", (2, 3, 300, 64), "float16", kernel="wgmma", target={"kind": "cuda", "arch": "sm_80"})
    with pytest.raises(ValueError, match="Hopper"):
        AttentionPlan("causal", (2, 3, 300, 64), "float16", kernel="wgmma", target="llvm")


@pytest.mark.parametrize("persistent, blocks", [(False, 3 * 2 * 3), (True, 7)])
def test_grid_is_one_block_per_work_item_or_sm_count_when_persistent(persistent, blocks):
    """3 tile rows x 2 batches x 3 heads = 18 work items: 18 blocks, or 7 persistent blocks walking them."""
    func = wgmma_attention_primfunc(**BASE, config=WgmmaAttentionConfig(persistent=persistent), sm_count=7)
    assert re.search(rf"T\.thread_binding\({blocks}, thread=\"blockIdx\.x\"\)", func.script())


@settings(max_examples=60, deadline=None)
@given(tile_rows=st.integers(1, 70), heads=st.integers(1, 40), sm_count=st.integers(1, 140),
       persistent=st.booleans())
def test_work_items_cover_every_tile_row_once_and_persistent_blocks_stay_balanced(tile_rows, heads, sm_count,
                                                                                 persistent):
    """Every (head, tile row) is one block's work item exactly once; on a causal mask (tile row r holds r + 1
    tiles) the persistent blocks' tile counts differ by at most one unit of tile rows (each holds tile_rows + 1
    tiles, or tile_rows where that is odd)."""
    grid, rounds = grid_shape(tile_rows, heads, sm_count, persistent)
    assert grid == (min(heads * -(-tile_rows // 2), sm_count) if persistent else tile_rows * heads)
    seen, work = [], []
    for bx in range(grid):
        items = [block_work_item(bx, j, tile_rows, heads, grid, persistent) for j in range(rounds)]
        seen += [(h, tr) for ok, h, tr in items if ok]
        work.append(sum(tr + 1 for ok, _, tr in items if ok))
    assert sorted(seen) == [(h, tr) for h in range(heads) for tr in range(tile_rows)]
    if persistent:
        assert max(work) - min(work) <= tile_rows + 1


# Two TMA configurations (CI time); the persistent and 64-key-tile ones are built and their SASS counted by
# scripts/bench_attention.py's s8tma plan (out/s8tma).
TMA_CONFIGS = [
    (64, "float16", WgmmaAttentionConfig(block_n=128, stages=3, consumers=3, loads="tma"), "bhsd"),
    (128, "bfloat16", WgmmaAttentionConfig(block_n=128, stages=2, loads="tma"), "bshd"),
    (128, "float16", WgmmaAttentionConfig(block_n=160, stages=2, persistent=True, loads="tma"), "bhsd"),   # wider
    (64, "bfloat16", WgmmaAttentionConfig(block_n=192, stages=3, persistent=True, loads="tma"), "bshd"),
]


ENCODE = re.compile(r'T\.tensormap_encode_tiled\((\w+), T\.address_of\((\w+)\[0, 0, 0, 0\]\), ([\d, ]+), '
                    r'descriptor_dtype="(\w+)", rank=(\d), interleave=0, swizzle=(\d)')


def _tensormap_encodes(func):
    """(map, operand, the integer operands, dtype, rank, swizzle) of each host-side encode in ``func``'s script."""
    return [(m[1], m[2], [int(x) for x in m[3].split(", ")], m[4], int(m[5]), int(m[6]))
            for m in ENCODE.finditer(func.script())]


@pytest.mark.parametrize("head_dim, dtype, config, out_layout", TMA_CONFIGS)
def test_tma_kernel_encodes_q_k_v_maps_on_the_host(head_dim, dtype, config, out_layout):
    """``loads="tma"``: three host calls encode the maps of Q, K and V from each operand's first element (so a view's
    offset counts) with :func:`panel_map`'s parameters: boxes of block_m query rows or block_n key rows."""
    from stof_tvm.schedules.tensor_maps import panel_map

    problem = dict(BASE, head_dim=head_dim, dtype=dtype, seq_k=260)
    func = wgmma_attention_primfunc(**problem, config=config, out_layout=out_layout)
    calls = _tensormap_encodes(func)
    bh = BASE["batch"] * BASE["heads"]
    expected = {"q": panel_map(bh, problem["seq_q"], head_dim, config.block_m, dtype),
                "k": panel_map(bh, 260, head_dim, config.block_n, dtype),
                "v": panel_map(bh, 260, head_dim, config.block_n, dtype)}
    assert [(c[0], c[1]) for c in calls] == [("q_map", "q"), ("k_map", "k"), ("v_map", "v")]
    for (_, _, numbers, map_dtype, rank, swizzle), params in zip(calls, expected.values()):
        assert numbers == [*params.dims, *params.strides, *params.box, *params.element_strides]
        assert (map_dtype, rank, swizzle) == (dtype, 3, params.swizzle)
    assert _tensormap_encodes(wgmma_attention_primfunc(**problem, config=WgmmaAttentionConfig())) == []


def test_tma_leaves_the_cpu_twin_as_it_is():
    """The llvm twin depends on the tile shape only: the load path is the CUDA kernel's business."""
    for consumers in (2, 3):
        plain = cpu_twin_primfunc(**BASE, config=WgmmaAttentionConfig(consumers=consumers))
        tma = cpu_twin_primfunc(**BASE, config=WgmmaAttentionConfig(consumers=consumers, loads="tma"))
        tvm.ir.assert_structural_equal(plain, tma)


@pytest.mark.parametrize("head_dim, dtype, config, out_layout", TMA_CONFIGS)
def test_tma_kernel_compiles_for_sm90a_with_tma_and_no_proxy_fence(head_dim, dtype, config, out_layout, tmp_path):
    """The maps are ``__grid_constant__`` kernel parameters; one producer thread issues ``cp.async.bulk.tensor``
    (UTMALDG in the SASS) and the bitmap's ``cp.async.bulk`` on transaction-count mbarriers; no 16-byte cp.async
    (LDGSTS) and no consumer ``fence.proxy.async`` (MEMBAR) remain; no spills, no serialised wgmma."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    func = wgmma_attention_primfunc(**dict(BASE, head_dim=head_dim, dtype=dtype), config=config,
                                    out_layout=out_layout)
    src = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=cuda_target("sm_90a")))
    assert src.count("const __grid_constant__ CUtensorMap") == 2 * 3       # declaration and definition
    for text in ("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                 "mbarrier.arrive.expect_tx.shared::cta.b64", "prefetch.tensormap",
                 f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16"):
        assert text in src, text
    for text in ("cp.async.cg", "cp.async.mbarrier.arrive", "fence.proxy.async"):
        assert text not in src, text
    sass = sm90a_sass(src, tmp_path)
    if sass is None:
        return
    assert re.search(rf"HGMMA\.64x{config.block_n}x16\.F32", sass)
    assert "UTMALDG.3D" in sass and "UBLKCP" in sass
    assert not re.search(r"\b(LDGSTS|MEMBAR|LDL|STL)\b", sass)
