"""Sparse attention on the H200: our block-wise (and row-wise) TensorIR kernels against the baselines, same mask.

Two steps, because the GPU machine has TVM's runtime but builds nothing:

1. ``build`` (here, with the TVM compiler): compile every kernel a plan needs for CUDA sm_90, export each as a
   shared library under ``--out`` and write ``manifest.json`` (cases, modules, ptxas register/spill reports, and
   one cubin per kernel configuration for a SASS check on the GPU machine).
2. ``run`` (GPU machine: torch, triton, TVM runtime from ``.devkit``): for every case build the mask and its
   format with numpy, draw fresh random inputs, poison the output, run our kernel and check it against a torch
   float32 reference; for timed cases also run FlexAttention (``torch.compile``'d ``flex_attention`` with a
   BlockMask from the *same* boolean mask), SDPA with that boolean mask, and SDPA causal / dense (the speed of
   ignoring sparsity), each checked against the same reference and timed with ``triton.testing.do_bench``
   (median, after warm-up). Prints a table and writes JSON (rewritten after every case).

Plans: ``check`` (small shapes: every config, fp16/bf16, D 64/128, shared / per-batch / per-head masks,
padding, empty rows, S not a multiple of the tile), ``tune`` (tile configurations at B=16, S=4096 and S=16384),
``grid`` (issue 3's grid: causal/sliding/longformer/bigbird x B {1,8,16} x S {128..4096}, H=12, D=64, fp16; plus
S 8192/16384 with D=128), ``headdims`` (issue 16: D 32-256 checked at small shapes, D 32/64/80/96/128/256 timed
on causal/sliding/bigbird), ``splitkv`` (split-KV checks, and B=1-2 long-context timings), ``issue16`` (one
~300 s run: split-KV checks with and without the device-side key padding; split-KV vs unsplit at B=1 S 8192/16384;
the wgmma kernel on causal; head dims 32/80/96/256; see :func:`plan_issue16`), ``s7causal`` (the wgmma kernel's
configurations on causal and dense D64/D128 beside SDPA, one < 80 s run; :func:`plan_s7causal`), ``s8wgmma`` (the
wgmma kernel against the mma.sync block-wise kernel on six masks, sparse ones never timed on wgmma before, and its
device-side key padding; the analytical model's predictions beside; :func:`plan_s8wgmma`). Effective TFLOP/s
counts kept pairs only: ``4 * kept * D`` per head.

    python scripts/bench_attention.py build --plan check,tune --out out/attn
    python3 scripts/bench_attention.py run --out out/attn --json $OUT/attn.json      # on the GPU machine

The GPU machine's command (modules prebuilt here; it needs only the TVM runtime of the device kit)::

    source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . &&
    python3 scripts/bench_attention.py run --out out/attn --json $OUT/attn.json --budget 300
    # carry: .devkit/runtime.tar.xz, .devkit/bootstrap.sh, out/attn

Plan ``s8wgmma`` (25 modules, 6.3 MB, built in ~85 s here): ``build --plan s8wgmma --out out/s8wgmma``, then on the
GPU machine ``run --out out/s8wgmma --json $OUT/s8wgmma.json --budget 85`` (same carry, out/s8wgmma for out/attn);
``scripts/calibrate_model.py fit-wgmma --json`` that JSON and the session-7 ones refits the wgmma constants.

Plan ``s9attn`` (44 modules, 11 MB, built in ~8 min here with ``--jobs 1``; :func:`plan_s9attn`): ``build --plan
s9attn --out out/s9attn``, then on the GPU machine (carry .devkit/runtime.tar.xz, .devkit/bootstrap.sh, out/s9attn)::

    python3 scripts/bench_attention.py run --out out/s9attn --only check --json $OUT/s9attn_checks.json --budget 30
    python3 scripts/bench_attention.py run --out out/s9attn --only time --skip-failed-in $OUT/s9attn_checks.json \
        --json $OUT/s9attn.json --budget 60

then ``calibrate_model.py fit-wgmma --json s9attn.json --constants wgmma_tma_tile_cycles --loads tma``.

Plan ``s9sparse`` (:func:`plan_s9sparse`, 63 modules, 9.2 MB, ~13 min here with ``--jobs 1``: the block-wise
kernel's row-sum forms, skip vote and key-tile prefetch on issue 16's sparse masks). The ``head`` variant is built
from the tree before them, ``vote`` from a tree with the vote alone (the kernel file without the prefetch), then
this tree's modules (merged)::

    git archive d8cd128 | tar -x -C /tmp/s9head && ln -s ../schedules /tmp/s9head/stof_tvm/schedules &&
    ln -s ../sparse_formats /tmp/s9head/stof_tvm/sparse_formats
    python scripts/bench_attention.py build --plan s9sparse --out out/s9sparse --only-variant head \
        --source-tree /tmp/s9head --source-commit d8cd128 --jobs 1      # and --only-variant vote, /tmp/s9vote
    python scripts/bench_attention.py build --plan s9sparse --out out/s9sparse --jobs 1

and on the GPU machine (carry .devkit/runtime.tar.xz, .devkit/bootstrap.sh, out/s9sparse) ``run --out
out/s9sparse`` with ``--only check`` then ``--only time --skip-failed-in`` as for s9attn (budgets 20 + 65 s).

Plan ``s37gqa`` (:func:`plan_s37gqa`, 12 cases, 8 modules, 1.7 MB, built in ~15 s here: grouped-query attention,
H32 over 8 key/value heads, D128, against the same problem on repeated K and V and the ``enable_gqa`` baselines):
``build --plan s37gqa --out out/s37gqa``, then on the GPU machine ``run --out out/s37gqa --json $OUT/s37gqa.json
--budget 120`` (carry .devkit/runtime.tar.xz, .devkit/bootstrap.sh, out/s37gqa); its table comes last.

Plan ``s38kinds`` (:func:`plan_s38kinds`, 16 cases, 11 modules, 2.2 MB): s36kinds' block-wise against wgmma question
at head dims 64 and 128 (the document mask of issue 16 among them), ``run ... --budget 90``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)
from benchlib import source_key  # noqa: E402

import numpy as np

H_BENCH = 12
NAMED_MASKS = ("causal", "sliding", "longformer", "bigbird")
GRID_SEQS = (128, 256, 512, 1024, 2048, 4096)
GRID_BATCHES = (1, 8, 16)
LONG_SEQS = (8192, 16384)
LONG_BATCHES = (1, 4)
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
CUDA_TARGET = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
               "max_shared_memory_per_block": 232448}

# Block configurations (block_m, block_n, num_warps, stages, heavy_first). The tune plan sweeps TUNE_CONFIGS;
# the grid times every GRID_CONFIGS entry of a case and reports each (and the best), all checked for correctness.
TUNE_CONFIGS = {64: [(128, 64, 4, 2, False), (128, 64, 4, 3, False), (64, 64, 4, 2, False), (64, 64, 2, 2, False),
                     (64, 128, 4, 2, False), (64, 32, 4, 2, False), (32, 64, 2, 2, False)],
                128: [(128, 64, 8, 2, False), (64, 64, 4, 2, False), (128, 32, 8, 2, False), (64, 32, 4, 2, False)]}
GRID_CONFIGS = {
    ("causal", 64): [(128, 64, 4, 2, False)],
    ("sparse", 64): [(64, 64, 2, 2, False), (64, 32, 4, 2, False), (64, 32, 4, 2, True), (32, 64, 2, 2, True)],
    ("sparse_small", 64): [(64, 64, 2, 2, False), (32, 64, 2, 2, True)],
    ("causal", 128): [(128, 64, 8, 2, False)],
    ("sparse", 128): [(64, 64, 4, 2, False), (64, 32, 4, 2, False), (64, 32, 4, 2, True)],
}


def grid_configs(recipe: str, seq: int, head_dim: int) -> list[tuple]:
    if recipe == "causal":
        return GRID_CONFIGS[("causal", head_dim)]
    if head_dim == 64 and seq <= 512:
        return GRID_CONFIGS[("sparse_small", 64)]
    return GRID_CONFIGS[("sparse", head_dim)]


# ----------------------------------------------------------------------------------------------------------
# Masks (numpy only: used on both machines)
# ----------------------------------------------------------------------------------------------------------

def mask_groups(recipe: str, batch: int, heads: int) -> tuple[int, int]:
    """(mask_batch, mask_heads) of a mask recipe: named masks are shared, random ones per (batch, head)."""
    kind = recipe.split(":")[0]
    if kind in ("random", "random_empty", "random_global"):
        return batch, heads
    if kind == "padding":
        return batch, 1
    if kind == "head_blocks":
        return 1, heads
    return 1, 1


def build_mask(recipe: str, batch: int, heads: int, seq: int, seed: int) -> np.ndarray:
    """Normalised boolean mask [Bm, Hm, S, S] of a recipe: a mask spec name, ``random:<density>``,
    ``random_empty:<density>`` (random plus whole empty query rows), ``padding`` (random valid lengths per
    batch, one batch of length 0), ``document`` (ragged packed sequences, causal within each, shared by the
    batch: segment lengths drawn from S/16 .. S/4), ``bigbird_causal`` (BigBird AND causal: what a GPT-2 compile
    with the BigBird mask runs) or ``head_blocks:<density>`` (each head its own random 64 x 64 tiles, the share
    ``density`` of them kept, shared by the batch)."""
    from stof_tvm.sparse_formats import normalize_mask

    rng = np.random.default_rng(seed)
    kind, _, arg = recipe.partition(":")
    if kind in ("random", "random_empty"):
        mask = rng.random((batch, heads, seq, seq)) < float(arg)
        if kind == "random_empty":
            mask[:, :, rng.random(seq) < 0.2, :] = False
        return normalize_mask(mask, batch=batch, heads=heads, seq_q=seq)
    if kind == "random_global":
        mask = rng.random((batch, heads, seq, seq)) < float(arg)
        dense = rng.random((batch, heads, seq)) < 0.03
        dense[:, ::3] = False
        mask[dense] = True
        mask[(rng.random((batch, heads, seq)) < 0.1) & ~dense] = False
        return normalize_mask(mask, batch=batch, heads=heads, seq_q=seq)
    if kind == "head_blocks":
        tiles = -(-seq // 64)
        keep = rng.random((1, heads, tiles, tiles)) < float(arg)
        keep = keep.repeat(64, axis=2).repeat(64, axis=3)[:, :, :seq, :seq]
        return normalize_mask(keep, batch=batch, heads=heads, seq_q=seq)
    if kind == "padding":
        lengths = rng.integers(1, seq + 1, size=batch)
        lengths[0] = 0
        return normalize_mask(lengths.astype(np.int64), batch=batch, heads=heads, seq_q=seq)
    if kind == "bigbird_causal":
        from stof_tvm.sparse_formats import make_mask

        keep = make_mask("bigbird", seq) & np.tril(np.ones((seq, seq), dtype=bool))
        return normalize_mask(keep, batch=batch, heads=heads, seq_q=seq)
    if kind == "document":
        ends = np.cumsum(rng.integers(max(1, seq // 16), max(2, seq // 4) + 1, size=seq))
        ends = np.append(ends[ends < seq], seq)
        segment = np.searchsorted(ends, np.arange(seq), side="right")
        rows = np.arange(seq)
        keep = (segment[:, None] == segment[None, :]) & (rows[None, :] <= rows[:, None])
        return normalize_mask(keep, batch=batch, heads=heads, seq_q=seq)
    return normalize_mask(recipe, batch=batch, heads=heads, seq_q=seq)


def tiled_arrays(mask4: np.ndarray, block_m: int, block_n: int) -> list[np.ndarray]:
    """The five format arrays of the block-wise kernel, empty lists padded with one dummy entry."""
    from stof_tvm.sparse_formats import build_tiled

    fmt = build_tiled(mask4, block_m, block_n)
    full_idx = fmt.full_indices if fmt.full_indices.size else np.zeros(1, np.int32)
    part_idx = fmt.part_indices if fmt.part_indices.size else np.zeros(1, np.int32)
    bitmaps = fmt.part_bitmaps if fmt.part_bitmaps.size else np.zeros((1, block_m // 8, block_n // 8), np.uint64)
    return [fmt.full_indptr, full_idx, fmt.part_indptr, part_idx, np.ascontiguousarray(bitmaps)]


PAD_KEEPS = ("mixed", "ones", "right")


def padding_mask(batch: int, seq: int, pattern: str = "mixed") -> np.ndarray:
    """A model's ``attention_mask`` [B, S] (True = key kept). ``mixed`` (the padded checks' and timings' default):
    batch row b % 4 is right padding (61% kept), left padding with holes (10% of keys dropped), no padding, or
    nothing kept; ``ones``: every key kept (what the HF exports run in scripts/e2e_models.py); ``right``: right
    padding of random lengths from S/2 to S, one row unpadded (a batch of real texts)."""
    rng = np.random.default_rng(batch * 7919 + seq)
    keep = np.ones((batch, seq), bool)
    if pattern not in PAD_KEEPS:
        raise ValueError(f"padding pattern must be one of {PAD_KEEPS}, got {pattern!r}")
    if pattern == "ones":
        return keep
    if pattern == "right":
        lengths = rng.integers(seq // 2, seq + 1, size=batch)
        lengths[0] = seq
        return np.arange(seq)[None, :] < lengths[:, None]
    for b in range(batch):
        pattern = b % 4
        if pattern == 0:
            keep[b, int(seq * 0.61):] = False
        elif pattern == 1:
            keep[b, :seq // 13] = False
            keep[b, rng.random(seq) < 0.1] = False
        elif pattern == 3:
            keep[b] = False
    return keep


def key_padding_inputs(keep: np.ndarray) -> list[np.ndarray]:
    """``pad_range`` [B, 3] int32 (first kept key, last + 1, holes) and ``pad_bits`` [B, ceil(S/32)] uint32 of an
    attention mask, from their definition in schedules/key_padding.py (what its device kernel computes)."""
    batch, seq = keep.shape
    ranges = np.zeros((batch, 3), np.int32)
    for b in range(batch):
        kept = np.flatnonzero(keep[b])
        if kept.size:
            ranges[b] = kept[0], kept[-1] + 1, int(kept.size != kept[-1] + 1 - kept[0])
    padded = np.zeros((batch, -(-seq // 32) * 32), bool)
    padded[:, :seq] = keep
    weights = np.left_shift(np.uint64(1), np.arange(32, dtype=np.uint64))
    bits = (padded.reshape(batch, -1, 32).astype(np.uint64) * weights).sum(axis=-1).astype(np.uint32)
    return [ranges, bits]


def split_arrays(mask4: np.ndarray, block_tile: tuple, dense_tile: tuple) -> tuple:
    """The dense-row split's host inputs (:mod:`stof_tvm.sparse_formats.row_classes`): the block-wise format of
    the mask with its dense query rows emptied, the dense rows' ids ``[Bm, Hm, G]`` (-1: a pad slot) and the
    tiled format of the packed ``[Bm, Hm, G, Sk]`` dense rows at the wgmma tile."""
    from stof_tvm.sparse_formats.row_classes import pack_dense_rows, split_dense_rows

    _, sparse = split_dense_rows(mask4)
    row_ids, packed = pack_dense_rows(mask4)
    return tiled_arrays(sparse, *block_tile), row_ids, tiled_arrays(packed, *dense_tile)


def dense_row_count(recipe: str, batch: int, heads: int, seq: int, seed: int) -> int:
    """G of a mask's packed dense rows (the wgmma module of a split case is built for it)."""
    from stof_tvm.sparse_formats.row_classes import pack_dense_rows

    return int(pack_dense_rows(build_mask(recipe, batch, heads, seq, seed))[0].shape[2])


def row_arrays(mask4: np.ndarray) -> list[np.ndarray]:
    from stof_tvm.sparse_formats import build_rows

    fmt = build_rows(mask4)
    return [fmt.indptr, fmt.indices if fmt.indices.size else np.zeros(1, np.int32)]


# ----------------------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------------------

def _case(kind, family, recipe, batch, heads, seq, head_dim, dtype, config, seed=0, padding=False):
    """One case. ``family``: "block", "row", "wgmma" (config ``(block_n, stages, pingpong, persistent)``) or
    "split" (the dense-row split, :func:`split_case`); ``padding``: the module takes the device-side key padding
    inputs (``pad_range``, ``pad_bits``) and the run gives it a per-batch attention mask (PADDING_PATTERNS), as
    the compiled models do."""
    case = {"kind": kind, "family": family, "mask": recipe, "batch": batch, "heads": heads, "seq": seq,
            "head_dim": head_dim, "dtype": dtype, "config": list(config) if config else None, "seed": seed}
    return dict(case, padding=True) if padding else case


def split_case(kind, recipe, batch, heads, seq, head_dim, dtype, block_config, dense_config, seed=0) -> dict:
    """A dense-row split case: the block-wise kernel (``block_config``) on the mask with its dense query rows
    emptied (it writes every row, 0 at the dense ones), then the dense rows gathered (torch ``index_select``),
    the wgmma kernel (``dense_config``, a WgmmaAttentionConfig field tuple) on them as a dense problem of G
    queries, and their outputs scattered into the same output (``index_copy_``): exact, each row's softmax is
    the mask's. Its wgmma module is built for this mask's G."""
    case = _case(kind, "split", recipe, batch, heads, seq, head_dim, dtype, block_config, seed)
    return dict(case, dense_config=list(dense_config),
                dense_rows=dense_row_count(recipe, batch, heads, seq, seed))


def _parts(case: dict) -> list[dict]:
    """The modules a case runs, as cases of their own: a split case's block-wise module (the one a block case of
    its configuration runs) and its wgmma module at ``seq_q = G``; any other case is its own module."""
    if case["family"] != "split":
        return [case]
    return [dict(case, family="block"), dict(case, family="wgmma", config=case["dense_config"],
                                             seq_q=case["dense_rows"])]


def plan_check() -> list[dict]:
    """Correctness only: every tuned and grid configuration on small shapes and awkward masks."""
    cases = []
    seq, batch, heads = 200, 2, 3
    masks = ["causal", "sliding", "bigbird", "longformer", "random:0.3", "random_empty:0.05", "padding", "dense"]
    for head_dim in (64, 128):
        configs = sorted({c for (_, d), cfgs in GRID_CONFIGS.items() if d == head_dim for c in cfgs}, reverse=True)
        for config in configs:
            for recipe in (masks if config == configs[0] else ["sliding", "random_empty:0.05", "padding"]):
                cases.append(_case("check", "block", recipe, batch, heads, seq, head_dim, "float16", config))
        for recipe in ("bigbird", "random_empty:0.05"):
            cases.append(_case("check", "block", recipe, batch, heads, seq, head_dim, "bfloat16", configs[0]))
    for recipe in ("longformer", "random:0.5", "padding"):      # tile-aligned S, a single tile row, heavy rows
        cases.append(_case("check", "block", recipe, 2, 2, 1024, 64, "float16", (64, 32, 4, 2, True)))
        cases.append(_case("check", "block", recipe, 2, 2, 7, 64, "float16", (64, 64, 4, 2, False)))
    for recipe in ("sliding", "random_empty:0.05", "padding"):
        cases.append(_case("check", "row", recipe, batch, heads, seq, 64, "float16", None))
    return cases


