"""Head dims 32, 80, 96 and 256 of the Hopper wgmma attention kernel (schedules/attention_wgmma.py), beside 64 and 128.

Rows of 64, 160 and 192 bytes are not whole 128-byte swizzle spans, so those head dims keep their tiles as panels of
32 columns (64-byte rows, 64-byte swizzle: 32 and 96) or 16 columns (32-byte rows, 32-byte swizzle: 80). Checked
here without a GPU:

- the layout: a tile placed by the cp.async producer (:func:`panel_offset`) and by an emulation of the copy engine
  (TMA boxes of :func:`panel_map`, the swizzle applied on shared address bits) is the same bytes, and reading it
  back through the kernel's descriptors (:func:`descriptor_bits` decoded, the PTX ISA canonical K-major and
  MN-major layouts of each swizzle mode, the swizzle on the address) at every k16 step of ``S = Q K^T`` and of
  ``O += P V`` (:func:`s_step_offset`, :func:`pv_step_offset`) gives exactly the operand's elements;
- the configurations (registers of S, O and P per consumer thread, shared memory, the cp.async producer's head
  dims) and the defaults;
- the CUDA source built for sm_90a: the wgmma shapes of each head dim, 0 spills, no stack, no serialised wgmma,
  HGMMA in the SASS where a disassembler exists;
- the CPU twin's numerics at the new tile shapes;
- the defaults (the forms measured fastest on the H200) and that the analytical model and the compile path offer
  the kernel only at head dims checked on a GPU (:data:`CHECKED_HEAD_DIMS`), at the new ones the default alone.

Their numerics on the H200: ``scripts/bench_attention.py`` plan ``s10dims`` (session 10, call 6: 49/49 checks)."""
from __future__ import annotations

import math
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest
import tvm

from stof_tvm.schedules import attention_wgmma
from stof_tvm.schedules.attention_wgmma import (DEFAULT_PAD_PANELS, DEFAULT_PERSISTENT, SUPPORTED_HEAD_DIMS,
                                                WgmmaAttentionConfig, cpu_twin_primfunc, default_config,
                                                descriptor_bits, panel_cols, panel_offset, pv_step_offset,
                                                s_step_offset, wgmma_attention_primfunc)
from stof_tvm.schedules.tensor_maps import SWIZZLE_BYTES, panel_map
from stof_tvm.schedules.templates.build import cuda_source, cuda_target
from stof_tvm.sparse_formats import build_tiled, normalize_mask

from attention_reference import assert_attention_close, numpy_dtype, random_qkv, reference_attention
from hopper_checks import sm90a_sass

NEW_HEAD_DIMS = (32, 80, 96, 256)
SPAN_OF_LAYOUT = {1: 128, 2: 64, 3: 32}       # descriptor layout type -> swizzle span in bytes


