"""The fused relative-position bias (stof_tvm.schedules.relative_bias, stof_tvm.compiler.relative_bias_match).

The window tables round-trip; the loop-nest kernel computes the graph's bias from them (numpy: the full products,
gathered, scaled and summed) on DeBERTa-like relative positions, including tiles whose window is clamped to the
last positions; the CUDA kernel has mma.sync products and builds for sm_90a without spills; the compile path
fuses both terms of every layer of HF DeBERTa-v3 exports (TorchScript and dynamo) and the llvm module's output
equals the unfused graph's; other forms are left as they were. The compile option is on by default; the tests
name it either way."""
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from hopper_checks import sm90_ptxas_report
from hypothesis import given, settings, strategies as st

from stof_tvm.compiler.pipeline import CUDA_DEFAULTS, make_target
from stof_tvm.compiler.relative_bias_match import _windows, offset_words, strip_window
from stof_tvm.schedules.relative_bias import STRIP, TILE, relative_bias_primfunc, relative_bias_reference, window_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from check_relative_bias_gpu import graph_form, log_bucket_positions  # noqa: E402  (the GPU check's graph form)


def decode(words: np.ndarray, which: int) -> np.ndarray:
    """The offsets of term ``which`` back from :func:`offset_words`'s words, in output order."""
    seq = words.shape[0]
    parts = words.reshape(seq, seq // TILE, 32)
    halves = [(parts >> np.uint32(16 * which + 8 * half)) & np.uint32(255) for half in (0, 1)]
    return np.stack(halves, axis=2).reshape(seq, seq).astype(np.int64)


def strip_bases(bases: np.ndarray, strip_axis: int) -> np.ndarray:
    """Each output's absolute strip start from a term's ``[tiles, tiles, 1 + WARPS]`` table (``strip_axis`` 0: the
    strip of the row, 1: of the column)."""
    tiles = bases.shape[0]
    index = np.arange(tiles * TILE)
    tile, strip = index // TILE, index % TILE // STRIP
    starts = bases[:, :, :1] + bases[:, :, 1:]
    if strip_axis == 0:
        return starts[tile[:, None], tile[None, :], strip[:, None]]
    return starts[tile[:, None], tile[None, :], strip[None, :]]


def relative_tables(seq: int, positions: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two position tables indexed as outputs [i, j]: a shifted relative position i - j, clipped at both ends (the
    second the transpose of such a table, as the position-to-content term reads it)."""
    rng = np.random.default_rng(seed)
    first, second = (np.clip(np.arange(seq)[:, None] - np.arange(seq)[None, :] + rng.integers(0, positions),
                             0, positions - 1) for _ in range(2))
    return first, second.T


@settings(max_examples=40, deadline=None)
@given(tiles=st.integers(1, 4), positions=st.sampled_from([64, 96, 128, 256, 512]), seed=st.integers(0, 2**16))
def test_windows_round_trip(tiles, positions, seed):
    """Each tile's base plus its strip's start plus the output's offset gives back every position; windows stay
    inside the positions, strips inside their tile's window, and offsets inside a strip."""
    tables = relative_tables(tiles * TILE, positions, seed)
    columns = max(strip_window(t, axis) for axis, t in enumerate(tables))
    assert columns <= min(80, window_size(positions))       # a strip of 16 rows reads at most 16 + 63 positions
    windows = [_windows(t, positions, columns, axis) for axis, t in enumerate(tables)]
    words = offset_words(windows[0][1], windows[1][1])
    for which, (table, (bases, offsets)) in enumerate(zip(tables, windows)):
        assert bases[..., 0].min() >= 0 and bases[..., 0].max() <= positions - window_size(positions)
        assert bases[..., 1:].min() >= 0 and bases[..., 1:].max() <= window_size(positions) - columns
        assert offsets.min() >= 0 and offsets.max() < columns
        assert (strip_bases(bases, which) + decode(words, which) == table).all()


def test_windows_refuse_spans_wider_than_the_window():
    table = np.random.default_rng(0).integers(0, 512, size=(128, 128))
    assert _windows(table, 512, 128, 0) is None


def test_windows_refuse_strips_wider_than_asked():
    first, _ = relative_tables(128, 512, 0)
    assert strip_window(first, 0) == 80 and _windows(first, 512, 64, 0) is None


@pytest.mark.parametrize("seq,buckets", [(128, 32), (256, 64), (256, 256)])
def test_reference_kernel_matches_the_gathered_products(seq, buckets):
    """The llvm loop nest, fed the window tables, equals the graph's arithmetic in numpy (full products rounded to
    float16, gathered, divided, summed, rounded), including tiles far from the diagonal whose positions sit in the
    log buckets and windows clamped to the last positions."""
    batch, groups, depth = 4, 2, 64
    positions = 2 * buckets
    rng = np.random.default_rng(seq + buckets)
    a1, a2 = (rng.standard_normal((batch, seq, depth)).astype("float16") for _ in range(2))
    w1, w2 = (rng.standard_normal((groups, positions, depth)).astype("float16") for _ in range(2))
    c2p_index = log_bucket_positions(seq, buckets, 4 * buckets)
    p2c_index = log_bucket_positions(seq, buckets, 4 * buckets)          # read at [j, i]
    scales = (13.856406, 9.0)
    tables = (c2p_index, p2c_index.T)
    columns = max(strip_window(t, axis) for axis, t in enumerate(tables))
    windows = [_windows(t, positions, columns, axis) for axis, t in enumerate(tables)]
    assert all(w is not None for w in windows)
    words = offset_words(windows[0][1], windows[1][1])
    bases = np.stack([windows[0][0], windows[1][0]], axis=2).astype("int32")
    func = relative_bias_reference(batch=batch, seq=seq, positions=positions, head_dim=depth, groups=groups,
                                   strip_window=columns, scales=scales)
    kernel = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.full((batch, seq, seq), np.nan, "float16"))
    visited = np.ones((1, seq // TILE, seq // TILE), "int32")
    kernel(*[tvm.runtime.tensor(x) for x in (a1, w1, a2, w2, words, bases, visited)], out)

    g = np.arange(batch) % groups
    c2p = np.einsum("nid,ntd->nit", a1.astype("float32"), w1[g].astype("float32")).astype("float16")
    p2c = np.einsum("njd,ntd->njt", a2.astype("float32"), w2[g].astype("float32")).astype("float16")
    rows = np.arange(seq)[:, None]
    term1 = c2p[:, rows, c2p_index].astype("float32") / np.float32(scales[0])
    term2 = p2c[:, rows, p2c_index].transpose(0, 2, 1).astype("float32") / np.float32(scales[1])
    expected = (term1 + term2).astype("float16")
    got = out.numpy()
    assert np.isfinite(got).all()
    # the products' float32 sums run in another order: a few elements may round to the neighbouring float16
    close = np.isclose(got.astype("float32"), expected.astype("float32"), rtol=2e-3, atol=2e-3)
    assert close.all(), np.argwhere(~close)[:5]
    assert (got == expected).mean() > 0.99


def test_cuda_kernel_builds_without_spills(tmp_path):
    """DeBERTa-v3-base's kernel at 8 x 512 tokens: mma.sync products, within its launch bounds (4 blocks an SM:
    at most 128 registers) without spilling."""
    func = relative_bias_primfunc(batch=96, seq=512, positions=512, head_dim=64, groups=12, strip_window=80,
                                  scales=(13.9, 13.9))
    func = func.with_attr("global_symbol", "relative_bias").with_attr("tirx.is_scheduled", True)
    target = make_target({**CUDA_DEFAULTS, "arch": "sm_90a"})
    source = tvm.compile(tvm.IRModule({"relative_bias": func}), target=target).mod.imports[0].inspect_source()
    assert "mma.sync.aligned.m16n8k16" in source and "ldmatrix" in source and "cp.async" in source
    log = sm90_ptxas_report(source, tmp_path, arch="sm_90a")
    assert "0 bytes spill stores" in log and "0 bytes spill loads" in log, log
    assert "__launch_bounds__(128, 4)" in source


def test_kernel_refuses_partial_tiles():
    with pytest.raises(ValueError, match="multiple of 64"):
        relative_bias_primfunc(batch=2, seq=100, positions=512, head_dim=64, groups=1, strip_window=80,
                               scales=(1.0, 1.0))


def _calls(mod) -> dict:
    text = mod["main"].script(show_meta=False)
    return {name: text.count(name) for name in ("stof_relative_bias", "R.take(", "R.matmul(", "stof_visited_tiles")}


@pytest.mark.parametrize("exporter,opset", [("torchscript", 17), ("dynamo", 23)])
def test_deberta_layers_take_the_fused_kernel(hf_export, exporter, opset):
    """Every layer's bias of a DeBERTa-v3 export is one fused call (no product or gather left); with
    ``fuse_relative_bias=False`` the graph's products and gathers stay."""
    from stof_tvm.compiler import front_end

    path = hf_export("deberta", "eager", exporter, opset, False, 2, 128)
    calls = {fuse: _calls(front_end(path, mask="bigbird", batch=2, seq_len=128, target="cuda", dtype="float16",
                                    kernel="block", schedule=False, fuse_relative_bias=fuse).mod)
             for fuse in (True, False)}
    layers = calls[False]["R.matmul("] // 2
    assert layers >= 2
    assert calls[True]["stof_relative_bias"] == layers and calls[True]["R.matmul("] == 0
    # one map of the tiles the attention visits, from the runtime mask's format, read by every layer's bias
    assert calls[True]["stof_visited_tiles"] == 1 and calls[False]["stof_visited_tiles"] == 0
    assert calls[False]["stof_relative_bias"] == 0 and calls[False]["R.take("] >= 2 * layers


def test_fused_llvm_module_equals_the_graph(deberta_on_llvm):
    """On llvm the fused kernel's loop nest gives the same output as the graph's products and gathers (both sum
    each product over the head dim in order)."""
    outputs = {fuse: deberta_on_llvm(2, 128, fuse_relative_bias=fuse)[:2] for fuse in (True, False)}
    (fused, kept), (graph, _) = outputs[True], outputs[False]
    assert np.isfinite(fused).all()
    difference = np.linalg.norm(fused[kept] - graph[kept]) / np.linalg.norm(graph[kept])
    assert difference < 1e-4, difference


def test_other_seq_lengths_keep_the_graph(hf_export):
    """A sequence that is not a whole number of 64-row tiles keeps the graph's own kernels."""
    from stof_tvm.compiler import front_end

    path = hf_export("deberta", "eager", "torchscript", 17, False, 2, 96)
    calls = _calls(front_end(path, mask="bigbird", batch=2, seq_len=96, target="cuda", dtype="float16",
                             kernel="block", schedule=False, fuse_relative_bias=True).mod)
    assert calls["stof_relative_bias"] == 0 and calls["R.matmul("] > 0


def test_runtime_position_tables_repeated_over_the_batch():
    """With the position projections as graph values (the base model's form), the fused call reads each head's
    table once (``groups`` = heads, not batch x heads) and the llvm module equals the graph's."""
    from tvm import relax

    from stof_tvm.compiler.relative_bias_match import fuse_relative_biases

    batch, heads, seq, depth, buckets = 2, 3, 128, 64, 128
    graph, _ = graph_form(batch, heads, seq, depth, buckets)
    fused, count = fuse_relative_biases(graph, "llvm")
    assert count == 1
    calls = []
    relax.analysis.post_order_visit(fused["main"], lambda e: calls.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", "") == "relax.call_tir" else None)
    assert len(calls) == 1
    operands = calls[0].args[1].fields
    assert operands[1].same_as(fused["main"].params[2]) and operands[3].same_as(fused["main"].params[3])
    assert "R.matmul(" not in fused["main"].script(show_meta=False)

    rng = np.random.default_rng(1)
    n = batch * heads
    feeds = [rng.standard_normal(shape).astype("float16")
             for shape in ((n, seq, depth), (n, seq, depth), (heads, 2 * buckets, depth), (heads, 2 * buckets, depth))]
    results = []
    for mod in (graph, fused):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        results.append(vm["main"](*[tvm.runtime.tensor(f) for f in feeds]).numpy().astype("float32"))
    assert np.isfinite(results[1]).all()
    close = np.isclose(results[1], results[0], rtol=2e-3, atol=2e-3)
    assert close.all() and (results[1] == results[0]).mean() > 0.99


@pytest.mark.parametrize("block_m,block_n,mask_batch", [(32, 64, 1), (16, 128, 2), (128, 32, 1), (192, 64, 1)])
def test_visited_tiles_map_the_attention_format(block_m, block_n, mask_batch, tmp_path):
    """The visit map kernel, run by the CPU emulation of CUDA on a BigBird format (one mask, or one per batch row),
    marks exactly the 64 x 64 bias tiles that some listed attention tile overlaps."""
    from cuda_emulation import run_on_cpu

    import stof_tvm
    from stof_tvm.schedules.relative_bias import visited_tiles_primfunc
    from stof_tvm.sparse_formats.tiled import build_tiled

    seq, tiles = 384, 384 // TILE
    masks = [np.asarray(stof_tvm.make_mask(f"bigbird:seed={seed}", seq), bool) for seed in range(mask_batch)]
    mask = np.stack(masks)[:, None]                                         # [mask_batch, 1, S, S]
    fmt = build_tiled(mask, block_m, block_n)
    func = visited_tiles_primfunc(mask_groups=mask_batch, seq=seq, block_m=block_m, block_n=block_n)
    func = func.with_attr("global_symbol", "main").with_attr("tirx.is_scheduled", True)
    src = tvm.compile(tvm.IRModule({"main": func}), target=make_target(dict(CUDA_DEFAULTS))).mod.imports[0] \
        .inspect_source()
    arrays = {"full_indptr": fmt.full_indptr, "full_indices": fmt.full_indices, "part_indptr": fmt.part_indptr,
              "part_indices": fmt.part_indices}
    entries = mask_batch * tiles * tiles
    got = run_on_cpu(src, arrays, {"visited": (mask_batch, tiles, tiles)}, -(-entries // 64), (64, 1), tmp_path,
                     dtype="int32")["visited"]
    rows, cols = -(-seq // block_m), -(-seq // block_n)
    padded = np.zeros((mask_batch, rows * block_m, cols * block_n), bool)
    padded[:, :seq, :seq] = mask[:, 0]
    listed = padded.reshape(mask_batch, rows, block_m, cols, block_n).any(axis=(2, 4))
    covered = np.repeat(np.repeat(listed, block_m, 1), block_n, 2)[:, :seq, :seq]
    expected = covered.reshape(mask_batch, tiles, TILE, tiles, TILE).any(axis=(2, 4))
    assert (got == expected).all(), np.argwhere(got != expected)[:5]
    assert 0 < expected.mean() < 1                                         # the mask leaves some tiles out