def plan_tune() -> list[dict]:
    cases = []
    for head_dim, seq, batch in ((64, 4096, 16), (128, 16384, 1)):
        for config in TUNE_CONFIGS[head_dim]:
            for recipe in NAMED_MASKS:
                cases.append(_case("time", "block", recipe, batch, H_BENCH, seq, head_dim, "float16", config))
    return cases


def plan_grid() -> list[dict]:
    """Issue 3's grid, most important shapes first (B >= 8, S >= 1024; then long context; then the rest), so a
    run cut short by its time budget still covers the acceptance shapes."""
    first = [(b, s, 64) for b in (16, 8) for s in (4096, 2048, 1024)]
    long = [(b, s, 128) for s in LONG_SEQS for b in LONG_BATCHES]
    rest = [(b, s, 64) for s in GRID_SEQS for b in GRID_BATCHES if (b, s, 64) not in first]
    cases = []
    for batch, seq, head_dim in first + long + rest:
        for recipe in NAMED_MASKS:
            for config in grid_configs(recipe, seq, head_dim):
                cases.append(_case("time", "block", recipe, batch, H_BENCH, seq, head_dim, "float16", config))
            if recipe != "causal":      # the row-wise kernel is meant for sparse masks
                cases.append(_case("time", "row", recipe, batch, H_BENCH, seq, head_dim, "float16", None))
    return cases


def plan_pick() -> list[dict]:
    """Does the model's pick hold outside the calibrated configurations? For the BigBird shapes of the end-to-end
    runs, the model's three top-ranked block configurations (which may never have been measured) and the
    calibrated ones it ranks below them, each checked and timed side by side."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile
    from stof_tvm.cost_model.attention import rank_attention

    calibrated = [(64, 32, 4, 2, True), (32, 64, 2, 2, True), (64, 64, 4, 2, False), (64, 32, 4, 2, False)]
    cases = []
    for batch, seq in ((16, 2048), (8, 512), (16, 4096), (8, 4096), (64, 512)):
        mask = build_mask("bigbird", batch, H_BENCH, seq, 0)
        problem = AttentionProblem(batch=batch, heads=H_BENCH, head_dim=64, dtype="float16", mask=MaskProfile(mask))
        top = [r.candidate.config for r in rank_attention(problem) if r.candidate.kind == "block"][:3]
        picks = [(c.block_m, c.block_n, c.num_warps, c.stages, c.heavy_first) for c in top]
        for config in dict.fromkeys(picks + calibrated):
            cases.append(_case("time", "block", "bigbird", batch, H_BENCH, seq, 64, "float16", config))
    return cases


def _config_tuple(config) -> tuple:
    """A block configuration as a case's list: the five classic fields, then the later ones up to the last one
    that is not at its default (split-KV pair, ``min_blocks``, ``row_sums``, ``reverse_full``, ``lean_padding``)."""
    fields = (config.block_m, config.block_n, config.num_warps, config.stages, config.heavy_first)
    later = (config.kv_splits, config.split_rows, config.min_blocks, getattr(config, "row_sums", "mma"),
             getattr(config, "reverse_full", False), getattr(config, "lean_padding", False))
    defaults = (1, 1, 0, "mma", False, False)
    kept = max((i + 1 for i in range(len(later)) if later[i] != defaults[i]), default=0)
    return fields + later[:max(kept, 2) if kept else 0]             # the split-KV pair stays whole


HEAD_DIM_CHECKS = (32, 80, 96, 192, 256)          # odd-stride rows (32, 80, 96); Q reloaded per tile (192, 256)
HEAD_DIM_TIMES = (80, 96, 32, 256, 64, 128)       # new widths first, then the two measured before
HEAD_DIM_SHAPES = {256: (4, 8, 4096)}             # (B, H, S); every other width: HEAD_DIM_SHAPE
HEAD_DIM_SHAPE = (8, 12, 4096)


def plan_headdims() -> list[dict]:
    """Head dims other than 64 and 128 (issue 16). Checks at small shapes: both default configurations of each
    width in HEAD_DIM_CHECKS (dense default: causal, per-head random with empty rows; sparse default: bigbird,
    padding; bf16), the row-wise kernel too. Timed, D in HEAD_DIM_TIMES: causal on the dense default, sliding and
    bigbird on the sparse default, each also on the model's top-ranked block configuration, against
    FlexAttention (BlockMask of the same mask) and SDPA."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, choose_attention
    from stof_tvm.schedules.attention_blockwise import default_block_config

    cases = []
    seq, batch, heads = 200, 2, 3
    for head_dim in HEAD_DIM_CHECKS:
        dense = _config_tuple(default_block_config(head_dim, "float16", seq))
        sparse = _config_tuple(default_block_config(head_dim, "float16", seq, sparse=True))
        for config, recipes in ((dense, ("causal", "random_empty:0.05")), (sparse, ("bigbird", "padding"))):
            for recipe in recipes:
                cases.append(_case("check", "block", recipe, batch, heads, seq, head_dim, "float16", config))
        cases.append(_case("check", "block", "random_empty:0.05", batch, heads, seq, head_dim, "bfloat16", sparse))
        if head_dim != 192:
            cases.append(_case("check", "row", "random_empty:0.05", batch, heads, seq, head_dim, "float16", None))
    for head_dim in HEAD_DIM_TIMES:
        batch, heads, seq = HEAD_DIM_SHAPES.get(head_dim, HEAD_DIM_SHAPE)
        for recipe in ("causal", "sliding", "bigbird"):
            default = _config_tuple(default_block_config(head_dim, "float16", seq, sparse=recipe != "causal"))
            problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                       mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
            best = choose_attention(problem, kinds=("block",)).candidate.config
            for config in dict.fromkeys((default, _config_tuple(best))):
                cases.append(_case("time", "block", recipe, batch, heads, seq, head_dim, "float16", config))
    return cases


SPLIT_CHECK_CONFIGS = ((64, 32, 4, 2, True, 4, 1), (64, 32, 4, 2, True, 16, 2), (32, 32, 2, 2, True, 8, 4))
SPLIT_TIME_SHAPES = (("bigbird", 1, 12, 8192, 64), ("longformer", 1, 12, 8192, 64), ("bigbird", 1, 12, 16384, 128),
                     ("bigbird", 2, 12, 8192, 64))


def plan_splitkv() -> list[dict]:
    """Split-KV (issue 16). Checks at S=1000 (not tile-aligned): masks with fewer, as many and more heavy rows than
    the configuration splits (longformer: 2 per head, bigbird: 1), none (random, dense: every slice block but
    the first idles) and padding with an empty batch; D=128 and D=80 bf16 too. Timed at B=1-2 and long S: the
    model's best split configuration against its best unsplit one and the sparse default."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, rank_attention
    from stof_tvm.schedules.attention_blockwise import default_block_config

    cases = []
    for config in SPLIT_CHECK_CONFIGS:
        for recipe in ("longformer", "bigbird", "random:0.3", "padding", "dense"):
            cases.append(_case("check", "block", recipe, 2, 3, 1000, 64, "float16", config))
    cases.append(_case("check", "block", "longformer", 2, 3, 1000, 128, "float16", (64, 32, 4, 2, True, 4, 2)))
    cases.append(_case("check", "block", "bigbird", 2, 3, 1000, 80, "bfloat16", (64, 32, 4, 2, True, 8, 3)))
    for recipe, batch, heads, seq, head_dim in SPLIT_TIME_SHAPES:
        problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                   mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
        blocks = [r.candidate.config for r in rank_attention(problem) if r.candidate.kind == "block"]
        split = next(c for c in blocks if c.kv_splits > 1)
        unsplit = next(c for c in blocks if c.kv_splits == 1)
        default = default_block_config(head_dim, "float16", seq, sparse=True)
        for config in dict.fromkeys(_config_tuple(c) for c in (split, unsplit, default)):
            cases.append(_case("time", "block", recipe, batch, heads, seq, head_dim, "float16", config))
    return cases


ISSUE16_SPLIT_SHAPES = tuple((recipe, 1, 16, seq, head_dim) for seq in (8192, 16384) for head_dim in (128, 64)
                             for recipe in ("longformer", "bigbird"))
ISSUE16_HEAD_DIMS = ((32, 16), (80, 16), (96, 16), (256, 4))         # (D, B) at H=12, S=4096
ISSUE16_WGMMA = (("causal", 16, 12, 4096, 64), ("causal", 4, 16, 8192, 128))
ISSUE16_SPLIT_CHECKS = ((64, 32, 4, 2, True, 4, 1), (32, 32, 2, 2, True, 8, 4))


def plan_issue16() -> list[dict]:
    """Issue 16 in one GPU run, most important first. Checks (S=1000, not tile-aligned): split-KV with fewer /
    more heavy rows than it splits and per-head random masks; split-KV with the device-side key padding (right,
    left + holes, none, empty). Timed, each also checked against float32: (a) split-KV at B=1, H=16, S 8192 /
    16384, D 128 / 64, Longformer and BigBird: the model's pick (split) and its best unsplit configuration;
    (c) the wgmma kernel (its default configuration, as ``AttentionPlan(kernel="wgmma")``) on causal D64 B16
    S4096 and D128 B4 S8192; (b) head dims 32/80/96/256 at B=16 (B=4 at 256), H=12, S=4096, causal and BigBird,
    on the automatic choice (and, where it splits, the best unsplit configuration). Every timed case beside
    FlexAttention (BlockMask of the same mask) and SDPA."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, rank_attention
    from stof_tvm.schedules.attention_wgmma import default_config as wgmma_default

    cases = []
    for config in ISSUE16_SPLIT_CHECKS:
        for recipe in ("longformer", "bigbird", "random:0.3"):
            cases.append(_case("check", "block", recipe, 2, 3, 1000, 64, "float16", config))
    for recipe in ("longformer", "bigbird"):
        cases.append(_case("check", "block", recipe, 4, 2, 1000, 64, "float16", (64, 32, 4, 2, True, 16, 2),
                           padding=True))
    cases.append(_case("check", "block", "bigbird", 4, 2, 1000, 128, "bfloat16", (64, 32, 4, 2, True, 4, 1),
                       padding=True))

    def problem(recipe, batch, heads, seq, head_dim):
        return AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))

    for shape in ISSUE16_SPLIT_SHAPES:
        blocks = [r.candidate.config for r in rank_attention(problem(*shape)) if r.candidate.kind == "block"]
        picks = (blocks[0], next(c for c in blocks if c.kv_splits == 1))
        for config in dict.fromkeys(_config_tuple(c) for c in picks):
            cases.append(_case("time", "block", shape[0], *shape[1:], "float16", config))
    for recipe, batch, heads, seq, head_dim in ISSUE16_WGMMA:
        c = wgmma_default(head_dim)
        cases.append(_case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16",
                           (c.block_n, c.stages, c.pingpong, c.persistent)))
    for head_dim, batch in ISSUE16_HEAD_DIMS:
        for recipe in ("causal", "bigbird"):
            ranked = [r.candidate for r in rank_attention(problem(recipe, batch, H_BENCH, 4096, head_dim))]
            picks = [ranked[0]] + ([next(c for c in ranked if c.kind == "block" and c.config.kv_splits == 1)]
                                   if ranked[0].kind == "block" and ranked[0].config.kv_splits > 1 else [])
            for pick in picks:      # the automatic choice; where it splits, the best unsplit one too
                config = _config_tuple(pick.config) if pick.kind == "block" else None
                cases.append(_case("time", pick.kind, recipe, batch, H_BENCH, 4096, head_dim, "float16", config))
    return cases


S7_MASKS = ("longformer", "bigbird", "sliding")
# (config, the variants also built from other source trees: base = before this session's changes, lazy = with the
# lazy rescaling but neither the tensor-core row sums nor launch bounds): the calibrated sparse default and its
# default-order twin, each also with min_blocks (__launch_bounds__ registers: 96), the model's top-ranked picks
# (one and two warps on 32x32 tiles, 32x16), split-KV at B=16.
S7_CONFIGS = (((64, 32, 4, 2, True), ("base", "lazy")), ((64, 32, 4, 2, True, 1, 1, 5), ()),
              ((32, 32, 1, 2, True), ("base", "lazy")), ((32, 32, 2, 2, True), ("base",)),
              ((32, 32, 2, 2, True, 1, 1, 10), ()), ((64, 32, 4, 2, False), ("base",)),
              ((64, 32, 4, 2, False, 1, 1, 5), ()), ((32, 16, 1, 2, True), ()), ((64, 32, 4, 2, True, 4, 2), ()))
S7_CHECKS = (((64, 32, 4, 2, True), ("longformer", "bigbird", "random_empty:0.05"), 1000),
             ((64, 32, 4, 2, True), ("longformer", "bigbird"), 1024),
             ((32, 32, 1, 2, True), ("longformer", "random_empty:0.05"), 1000),
             ((32, 32, 1, 2, True), ("bigbird",), 1024),
             ((64, 32, 4, 2, False), ("sliding", "random_empty:0.05"), 1000),
             ((64, 32, 4, 2, True, 4, 2), ("longformer", "bigbird"), 1000),
             ((64, 32, 4, 2, True, 1, 1, 5), ("bigbird", "random_empty:0.05"), 1000))


def plan_s7sparse() -> list[dict]:
    """Issue 16's sparse goals (B=16, H=12, S=4096, D=64, fp16: sliding, Longformer, BigBird <= 0.133 ms), one
    short run (< 70 s). Checks first, at S=1000 (keys past Sk: clamped loads) and S=1024 (aligned: no clamp), with
    Q scaled by 8 so that running maxima rise well past the lazy-rescale threshold (2^8) within a row: the
    changed configurations on shared, per-head (random, empty rows) and device-padded masks, bf16 D=128. Then
    every S7_CONFIGS entry timed on the three masks, beside the same configuration built from the earlier source
    trees it names (``variant``: ``build --only-variant NAME --source-tree DIR``), and FlexAttention."""
    cases = []
    for config, recipes, seq in S7_CHECKS:
        for recipe in recipes:
            cases.append(dict(_case("check", "block", recipe, 2, 3, seq, 64, "float16", config), q_scale=8.0))
    cases.append(dict(_case("check", "block", "longformer", 4, 2, 1000, 64, "float16", (64, 32, 4, 2, True),
                            padding=True), q_scale=8.0))
    cases.append(dict(_case("check", "block", "bigbird", 2, 3, 1000, 128, "bfloat16", (64, 32, 4, 2, True)),
                      q_scale=8.0))
    for recipe in S7_MASKS:
        for config, variants in S7_CONFIGS:
            case = _case("time", "block", recipe, 16, H_BENCH, 4096, 64, "float16", config)
            cases += [dict(case, variant=name) for name in variants] + [case]
    return cases


S7C_SHAPES = {64: (16, 12, 4096), 128: (4, 16, 8192)}      # head dim: (B, H, S) of issue 16's causal goals
# wgmma configurations (block_n, stages, pingpong, persistent[, consumers]) per head dim, each with "also built
# from the baseline tree": the default; three consumer warpgroups (192-query tiles) with 3, 4 and 5 stages; at
# D=128 64-key tiles with a 4-deep ring; the persistent grids (balanced two-row units), never run on a GPU
# before, so timed last.
S7C_CONFIGS = {64: (((128, 3, True, False), True), ((128, 3, True, False, 3), False),
                    ((128, 4, True, False, 3), False), ((128, 5, True, False, 3), False)),
               128: (((128, 2, True, False), True), ((64, 4, True, False), False))}
S7C_PERSISTENT = {64: ((128, 3, True, True), (128, 4, True, True, 3), (128, 3, True, True, 3)),
                  128: ((128, 2, True, True), (64, 4, True, True))}


def plan_s7causal() -> list[dict]:
    """Issue 16's causal/dense goals on the wgmma kernel (causal D64 B16 H12 S4096 <= 0.92 ms, D128 B4 H16 S8192
    <= 1.77 ms; dense >= SDPA dense), one short run (< 80 s): the default configuration built from the baseline
    tree (``variant: base``) and from this one, and the new configurations side by side on causal and dense,
    beside SDPA (causal flag / dense) and FlexAttention. Checks first (S=1000: not a multiple of either tile
    height, keys past Sk; Q scaled by 8): three consumers on causal, per-head random masks with empty rows, per-batch
    lengths with an empty batch, dense, bf16; the persistent grids (checked, then timed; every timed case is
    checked too) come last so a fault there cannot cost the rest."""
    cases = []

    def checks(config, head_dim, recipes, dtypes=("float16",)):
        for dtype in dtypes:
            for recipe in recipes:
                cases.append(dict(_case("check", "wgmma", recipe, 2, 3, 1000, head_dim, dtype, config), q_scale=8.0))

    def timed(config, head_dim, with_base=False):
        batch, heads, seq = S7C_SHAPES[head_dim]
        for recipe in ("causal", "dense"):
            case = _case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16", config)
            cases.extend([dict(case, variant="base"), case] if with_base else [case])

    checks((128, 3, True, False, 3), 64, ("causal", "random_empty:0.05", "padding", "dense"))
    checks((128, 4, True, False, 3), 64, ("causal", "random_empty:0.05", "dense"))
    checks((128, 3, True, False, 3), 64, ("random_empty:0.05",), ("bfloat16",))
    for head_dim, configs in S7C_CONFIGS.items():
        for config, with_base in configs:
            timed(config, head_dim, with_base)
    for head_dim, configs in S7C_PERSISTENT.items():
        for config in configs:
            checks(config, head_dim, ("causal", "random_empty:0.05"))
    for head_dim, configs in S7C_PERSISTENT.items():
        for config in configs:
            timed(config, head_dim)
    return cases


# s8tma: (block_n, stages, pingpong, persistent, consumers) per head dim, each timed with both loads: the fastest
# session-7 configurations (D64 three consumers, 3 and 4 stages; D128 128-key tiles, 2 stages, one block per item
# and persistent) and D128 64-key tiles with 4 stages (the producer's 16-byte copy stream was largest there)
S8T_CONFIGS = {64: ((128, 3, True, False, 3), (128, 4, True, False, 3)),
               128: ((128, 2, True, False, 2), (64, 4, True, False, 2), (128, 2, True, True, 2))}
LOADS = ("cp.async", "tma")


def plan_s8tma() -> list[dict]:
    """TMA loads (``WgmmaAttentionConfig.loads="tma"``: host-encoded tensor maps, one producer thread, no consumer
    proxy fence) against the 16-byte cp.async producer, same configurations side by side on issue 16's causal and
    dense shapes (D64 B16 H12 S4096, D128 B4 H16 S8192) beside SDPA and FlexAttention, one short run (< 90 s).
    Checks first (S=1000: rows past Sq and keys past Sk zero-filled by the copy engine; Q scaled by 8): every TMA
    configuration on causal and per-head random masks with empty rows, D64 also on per-batch lengths and dense,
    bf16 at both head dims, and Q/K/V as views into one packed projection starting 8 elements (16 bytes) into its
    allocation (``qkv_offset``: TMA's 16-byte address rule at its limit); every timed case is checked too."""
    cases = []

    def checks(config, head_dim, recipes, dtype="float16", **extra):
        for recipe in recipes:
            cases.append(dict(_case("check", "wgmma", recipe, 2, 3, 1000, head_dim, dtype, config), q_scale=8.0,
                              **extra))

    for head_dim, configs in S8T_CONFIGS.items():
        for config in configs:
            checks(config + ("tma",), head_dim, ("causal", "random_empty:0.05"))
    checks(S8T_CONFIGS[64][0] + ("tma",), 64, ("padding", "dense"))
    checks(S8T_CONFIGS[64][0] + ("tma",), 64, ("causal",), qkv_offset=8)
    checks(S8T_CONFIGS[128][0] + ("tma",), 128, ("random_empty:0.05",), qkv_offset=8)
    for head_dim in S8T_CONFIGS:
        checks(S8T_CONFIGS[head_dim][0] + ("tma",), head_dim, ("random_empty:0.05",), dtype="bfloat16")
    for head_dim, configs in S8T_CONFIGS.items():
        batch, heads, seq = S7C_SHAPES[head_dim]
        for config in configs:
            for recipe in ("causal", "dense"):
                for loads in LOADS:
                    cases.append(_case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16",
                                       config + (loads,)))
    return cases