def swizzle(addr, span: int):
    """The shared-memory swizzle of a ``span``-byte mode on byte addresses: 16-byte chunk bits 4.. XORed with bits
    7.. (128: three bits, 64: two, 32: one)."""
    return addr ^ (((addr >> 7) & (span // 16 - 1)) << 4)


def cp_async_tile(operand: np.ndarray, row0: int, rows: int, head_dim: int) -> np.ndarray:
    """Bytes the cp.async producer writes for rows ``row0 ..`` of ``operand`` [S, D] (uint16): chunk ``ch`` of row
    ``r`` into panel ``ch // chunks`` at :func:`panel_offset`; rows past the end zero-filled."""
    cols = panel_cols(head_dim)
    row_bytes, chunks = 2 * cols, cols // 8
    out = np.zeros(rows * head_dim * 2, np.uint8)
    for r in range(rows):
        for ch in range(head_dim // 8):
            dst = (ch // chunks) * rows * row_bytes + panel_offset(r, ch % chunks, row_bytes)
            if row0 + r < operand.shape[0]:
                out[dst:dst + 16] = np.ascontiguousarray(operand[row0 + r, ch * 8:ch * 8 + 8]).view(np.uint8)
    return out


def tma_tile(operand: np.ndarray, row0: int, rows: int, config: WgmmaAttentionConfig) -> np.ndarray:
    """Bytes the TMA producer's boxes write (:func:`panel_map` of this head dim and configuration, one box per panel
    at panel ``p * rows * row_bytes``): box element (x, y) stored densely, then moved by the map's swizzle; rows
    past the end, and with ``pad_panels`` columns past the head dim, read as zeros."""
    head_dim = operand.shape[1]
    cols, width = config.panel_cols(head_dim), config.smem_head_dim(head_dim)
    params = panel_map(1, operand.shape[0], head_dim, rows, "float16", cols, config.pad_panels)
    box_cols, span = params.box[0], SWIZZLE_BYTES[params.swizzle]
    y, x = np.meshgrid(np.arange(rows), np.arange(box_cols), indexing="ij")
    offset = swizzle((y * box_cols + x) * 2, span)
    out = np.zeros(rows * width * 2, np.uint8)
    padded = np.zeros((row0 + rows, width), np.uint16)
    valid = min(operand.shape[0], row0 + rows)
    padded[:valid, :head_dim] = operand[:valid]
    for p in range(width // box_cols):
        panel = out[p * rows * box_cols * 2:(p + 1) * rows * box_cols * 2].view(np.uint16)
        panel[offset // 2] = padded[row0 + y, p * box_cols + x]
    return out


def decode(bits: int):
    """(leading byte offset, stride byte offset, swizzle span) of a descriptor's upper fields."""
    return ((bits >> 16) & 0x3FFF) << 4, ((bits >> 32) & 0x3FFF) << 4, SPAN_OF_LAYOUT[bits >> 62]


def read_k_major(smem: np.ndarray, start: int, bits: int, rows: int) -> np.ndarray:
    """The [rows, 16] operand a K-major wgmma reads at ``start``: row m at ``(m // 8) * SBO + (m % 8) * span``,
    element k at ``2 k`` on (the canonical swizzled K-major layout), the swizzle on the address."""
    _, sbo, span = decode(bits)
    m, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
    addr = swizzle(start + (m // 8) * sbo + (m % 8) * span + k * 2, span)
    return smem.view(np.uint16)[addr // 2]


def read_mn_major(smem: np.ndarray, start: int, bits: int, n: int) -> np.ndarray:
    """The [16, n] operand an MN-major (transposed) wgmma reads at ``start``: element (k, j) at ``(j % (span / 2))
    * 2 + (j // (span / 2)) * LBO + (k % 8) * span + (k // 8) * SBO`` (the canonical swizzled MN-major layout)."""
    lbo, sbo, span = decode(bits)
    k, j = np.meshgrid(np.arange(16), np.arange(n), indexing="ij")
    addr = swizzle(start + (j % (span // 2)) * 2 + (j // (span // 2)) * lbo + (k % 8) * span + (k // 8) * sbo, span)
    return smem.view(np.uint16)[addr // 2]


def _padded_config(head_dim):
    return WgmmaAttentionConfig(block_n=128, stages=2, consumers=3 if head_dim == 32 else 2, loads="tma",
                                pad_panels=True)


@pytest.mark.parametrize("head_dim, pad_panels", [(d, False) for d in SUPPORTED_HEAD_DIMS] +
                         [(32, True), (80, True), (96, True)])
def test_panel_layout_reads_back_through_the_descriptors_at_every_step(head_dim, pad_panels):
    """Q (every consumer's rows), K and V tiles, each placed both ways (cp.async: not with ``pad_panels``; the last
    tile partly past the operand's end), read through the kernel's descriptors step by step: exactly the operand's
    elements, zeros past its end (and, with ``pad_panels``, in the padded columns P V reads)."""
    config = _padded_config(head_dim) if pad_panels else replace(default_config(head_dim), pad_panels=False)
    bm, bn = config.block_m, config.block_n
    cols, width = config.panel_cols(head_dim), config.smem_head_dim(head_dim)
    row_bytes = 2 * cols
    rng = np.random.default_rng(head_dim)
    seq = bm + bn + 37
    q, k, v = (rng.integers(1, 1 << 15, size=(seq, head_dim), dtype=np.uint16) for _ in range(3))
    # the second tile row: 37 + bn rows, then zeros
    q_tile, k_tile, v_tile = tma_tile(q, bm, bm, config), tma_tile(k, bn, bn, config), tma_tile(v, bn, bn, config)
    if not pad_panels:
        assert np.array_equal(q_tile, cp_async_tile(q, bm, bm, head_dim))
        assert np.array_equal(k_tile, cp_async_tile(k, bn, bn, head_dim))
        assert np.array_equal(v_tile, cp_async_tile(v, bn, bn, head_dim))

    def rows_of(x, row0, rows):
        out = np.zeros((rows, width), np.uint16)
        valid = x[row0:row0 + rows]
        out[:len(valid), :head_dim] = valid
        return out

    q_rows, k_rows, v_rows = rows_of(q, bm, bm), rows_of(k, bn, bn), rows_of(v, bn, bn)
    k_major = descriptor_bits(row_bytes, 16)
    mn_major = descriptor_bits(row_bytes, bn * row_bytes)          # the next panel of the V tile
    for kk in range(head_dim // 16):                               # S reads the head dim's columns only
        step = slice(16 * kk, 16 * kk + 16)
        for c in range(config.consumers):
            start = c * 64 * row_bytes + s_step_offset(kk, cols, bm * row_bytes)
            assert np.array_equal(read_k_major(q_tile, start, k_major, 64), q_rows[64 * c:64 * c + 64, step])
        start = s_step_offset(kk, cols, bn * row_bytes)
        assert np.array_equal(read_k_major(k_tile, start, k_major, bn), k_rows[:, step])
    for kk in range(bn // 16):                                     # P V: the shared tiles' width
        got = read_mn_major(v_tile, pv_step_offset(kk, cols), mn_major, width)
        assert np.array_equal(got, v_rows[16 * kk:16 * kk + 16])


def test_panels_and_maps_per_head_dim():
    assert [panel_cols(d) for d in SUPPORTED_HEAD_DIMS] == [32, 64, 16, 32, 64, 64]
    for head_dim, (box_cols, span) in {32: (32, 64), 80: (16, 32), 96: (32, 64), 256: (64, 128)}.items():
        params = panel_map(6, 300, head_dim, 128, "bfloat16", panel_cols(head_dim))
        assert params.box == (box_cols, 128, 1) and SWIZZLE_BYTES[params.swizzle] == span
        assert params.strides == (head_dim * 2, 300 * head_dim * 2)
        assert decode(descriptor_bits(2 * box_cols, 16))[1:] == (16 * box_cols, span)   # SBO: eight rows
    with pytest.raises(ValueError, match="multiple of 32"):
        panel_map(6, 300, 80, 128, "float16", 32)
    with pytest.raises(ValueError, match="panel_cols"):
        panel_map(6, 300, 80, 128, "float16", 8)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_default_configs_fit_every_head_dim(head_dim):
    for padding in (False, True):
        config = default_config(head_dim, padding)
        config.validate(head_dim)
        assert config.shared_bytes(head_dim) <= 227 * 1024
        assert config.loads == "tma" and config.persistent == DEFAULT_PERSISTENT[head_dim, padding]
        assert config.pad_panels == DEFAULT_PAD_PANELS[head_dim, padding]
        assert config.consumers == (3 if head_dim <= 64 and not padding else 2)
    assert default_config(head_dim).block_n == (64 if head_dim == 256 else 128)


def test_defaults_at_the_new_head_dims_are_the_forms_measured_fastest():
    """s10dims (H200, causal): padded panels at 80 (1.234 ms vs 1.263), one block per item at 96 (1.257 vs 1.342)
    and 256 (0.938 vs 0.948), the persistent 64-byte-swizzle kernel at 32 (0.849 vs 0.865); key-padded calls keep
    the forms checked with key padding (persistent, the head dim's own panels)."""
    assert default_config(32) == WgmmaAttentionConfig(block_n=128, stages=4, persistent=True, consumers=3,
                                                      loads="tma")
    assert default_config(80) == WgmmaAttentionConfig(block_n=128, stages=2, persistent=True, loads="tma",
                                                      pad_panels=True)
    assert default_config(96) == WgmmaAttentionConfig(block_n=128, stages=3, persistent=False, loads="tma")
    assert default_config(256) == WgmmaAttentionConfig(block_n=64, stages=2, persistent=False, loads="tma")
    for head_dim in (32, 80, 96, 256):
        padded = default_config(head_dim, padding=True)
        assert padded.persistent and not padded.pad_panels and padded.consumers == 2


@pytest.mark.parametrize("head_dim, config, error", [
    (256, WgmmaAttentionConfig(block_n=128, stages=2, loads="tma"), "224 registers"),          # S 64 + O 128 + P 32
    (80, WgmmaAttentionConfig(block_n=128, stages=2, consumers=3, loads="tma"), "consumers=3"),
    (96, WgmmaAttentionConfig(block_n=128, stages=2, consumers=3, loads="tma"), "consumers=3"),
    (256, WgmmaAttentionConfig(block_n=64, stages=3, loads="tma"), "shared memory"),
    (80, WgmmaAttentionConfig(block_n=128, stages=3, loads="cp.async"), "cp.async"),
    (256, WgmmaAttentionConfig(block_n=64, stages=2, loads="cp.async"), "cp.async"),
    (80, WgmmaAttentionConfig(block_n=128, stages=3, loads="tma", pad_panels=True), "shared memory"),   # 128 wide
    (64, WgmmaAttentionConfig(block_n=128, stages=2, loads="tma", pad_panels=True), "pad_panels"),
    (32, WgmmaAttentionConfig(block_n=128, stages=2, loads="cp.async", pad_panels=True), "pad_panels"),
])
def test_configs_that_cannot_build_well_are_refused(head_dim, config, error):
    with pytest.raises(ValueError, match=error):
        wgmma_attention_primfunc(batch=1, heads=2, seq_q=300, seq_k=300, head_dim=head_dim, dtype="float16",
                                 mask_batch=1, mask_heads=1, config=config)


@pytest.mark.parametrize("head_dim, dtype, padding", [
    (32, "float16", False), (80, "float16", False), (96, "float16", False), (256, "float16", False),
    (80, "bfloat16", True),
])
def test_cuda_source_of_each_new_head_dim_compiles_without_spills(head_dim, dtype, padding, tmp_path):
    """The default configuration of each new head dim (padded panels at 80, P V over the padded width) and a
    key-padded one (80: the 32-byte swizzle with the padding predicate): both products at their shapes, 0 spills, no
    stack, no serialised wgmma; HGMMA of both shapes, setmaxnreg kept and no local memory in the SASS. (One nvcc per
    form: CI time; out/s10dims builds every form the H200 ran, all clean.)"""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    config = default_config(head_dim, padding)
    width = config.smem_head_dim(head_dim)
    func = wgmma_attention_primfunc(batch=2, heads=3, seq_q=300, seq_k=300, head_dim=head_dim, dtype=dtype,
                                    mask_batch=1, mask_heads=1, config=config, padding=padding)
    src = cuda_source(tvm.compile(tvm.IRModule({"main": func}), target=cuda_target("sm_90a")))
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    for text in (f"wgmma.mma_async.sync.aligned.m64n{config.block_n}k16.f32.{ab}.{ab}",
                 f"wgmma.mma_async.sync.aligned.m64n{width}k16.f32.{ab}.{ab}",
                 "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"):
        assert text in src, text
    sass = sm90a_sass(src, tmp_path)
    if sass is None:
        return
    assert re.search(rf"HGMMA\.64x{config.block_n}x16\.F32", sass)
    assert re.search(rf"HGMMA\.64x{width}x16\.F32", sass)
    assert sass.count("USETMAXREG") == 2           # setmaxnreg kept (ptxas drops it silently in some shapes)
    assert not re.search(r"\b(LDL|STL|LDGSTS)\b", sass)


@pytest.mark.parametrize("head_dim, dtype, out_layout", [(80, "float16", "bshd"), (256, "bfloat16", "bhsd")])
def test_cpu_twin_at_the_new_tile_shapes(head_dim, dtype, out_layout):
    """The llvm twin at the default tile shape (128 x 128 at 80, 128 x 64 at 256) against float64 numpy, per-head
    random mask with empty rows, two tile rows, the second partial."""
    config = default_config(head_dim)
    batch, heads, seq = 1, 2, config.block_m + 22
    rng = np.random.default_rng(head_dim)
    dense = rng.random((batch, heads, seq, seq)) < 0.3
    dense[:, :, rng.random(seq) < 0.2, :] = False
    mask4 = normalize_mask(dense, batch=batch, heads=heads, seq_q=seq)
    func = cpu_twin_primfunc(batch=batch, heads=heads, seq_q=seq, seq_k=seq, head_dim=head_dim, dtype=dtype,
                             mask_batch=batch, mask_heads=heads, config=config, out_layout=out_layout)
    fn = tvm.compile(func, target=tvm.target.Target({"kind": "llvm"}))["blockwise_attention"]
    q, k, v = random_qkv(batch, heads, seq, seq, head_dim, dtype)
    fmt = build_tiled(mask4, config.block_m, config.block_n)
    arrays = [fmt.full_indptr, fmt.full_indices if fmt.full_indices.size else np.zeros(1, np.int32),
              fmt.part_indptr, fmt.part_indices, fmt.part_bitmaps]
    shape = (batch, seq, heads, head_dim) if out_layout == "bshd" else q.shape
    out = np.full(shape, np.nan, dtype=numpy_dtype(dtype))
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu()) for a in (q, k, v, *arrays, out)]
    fn(*args)
    got = args[-1].numpy()
    if out_layout == "bshd":
        got = got.transpose(0, 2, 1, 3)
    assert_attention_close(got, reference_attention(q, k, v, mask4, 1 / math.sqrt(head_dim)), mask4, dtype)


@pytest.mark.parametrize("padding", [False, True])
def test_model_and_compile_path_offer_only_gpu_checked_head_dims(padding, monkeypatch):
    """Every head dim the kernel builds is GPU-checked now: the model offers the default alone at the new ones (the
    knob space at 64 and 128). A head dim built but not checked (80 taken out of CHECKED_HEAD_DIMS) gets no wgmma
    candidate, and the compile path says why it does not use the kernel there."""
    from stof_tvm.compiler.kernels import wgmma_unavailable
    from stof_tvm.cost_model import attention as model

    def unavailable(head_dim):
        return wgmma_unavailable(head_dim=head_dim, dtype="float16", target_kind="cuda", target_arch="sm_90a",
                                 bias=None, padding=padding)

    assert attention_wgmma.CHECKED_HEAD_DIMS == SUPPORTED_HEAD_DIMS
    for head_dim in SUPPORTED_HEAD_DIMS:
        offered = [c.config for c in model.wgmma_candidates(head_dim, padding=padding)]
        assert offered[0] == default_config(head_dim, padding) and (len(offered) == 1) == (head_dim not in (64, 128))
        assert unavailable(head_dim) is None or "nvcc" in unavailable(head_dim)
    checked = tuple(d for d in SUPPORTED_HEAD_DIMS if d != 80)
    monkeypatch.setattr(attention_wgmma, "CHECKED_HEAD_DIMS", checked)
    monkeypatch.setattr(model, "WGMMA_HEAD_DIMS", checked)
    assert model.wgmma_candidates(80, padding=padding) == []
    assert "checked on the GPU at head dims" in unavailable(80)


def test_a_timing_run_skips_what_failed_or_hung_in_the_checks():
    """s10dims runs its checks and timings as two processes under timeouts: a configuration that failed a check, or
    whose check was in flight when the check process was killed (a hung kernel), is not timed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_attention

    def case(head_dim, config, ok=None):
        row = {"family": "wgmma", "head_dim": head_dim, "config": list(config)}
        return row if ok is None else dict(row, ok=ok)

    good, bad, hung = (128, 4, True, True, 3, "tma"), (128, 3, True, True, 2, "tma"), (64, 2, True, True, 2, "tma")
    earlier = {"results": [case(32, good, True), case(80, bad, False)], "in_flight": case(256, hung)}
    failed = bench_attention.failed_configs(earlier)
    assert failed == {bench_attention._config_key(case(80, bad)), bench_attention._config_key(case(256, hung))}
    assert bench_attention._config_key(case(32, good)) not in failed
    assert bench_attention.failed_configs({"results": [case(32, good, True)]}) == set()


@pytest.mark.parametrize("head_dim, padding", [(32, False), (80, False), (80, True), (96, False), (256, False)])
def test_compile_path_takes_the_measured_default_at_the_new_head_dims(head_dim, padding):
    """``kernel="auto"`` in the compile path on an sm_90 target: a causal mask at a new head dim goes to the wgmma
    kernel with the default configuration (padded panels at 80 unless key-padded), its format at that tile shape,
    and the configuration round-trips through the choice's manifest dict into a kernel that builds."""
    from stof_tvm.compiler.kernels import choose_kernel, config_object, kernel_primfunc

    mask = normalize_mask("causal", seq_q=2048)
    choice = choose_kernel("auto", mask, batch=16, heads=12, head_dim=head_dim, dtype="float16", seq_q=2048,
                           target_kind="cuda", mask_batch=1, mask_heads=1, target_arch="sm_90", padding=padding)
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed (the compile path offers wgmma only with it)")
    config = default_config(head_dim, padding)
    assert choice.kind == "wgmma" and config_object("wgmma", choice.config) == config, choice.reason
    assert choice.tile == (config.block_m, config.block_n)
    func = kernel_primfunc(choice, batch=2, heads=3, seq_q=300, seq_k=300, head_dim=head_dim, dtype="float16",
                           scale=head_dim ** -0.5, target_kind="cuda")
    assert func.attrs["global_symbol"] == "wgmma_attention"