S8W_SHAPES = {64: (16, 12, 4096), 128: (4, 16, 8192)}      # head dim: (B, H, S) of issue 16's goals
S8W_MASKS = ("causal", "dense", "document", "sliding", "longformer", "bigbird")
# wgmma configurations (block_n, stages, pingpong, persistent, consumers): the defaults, and at D64 the two-consumer
# one the model offers padded calls (three spill under the padding predicate)
S8W_WGMMA = {64: ((128, 3, True, False, 3), (128, 3, True, False, 2)), 128: ((128, 2, True, False, 2),)}


def _predicted_ms(problem, kind: str, config) -> float:
    from stof_tvm.cost_model import AttentionCandidate, attention_work, predict
    from stof_tvm.hardware import H200

    return predict(attention_work(problem, AttentionCandidate(kind, config)), H200).time_s * 1e3


def plan_s8wgmma() -> list[dict]:
    """The wgmma kernel beside the mma.sync block-wise kernel on six masks (S8W_MASKS) at issue 16's shapes (D64
    B16 H12 S4096, D128 B4 H16 S8192), FlexAttention and SDPA as in every plan, one short run (< 90 s with
    ``--budget 85``; D128 last). The sparse masks and the document mask were never timed on wgmma: the model's
    partial-tile cost for it is assumed, and these timings are what ``calibrate_model.py fit-wgmma`` needs next.
    Each timed case carries the model's prediction (``predicted_ms``) and pick (``model_pick``, ``auto``'s
    kind and configuration). Checks first (S=1000, Q scaled by 8): every wgmma configuration on the sparse and
    document masks, and the device-side key padding (``padding``: right, left-with-holes, none and empty batch
    rows) on causal, dense and sliding masks at both head dims; every timed case is checked too."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, decide_attention
    from stof_tvm.schedules.attention_wgmma import WgmmaAttentionConfig

    cases = []
    for head_dim, configs in S8W_WGMMA.items():
        for config in configs:
            for recipe in ("sliding", "longformer", "bigbird", "document"):
                cases.append(dict(_case("check", "wgmma", recipe, 2, 3, 1000, head_dim, "float16", config),
                                  q_scale=8.0))
        padded = configs[-1]
        for recipe in ("causal", "dense", "sliding"):
            cases.append(dict(_case("check", "wgmma", recipe, 4, 2, 1000, head_dim, "float16", padded,
                                    padding=True), q_scale=8.0))
        cases.append(dict(_case("check", "wgmma", "causal", 4, 2, 1000, head_dim, "bfloat16", padded,
                                padding=True), q_scale=8.0))
    for head_dim, (batch, heads, seq) in S8W_SHAPES.items():
        for recipe in S8W_MASKS:
            problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                       mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
            decision = decide_attention(problem, kinds=("block", "row", "wgmma"))
            pick = f"{decision.best.candidate} ({decision.reason})"
            block = decide_attention(problem, kinds=("block",)).best.candidate.config
            for config in S8W_WGMMA[head_dim]:
                case = _case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16", config)
                cases.append(dict(case, model_pick=pick,
                                  predicted_ms=_predicted_ms(problem, "wgmma", WgmmaAttentionConfig(*config))))
            case = _case("time", "block", recipe, batch, heads, seq, head_dim, "float16", _config_tuple(block))
            cases.append(dict(case, model_pick=pick, predicted_ms=_predicted_ms(problem, "block", block)))
        # what a padded model (HF's attention_mask) runs: the padded wgmma configuration, the block pick, causal
        problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16", padding=True,
                                   mask=MaskProfile(build_mask("causal", batch, heads, seq, 0)))
        decision = decide_attention(problem, kinds=("block", "row", "wgmma"))
        pick = f"{decision.best.candidate} ({decision.reason})"
        block = decide_attention(problem, kinds=("block",)).best.candidate.config
        padded = S8W_WGMMA[head_dim][-1]
        cases.append(dict(_case("time", "wgmma", "causal", batch, heads, seq, head_dim, "float16", padded,
                                padding=True), model_pick=pick,
                          predicted_ms=_predicted_ms(problem, "wgmma", WgmmaAttentionConfig(*padded))))
        cases.append(dict(_case("time", "block", "causal", batch, heads, seq, head_dim, "float16",
                                _config_tuple(block), padding=True), model_pick=pick,
                          predicted_ms=_predicted_ms(problem, "block", block)))
    return cases


# s9attn: TMA candidates (block_n, stages, pingpong, persistent, consumers, loads) timed on issue 16's shapes beside
# the cp.async defaults; after session 9's s8tma run (TMA faster in all 6 pairs measured, by 6-16%), the default
# D64 configuration with TMA (its checks had failed in the harness) and persistent grids at D64 too
S9A_TIMED = {64: ((128, 3, True, False, 3, "cp.async"), (128, 3, True, False, 3, "tma"), (128, 4, True, False, 3, "tma"),
                  (128, 2, True, False, 3, "tma"), (128, 3, True, True, 3, "tma"), (128, 4, True, True, 3, "tma")),
             128: ((128, 2, True, False, 2, "cp.async"), (128, 2, True, False, 2, "tma"), (128, 2, True, True, 2, "tma"),
                   (64, 4, True, False, 2, "tma"), (64, 4, True, True, 2, "tma"), (64, 5, True, True, 2, "tma"))}
# what padded models (HF exports with an attention_mask) run: two consumers at D64
S9A_PADDED = {64: ((128, 3, True, False, 2, "cp.async"), (128, 3, True, False, 2, "tma"),
                   (128, 3, True, True, 2, "tma")),
              128: ((128, 2, True, False, 2, "cp.async"), (128, 2, True, False, 2, "tma"),
                    (128, 2, True, True, 2, "tma"))}


def plan_s9attn() -> list[dict]:
    """TMA loads as the wgmma kernel's default: one short run (< 90 s with ``--budget 85``). Checks first (S=1000,
    Q scaled by 8): session 9's two failed checks again (Q/K/V as views 16 bytes into one packed projection,
    ``qkv_offset``: the harness passed them misaligned to ``from_dlpack``; now as TVM passes views), the same views
    on the cp.async producer (unpadded and key-padded: the compile path hands the kernel such views), every TMA
    configuration to be timed on causal and per-head random masks with empty rows, the device-side key padding
    with TMA (right / left-with-holes / empty rows on causal, dense, sliding; bf16), and ``replays``: the same
    module called again on fresh tensors at new addresses (maps encoded from that call's pointers) and captured in
    a torch CUDA graph, replayed after new values are written into the captured buffers (the maps captured with
    the graph must read them). Then issue 16's shapes (D64 B16 H12 S4096, D128 B4 H16 S8192) causal and dense for
    every S9A_TIMED configuration, the padded causal ones, and the first two of each head dim again at the end
    (``repeat``: drift within the run)."""
    cases = []

    def check(recipe, head_dim, config, batch=2, heads=3, dtype="float16", padding=False, **extra):
        cases.append(dict(_case("check", "wgmma", recipe, batch, heads, 1000, head_dim, dtype, config,
                                padding=padding), q_scale=8.0, **extra))

    check("causal", 64, S9A_TIMED[64][1], qkv_offset=8)
    check("random_empty:0.05", 128, S9A_TIMED[128][1], qkv_offset=8)
    check("causal", 64, S9A_TIMED[64][0], qkv_offset=8)                  # the cp.async producer on views too,
    for head_dim in S9A_PADDED:                                         # as padded models run
        check("causal", head_dim, S9A_PADDED[head_dim][0], batch=4, heads=2, padding=True, qkv_offset=8)
    for head_dim, configs in S9A_TIMED.items():
        for config in configs[1:]:
            for recipe in ("causal", "random_empty:0.05"):
                check(recipe, head_dim, config)
    for head_dim, configs in S9A_PADDED.items():
        for config in configs[1:]:
            for recipe in ("causal", "dense", "sliding"):
                check(recipe, head_dim, config, batch=4, heads=2, padding=True)
        check("causal", head_dim, configs[1], batch=4, heads=2, dtype="bfloat16", padding=True)
    check("causal", 64, S9A_TIMED[64][1], replays=True)
    check("causal", 128, S9A_TIMED[128][2], replays=True)
    check("causal", 64, S9A_PADDED[64][1], batch=4, heads=2, padding=True, replays=True)
    for head_dim, configs in S9A_TIMED.items():
        batch, heads, seq = S7C_SHAPES[head_dim]
        for recipe in ("causal", "dense"):
            for config in configs:
                cases.append(_case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16", config))
        for config in S9A_PADDED[head_dim]:
            cases.append(_case("time", "wgmma", "causal", batch, heads, seq, head_dim, "float16", config,
                               padding=True))
    for head_dim, configs in S9A_TIMED.items():
        batch, heads, seq = S7C_SHAPES[head_dim]
        for recipe in ("causal", "dense"):
            for config in configs[:2]:
                cases.append(dict(_case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16", config),
                                  repeat=True))
    return cases


# s9sparse: issue 16's sparse shapes, each block configuration in up to four forms side by side: row sums of P on
# the tensor cores (``mma``, the default since 65cc2c5) and by float adds (``fadd``, as before it), both with this
# tree's one-load-a-lane skip vote and key tiles read one tile ahead, and the same mma configuration built from
# the tree before both (``variant: head``) and with the vote only (``variant: vote``, D64; what the kernel is since
# the session-9 run, which found the prefetch slower: scripts/NOTES_attention.md). The configurations:
# the model's session-9 picks (32x32x1x2, 32x16x1x2), session 7's measured best (32x32x2x2, with min_blocks 10:
# 96 registers, ten 2-warp blocks an SM), the 64x32x4x2 default with min_blocks 5, and untried ones (32x16x2x2 and
# 32x32x2x3 at min_blocks 10: 94 / 96 registers, 0 spills).
S9S_D64 = (((32, 32, 1, 2, True), True), ((32, 32, 1, 2, False), True), ((32, 16, 1, 2, True), True),
           ((32, 32, 2, 2, True), True), ((32, 32, 2, 2, True, 1, 1, 10), True),
           ((32, 16, 2, 2, True, 1, 1, 10), False), ((64, 32, 4, 2, True, 1, 1, 5), True),
           ((32, 32, 2, 3, True, 1, 1, 10), False))
# D128 B4 H16 S8192: session 9's picks (sliding 32x32x2x2 default order, Longformer heavy-first, BigBird split-KV)
S9S_D128 = {"sliding": (32, 32, 2, 2, False), "longformer": (32, 32, 2, 2, True),
            "bigbird": (32, 16, 2, 2, True, 4, 1)}


def _with_row_sums(config: tuple, row_sums: str) -> tuple:
    """``config`` (a BlockConfig field tuple) with ``row_sums`` written out, the fields before it at defaults."""
    return tuple(config) + (1, 1, 0)[len(config) - 5:] + (row_sums,)


def plan_s9sparse() -> list[dict]:
    """Issue 16's sparse goals (sliding, Longformer, BigBird at B16 H12 S4096 D64 fp16 <= 0.133 ms), one short run
    (< 90 s with ``--budget 85``): every S9S_D64 configuration on the three masks in its forms (``mma``, ``fadd``,
    and ``variant: head`` / ``vote`` where built), then D128 B4 H16 S8192 (S9S_D128; mma, fadd, head). Checks
    first (S=1000 and 1024, Q scaled by 8): both row-sum forms with the new vote on shared masks, per-head random
    masks with empty rows (warps whose rows keep nothing in a partial tile), device key padding, bf16 D128 and
    split-KV. Each timed case carries the model's block pick (``model_pick``)."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, decide_attention

    cases = []

    def check(recipe, config, seq=1000, head_dim=64, dtype="float16", batch=2, heads=3, padding=False):
        cases.append(dict(_case("check", "block", recipe, batch, heads, seq, head_dim, dtype, config,
                                padding=padding), q_scale=8.0))

    for row_sums in ("fadd", "mma"):
        for config in ((32, 32, 1, 2, True), (32, 32, 2, 2, True, 1, 1, 10), (64, 32, 4, 2, True, 1, 1, 5)):
            for recipe in ("longformer", "random_empty:0.05"):
                check(recipe, _with_row_sums(config, row_sums))
            check("bigbird", _with_row_sums(config, row_sums), seq=1024)
        check("sliding", _with_row_sums((32, 16, 1, 2, False), row_sums))
        check("longformer", _with_row_sums((64, 32, 4, 2, True), row_sums), batch=4, heads=2, padding=True)
        check("bigbird", _with_row_sums((64, 32, 4, 2, True), row_sums), head_dim=128, dtype="bfloat16")
        check("bigbird", _with_row_sums((32, 16, 2, 2, True, 4, 1), row_sums), head_dim=128)

    def timed(recipe, batch, heads, seq, head_dim, config, with_head):
        problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                   mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
        pick = str(decide_attention(problem, kinds=("block",)).best.candidate)
        base = _case("time", "block", recipe, batch, heads, seq, head_dim, "float16", config)
        forms = [dict(base, variant=name) for name in (("head", "vote") if head_dim == 64 else ("head",))
                 if with_head]
        for row_sums in ("mma", "fadd"):
            forms.append(_case("time", "block", recipe, batch, heads, seq, head_dim, "float16",
                               _with_row_sums(config, row_sums)))
        cases.extend(dict(case, model_pick=pick) for case in forms)

    for recipe in ("longformer", "bigbird", "sliding"):
        for config, with_head in S9S_D64:
            timed(recipe, 16, H_BENCH, 4096, 64, config, with_head)
    for recipe, config in S9S_D128.items():
        timed(recipe, 4, 16, 8192, 128, config, True)
    return cases


def plan_s9check() -> list[dict]:
    """plan_s9sparse's checks alone (S=1000/1024, Q scaled by 8: both row-sum forms, per-head random masks with
    empty rows, key padding, bf16 D128, split-KV), for the kernel as it is after that plan's run (one-load skip
    vote, no key-tile prefetch): the run that timed it spent the checks' budget before their first case."""
    return [case for case in plan_s9sparse() if case["kind"] == "check"]


def _reversed(config: tuple) -> tuple:
    """A block configuration tuple with ``reverse_full`` set (the fields before it at their defaults)."""
    return tuple(config) + (1, 1, 0, "mma")[len(config) - 5:] + (True,)


S10_PICK = (32, 32, 2, 2, True, 1, 1, 10)            # the model's pick for Longformer and BigBird (session 9)
S10_BEST = (32, 32, 2, 2, True)                     # Longformer's best of session 9 (0.251 ms)
# split-KV of the global rows at B16: Longformer has 2 heavy tile rows a head, BigBird 1
S10_SPLIT_KV = {"longformer": ((32, 32, 2, 2, True, 2, 2, 10), (32, 32, 2, 2, True, 4, 2, 10)),
                "bigbird": ((32, 32, 2, 2, True, 2, 1, 10), (32, 32, 2, 2, True, 4, 1, 10))}
S10_SPLIT_BLOCK = (S10_PICK, (32, 32, 1, 2, False))
# wgmma configurations of the packed dense rows: the D64 default (three consumers, persistent, TMA), and two
# consumers, one block per (batch, head): the second consumer's rows lie past G <= 64, so it only keeps the turns
S10_SPLIT_DENSE = ((128, 3, True, True, 3, "tma"), (128, 3, True, False, 2, "tma"),
                   (128, 3, True, False, 2, "cp.async"))


def plan_s10sparse() -> list[dict]:
    """Issue 16's sparse masks, B16 H12 S4096 D64 fp16, beside FlexAttention and SDPA, what is expected to win first:

    1. ``reverse_full`` (the global rows walk their keys from the end, as the other rows do under heavy-first, so
       both read each K/V tile at about the same time: from L2, not twice from DRAM) on the model's pick and on
       Longformer's best of session 9, each beside itself without it;
    2. split-KV of the global rows at B16 (2 and 4 slices; with ``reverse_full`` too);
    3. the dense-row split (:func:`split_case`: the global rows packed on the wgmma kernel, the other rows on the
       block-wise kernel; its dense launch reads all of K and V again, so scripts/sparse_breakdown.py predicts no
       gain), each split case with its parts timed apart.

    Checks first (S=1000/1024, Q scaled by 8, outputs poisoned): ``reverse_full`` on Longformer, BigBird, per-head
    random masks with empty rows, device key padding and split-KV; the split on Longformer, BigBird and per-head
    masks whose heads hold different numbers of dense rows (pad-only heads) with empty rows, bf16 too."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, decide_attention

    cases = []

    def check(recipe, config, seq=1000, dtype="float16", batch=2, heads=3, padding=False):
        cases.append(dict(_case("check", "block", recipe, batch, heads, seq, 64, dtype, config, padding=padding),
                          q_scale=8.0))

    def check_split(recipe, block, dense, seq=1000, dtype="float16"):
        cases.append(dict(split_case("check", recipe, 2, 3, seq, 64, dtype, block, dense), q_scale=8.0))

    check("longformer", _reversed(S10_PICK))
    check("bigbird", _reversed(S10_PICK), seq=1024)
    check("random_empty:0.05", _reversed(S10_PICK))
    check("random_empty:0.05", _reversed(S10_BEST), dtype="bfloat16")
    check("longformer", _reversed((64, 32, 4, 2, True)), batch=4, heads=2, padding=True)
    check("longformer", _reversed(S10_SPLIT_KV["longformer"][1]))
    check("bigbird", _reversed(S10_SPLIT_KV["bigbird"][1]), seq=1024)
    for recipe, seq in (("longformer", 1000), ("bigbird", 1024), ("random_global:0.1", 1000)):
        check_split(recipe, S10_SPLIT_BLOCK[0], S10_SPLIT_DENSE[0], seq)
    check_split("random_global:0.1", S10_SPLIT_BLOCK[1], S10_SPLIT_DENSE[1], dtype="bfloat16")
    check_split("longformer", S10_SPLIT_BLOCK[1], S10_SPLIT_DENSE[2])
    batch, heads, seq = 16, H_BENCH, 4096
    timed = {}
    for recipe in ("longformer", "bigbird"):
        problem = AttentionProblem(batch=batch, heads=heads, head_dim=64, dtype="float16",
                                   mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
        pick = str(decide_attention(problem, kinds=("block",)).best.candidate)
        blocks = [S10_PICK, _reversed(S10_PICK), S10_BEST, _reversed(S10_BEST), *S10_SPLIT_KV[recipe],
                  _reversed(S10_SPLIT_KV[recipe][1])]
        splits = [(S10_SPLIT_BLOCK[1], S10_SPLIT_DENSE[0]), (S10_SPLIT_BLOCK[1], S10_SPLIT_DENSE[1]),
                  (S10_SPLIT_BLOCK[0], S10_SPLIT_DENSE[0])]
        timed[recipe] = ([dict(_case("time", "block", recipe, batch, heads, seq, 64, "float16", config),
                               model_pick=pick) for config in blocks],
                         [dict(split_case("time", recipe, batch, heads, seq, 64, "float16", block, dense),
                               model_pick=pick) for block, dense in splits])
    for part in (0, 1):             # every mask's block-wise cases before any split case
        for recipe in timed:
            cases.extend(timed[recipe][part])
    cases.append(_case("time", "block", "sliding", batch, heads, seq, 64, "float16", (32, 32, 1, 2, False)))
    return cases


# s10dims: the wgmma kernel at head dims 32, 80, 96 and 256 (39cc1a3), issue 16's "every head dim >= FlexAttention"
# and causal lines. Timed shapes: B16 H12 S4096 (B4 H16 S4096 at 256, as session 7 timed the block-wise kernel there),
# in the order of what is at stake (D32 below FlexAttention on mma.sync, D256 level with it, D80/96 behind SDPA).
S10D_SHAPES = {32: (16, 12, 4096), 256: (4, 16, 4096), 80: (16, 12, 4096), 96: (16, 12, 4096)}
# wgmma configurations timed (block_n, stages, pingpong, persistent, consumers, loads[, pad_panels]): session 10's
# default first (the checks take today's default), its one-block-per-item twin, and at 32 / 80 / 96 the padded-panel
# form (the 128-byte swizzle of head dims 64 and 128, checked on the H200 since session 6: the fallback should the 64-
# and 32-byte swizzles fail their checks)
S10D_PADDED = {32: (128, 4, True, True, 3, "tma", True), 80: (128, 2, True, True, 2, "tma", True),
               96: (128, 2, True, True, 2, "tma", True)}
S10D_TIMED = {32: ((128, 4, True, True, 3, "tma"), (128, 4, True, False, 3, "tma"), S10D_PADDED[32]),
              256: ((64, 2, True, True, 2, "tma"), (64, 2, True, False, 2, "tma")),
              80: ((128, 3, True, True, 2, "tma"), (128, 3, True, False, 2, "tma"), S10D_PADDED[80]),
              96: ((128, 3, True, True, 2, "tma"), (128, 3, True, False, 2, "tma"), S10D_PADDED[96])}
# issue 16's causal D64 goal (0.92 ms; 0.944 in session 9): session 10's default beside 4 ring stages
S10D_D64 = ((128, 3, True, True, 3, "tma"), (128, 4, True, True, 3, "tma"))


def _wgmma_tuple(config) -> tuple:
    return (config.block_n, config.stages, config.pingpong, config.persistent, config.consumers, config.loads)


def plan_s10dims() -> list[dict]:
    """The wgmma kernel at head dims 32, 80, 96 and 256 against FlexAttention and SDPA, one short run (checks
    < 30 s, timings < 70 s). Checks first (S=1000, Q scaled by 8, outputs poisoned), at each new head dim on the
    default configuration: causal, BigBird (partial tiles' bitmaps), a document mask, causal with Q/K/V as views
    16 bytes into one packed projection (``qkv_offset``) and again on fresh tensors and in a CUDA-graph replay
    (``replays``), per-head random masks with empty rows (fp16 and bf16), the device-side key padding (right,
    left with holes, empty batch rows) on causal and sliding (bf16 at 80 and 256), the padded-panel form
    (S10D_PADDED) on causal, BigBird and document; at 64 and 128 the default
    causal and key-padded causal again (their CUDA changed only in folded constants). Then S10D_SHAPES causal
    (every S10D_TIMED configuration and the block-wise kernel's model pick) and BigBird (the default and the
    block-wise pick), each checked against float32 and carrying the model's prediction; last causal D64 B16 H12
    S4096 with 3 (the default) and 4 ring stages (issue 16's 0.92 ms goal)."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, decide_attention
    from stof_tvm.schedules.attention_wgmma import WgmmaAttentionConfig, default_config

    cases = []

    def check(recipe, head_dim, config, batch=2, heads=3, dtype="float16", padding=False, **extra):
        cases.append(dict(_case("check", "wgmma", recipe, batch, heads, 1000, head_dim, dtype, config,
                                padding=padding), q_scale=8.0, **extra))

    for head_dim in S10D_SHAPES:
        config = _wgmma_tuple(default_config(head_dim))
        for recipe in ("causal", "bigbird", "document", "random_empty:0.05"):
            check(recipe, head_dim, config)
        check("causal", head_dim, config, qkv_offset=8)
        check("causal", head_dim, config, replays=True)
        check("random_empty:0.05", head_dim, config, dtype="bfloat16")
        padded = _wgmma_tuple(default_config(head_dim, padding=True))
        pad_dtype = "bfloat16" if head_dim in (80, 256) else "float16"
        for recipe in ("causal", "sliding"):
            check(recipe, head_dim, padded, batch=4, heads=2, dtype=pad_dtype, padding=True)
        if head_dim in S10D_PADDED:
            for recipe in ("causal", "bigbird", "document"):
                check(recipe, head_dim, S10D_PADDED[head_dim])
    for head_dim in (64, 128):
        check("causal", head_dim, _wgmma_tuple(default_config(head_dim)))
        check("causal", head_dim, _wgmma_tuple(default_config(head_dim, padding=True)), batch=4, heads=2,
              padding=True)
    for head_dim, (batch, heads, seq) in S10D_SHAPES.items():
        for recipe, configs in (("causal", S10D_TIMED[head_dim]), ("bigbird", S10D_TIMED[head_dim][:1])):
            problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                       mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
            decision = decide_attention(problem, kinds=("block", "row", "wgmma"))
            pick = f"{decision.best.candidate} ({decision.reason})"
            block = decide_attention(problem, kinds=("block",)).best.candidate.config
            for config in configs:
                cases.append(dict(_case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16", config),
                                  model_pick=pick,
                                  predicted_ms=_predicted_ms(problem, "wgmma", WgmmaAttentionConfig(*config))))
            cases.append(dict(_case("time", "block", recipe, batch, heads, seq, head_dim, "float16",
                                    _config_tuple(block)), model_pick=pick,
                              predicted_ms=_predicted_ms(problem, "block", block)))
    for config in S10D_D64:
        cases.append(_case("time", "wgmma", "causal", 16, H_BENCH, 4096, 64, "float16", config))
    return cases


def plan_s11gpt2() -> list[dict]:
    """GPT-2 16x2048's attention (issue 17): BigBird AND causal at B16 H12 S2048 D64 fp16 with the key padding of
    an HF export, as the compile path runs it. The model picks a one-warp block-wise configuration there (no heavy
    rows, so no heavy-first or launch-bound candidates), RoBERTa's BigBird at the same shape a two-warp heavy-first
    one with ``min_blocks`` 10 and ``reverse_full``: both, their neighbours, the wgmma kernel's padded default and
    ``auto``'s pick, beside FlexAttention and SDPA; and BigBird alone with RoBERTa's pick. Checks first (S=1024, Q
    scaled by 8, outputs poisoned): every timed configuration on the mask at B2 H3 with padding."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, decide_attention
    from stof_tvm.schedules.attention_wgmma import default_config

    batch, heads, seq = 16, H_BENCH, 2048

    def decided(recipe, kinds):
        problem = AttentionProblem(batch=batch, heads=heads, head_dim=64, dtype="float16", padding=True,
                                   mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
        return decide_attention(problem, kinds=kinds)

    gpt2_pick = decided("bigbird_causal", ("block",)).best.candidate.config
    roberta_pick = decided("bigbird", ("block",)).best.candidate.config
    auto = decided("bigbird_causal", ("block", "row", "wgmma"))
    blocks = list(dict.fromkeys([_config_tuple(gpt2_pick), _config_tuple(roberta_pick), (32, 32, 2, 2, False),
                                 (32, 32, 2, 2, True), (64, 32, 4, 2, False), (32, 32, 1, 2, True)]))
    wgmma = _wgmma_tuple(default_config(64, padding=True))
    cases = [dict(_case("check", "block", "bigbird_causal", 2, 3, 1024, 64, "float16", config, padding=True),
                  q_scale=8.0) for config in blocks]
    cases.append(dict(_case("check", "wgmma", "bigbird_causal", 2, 3, 1024, 64, "float16", wgmma, padding=True),
                      q_scale=8.0))
    pick = f"{auto.best.candidate} ({auto.reason})"
    cases += [dict(_case("time", "block", "bigbird_causal", batch, heads, seq, 64, "float16", config, padding=True),
                   model_pick=pick) for config in blocks]
    cases.append(dict(_case("time", "wgmma", "bigbird_causal", batch, heads, seq, 64, "float16", wgmma,
                            padding=True), model_pick=pick))
    cases.append(_case("time", "block", "bigbird", batch, heads, seq, 64, "float16", _config_tuple(roberta_pick),
                       padding=True))
    return cases


# s12bb: RoBERTa-base / BERT-base 16x2048's attention (BigBird, B16 H12 S2048 D64 fp16, the HF export's key padding).
S12_PICK = (32, 32, 2, 2, True, 1, 1, 10, "mma", True)        # the compile path's pick (heavy-first, min_blocks 10)
S12_LEAN = S12_PICK + (True,)                                  # the same with lean_padding
# (label, configuration, key padding patterns timed; () = the unpadded module), BigBird at S2048, in order
S12_BB = (
    ("pick 32x32x2x2 hf mb10 rf", S12_PICK, ((), "ones", "mixed", "right")),
    ("pick + lean_padding", S12_LEAN, ("ones", "mixed", "right")),
    ("32x32x2x2 hf rf", (32, 32, 2, 2, True, 1, 1, 0, "mma", True), ((), "ones")),
    ("32x32x2x2 hf rf + lean_padding", (32, 32, 2, 2, True, 1, 1, 0, "mma", True, True), ("ones",)),
    ("32x32x2x2 hf (walk first column first)", (32, 32, 2, 2, True), ("ones",)),
    ("32x32x2x2 default order", (32, 32, 2, 2, False), ("ones",)),
    ("32x32x1x2 hf rf (one warp)", (32, 32, 1, 2, True, 1, 1, 0, "mma", True), ("ones",)),
    ("32x32x2x3 hf mb10 rf (3 stages)", (32, 32, 2, 3, True, 1, 1, 10, "mma", True), ("ones",)),
    ("32x64x2x2 hf rf", (32, 64, 2, 2, True, 1, 1, 0, "mma", True), ("ones",)),
    ("64x32x4x2 hf rf (64-row tiles)", (64, 32, 4, 2, True, 1, 1, 0, "mma", True), ("ones",)),
    ("64x32x4x2 hf mb5 rf", (64, 32, 4, 2, True, 1, 1, 5, "mma", True), ("ones",)),
)
# 34c4ed4's tie-break (padded: more co-resident warps before the SM term): (mask, B, S, current pick, 34c4ed4's pick)
S12_TIES = (("sliding", 16, 2048, (32, 32, 1, 2, False), (32, 32, 2, 2, False)),
            ("sliding", 16, 4096, (32, 32, 1, 2, False), (32, 32, 2, 2, False)),
            ("bigbird_causal", 16, 2048, (32, 32, 1, 2, False), (32, 32, 2, 2, False)),
            ("bigbird_causal", 8, 512, (32, 32, 2, 4, False), (32, 32, 2, 3, False)),
            ("bigbird_causal", 8, 577, (32, 32, 2, 3, False), (32, 32, 2, 2, False)),
            ("bigbird_causal", 32, 197, (32, 32, 2, 3, False), (32, 32, 2, 2, False)))


def plan_s12bb() -> list[dict]:
    """RoBERTa-base (and BERT-base) 16x2048's attention: BigBird at B16 H12 S2048 D64 fp16 as the compile path runs
    it (the model's pick, S12_PICK, applying the HF export's key padding, which the e2e runs feed all ones), and why
    it measured 0.143 ms (session 11, s11gpt2: the padded module under the *mixed* padding patterns, holes included)
    against 0.186 at S4096 without padding. Timed, each a labelled case: the pick unpadded and padded under all-ones,
    mixed and right padding; the same with ``lean_padding`` (span tests only in batch rows that drop keys, the
    predicate's pad_bits words loaded once a tile); neighbours (no launch bounds, first-column-first walk, default
    order, one warp, 3 stages, 32x64, 64-row tiles) under all-ones padding; the wgmma kernel's padded and unpadded
    defaults; the pick at S4096 unpadded / all-ones (/ lean) for the per-pair rate; FlexAttention beside the first.
    Then the shapes whose picks 34c4ed4's tie-break moves (S12_TIES: padded, all-ones), current and 34c4ed4's pick.
    Checks first (S=1000 and 1024, Q scaled by 8, outputs poisoned, mixed padding: right, left with holes, none,
    nothing kept): lean_padding at 32x32 (the pick), 32x16 and 64x64 tiles (one- and two-word predicates)."""
    from stof_tvm.schedules.attention_wgmma import default_config

    cases = []
    for config, seq in ((S12_LEAN, 1024), ((32, 16, 2, 2, True, 1, 1, 0, "mma", True, True), 1000),
                        ((64, 64, 4, 2, False, 1, 1, 0, "mma", False, True), 1000)):
        cases.append(dict(_case("check", "block", "bigbird", 4, 2, seq, 64, "float16", config, padding=True),
                          q_scale=8.0))
    batch, heads = 16, H_BENCH

    def timed(label, family, recipe, b, seq, config, keep, baselines=False):
        case = _case("time", family, recipe, b, heads, seq, 64, "float16", config, padding=bool(keep))
        if keep:
            case["pad_keep"] = keep
        cases.append(dict(case, label=label, baselines=baselines))

    first = True
    for label, config, keeps in S12_BB:
        for keep in keeps:
            timed(label, "block", "bigbird", batch, 2048, config, keep, baselines=first)
            first = False
    timed("wgmma default (unpadded)", "wgmma", "bigbird", batch, 2048, _wgmma_tuple(default_config(64)), ())
    timed("wgmma padded default", "wgmma", "bigbird", batch, 2048, _wgmma_tuple(default_config(64, padding=True)),
          "ones")
    for keep, config, label in (((), S12_PICK, "pick"), ("ones", S12_PICK, "pick"),
                                ("ones", S12_LEAN, "pick + lean_padding")):
        timed(f"S4096: {label}", "block", "bigbird", batch, 4096, config, keep)
    for recipe, b, seq, current, tied in S12_TIES:
        timed("34c4ed4: current pick " + "x".join(map(str, current[:4])), "block", recipe, b, seq, current, "ones")
        timed("34c4ed4: its pick " + "x".join(map(str, tied[:4])), "block", recipe, b, seq, tied, "ones")
    return cases


# s17model: the end-to-end models' attention shapes (BigBird, H12 D64, the HF key padding fed all ones)
S17_SHAPES = ((8, 512), (8, 197), (1, 577), (1, 197), (1, 128))
S17_TILES = 12            # tile shapes timed per shape, in the model's order
S17_MIN_BLOCK_N = 32      # narrower key tiles only pay on very sparse masks


def plan_s17model() -> list[dict]:
    """Is the model's block-wise pick the fastest at the shapes the whole models run? Session 16's in-place timeline
    gave attention 10.7-15.9% of each forward (BERT-base 8x512: 20.6 us a layer, 3.4x Q, K, V and O at 4.2 TB/s)
    and the model's ranking is flat there (its top ten within 6%). For each shape in S17_SHAPES: the model's best
    stage count for its first S17_TILES block-wise tile shapes (block_m x block_n x warps, block_n >= 32), each
    labelled with its rank and prediction, then the padded wgmma default; FlexAttention and SDPA beside the first.
    Padded as the compiled models are, under all-ones padding (what the e2e runs feed)."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile
    from stof_tvm.cost_model.attention import rank_attention
    from stof_tvm.schedules.attention_wgmma import default_config

    cases = []
    for batch, seq in S17_SHAPES:
        mask = build_mask("bigbird", batch, H_BENCH, seq, 0)
        problem = AttentionProblem(batch=batch, heads=H_BENCH, head_dim=64, dtype="float16", padding=True,
                                   mask=MaskProfile(mask))
        ranked = [r for r in rank_attention(problem) if r.candidate.kind == "block"]
        tiles = {}
        for rank, r in enumerate(ranked):
            config = r.candidate.config
            if config.block_n >= S17_MIN_BLOCK_N:
                tiles.setdefault((config.block_m, config.block_n, config.num_warps), (rank, r))
        for rank, r in list(tiles.values())[:S17_TILES]:
            config = _config_tuple(r.candidate.config)
            case = _case("time", "block", "bigbird", batch, H_BENCH, seq, 64, "float16", config, padding=True)
            label = f"rank {rank:>2} predicted {r.prediction.time_s * 1e3:.4f} " + "x".join(map(str, config[:5]))
            cases.append(dict(case, pad_keep="ones", label=label, baselines=rank == 0))
        case = _case("time", "wgmma", "bigbird", batch, H_BENCH, seq, 64, "float16",
                     _wgmma_tuple(default_config(64, padding=True)), padding=True)
        cases.append(dict(case, pad_keep="ones", label="wgmma padded default"))
    return cases


# s19knobs: the knobs around the model's block-wise pick at the whole models' shapes (BigBird, H12 D64, all-ones pads)
S19_SHAPES = ((8, 512), (16, 2048), (8, 197))
S19_VARIANTS = (("stages", 2), ("stages", 3), ("stages", 4), ("min_blocks", 4), ("min_blocks", 8), ("row_sums", "fadd"),
                ("row_sums", "mma"), ("heavy_first", False), ("heavy_first", True), ("reverse_full", False),
                ("reverse_full", True), ("kv_splits", 2))


def _compile_path_pick(batch: int, seq: int):
    """The compile path's block-wise configuration for BigBird at ``batch`` x ``seq`` (H12 D64, padded): the model's
    rank-0 block-wise candidate with ``lean_padding``, as :func:`stof_tvm.compiler.front_end` sets it."""
    import dataclasses

    from stof_tvm.cost_model import AttentionProblem, MaskProfile
    from stof_tvm.cost_model.attention import rank_attention

    mask = build_mask("bigbird", batch, H_BENCH, seq, 0)
    problem = AttentionProblem(batch=batch, heads=H_BENCH, head_dim=64, dtype="float16", padding=True,
                               mask=MaskProfile(mask))
    pick = next(r for r in rank_attention(problem) if r.candidate.kind == "block").candidate.config
    return dataclasses.replace(pick, lean_padding=True)


def _labelled_block_cases(batch: int, seq: int, configs) -> list[dict]:
    """Timed BigBird cases of ``(label, BlockConfig)`` pairs under all-ones padding; the first carries the
    baselines."""
    cases = []
    for i, (label, config) in enumerate(configs):
        config_list = _config_tuple(config)
        case = _case("time", "block", "bigbird", batch, H_BENCH, seq, 64, "float16", config_list, padding=True)
        cases.append(dict(case, pad_keep="ones", label=f"{label} " + "x".join(map(str, config_list[:5])),
                          baselines=i == 0))
    return cases


def plan_s19knobs() -> list[dict]:
    """Is the model's block-wise pick the best of its own knobs at the shapes the whole models run? Session 17
    (s17model) timed the tile shapes (block_m x block_n x warps) and found the pick fastest or within 8-13%; the other
    knobs were left at the model's values. For each shape in S19_SHAPES: the compile path's configuration (the model's
    rank-0 block-wise candidate with ``lean_padding``, as :func:`stof_tvm.compiler.front_end` sets it), then that
    configuration with one knob changed (S19_VARIANTS: ring depth, ``min_blocks``, the row sums' form, the launch order,
    the full tiles' order, split-KV of the heavy rows), where it differs and validates; FlexAttention and SDPA beside
    the first. Padded as the compiled models are, under all-ones padding."""
    import dataclasses

    cases = []
    for batch, seq in S19_SHAPES:
        pick = _compile_path_pick(batch, seq)
        configs = [("pick", pick)]
        for knob, value in S19_VARIANTS:
            extra = {"heavy_first": True} if knob == "kv_splits" else {}
            if knob == "reverse_full" and value:
                extra = {"heavy_first": True}
            variant = dataclasses.replace(pick, **{knob: value}, **extra)
            if knob == "heavy_first" and not value:
                variant = dataclasses.replace(variant, kv_splits=1, split_rows=1, reverse_full=False)
            try:
                variant.validate(64)
            except ValueError:
                continue
            if variant != pick and all(variant != c for _, c in configs):
                configs.append((f"{knob}={value}", variant))
        cases += _labelled_block_cases(batch, seq, configs)
    return cases


# s19gate: the picks 92d77e6 moved (heavy-first offered at each tile shape with heavy rows), before and after; the
# "before" tuples are what the model picked at 683d7cb (lean_padding added as the compile path adds it)
S19_GATE = (("bigbird", 8, 512, (32, 64, 2, 2, False, 1, 1, 0, "mma", False, True)),
            ("longformer", 8, 512, (32, 64, 2, 2, False, 1, 1, 0, "mma", False, True)))


def plan_s19gate() -> list[dict]:
    """The attention picks that the heavy-first gate (92d77e6) moved, each against the pick before it, at the shape
    it moved at (B8 S512, H12 D64, fp16, padded under all-ones padding as the compiled models run); the first case
    of each pair carries FlexAttention and SDPA."""
    import dataclasses

    from stof_tvm.cost_model import AttentionProblem, MaskProfile
    from stof_tvm.cost_model.attention import rank_attention

    cases = []
    for recipe, batch, seq, before in S19_GATE:
        mask = build_mask(recipe, batch, H_BENCH, seq, 0)
        problem = AttentionProblem(batch=batch, heads=H_BENCH, head_dim=64, dtype="float16", padding=True,
                                   mask=MaskProfile(mask))
        pick = next(r for r in rank_attention(problem) if r.candidate.kind == "block").candidate.config
        after = _config_tuple(dataclasses.replace(pick, lean_padding=True))
        for i, (label, config) in enumerate((("now", after), ("before", before))):
            case = _case("time", "block", recipe, batch, H_BENCH, seq, 64, "float16", config, padding=True)
            cases.append(dict(case, pad_keep="ones", label=f"{recipe} {label} " + "x".join(map(str, config[:5])),
                              baselines=i == 0))
    return cases


# s25short: whole-row prefetch at the whole models' short rows (BigBird, H12 D64, all-ones pads)
S25_SHAPES = ((8, 197), (1, 128), (8, 512), (1, 577))


def plan_s25short() -> list[dict]:
    """Does a ring deep enough to hold a whole tile row help where rows are short? At S <= 577 every tile row holds a
    few K/V tiles, and the model's picks (16-32 query rows a block, a 2-deep ring) wait on each tile in turn; session
    19 found them latency-bound (8x197: no faster than SDPA's dense kernel at density 0.55). For each shape in
    S25_SHAPES: the compile path's pick (as in s19knobs), the pick with a ring as deep as its row, then 64 and 128
    query rows a block and one block per (batch, head, all rows), each with one or two m16 tiles a warp, 32- or
    64-key tiles and every tile of the row in flight (capped by shared memory); FlexAttention and SDPA beside the
    first. Padded as the compiled models are, under all-ones padding."""
    import dataclasses

    from stof_tvm.schedules.attention_blockwise import BlockConfig

    cases = []
    for batch, seq in S25_SHAPES:
        pick = _compile_path_pick(batch, seq)
        configs = [("pick", pick), ("pick, whole row", dataclasses.replace(
            pick, stages=max(2, -(-seq // pick.block_n))))]
        whole = 16 * -(-seq // 16)
        for block_m in dict.fromkeys((64, 128, whole if whole <= 256 else 256)):
            for rows_per_warp in (16, 32):
                for block_n in (32, 64):
                    stages = max(2, -(-seq // block_n))
                    config = BlockConfig(block_m=block_m, block_n=block_n, num_warps=max(1, block_m // rows_per_warp),
                                         stages=stages, lean_padding=True)
                    while config.stages > 2 and config.shared_bytes(64) > 200 * 1024:
                        config = dataclasses.replace(config, stages=config.stages - 1)
                    try:
                        config.validate(64)
                    except ValueError:
                        continue
                    if all(config != c for _, c in configs):
                        configs.append((f"{block_m} rows, {rows_per_warp} a warp", config))
        cases += _labelled_block_cases(batch, seq, configs)
    return cases


# s29short: the compile path's picks at the whole models' shapes, from this tree and from the tree before it
S29_SHAPES = ((8, 512), (8, 197), (1, 128), (1, 577), (16, 2048))


def plan_s29short() -> list[dict]:
    """This tree's block-wise kernel against the tree before it (``variant: base``, built with ``--only-variant base
    --source-tree DIR``) at the compile path's picks for BigBird at the whole models' shapes (S29_SHAPES, H12 D64,
    padded, all-ones padding as the models run); the first case of each shape carries FlexAttention and SDPA."""
    cases = []
    for batch, seq in S29_SHAPES:
        config = _config_tuple(_compile_path_pick(batch, seq))
        case = _case("time", "block", "bigbird", batch, H_BENCH, seq, 64, "float16", config, padding=True)
        label = "x".join(map(str, config[:5]))
        cases += [dict(case, pad_keep="ones", label=f"base {label}", variant="base", baselines=True),
                  dict(case, pad_keep="ones", label=f"this {label}", baselines=False)]
    return cases


# s30regs: the register cap of the 16x2048 pick, which spills 4 bytes at min_blocks 10 (96 registers; session 29)
S30_MIN_BLOCKS = (10, 9, 8, 0)


def plan_s30regs() -> list[dict]:
    """The compile path's BigBird pick at 16 x 2048 (H12 D64, padded, all-ones padding as RoBERTa-base runs it) at
    each ``min_blocks`` of S30_MIN_BLOCKS (0: no cap): does the cap that keeps 10 blocks an SM pay for the spill it
    causes? The manifest's ptxas report gives each build's registers and spills; the first case carries
    FlexAttention and SDPA."""
    import dataclasses

    pick = _compile_path_pick(16, 2048)
    configs = [(f"min_blocks {m}", dataclasses.replace(pick, min_blocks=m)) for m in S30_MIN_BLOCKS]
    return _labelled_block_cases(16, 2048, configs)


# s32prof: issue 16's causal and document shapes on both kernel families, for a profiler run (ncu) beside the timings
S32_SHAPES = {"causal": (16, 12, 4096, 64), "document": (8, 12, 4096, 64)}


def plan_s32prof() -> list[dict]:
    """Where do the wgmma kernel's cycles go on causal (dense tile rows, few partial tiles) and on document masks
    (short tile rows, most tiles partial)? For each of S32_SHAPES (D64): the wgmma default and the block-wise
    kernel's model pick, each timed and carrying the model's prediction and automatic choice; the first case of a
    shape carries FlexAttention and SDPA. Then causal D128 B4 H16 S8192 on the wgmma default. Run it once for the
    times, then under ``ncu`` with ``--masks``/``--families`` selecting one case a profile."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, decide_attention
    from stof_tvm.schedules.attention_wgmma import WgmmaAttentionConfig, default_config

    cases = []
    shapes = [(recipe, *shape) for recipe, shape in S32_SHAPES.items()] + [("causal", 4, 16, 8192, 128)]
    for recipe, batch, heads, seq, head_dim in shapes:
        problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                   mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
        decision = decide_attention(problem, kinds=("block", "row", "wgmma"))
        pick = f"{decision.best.candidate} ({decision.reason})"
        wgmma = default_config(head_dim)
        cases.append(dict(_case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16",
                                _wgmma_tuple(wgmma)), model_pick=pick, baselines=True,
                          predicted_ms=_predicted_ms(problem, "wgmma", wgmma)))
        if head_dim == 64:
            block = decide_attention(problem, kinds=("block",)).best.candidate.config
            cases.append(dict(_case("time", "block", recipe, batch, heads, seq, head_dim, "float16",
                                    _config_tuple(block)), model_pick=pick, baselines=False,
                              predicted_ms=_predicted_ms(problem, "block", block)))
    return cases


# s32wait: the trees built beside this one (``--only-variant NAME --source-tree DIR``), the reference first: in session
# 32 ``base`` (9ded202) and ``suspend`` (its producer's waits suspended: scripts/NOTES_attention_wgmma.md)
S32_VARIANTS = ("base", "suspend")


def plan_s32wait() -> list[dict]:
    """This tree's wgmma default against the same configuration built from the trees of S32_VARIANTS: causal and dense
    (D64 B16 H12 S4096, D128 B4 H16 S8192) and the document mask (D64 B8), each case timed on its own and then every
    tree's module of a shape interleaved round by round (``interleave``), the first case of a shape with
    FlexAttention and SDPA; checks first (S=1000, Q x8, bf16 too) on this tree."""
    from stof_tvm.schedules.attention_wgmma import default_config

    cases = []
    for head_dim in (64, 128):
        config = _wgmma_tuple(default_config(head_dim))
        for recipe, dtype in (("causal", "float16"), ("random_empty:0.05", "float16"), ("document", "bfloat16")):
            cases.append(dict(_case("check", "wgmma", recipe, 2, 3, 1000, head_dim, dtype, config), q_scale=8.0))
    shapes = (("causal", 16, 12, 4096, 64), ("document", 8, 12, 4096, 64), ("causal", 4, 16, 8192, 128),
              ("dense", 16, 12, 4096, 64), ("dense", 4, 16, 8192, 128))
    for recipe, batch, heads, seq, head_dim in shapes:
        case = _case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16",
                     _wgmma_tuple(default_config(head_dim)))
        group = f"{recipe} D{head_dim}"
        for i, variant in enumerate(S32_VARIANTS):
            cases.append(dict(case, label=variant, variant=variant, baselines=i == 0, interleave=group))
        cases.append(dict(case, label="this", baselines=False, interleave=group))
    return cases


# issue 16's goal rows (mask, B, H, S, D), the head dims' rows after them
S35_GOALS = (("causal", 16, 12, 4096, 64), ("causal", 4, 16, 8192, 128), ("dense", 16, 12, 4096, 64),
             ("dense", 4, 16, 8192, 128), ("sliding", 16, 12, 4096, 64), ("longformer", 16, 12, 4096, 64),
             ("bigbird", 16, 12, 4096, 64), ("document", 8, 12, 4096, 64), ("head_blocks:0.16", 8, 12, 4096, 64),
             ("bigbird", 4, 16, 8192, 128))
S35_HEAD_DIMS = tuple((recipe, *HEAD_DIM_SHAPES.get(d, HEAD_DIM_SHAPE), d)
                      for d in (32, 80, 96, 256) for recipe in ("causal", "bigbird"))


def plan_s35goals() -> list[dict]:
    """Every goal row of issue 16 as a user gets it: the analytical model's automatic choice among the block-wise,
    row-wise and wgmma kernels (what ``stof_tvm.AttentionPlan`` runs), each beside FlexAttention and SDPA, then
    the head dims 32, 80, 96 and 256 on causal and BigBird. Checks first (S=1000, Q scaled by 8, outputs
    poisoned) of every picked configuration on its mask."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, decide_attention

    cases, checks = [], []
    for recipe, batch, heads, seq, head_dim in S35_GOALS + S35_HEAD_DIMS:
        problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                   mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
        decision = decide_attention(problem, kinds=("block", "row", "wgmma"))
        candidate = decision.best.candidate
        kind = candidate.kind
        config = (_wgmma_tuple(candidate.config) if kind == "wgmma" else
                  _config_tuple(candidate.config) if kind == "block" else None)
        pick = f"{candidate} ({decision.reason})"
        cases.append(dict(_case("time", kind, recipe, batch, heads, seq, head_dim, "float16", config),
                          model_pick=pick, baselines=True, predicted_ms=decision.best.time_s * 1e3))
        checks.append(dict(_case("check", kind, recipe, 2, 3, 1000, head_dim, "float16", config), q_scale=8.0))
    return list({_module_key(c): c for c in checks}.values()) + cases


# s36wide: wider key tiles for dense rows (FlashAttention-3's non-causal tiles are wider than its causal ones): per
# head dim, (label, wgmma configuration) timed; the first is the default
S36_WIDE = {64: (("default", (128, 3, True, True, 3, "tma")), ("2 consumers", (128, 3, True, True, 2, "tma")),
                 ("160 keys", (160, 3, True, True, 2, "tma")), ("192 keys", (192, 3, True, True, 2, "tma")),
                 ("192 keys 4 stages", (192, 4, True, True, 2, "tma"))),
            128: (("default", (128, 2, True, True, 2, "tma")), ("160 keys", (160, 2, True, True, 2, "tma")))}
# ... and the block-wise tiles around sliding's pick (issue 16's B16 H12 S4096 D64 row: 0.135 ms on the H200 in
# sessions 9, 10 and 35 against the 0.133 goal), the pick first
S36_SLIDING = ((32, 32, 1, 2, False), (32, 32, 1, 3, False), (32, 32, 1, 4, False), (32, 32, 2, 2, False),
               (32, 64, 1, 2, False), (64, 32, 2, 2, False), (64, 64, 2, 2, False), (64, 32, 4, 2, False))


def plan_s36wide() -> list[dict]:
    """Wider key tiles on the wgmma kernel (block_n 160 and 192, two consumers) against the default, on dense and
    causal rows of issue 16's shapes (D64 B16 H12 S4096, D128 B4 H16 S8192), each shape's forms interleaved round by
    round, the default's case with FlexAttention and SDPA. Checks first (S=1000, not a multiple of either width; Q
    scaled by 8, outputs poisoned) of every wide form: dense, causal, per-head random masks with empty rows, the
    device-side key padding, and bfloat16 document masks. Then the block-wise tiles of :data:`S36_SLIDING` on the
    sliding window (B16 H12 S4096 D64), interleaved, the model's pick first with the baselines."""
    cases = []
    for head_dim, forms in S36_WIDE.items():
        for _, config in forms[1:]:
            for recipe, dtype, padding in (("dense", "float16", False), ("causal", "float16", False),
                                           ("random_empty:0.05", "float16", False), ("causal", "float16", True),
                                           ("document", "bfloat16", False)):
                cases.append(dict(_case("check", "wgmma", recipe, 2, 3, 1000, head_dim, dtype, config,
                                        padding=padding), q_scale=8.0))
    for head_dim, forms in S36_WIDE.items():
        batch, heads, seq = S8W_SHAPES[head_dim]
        for recipe in ("dense", "causal"):
            for i, (label, config) in enumerate(forms):
                cases.append(dict(_case("time", "wgmma", recipe, batch, heads, seq, head_dim, "float16", config),
                                  label=label, baselines=i == 0, interleave=f"{recipe} D{head_dim}"))
    for i, config in enumerate(S36_SLIDING):
        cases.append(dict(_case("time", "block", "sliding", 16, H_BENCH, 4096, 64, "float16", config),
                          label="x".join(map(str, config)), baselines=i == 0, interleave="sliding D64"))
    return cases


# s36dims: the block-wise kernel's ranking at head dims 32, 80, 96 and 256 (BigBird, where the model's split-KV picks
# ran 1.41-1.80x slower than predicted in session 35): its best S36_DIMS_TOP distinct tile shapes per head dim
S36_DIMS_TOP = 8


def plan_s36dims() -> list[dict]:
    """The analytical model's :data:`S36_DIMS_TOP` best block-wise configurations (one per tile shape, warps,
    stages and split-KV or not) on BigBird at head dims 32, 80, 96 and 256, each head dim's
    forms interleaved round by round, the model's pick first with FlexAttention and SDPA; the measured order against
    the predicted one is what ``calibrate_model.py`` refits from. Checks first (S=1000, Q scaled by 8, outputs
    poisoned) of every form."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, attention_candidates, rank_attention

    cases, checks = [], []
    for head_dim in (32, 80, 96, 256):
        batch, heads, seq = HEAD_DIM_SHAPES.get(head_dim, HEAD_DIM_SHAPE)
        problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                   mask=MaskProfile(build_mask("bigbird", batch, heads, seq, 0)))
        ranked = rank_attention(problem, candidates=attention_candidates(problem, kinds=("block",)))
        chosen, shapes = [], set()
        for r in ranked:
            c = r.candidate.config
            shape = (c.block_m, c.block_n, c.num_warps, c.stages, c.kv_splits > 1)
            if shape not in shapes:
                shapes.add(shape)
                chosen.append(r)
            if len(chosen) == S36_DIMS_TOP:
                break
        for i, r in enumerate(chosen):
            config = _config_tuple(r.candidate.config)
            cases.append(dict(_case("time", "block", "bigbird", batch, heads, seq, head_dim, "float16", config),
                              label=str(r.candidate), baselines=i == 0, predicted_ms=r.time_s * 1e3,
                              model_pick=str(chosen[0].candidate), interleave=f"bigbird D{head_dim}"))
            checks.append(dict(_case("check", "block", "bigbird", 2, 3, 1000, head_dim, "float16", config),
                               q_scale=8.0))
    return list({_module_key(c): c for c in checks}.values()) + cases


# s36kinds: block-wise against wgmma at head dims 32, 80, 96 and 256 on masks between sparse and causal, where the
# block-wise kernel's timings ran 1.4-1.8x its predictions (session 35) and a truer price would flip the kind
S36_KIND_MASKS = ("sliding", "document", "bigbird_causal", "head_blocks:0.4")


def plan_s36kinds() -> list[dict]:
    """Per head dim 32, 80, 96, 256 and mask of :data:`S36_KIND_MASKS`: the analytical model's best block-wise form
    and its best wgmma form, interleaved round by round, without baselines (kind against kind is the question);
    every timed output is checked against float32 after timing."""
    return _kind_against_kind((32, 80, 96, 256))


def plan_s38kinds() -> list[dict]:
    """:func:`plan_s36kinds` at the head dims the model was calibrated on, 64 and 128: whether the masks between
    sparse and causal (the document mask of issue 16 above all, 1.82x FlexAttention on the block-wise pick) run
    faster on wgmma there too, as they did at 80 and 96."""
    return _kind_against_kind((64, 128))


def _kind_against_kind(head_dims) -> list[dict]:
    """The cases of :func:`plan_s36kinds` at ``head_dims``."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, attention_candidates, rank_attention

    cases = []
    for head_dim in head_dims:
        batch, heads, seq = HEAD_DIM_SHAPES.get(head_dim, HEAD_DIM_SHAPE)
        for recipe in S36_KIND_MASKS:
            problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                       mask=MaskProfile(build_mask(recipe, batch, heads, seq, 0)))
            pick = rank_attention(problem, candidates=attention_candidates(problem, kinds=("block", "wgmma")))[0]
            for kind in ("block", "wgmma"):
                best = rank_attention(problem, candidates=attention_candidates(problem, kinds=(kind,)))[0]
                as_tuple = _wgmma_tuple if kind == "wgmma" else _config_tuple
                config = as_tuple(best.candidate.config)
                cases.append(dict(_case("time", kind, recipe, batch, heads, seq, head_dim, "float16", config),
                                  label=str(best.candidate), baselines=False, predicted_ms=best.time_s * 1e3,
                                  model_pick=str(pick.candidate), interleave=f"{recipe} D{head_dim}"))
    return cases


# s37gqa: grouped-query attention as Mistral 7B and Llama 3 8B run it (32 query heads over 8 key/value heads, D128):
# (B, H, Hkv, S, D) shapes and the masks
S37_SHAPES = ((4, 32, 8, 4096, 128), (16, 32, 8, 2048, 128))
S37_MASKS = ("sliding", "causal", "bigbird_causal")


def _decided_case(recipe, batch, heads, seq, head_dim, kv_heads) -> dict:
    """A timed fp16 case of the kernel and configuration the compile path runs for this problem: the model's pick,
    :func:`stof_tvm.attention.decide_kernel` on sm_90 (``kv_heads`` 0: K and V with every query head)."""
    from stof_tvm.attention import decide_kernel

    mask = build_mask(recipe, batch, heads, seq, 0)
    kind, config, reason = decide_kernel(mask, batch=batch, heads=heads, head_dim=head_dim, dtype="float16",
                                         target_kind="cuda", target_arch="sm_90", kv_heads=kv_heads)
    as_tuple = {"block": _config_tuple, "wgmma": _wgmma_tuple}.get(kind)
    case = _case("time", kind, recipe, batch, heads, seq, head_dim, "float16", as_tuple(config) if as_tuple else None)
    return dict(case, model_pick=f"{kind}: {reason}")


def plan_s37gqa() -> list[dict]:
    """Grouped-query attention on our kernels (K and V of Hkv heads, query head h reading head h // (H / Hkv)) against
    the path before it (the same problem on K and V repeated to every head, the repeat's copy timed apart), SDPA and
    FlexAttention with ``enable_gqa``. Per shape of :data:`S37_SHAPES` and mask of :data:`S37_MASKS`: the model's
    pick for the grouped problem (``gqa_form`` grouped: checked against float32 on the repeated K and V, with the
    baselines) and its pick for the repeated one (``gqa_form`` repeated), the two interleaved round by round."""
    cases = []
    for batch, heads, kv_heads, seq, head_dim in S37_SHAPES:
        for recipe in S37_MASKS:
            group = f"{recipe} B{batch} S{seq}"
            grouped = _decided_case(recipe, batch, heads, seq, head_dim, kv_heads)
            repeated = _decided_case(recipe, batch, heads, seq, head_dim, 0)
            cases += [dict(grouped, kv_heads=kv_heads, gqa_form="grouped", label="grouped", interleave=group),
                      dict(repeated, gqa_form="repeated", label="repeated", baselines=False, interleave=group)]
    return cases


PLANS = {"check": plan_check, "tune": plan_tune, "grid": plan_grid, "pick": plan_pick, "headdims": plan_headdims,
         "splitkv": plan_splitkv, "issue16": plan_issue16, "s7sparse": plan_s7sparse, "s7causal": plan_s7causal,
         "s8tma": plan_s8tma, "s8wgmma": plan_s8wgmma, "s9attn": plan_s9attn,
         "s9sparse": plan_s9sparse, "s9check": plan_s9check, "s10sparse": plan_s10sparse,
         "s10dims": plan_s10dims, "s11gpt2": plan_s11gpt2, "s12bb": plan_s12bb,
         "s17model": plan_s17model, "s19knobs": plan_s19knobs,
         "s19gate": plan_s19gate, "s25short": plan_s25short, "s29short": plan_s29short,
         "s30regs": plan_s30regs, "s32prof": plan_s32prof, "s32wait": plan_s32wait,
         "s35goals": plan_s35goals, "s36wide": plan_s36wide, "s36dims": plan_s36dims,
         "s36kinds": plan_s36kinds, "s37gqa": plan_s37gqa, "s38kinds": plan_s38kinds}
SYMBOLS = {"block": "blockwise_attention", "row": "rowwise_attention", "wgmma": "wgmma_attention"}


# ----------------------------------------------------------------------------------------------------------
# build (TVM compiler side)
# ----------------------------------------------------------------------------------------------------------

def _module_key(case: dict) -> str:
    mb, mh = mask_groups(case["mask"], case["batch"], case["heads"])
    cfg = "x".join(map(str, case["config"])) if case["config"] else "default"
    seq = f"s{case['seq']}" + (f"q{case['seq_q']}" if case.get("seq_q") is not None else "")
    return (f"{case['family']}_b{case['batch']}h{case['heads']}{seq}d{case['head_dim']}_"
            f"{case['dtype']}_g{mb}x{mh}_{cfg}" + ("_pad" if case.get("padding") else "")
            + (f"_{case['variant']}" if case.get("variant") else "") + _kv_suffix(case))


def _kv_suffix(case: dict) -> str:
    """``_kv<Hkv>`` for a grouped-query case (K and V with ``kv_heads`` heads), empty otherwise: a grouped module
    and names derived from it stay apart from the same configuration on K and V of every head."""
    return f"_kv{case['kv_heads']}" if case.get("kv_heads") else ""


def _primfunc(case: dict):
    mb, mh = mask_groups(case["mask"], case["batch"], case["heads"])
    common = dict(batch=case["batch"], heads=case["heads"], seq_q=case.get("seq_q") or case["seq"],
                  seq_k=case["seq"], head_dim=case["head_dim"], dtype=case["dtype"], mask_batch=mb, mask_heads=mh,
                  scale=None,
                  target_kind="cuda")
    if case.get("kv_heads"):            # only then: a --source-tree from before grouped K and V has no such argument
        common["kv_heads"] = case["kv_heads"]
    if case["family"] == "wgmma":
        from stof_tvm.schedules.attention_wgmma import WgmmaAttentionConfig, wgmma_attention_primfunc
        del common["target_kind"]
        return wgmma_attention_primfunc(config=WgmmaAttentionConfig(*case["config"]),
                                        padding=case.get("padding", False), **common)
    if case["family"] == "block":
        from stof_tvm.schedules.attention_blockwise import BlockConfig, blockwise_attention_primfunc
        return blockwise_attention_primfunc(config=BlockConfig(*case["config"]), padding=case.get("padding", False),
                                            **common)
    from stof_tvm.schedules.attention_rowwise import rowwise_attention_primfunc
    return rowwise_attention_primfunc(config=None, **common)


def _nvcc_cubin(src: str, cubin_path: Path, arch: str = "sm_90") -> dict:
    """Compile ``src`` with nvcc -Xptxas -v into ``cubin_path``; return registers / spill figures. sm_90 with
    TVM's fast math for the mma.sync kernels; sm_90a (the wgmma kernel) as its own build does, without."""
    if arch == "sm_90a":
        return bl.nvcc_cubin(src, cubin_path, arch, gencode=True)
    return bl.nvcc_cubin(src, cubin_path, arch, fast_math=True)


def _variant_manifests(out: Path, variants: set) -> dict:
    """The manifests of the variant builds present in ``out`` (a variant without one is left out, and said)."""
    found = {}
    for name in sorted(variants):
        path = out / f"manifest.{name}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
        else:
            print(f"no {path.name}: the plan's '{name}' cases are left out (build them first with "
                  f"--only-variant {name} --source-tree DIR)")
    return found


def build(args) -> None:
    """Compile every module of the plan; nvcc turns each module's CUDA source into a cubin stored under its
    source hash, which ``run`` hands to TVM's CUDA loader instead of compiling the source again there."""
    import tvm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [c for name in args.plan.split(",") for c in PLANS[name]()]
    variant = args.only_variant
    # A plan's "variant" cases are built by a separate build of another source tree (--only-variant); this build
    # takes the others and merges the variant builds it finds (manifest.<variant>.json) into its manifest.
    merged = {} if variant else _variant_manifests(out, {c["variant"] for c in cases if c.get("variant")})
    cases = [c for c in cases if c.get("variant") == variant
             or (not variant and c.get("variant") in merged)]
    have_rowwise = (Path(__file__).resolve().parents[1] / "schedules" / "attention_rowwise.py").exists()
    cases = [c for c in cases if c["family"] != "row" or have_rowwise]
    targets = {arch: tvm.target.Target(dict(CUDA_TARGET, arch=arch), host={"kind": "llvm"})
               for arch in ("sm_90", "sm_90a")}
    modules, sources, sass, arches = {}, {}, {}, {}
    t0 = time.time()
    parts = []
    for case in cases:
        pieces = _parts(case)
        for piece in pieces:
            piece["module"] = _module_key(piece)
        case["module"] = pieces[0]["module"]
        if case["family"] == "split":
            case["dense_module"] = pieces[1]["module"]
        parts.extend(pieces)
    for case in parts:
        key = case["module"]
        if key in modules or case.get("variant") != variant:
            continue
        arch = "sm_90a" if case["family"] == "wgmma" else "sm_90"
        ex = tvm.compile(_primfunc(case), target=targets[arch])
        kinds = [m.kind for m in ex.mod.imports]
        if "cuda" not in kinds:
            raise RuntimeError(f"{key}: no CUDA module in the build (imports: {kinds})")
        ex.export_library(str(out / f"{key}.so"))
        src = ex.mod.imports[0].inspect_source()
        cfg = "x".join(map(str, case["config"])) if case["config"] else "default"
        modules[key] = {"library": f"{key}.so", "source": source_key(src), "symbol": SYMBOLS[case["family"]],
                        "kernel": f"{case['family']}_d{case['head_dim']}_{case['dtype']}_{cfg}"
                        + (f"_{variant}" if variant else "") + _kv_suffix(case)}
        sources.setdefault(source_key(src), src)
        arches[source_key(src)] = arch
        print(f"built {key} ({time.time() - t0:.0f} s)", flush=True)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        reports = dict(zip(sources, pool.map(lambda kv: _nvcc_cubin(kv[1], out / f"{kv[0]}.cubin", arches[kv[0]]),
                                             sources.items())))
    for info in modules.values():
        info.update(reports[info["source"]])
        sass.setdefault(info["kernel"], info)          # one SASS check per kernel configuration
    manifest = {"cases": cases, "modules": modules, "sass": sass,
                "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()}
    for name, part in merged.items():
        manifest["modules"].update(part["modules"])
        manifest["sass"].update(part["sass"])
        manifest[f"commit_{name}"] = part.get("source_commit", "?")
    if variant:
        manifest["source_commit"] = args.source_commit
    (out / (f"manifest.{variant}.json" if variant else "manifest.json")).write_text(json.dumps(manifest, indent=1))
    print(f"{len(cases)} cases, {len(modules)} modules, {len(sources)} cubins in {out} ({time.time() - t0:.0f} s)")


# ----------------------------------------------------------------------------------------------------------
# run (GPU side)
# ----------------------------------------------------------------------------------------------------------

def repeat_kv(k, v, heads: int) -> tuple:
    """K and V repeated along dim 1 to ``heads`` heads, query head h reading key/value head h // (heads / Hkv): what
    a grouped-query model fed the kernels before they took grouped K and V. K and V of ``heads`` heads: as they are."""
    group = heads // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def flex_block_mask(mask_t, seq: int):
    """FlexAttention's BlockMask of the boolean ``[Bm, Hm, S, S]`` mask's first (batch, head) group, shared by every
    batch and head (the masks with baselines are shared)."""
    from torch.nn.attention.flex_attention import create_block_mask

    dense_mask = mask_t[0, 0]

    def mask_mod(b, h, q_idx, kv_idx):
        return dense_mask[q_idx, kv_idx]

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device="cuda")


class Runner:
    """Holds loaded modules, compiled baselines and the results of one ``run``."""

    def __init__(self, out: Path, json_path: Path | None, budget_s: float):
        import torch
        import tvm
        from stof_tvm.cuda_runtime import ensure_cuda_runtime

        if not ensure_cuda_runtime():
            raise RuntimeError("TVM's CUDA runtime could not be loaded")
        self.cubins = bl.PrebuiltCubins(out)   # TVM's CUDA compile of a loaded module answered from out/
        torch._dynamo.config.cache_size_limit = 1024
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        self.torch, self.tvm = torch, tvm
        self.out, self.json_path, self.deadline = out, json_path, time.time() + budget_s
        self.manifest = json.loads((out / "manifest.json").read_text())
        self.loaded, self.results, self.baselines, self.masks = {}, [], {}, {}
        self.interleaved: dict[str, dict] = {}    # group -> label -> call (checked time cases with ``interleave``)
        self.load_seconds = 0.0
        from torch.nn.attention.flex_attention import flex_attention
        self.flex = torch.compile(flex_attention, dynamic=False)


    # -- helpers ---------------------------------------------------------------------------------------
    def kernel(self, key: str):
        if key not in self.loaded:
            t0 = time.time()
            info = self.manifest["modules"][key]
            mod = self.tvm.runtime.load_module(str(self.out / info["library"]))
            name = info.get("symbol") or ("blockwise_attention" if key.startswith("block") else "rowwise_attention")
            self.loaded[key] = mod[name]
            self.load_seconds += time.time() - t0
        return self.loaded[key]

    def to_tvm(self, tensor, offset_bytes: int = 0):
        """``tensor`` shared with TVM, never copied; a view into a larger allocation (``qkv_offset``) goes as TVM
        passes its own views (aligned pointer + byte offset, :func:`stof_tvm.torch_views.tvm_tensor`), at the
        offsets the kernel's Q/K/V buffers take (``offset_bytes``)."""
        from stof_tvm.torch_views import tvm_tensor

        shared, owner = tvm_tensor(tensor, offset_bytes)
        if owner is not tensor:
            raise RuntimeError(f"a {tuple(tensor.shape)} operand at {tensor.data_ptr() % 64} bytes past 64 would be "
                               "copied: the case would not test what it names")
        return shared

    def reference(self, q, k, v, mask_t, scale):
        """float32 attention on the GPU, one (batch) at a time; rows with no kept key give 0. Grouped K and V (fewer
        heads than Q) are repeated to every query head first."""
        torch = self.torch
        k, v = repeat_kv(k, v, q.shape[1])
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for b in range(q.shape[0]):
            m = mask_t[b if mask_t.shape[0] > 1 else 0]
            for h0 in range(0, q.shape[1], 4):
                hs = slice(h0, h0 + 4)
                s = torch.matmul(q[b, hs].float(), k[b, hs].float().transpose(-1, -2)) * scale
                mh = m[hs] if m.shape[0] > 1 else m
                s = s.masked_fill(~mh, float("-inf"))
                p = torch.softmax(s, dim=-1).nan_to_num(0.0)
                out[b, hs] = torch.matmul(p, v[b, hs].float())
        return out

    @staticmethod
    def rel_err(x, ref) -> float:
        x = x.float()
        if not bool(x.isfinite().all()):
            return float("inf")
        return float((x - ref).norm() / ref.norm().clamp_min(1e-30))

    def bench(self, fn) -> float:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))

    # -- one case --------------------------------------------------------------------------------------
    def run_case(self, case: dict) -> dict:
        torch = self.torch
        B, H, S, D, dtype = case["batch"], case["heads"], case["seq"], case["head_dim"], case["dtype"]
        tdt = getattr(torch, dtype)
        mask_key = (case["mask"], B, H, S, case["seed"])
        if mask_key not in self.masks:                   # masks and formats are reused across configurations
            self.masks = {mask_key: (build_mask(case["mask"], B, H, S, case["seed"]), {})}
        mask4, formats = self.masks[mask_key]
        pad_inputs, keep4 = [], mask4          # keep4: what the kernel must keep (the mask AND the key padding)
        if case.get("padding"):
            keep = padding_mask(B, S, case.get("pad_keep", "mixed"))
            dev = self.tvm.cuda(0)      # TVM tensors: no torch uint32 on the way
            pad_inputs = [self.tvm.runtime.tensor(a, dev) for a in key_padding_inputs(keep)]
            keep4 = mask4 & keep[:, None, None, :]
        kept = int(keep4.sum(dtype=np.int64)) * (B // keep4.shape[0]) * (H // keep4.shape[1])
        flops = 4.0 * kept * D
        gen = torch.Generator(device="cuda").manual_seed(1234 + len(self.results))
        shapes = [(B, H, S, D)] + [(B, case.get("kv_heads") or H, S, D)] * 2      # grouped K and V: Hkv heads
        if case.get("qkv_offset") is not None:
            # Q, K, V as views into one packed projection that starts qkv_offset elements into its allocation
            sizes = [math.prod(shape) for shape in shapes]
            starts = np.cumsum([case["qkv_offset"]] + sizes).tolist()
            packed = torch.randn((starts[-1],), generator=gen, device="cuda", dtype=tdt)
            q, k, v = (packed[starts[i]:starts[i + 1]].view(shapes[i]) for i in range(3))
            q.mul_(case.get("q_scale", 1.0))
        else:
            q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=tdt) for shape in shapes)
            if case.get("q_scale", 1.0) != 1.0:       # larger scores: running maxima keep rising along a row
                q = q * case["q_scale"]
        out = torch.full_like(q, float("nan"))
        parts = {}
        if case["family"] == "split":
            call, parts = self.split_call(case, mask4, formats, q, k, v, out)
        else:
            # the wgmma kernel's tiles: 64 query rows per consumer warpgroup (config field 5, default 2) x block_n
            fmt_key = _wgmma_tile(case["config"]) if case["family"] == "wgmma" else \
                "row" if case["family"] == "row" else tuple(case["config"][:2])
            if fmt_key not in formats:
                fmt = row_arrays(mask4) if fmt_key == "row" else tiled_arrays(mask4, *fmt_key)
                formats[fmt_key] = [torch.from_numpy(a).cuda() for a in fmt]
            fmt_t = formats[fmt_key]
            fn = self.kernel(case["module"])
            views = 0 if case["family"] == "row" else 16      # the block-wise and wgmma kernels read Q/K/V views
            args = ([self.to_tvm(t, views) for t in (q, k, v)] + [self.to_tvm(t) for t in fmt_t] + pad_inputs
                    + [self.to_tvm(out)])

            def call():
                fn(*args)
        call()
        torch.cuda.synchronize()
        mask_t = torch.from_numpy(np.ascontiguousarray(keep4)).cuda()
        scale = 1.0 / math.sqrt(D)
        ref = self.reference(q, k, v, mask_t, scale)
        err = self.rel_err(out, ref)
        row = dict(case, kept=kept, rel_err=err, ok=err <= TOLERANCE[dtype])
        if case.get("replays"):
            row.update(self.replays(fn, args, (q, k, v), out, mask_t, scale, case.get("q_scale", 1.0)))
            row["ok"] = row["ok"] and max(row["fresh_rel_err"], row["graph_rel_err"]) <= TOLERANCE[dtype]
        if case["kind"] == "time":
            ms = self.bench(call)
            out.fill_(float("nan"))          # the timed runs must have rewritten every element, too
            call()
            torch.cuda.synchronize()
            row["rel_err_after_timing"] = self.rel_err(out, ref)
            row["ok"] = row["ok"] and row["rel_err_after_timing"] <= TOLERANCE[dtype]
            row.update(ms=ms, tflops=flops / ms / 1e9)
            if parts:
                row["parts_ms"] = {name: self.bench(part) for name, part in parts.items()}
            if case.get("kv_heads"):      # what the path before grouped K and V paid on top of its kernel
                row["repeat_kv_ms"] = self.bench(lambda: repeat_kv(k, v, H))
            baselines = self.gqa_baselines if case.get("kv_heads") else self.baselines_for
            row["baselines"] = baselines(case, q, k, v, mask_t, ref, flops) if case.get("baselines", True) else {}
            if case.get("interleave") and row["ok"]:     # kept alive (its tensors too) for time_interleaved
                self.interleaved.setdefault(case["interleave"], {})[case.get("label", case["module"])] = call
        del q, k, v, out, ref
        return row

    def split_call(self, case, mask4, formats, q, k, v, out):
        """(call, parts) of a split case (:func:`split_case`): ``call`` runs the block-wise kernel on the sparse
        rows, the gather, the wgmma kernel on the dense rows and the scatter, in that order on torch's and TVM's
        default stream; ``parts``: each piece alone, timed apart (``parts_ms``)."""
        torch = self.torch
        B, H, S, D = case["batch"], case["heads"], case["seq"], case["head_dim"]
        block_tile, dense_tile = tuple(case["config"][:2]), _wgmma_tile(case["dense_config"])
        key = ("split", block_tile, dense_tile)
        if key not in formats:
            block_fmt, row_ids, dense_fmt = split_arrays(mask4, block_tile, dense_tile)
            ids = np.broadcast_to(row_ids, (B, H, row_ids.shape[2]))
            base = (np.arange(B * H, dtype=np.int64) * S).reshape(B, H, 1)
            valid = (ids >= 0).reshape(-1)
            gather = (np.where(ids >= 0, ids, 0) + base).reshape(-1)     # a pad slot reads its head's row 0
            formats[key] = ([torch.from_numpy(a).cuda() for a in block_fmt],
                            [torch.from_numpy(a).cuda() for a in dense_fmt], torch.from_numpy(gather).cuda(),
                            None if valid.all() else torch.from_numpy(np.flatnonzero(valid)).cuda(),
                            torch.from_numpy(gather[valid]).cuda(), row_ids.shape[2])
        block_fmt, dense_fmt, gather, slots, rows, count = formats[key]
        if count != case["dense_rows"]:
            raise RuntimeError(f"the mask has {count} packed dense rows, the module was built for "
                               f"{case['dense_rows']}")
        q_packed = torch.empty((B, H, count, D), dtype=q.dtype, device=q.device)
        out_packed = torch.empty_like(q_packed)
        block_fn, dense_fn = self.kernel(case["module"]), self.kernel(case["dense_module"])
        block_args = [self.to_tvm(t, 16) for t in (q, k, v)] + [self.to_tvm(t) for t in block_fmt] + [self.to_tvm(out)]
        dense_args = ([self.to_tvm(t, 16) for t in (q_packed, k, v)] + [self.to_tvm(t) for t in dense_fmt]
                      + [self.to_tvm(out_packed)])
        flat_q, flat_out = q.view(-1, D), out.view(-1, D)
        packed_q, packed_out = q_packed.view(-1, D), out_packed.view(-1, D)

        def dense():
            torch.index_select(flat_q, 0, gather, out=packed_q)
            dense_fn(*dense_args)
            flat_out.index_copy_(0, rows, packed_out if slots is None else packed_out.index_select(0, slots))

        def call():
            block_fn(*block_args)
            dense()

        return call, {"sparse_rows_block": lambda: block_fn(*block_args), "dense_rows_wgmma": lambda:
                      dense_fn(*dense_args), "dense_rows_with_gather_scatter": dense}

    def replays(self, fn, args, qkv, out, mask_t, scale, q_scale) -> dict:
        """The module called again on fresh Q/K/V and output at new addresses (the maps are encoded from each
        call's pointers), then the first call's buffers captured in a torch CUDA graph (launched on torch's
        stream), new values written into them, the output poisoned and the graph replayed (the maps captured
        with the graph must read the new values): both against float32 on their inputs."""
        import tvm_ffi
        torch = self.torch

        def fresh_like(t, factor):
            return torch.randn(t.shape, device=t.device, dtype=t.dtype) * factor

        new = [fresh_like(t, q_scale if i == 0 else 1.0) for i, t in enumerate(qkv)]
        new_out = torch.full_like(out, float("nan"))
        fn(*[self.to_tvm(t, 16) for t in new], *args[3:-1], self.to_tvm(new_out))
        torch.cuda.synchronize()
        fresh = self.rel_err(new_out, self.reference(*new, mask_t, scale))

        def call():
            with tvm_ffi.use_torch_stream():
                fn(*args)

        replay, _ = bl.graphed(call)
        for i, t in enumerate(qkv):
            t.copy_(fresh_like(t, q_scale if i == 0 else 1.0))
        out.fill_(float("nan"))
        replay()
        torch.cuda.synchronize()
        return {"fresh_rel_err": fresh, "graph_rel_err": self.rel_err(out, self.reference(*qkv, mask_t, scale))}

    def baselines_for(self, case, q, k, v, mask_t, ref, flops) -> dict:
        key = (case["mask"], case["batch"], case["seq"], case["head_dim"], case["dtype"])
        if key in self.baselines:
            return self.baselines[key]
        import torch.nn.functional as F

        dense_mask = mask_t[0, 0]
        result = {}
        block_mask = flex_block_mask(mask_t, case["seq"])
        candidates = {
            "flex": (lambda: self.flex(q, k, v, block_mask=block_mask), True),
            "sdpa_mask": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask), True),
            "sdpa_causal": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                            case["mask"] == "causal"),
            "sdpa_dense": (lambda: F.scaled_dot_product_attention(q, k, v), case["mask"] == "dense"),
        }
        shape_key = key[1:]
        for name, (fn, exact) in candidates.items():
            try:
                err = self.rel_err(fn(), ref) if exact else None
                if name in ("sdpa_causal", "sdpa_dense") and (name, shape_key) in self.baselines:
                    ms = self.baselines[(name, shape_key)]          # mask-independent: timed once per shape
                else:
                    ms = self.baselines[(name, shape_key)] = self.bench(fn)
                result[name] = {"ms": ms, "tflops": flops / ms / 1e9, "exact": exact, "rel_err": err}
            except Exception as exc:  # a baseline that cannot run this shape is reported, not fatal
                result[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        self.baselines[key] = result
        return result

    def gqa_baselines(self, case, q, k, v, mask_t, ref, flops) -> dict:
        """The baselines of a grouped-query case, each on the grouped K and V (``enable_gqa``): FlexAttention with
        the mask's BlockMask (``flex_gqa``) and SDPA (``sdpa_gqa``) with the causal flag where the mask keeps no key
        past its query, else dense (a boolean mask would leave SDPA's fused kernels). SDPA's form is the mask's
        function only when the mask is all of it (checked then, ``exact``); otherwise it is the speed of ignoring
        the sparsity (``form`` says which)."""
        import torch.nn.functional as F

        dense_mask = mask_t[0, 0]
        lower = self.torch.ones_like(dense_mask).tril()
        causal = not bool((dense_mask & ~lower).any())
        sdpa_exact = bool((dense_mask == lower).all()) if causal else bool(dense_mask.all())
        block_mask = flex_block_mask(mask_t, case["seq"])
        candidates = {
            "flex_gqa": (lambda: self.flex(q, k, v, block_mask=block_mask, enable_gqa=True), True, "mask"),
            "sdpa_gqa": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                         sdpa_exact, "causal" if causal else "dense"),
        }
        result = {}
        for name, (fn, exact, form) in candidates.items():
            try:
                err = self.rel_err(fn(), ref) if exact else None
                ms = self.bench(fn)
                result[name] = {"ms": ms, "tflops": flops / ms / 1e9, "exact": exact, "rel_err": err, "form": form}
            except Exception as exc:  # a baseline that cannot run this shape is reported, not fatal
                result[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        return result

    def save(self, extra: dict) -> None:
        if self.json_path:
            self.json_path.write_text(json.dumps({"results": self.results, **extra}, indent=1))


def _wgmma_tile(config) -> tuple:
    """(block_m, block_n) of a wgmma configuration tuple: 64 query rows per consumer (field 5, default 2)."""
    return 64 * (config[4] if len(config) > 4 else 2), config[0]


def sass_summary(out: Path, manifest: dict) -> dict:
    """HMMA / local-memory instruction counts per kernel configuration (cuobjdump on the GPU machine)."""
    summary = {}
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    for key, info in manifest["sass"].items():
        proc = subprocess.run([tool, "-sass", str(out / info["cubin"])], capture_output=True, text=True)
        text = proc.stdout
        summary[key] = dict(info, HMMA=text.count("HMMA"), HGMMA=text.count("HGMMA"), LDL=text.count("LDL"),
                            STL=text.count("STL"),
                            LDSM=text.count("LDSM"), LDGSTS=text.count("LDGSTS"), MUFU_EX2=text.count("MUFU.EX2"),
                            UTMALDG=text.count("UTMALDG"), MEMBAR=text.count("MEMBAR"))
    return summary


def print_details(timed: list[dict]) -> None:
    print("\nper kernel configuration (block cfg = block_m x block_n x warps x stages x heavy_first):")
    print(f"{'mask':<10} {'B':>2} {'S':>5} {'D':>4}  kernel cfg                       ms  TFLOP/s  check")
    for r in timed:
        cfg = "x".join(str(x)[0] if isinstance(x, bool) else str(x) for x in r["config"]) if r["config"] else "-"
        print(f"{r['mask']:<10} {r['batch']:>2} {r['seq']:>5} {r['head_dim']:>4}  {r['family']:<5} {cfg:<20} "
              f"{r['ms']:9.4f} {r['tflops']:8.1f}  {'ok' if r['ok'] else 'FAIL'} {r['rel_err']:.1e}"
              + (f"  ({r['variant']})" if r.get("variant") else "")
              + (f"  (K, V of {r['kv_heads']} heads)" if r.get("kv_heads") else ""))


def print_variants(timed: list[dict]) -> None:
    """Cases built from another source tree (``variant``) beside the same configuration built from this one."""
    plain = {(r["mask"], r["batch"], r["seq"], r["head_dim"], str(r["config"])): r for r in timed
             if not r.get("variant")}
    pairs = [(r, plain.get((r["mask"], r["batch"], r["seq"], r["head_dim"], str(r["config"])))) for r in timed
             if r.get("variant")]
    if not pairs:
        return
    print("\nthis tree vs the variant builds (ms; ratio = this / variant; block cfg as above)")
    for old, new in pairs:
        cfg = "x".join(str(x)[0] if isinstance(x, bool) else str(x) for x in old["config"])
        ratio = f"{new['ms'] / old['ms']:.3f}" if new else "-"
        print(f"  {old['mask']:<10} B{old['batch']} S{old['seq']} D{old['head_dim']} {cfg:<18} {old['variant']} "
              f"{old['ms']:.4f}  this {new['ms'] if new else float('nan'):.4f}  ratio {ratio}"
              + ("" if old["ok"] and (new is None or new["ok"]) else "  CHECK FAILED"))


def print_row_sums(timed: list[dict]) -> None:
    """Block cases of plan s9sparse: per mask, shape and configuration, the row sums of P on the tensor cores
    (``mma``) and by float adds (``fadd``) in this tree, beside the mma form built from the tree before its skip
    vote and key-tile prefetch (``head``) and with the vote only (``vote``); fastest first per mask and shape (a
    failed check counts as NaN)."""
    rows = {}
    for r in timed:
        if r["family"] != "block" or not (len(r["config"]) == 9 or r.get("variant") in ("head", "vote")):
            continue
        config = list(r["config"]) + [1, 1, 0, "mma"][len(r["config"]) - 5:]
        form = r.get("variant") or config[8]
        cfg = "x".join(str(x)[0] if isinstance(x, bool) else str(x) for x in config[:8])
        key = (r["mask"], f"{r['batch']},{r['heads']},{r['seq']},{r['head_dim']}", cfg)
        rows.setdefault(key, {})[form] = r["ms"] if r["ok"] else float("nan")
    if not rows:
        return

    def fastest(forms):        # (ms, form) of the fastest form that passed its check
        return min(((ms, form) for form, ms in forms.items() if ms == ms), default=(math.inf, "-"))

    def ratio(forms, a, b):
        return f"{forms[a] / forms[b]:.3f}" if a in forms and b in forms else "-"

    print("\nrow sums of P: tensor cores (mma) vs float adds (fadd), this tree; head = mma before the one-load vote"
          " and the key-tile prefetch, vote = with the vote only (ms; cfg BMxBNxwarpsxstagesxheavyxsplitsxrowsx"
          "min_blocks)")
    print(f"  {'mask':<10} {'B,H,S,D':<16} {'cfg':<22} {'head':>7} {'vote':>7} {'mma':>7} {'fadd':>7}  best   "
          "fadd/mma mma/head")
    for key, forms in sorted(rows.items(), key=lambda item: (item[0][:2], fastest(item[1]))):
        cells = " ".join(f"{forms[f]:7.4f}" if f in forms else f"{'-':>7}" for f in ("head", "vote", "mma", "fadd"))
        print(f"  {key[0]:<10} {key[1]:<16} {key[2]:<22} {cells}  {fastest(forms)[1]:<6} "
              f"{ratio(forms, 'fadd', 'mma'):>8} {ratio(forms, 'mma', 'head'):>8}")


def print_loads(timed: list[dict]) -> None:
    """wgmma cases timed with both loads (config field 6): TMA beside cp.async, same mask, shape and knobs."""
    by_key = {(r["mask"], r["batch"], r["seq"], r["head_dim"], str(r["config"][:5]), r["config"][5]): r
              for r in timed if r["family"] == "wgmma" and len(r["config"]) == 6 and not r.get("padding")
              and not r.get("repeat")}
    pairs = [(r, by_key.get(key[:5] + ("cp.async",))) for key, r in by_key.items() if key[5] == "tma"]
    if not pairs:
        return
    print("\nTMA vs cp.async loads (ms; ratio = tma / cp.async; cfg = block_n x stages x pingpong x persistent x "
          "consumers)")
    for tma, cp in pairs:
        cfg = "x".join(str(x)[0] if isinstance(x, bool) else str(x) for x in tma["config"][:5])
        sdpa = tma["baselines"].get("sdpa_causal" if tma["mask"] == "causal" else "sdpa_dense", {}).get("ms")
        print(f"  {tma['mask']:<7} B{tma['batch']} S{tma['seq']} D{tma['head_dim']} {cfg:<14} "
              f"cp.async {cp['ms'] if cp else float('nan'):.4f}  tma {tma['ms']:.4f}  "
              f"ratio {tma['ms'] / cp['ms'] if cp else float('nan'):.3f}  sdpa {sdpa or float('nan'):.4f}"
              + ("" if tma["ok"] and (cp is None or cp["ok"]) else "  CHECK FAILED"))


def print_candidates(timed: list[dict]) -> None:
    """Plan s9attn's last table: per mask, head dim and padding every wgmma configuration timed, fastest first,
    against the cp.async one of the group (its first timing) and SDPA (causal flag / dense); ``again``: a second
    timing at the end of the run."""
    groups = {}
    for r in timed:
        if r["family"] == "wgmma" and len(r["config"]) in (6, 7):       # 7: with pad_panels (plan s10dims)
            key = (r["mask"] + (" +pad" if r.get("padding") else ""), r["batch"], r["seq"], r["head_dim"])
            groups.setdefault(key, []).append(r)
    if not groups:
        return
    print("\nwgmma configurations, fastest first (ms; cfg = block_n x stages x pingpong x persistent x consumers x "
          "loads; x cp.async = the group's cp.async ms / ms; x SDPA = SDPA causal/dense ms / ms)")
    for (mask, batch, seq, head_dim), rs in groups.items():
        cp = next((r for r in rs if r["config"][5] == "cp.async" and not r.get("repeat")), None)
        sdpa = rs[0]["baselines"].get("sdpa_dense" if mask == "dense" else "sdpa_causal", {}).get("ms", float("nan"))
        print(f"  {mask} B{batch} S{seq} D{head_dim} (SDPA {sdpa:.4f})")
        for r in sorted(rs, key=lambda r: r["ms"]):
            cfg = "x".join(str(x)[0] if isinstance(x, bool) else str(x) for x in r["config"])
            print(f"    {cfg:<22} {r['ms']:.4f}  x cp.async {cp['ms'] / r['ms'] if cp else float('nan'):.3f}  "
                  f"x SDPA {sdpa / r['ms']:.3f}" + ("  again" if r.get("repeat") else "")
                  + ("" if r["ok"] else "  CHECK FAILED"))


def print_model(timed: list[dict]) -> None:
    """Cases that carry the model's prediction (plan s8wgmma): measured beside predicted, wgmma beside mma.sync."""
    rows = [r for r in timed if "predicted_ms" in r]
    if not rows:
        return
    print("\nwgmma vs mma.sync block-wise, measured and as the model predicts (ms; cfg as above; "
          "ratio = measured / predicted)")
    for r in rows:
        cfg = "x".join(str(x)[0] if isinstance(x, bool) else str(x) for x in r["config"])
        mask = r["mask"] + (" +pad" if r.get("padding") else "")
        print(f"  {mask:<10} B{r['batch']:<2} S{r['seq']:<5} D{r['head_dim']:<3} {r['family']:<5} {cfg:<18} "
              f"measured {r['ms']:.4f}  predicted {r['predicted_ms']:.4f}  ratio {r['ms'] / r['predicted_ms']:.2f}"
              + ("" if r["ok"] else "  CHECK FAILED"))
    picks = {(r["mask"], r["batch"], r["seq"], r["head_dim"], bool(r.get("padding"))): r["model_pick"] for r in rows}
    for (mask, batch, seq, head_dim, padded), pick in picks.items():
        group = [r for r in rows if r["ok"] and (r["mask"], r["batch"], r["seq"], r["head_dim"],
                                                 bool(r.get("padding"))) == (mask, batch, seq, head_dim, padded)]
        best = {fam: min([r["ms"] for r in group if r["family"] == fam] or [float("nan")]) for fam in
                ("wgmma", "block")}
        print(f"  {mask + (' +pad' if padded else ''):<10} B{batch} S{seq} D{head_dim}: wgmma {best['wgmma']:.4f} "
              f"block {best['block']:.4f} "
              f"(wgmma / block {best['wgmma'] / best['block']:.2f}); the model picks {pick.split(' (')[0]}")


def print_split(timed: list[dict]) -> None:
    """The dense-row split beside the block-wise kernel alone on the whole mask: per mask the fastest checked
    block-wise case, then every split case with its parts timed apart (ms)."""
    rows = [r for r in timed if r["family"] == "split"]
    if not rows:
        return
    print("\ndense-row split (block-wise on the sparse rows, then gather + wgmma on the dense rows + scatter), ms; "
          "block cfg as above, wgmma cfg = block_n x stages x pingpong x persistent x consumers x loads:")
    for mask in dict.fromkeys(r["mask"] for r in rows):
        block = [r for r in timed if r["mask"] == mask and r["family"] == "block" and r["ok"]
                 and (r["batch"], r["seq"]) == (rows[0]["batch"], rows[0]["seq"])]
        best = min(block, key=lambda r: r["ms"]) if block else None
        print(f"  {mask}: block-wise alone {best['ms']:.4f} ({_cfg_text(best['config'])})" if best else
              f"  {mask}: no block-wise case")
        for r in (r for r in rows if r["mask"] == mask):
            p = r.get("parts_ms", {})
            print(f"    split {_cfg_text(r['config']):<14} + {_cfg_text(r['dense_config']):<22} G={r['dense_rows']:<3} "
                  f"{r['ms']:.4f}  sparse rows {p.get('sparse_rows_block', float('nan')):.4f}  dense wgmma "
                  f"{p.get('dense_rows_wgmma', float('nan')):.4f}  dense + gather/scatter "
                  f"{p.get('dense_rows_with_gather_scatter', float('nan')):.4f}"
                  + (f"  vs alone {best['ms'] / r['ms']:.2f}x" if best else "") + ("" if r["ok"] else "  CHECK FAILED"))


def print_reverse(timed: list[dict]) -> None:
    """Block cases with ``reverse_full`` (config field 10) beside the same configuration without it (ms)."""
    plain = {(r["mask"], r["batch"], r["seq"], r["head_dim"], _cfg_text(r["config"])): r for r in timed
             if r["family"] == "block" and not (len(r["config"]) > 9 and r["config"][9])}
    pairs = [(r, plain.get((r["mask"], r["batch"], r["seq"], r["head_dim"],
                            _cfg_text(_trimmed(r["config"][:9]))))) for r in timed
             if r["family"] == "block" and len(r["config"]) > 9 and r["config"][9]]
    if not pairs:
        return
    print("\nreverse_full (full tiles walked last column first) vs the same configuration walked first column first "
          "(ms; ratio = reversed / plain)")
    for rev, base in pairs:
        ratio = f"{rev['ms'] / base['ms']:.3f}" if base else "-"
        print(f"  {rev['mask']:<10} B{rev['batch']} S{rev['seq']} {_cfg_text(_trimmed(rev['config'][:9])):<26} "
              f"plain {base['ms'] if base else float('nan'):.4f}  reversed {rev['ms']:.4f}  ratio {ratio}"
              + ("" if rev["ok"] and (base is None or base["ok"]) else "  CHECK FAILED"))


def _trimmed(config) -> list:
    """A block configuration tuple without its trailing default fields (as the plans write them)."""
    defaults = (None, None, None, None, None, 1, 1, 0, "mma", False)
    config = list(config)
    while len(config) > 5 and config[-1] == defaults[len(config) - 1]:
        config.pop()
    return config


def _cfg_text(config) -> str:
    return "x".join(str(x)[0] if isinstance(x, bool) else str(x) for x in config)


def print_checks(results: list[dict]) -> None:
    bad = [r for r in results if not r["ok"]]
    errs = {dt: max([r["rel_err"] for r in results if r["dtype"] == dt] or [0.0]) for dt in TOLERANCE}
    print(f"\ncorrectness: {len(results) - len(bad)}/{len(results)} runs of our kernels within tolerance "
          f"({sum(r['kind'] == 'check' for r in results)} check cases, {sum(r['kind'] == 'time' for r in results)} "
          f"timed cases, outputs poisoned with NaN first); max rel err fp16 {errs['float16']:.2e}, "
          f"bf16 {errs['bfloat16']:.2e}")
    for r in bad:
        print(f"  FAIL {r['kind']} {r['family']} {r['mask']} B{r['batch']} H{r['heads']} S{r['seq']} "
              f"D{r['head_dim']} {r['dtype']} cfg={r['config']}: rel err {r['rel_err']:.3e} {r.get('error', '')}")


def print_summary(timed: list[dict]) -> None:
    summary = summarize(timed)
    print("\nsummary: best checked configuration of ours vs baselines on the same mask (ms; TFLOP/s counts kept "
          "pairs; x = best exact baseline / ours)")
    print(f"{'mask':<10} {'B':>2} {'S':>5} {'D':>4} {'block':>8} {'cfg':<16} {'TFLOP/s':>7} {'row':>8} {'flex':>8} "
          f"{'sdpaMask':>8} {'sdpaCaus':>8} {'sdpaDens':>8}  {'speedup':>7}")
    for row in summary:
        def f(x):
            return f"{x:8.3f}" if x == x else "       -"
        print(f"{row['mask']:<10} {row['batch']:>2} {row['seq']:>5} {row['head_dim']:>4} {f(row['block_ms'])} "
              f"{row['block_cfg']:<16} {row['block_tflops']:7.1f} {f(row['row_ms'])} {f(row['flex'])} "
              f"{f(row['sdpa_mask'])} {f(row['sdpa_causal'])} {f(row['sdpa_dense'])}  {row['speedup']:6.2f}x"
              + ("" if row["all_ok"] else "  CHECK FAILED"))


def summarize(timed: list[dict]) -> list[dict]:
    """One row per (mask, B, S, D): our best checked block-wise configuration (mma.sync or, prefixed ``w``,
    wgmma, or ``s``, the dense-row split: its block-wise configuration), the row-wise kernel, the baselines."""
    groups = {}
    for r in timed:       # device-padded cases (a per-batch attention mask on top) are rows of their own
        groups.setdefault((r["mask"] + (" +" + _pad_label(r) if r.get("padding") else ""), r["batch"], r["seq"],
                           r["head_dim"]), []).append(r)
    rows = []
    nan = float("nan")
    for (mask, batch, seq, head_dim), rs in groups.items():
        blocks = [r for r in rs if r["family"] in ("block", "wgmma", "split") and r["ok"] and not r.get("variant")]
        rows_k = [r for r in rs if r["family"] == "row" and r["ok"]]
        best = min(blocks, key=lambda r: r["ms"]) if blocks else None
        base = next((r["baselines"] for r in rs if r["baselines"]), {})
        exact = [b["ms"] for b in base.values() if b.get("exact") and "ms" in b]
        ours = min([r["ms"] for r in blocks + rows_k] or [nan])
        rows.append({
            "mask": mask, "batch": batch, "seq": seq, "head_dim": head_dim,
            "block_ms": best["ms"] if best else nan,
            "block_cfg": {"wgmma": "w", "split": "s"}.get(best["family"], "")
            + "x".join(str(x)[0] if isinstance(x, bool) else str(x) for x in best["config"]) if best else "-",
            "block_tflops": best["tflops"] if best else nan,
            "row_ms": rows_k[0]["ms"] if rows_k else nan,
            **{name: base.get(name, {}).get("ms", nan) for name in ("flex", "sdpa_mask", "sdpa_causal",
                                                                     "sdpa_dense")},
            "best_exact_baseline_ms": min(exact) if exact else nan,
            "speedup": (min(exact) / ours) if exact and ours == ours else nan,
            "all_ok": all(r["ok"] for r in rs)})
    return rows


def _pad_label(row: dict) -> str:
    """``pad`` for the mixed key padding patterns, ``pad:ones`` / ``pad:right`` for the others."""
    keep = row.get("pad_keep", "mixed")
    return "pad" if keep == "mixed" else f"pad:{keep}"


def print_labelled(timed: list[dict]) -> None:
    """Every timed case that carries a ``label`` (plans that compare named configurations: s12bb), in plan order:
    the label, the key padding (none, or its pattern), ms and the check; printed last."""
    rows = [r for r in timed if r.get("label")]
    if not rows:
        return
    print("\nlabelled cases (ms; padding: the module applies a per-batch attention mask of that pattern)")
    print(f"{'mask':<15} {'B':>2} {'S':>5} {'padding':<10} {'configuration':<44} {'ms':>7}  check")
    for r in rows:
        pad = _pad_label(r) if r.get("padding") else "none"
        print(f"{r['mask']:<15} {r['batch']:>2} {r['seq']:>5} {pad:<10} {r['label'][:44]:<44} {r['ms']:7.4f}  "
              + (f"ok {r['rel_err']:.1e}" if r["ok"] else f"FAILED {r['rel_err']:.1e}"))


def _gqa_pick(row: dict | None) -> str:
    """The kernel and configuration of a grouped-query plan's case, short (``-``: the case did not run)."""
    if row is None:
        return "-"
    return row["family"] + (" " + _cfg_text(row["config"]) if row["config"] else "")


def gqa_rows(timed: list[dict]) -> list[dict]:
    """One row per grouped case (``gqa_form``, plan s37gqa) beside the repeated case of its problem: each form's
    kernel pick and ms, the repeat's copy of K and V, the GQA baselines (SDPA's form: causal or dense, and whether
    it is the mask's function), ``x_best_baseline`` = grouped ms / the fastest exact baseline's (< 1: ours
    faster) and the grouped kernel's largest error against float32 (before and after timing)."""
    nan = float("nan")
    repeated = {(r["mask"], r["batch"], r["heads"], r["seq"], r["head_dim"]): r for r in timed
                if r.get("gqa_form") == "repeated"}
    rows = []
    for r in (r for r in timed if r.get("gqa_form") == "grouped"):
        rep = repeated.get((r["mask"], r["batch"], r["heads"], r["seq"], r["head_dim"]))
        base = r["baselines"]
        exact = [b["ms"] for b in base.values() if b.get("exact") and "ms" in b]
        sdpa = base.get("sdpa_gqa", {})
        rows.append({
            "mask": r["mask"], "shape": f"B{r['batch']} H{r['heads']}/{r['kv_heads']} S{r['seq']} D{r['head_dim']}",
            "pick_grouped": _gqa_pick(r), "pick_repeated": _gqa_pick(rep),
            "grouped_ms": r["ms"], "repeated_ms": rep["ms"] if rep else nan, "repeat_copy_ms": r["repeat_kv_ms"],
            "sdpa_gqa_ms": sdpa.get("ms", nan), "sdpa_gqa_form": sdpa.get("form", "-"),
            "sdpa_gqa_exact": bool(sdpa.get("exact")),
            "flex_gqa_ms": base.get("flex_gqa", {}).get("ms", nan),
            "x_best_baseline": r["ms"] / min(exact) if exact else nan,
            "max_rel_err": max(r["rel_err"], r["rel_err_after_timing"]),
            "repeated_rel_err": max(rep["rel_err"], rep["rel_err_after_timing"]) if rep else nan,
            "all_ok": r["ok"] and (rep is None or rep["ok"])})
    return rows


def print_gqa(rows: list[dict]) -> None:
    """The table of :func:`gqa_rows` (ms; the repeated form's kernel on K and V of every head, its copy apart)."""
    if not rows:
        return
    print("\ngrouped-query attention: our kernel on grouped K and V vs on K and V repeated to every head (ms; copy = "
          "repeat_interleave of K and V; SDPA with enable_gqa and the causal flag or dense, * = not the mask's "
          "function; x best = grouped / the fastest exact baseline; err = the grouped kernel's max rel err)")
    print(f"{'mask':<15} {'shape':<22} {'pick grouped':<24} {'pick repeated':<24} {'grouped':>8} {'repeated':>8} "
          f"{'copy':>7} {'SDPA gqa':>15} {'Flex gqa':>8} {'x best':>6}  err")
    for row in rows:
        sdpa = f"{row['sdpa_gqa_ms']:.4f} {row['sdpa_gqa_form']}" + (" " if row["sdpa_gqa_exact"] else "*")
        print(f"{row['mask']:<15} {row['shape']:<22} {row['pick_grouped']:<24} {row['pick_repeated']:<24} "
              f"{row['grouped_ms']:8.4f} {row['repeated_ms']:8.4f} {row['repeat_copy_ms']:7.4f} {sdpa:>15} "
              f"{row['flex_gqa_ms']:8.4f} {row['x_best_baseline']:6.3f}  {row['max_rel_err']:.1e}"
              + ("" if row["all_ok"] else "  CHECK FAILED"))


def time_groups(groups: dict, time_interleaved) -> dict:
    """Time each group's calls against each other round by round (``benchlib.time_interleaved``: the GPU's clock and
    temperature drift reaches every call alike; the same module timed one case after another has measured up to 5%
    apart) and print each call's median, its range and its ratio to the group's first call (> 1 = slower)."""
    results = {}
    print("\ninterleaved groups (ms per call: median over rounds [min - max]; x first = median / the first's)")
    for group, calls in groups.items():
        timing = time_interleaved({label: (call, None) for label, call in calls.items()}, rounds=40, sample_ms=20.0)
        first = next(iter(timing.values())).median_ms
        results[group] = {label: dict(t.as_dict(), x_first=t.median_ms / first) for label, t in timing.items()}
        for label, t in timing.items():
            print(f"  {group:<14} {label:<24} {t.median_ms:8.4f} [{t.min_ms:.4f} - {t.max_ms:.4f}]  "
                  f"x first {t.median_ms / first:.3f}")
    return results


def _config_key(case: dict) -> tuple:
    """A case's kernel configuration (a split case's: both kernels'), for --skip-failed-in."""
    return (case["family"], case["head_dim"], str(case["config"])) + \
        ((str(case["dense_config"]),) if case.get("dense_config") else ()) + \
        ((case["kv_heads"],) if case.get("kv_heads") else ())


def failed_configs(earlier: dict) -> set:
    """Kernel configurations (:func:`_config_key`) not to time after an earlier run (its JSON): those that failed a
    check there, and the one it was running when it was killed (``in_flight``: a kernel that hung, stopped by the
    caller's timeout, so that the timing run does not hang on it again)."""
    failed = {_config_key(r) for r in earlier["results"] if not r["ok"]}
    if earlier.get("in_flight"):
        failed.add(_config_key(earlier["in_flight"]))
    return failed


def run(args) -> None:
    out = Path(args.out)
    runner = Runner(out, Path(args.json) if args.json else None, args.budget)
    import torch
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "commit": runner.manifest.get("commit"), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        info["sass"] = sass_summary(out, runner.manifest)
    except FileNotFoundError:
        info["sass"] = "cuobjdump not found"
    cases = runner.manifest["cases"]
    if args.only:
        cases = [c for c in cases if c["kind"] in args.only.split(",")]
    if args.head_dims:
        cases = [c for c in cases if c["head_dim"] in {int(d) for d in args.head_dims.split(",")}]
    if args.masks:
        cases = [c for c in cases if c["mask"] in args.masks.split(",")]
    if args.families:
        cases = [c for c in cases if c["family"] in args.families.split(",")]
    if args.no_baselines:
        cases = [dict(c, baselines=False) for c in cases]
    if args.skip_failed_in:
        failed = failed_configs(json.loads(Path(args.skip_failed_in).read_text()))
        info["skipped_configs"] = sorted(map(list, failed))
        cases = [c for c in cases if _config_key(c) not in failed]
    skipped = 0
    for case in cases:
        if time.time() > runner.deadline:
            skipped += 1
            continue
        runner.save(dict(info, in_flight=case))       # what a killed run was doing (replaced after the case)
        try:
            t0 = time.time()
            runner.results.append(runner.run_case(case))
            r = runner.results[-1]
            print(f"{case['kind']} {case['module']} {case['mask']}: err {r['rel_err']:.1e}"
                  + (f" fresh {r['fresh_rel_err']:.1e} graph {r['graph_rel_err']:.1e}" if "graph_rel_err" in r else "")
                  + (f" {r['ms']:.3f} ms" if "ms" in r else "") + f" ({time.time() - t0:.1f} s)", flush=True)
        except Exception as exc:
            runner.results.append(dict(case, kind=case["kind"], ok=False, rel_err=float("inf"),
                                       error=f"{type(exc).__name__}: {exc}"[:400]))
            print("ERROR", case["module"], runner.results[-1]["error"], flush=True)
        info["module_load_s"] = round(runner.load_seconds, 1)
        info["cubin_hits"], info["cubin_misses"] = runner.cubins.hits, len(runner.cubins.misses)
        info["skipped_for_budget"] = skipped
        runner.save(info)
    timed = [r for r in runner.results if r["kind"] == "time" and "ms" in r]
    print_details(timed)
    if runner.interleaved:
        info["interleaved"] = time_groups(runner.interleaved, bl.time_interleaved)
        runner.save(info)
    if isinstance(info["sass"], dict):
        print("\nSASS (per kernel configuration): registers, spills, instruction counts")
        for key, s in info["sass"].items():
            print(f"  {key:<40} regs {s['registers']:>3} spill {s['spill_stores']}/{s['spill_loads']} "
                  f"stack {s['stack_frame']} HMMA {s['HMMA']} HGMMA {s.get('HGMMA', 0)} LDSM {s['LDSM']} "
                  f"LDGSTS {s['LDGSTS']} UTMALDG {s.get('UTMALDG', 0)} MEMBAR {s.get('MEMBAR', 0)} LDL {s['LDL']} "
                  f"STL {s['STL']}")
    print(f"\nmodule load {runner.load_seconds:.1f} s (prebuilt cubins used {runner.cubins.hits}, "
          f"compiled here {len(runner.cubins.misses)}); {skipped} cases skipped for the time budget; "
          f"{info['device']}, torch {info['torch']}, commit {info['commit']}")
    print_checks(runner.results)
    print_variants(timed)
    print_loads(timed)
    print_model(timed)
    print_candidates(timed)
    print_row_sums(timed)
    print_reverse(timed)
    print_split(timed)
    print_summary(timed)
    print_labelled(timed)
    info["gqa"] = gqa_rows(timed)
    print_gqa(info["gqa"])
    info["summary"] = summarize([r for r in runner.results if r["kind"] == "time" and "ms" in r])
    runner.save(info)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the plan's kernels for sm_90 (needs the TVM compiler and nvcc)")
    b.add_argument("--plan", default="check,tune", help=f"comma-separated plans from {sorted(PLANS)}")
    b.add_argument("--out", default="out/attn")
    b.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes")
    b.add_argument("--only-variant", default=None,
                   help="build only the plan's cases of this variant (e.g. base), into manifest.<variant>.json")
    b.add_argument("--source-tree", default=None,
                   help="import stof_tvm from this checkout (e.g. `git archive` of an earlier commit, with "
                        "stof_tvm/schedules and stof_tvm/sparse_formats linked to its top-level folders)")
    b.add_argument("--source-commit", default="?", help="the commit --source-tree was exported from")
    r = sub.add_parser("run", help="check and time on the GPU (needs torch, triton and the TVM runtime)")
    r.add_argument("--out", default="out/attn")
    r.add_argument("--json", default=None, help="write results here (rewritten after every case)")
    r.add_argument("--budget", type=float, default=480.0, help="seconds after which no new case starts")
    r.add_argument("--only", default=None, help="run only these case kinds (check,time)")
    r.add_argument("--head-dims", default=None, help="run only the cases of these head dims (e.g. 80,96)")
    r.add_argument("--masks", default=None, help="run only the cases of these mask recipes (e.g. causal,document)")
    r.add_argument("--families", default=None, help="run only the cases of these kernel families (block,wgmma)")
    r.add_argument("--no-baselines", action="store_true",
                   help="time our kernels alone (a profiler run: ncu --kernel-name selects one of them)")
    r.add_argument("--skip-failed-in", default=None, help="JSON of an earlier run: skip configs that failed there")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.command == "build" and args.source_tree:
        sys.path.insert(0, str(Path(args.source_tree).resolve()))
    build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
