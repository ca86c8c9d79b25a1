"""The wgmma GEMMs at BERT-Base's small-K shapes on an H200: the older knob sets against the ``block_m = 256`` and
``staged`` ones (:mod:`stof_tvm.schedules.templates.wgmma_kernel`), side by side with cuBLAS.

At K = 768 a tile's main loop is 12 steps of 64, so the per-tile costs weigh: the epilogue's 2-byte stores (one
``STG.E.U16`` per output element) and the ring refill after it. The new knob values attack both: 16-byte stores
through a per-warp shared-memory buffer (``staged``) and 256-row tiles (half the tiles, 22% fewer L2 bytes per flop
at 256 x 192 than at 128 x 256).

Two steps, because the GPU machine has no TVM compiler (same protocol as ``check_wgmma_gpu.py``):

1. ``build`` (here): per case the older knob sets (the template's first choice, the best-ranked persistent
   cooperative set and ping-pong set of each tile width) and the new ones (each older one with ``staged``, the
   best-ranked 256-row sets of width 128 and 192, direct and staged) are compiled with TVM, exported to
   ``<out>/<key>.so`` with an sm_90a cubin per source (nvcc; ptxas registers, spills and warnings in
   ``manifest.json``).
2. ``run`` (on the GPU): per case fresh random inputs, every module's output poisoned with NaN and checked against
   torch float32 (TF32 off; relative Frobenius error within 1e-2), then timed with CUDA events (median of
   ``--iters`` samples of ``--reps`` back-to-back calls, after warm-up) with the torch baselines in the same
   process: ``F.linear`` alone (cuBLAS, bias fused where the template has one) and torch eager's whole form (plus
   ``F.gelu``; for the QKV projection the permute into [3, B, H, S, D]). Prints a table (ms, TFLOP/s, x cuBLAS,
   error) and the best older vs best new set per case, writes ``--json``.

Cases (float16): attention output ``gemm`` 32768x768x768 and FFN down ``gemm`` 32768x768x3072 (the compile path's
GEMMs before the bias + residual LayerNorm), FFN up ``gemm_bias_gelu_erf`` 32768x3072x768, and the QKV projection
at batch 16, sequence 2048 (32768x2304x768)::

    .venv/bin/python scripts/bench_wgmma_small_k.py build
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/bench_wgmma_small_k.py run --json $OUT/small_k.json",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/wgmma_small_k"], timeout_s=420)

``--plan s8tma`` (issue 17; default folder ``out/s8gemm_tma``, 11 MB): cp.async against TMA loads (the opt-in
``loads="tma"`` knob of :mod:`stof_tvm.schedules.templates.wgmma_kernel`, not yet measured) at RoBERTa-base's four
GEMMs at 16 x 2048 and 8 x 512 tokens (32768 and 4096 rows: QKV 2304 x 768, FFN up + erf GELU 3072 x 768, FFN down
768 x 3072, attention output 768 x 768), per case the template's first knob set and the first staged 128-row set of
another tile, each with both loads, beside cuBLAS (``F.linear``, + ``F.gelu``). Every TMA module is also captured
in a torch CUDA graph and replayed on new activations written into the captured input (the maps are encoded on
the host at capture and replayed as captured). Then a whole model: a tiny HF RoBERTa at 48 x 256 tokens (every GEMM
on wgmma) compiled for CUDA with graphs once per loads value (the knob forced into the compile path), called three
times (capture, replays on new and on the first inputs) against torch float32 outputs computed at build time and
against each other. A TMA kernel that faults leaves the CUDA context unusable, so the GPU run checks first
(cp.async modules before TMA ones, the model last) in one process, then times in another only what passed (``--only
check`` / ``--only time --skip-failed-in``); the table comparing each knob set's two loads comes last::

    .venv/bin/python scripts/bench_wgmma_small_k.py build --plan s8tma
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation --no-index "
                "-e . && { python3 scripts/bench_wgmma_small_k.py run --plan s8tma --only check "
                "--json $OUT/s8gemm_tma_checks.json; python3 scripts/bench_wgmma_small_k.py run --plan s8tma "
                "--only time --skip-failed-in $OUT/s8gemm_tma_checks.json --json $OUT/s8gemm_tma.json; }",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/s8gemm_tma"], timeout_s=300)

``--plan s9splitk`` (issue 17; default folder ``out/s9splitk``, 6.3 MB): split-K (knob ``split_k``: a cluster of
blocks per tile, each on its own k slice, float32 partials reduced through distributed shared memory in rank order,
then the epilogue) and the new knob order (128 x 128 first where 256 x 192 fills the waves worse, TMA loads by
default) at RoBERTa-base's four GEMMs at 1 x 128, 1 x 512 and 8 x 512 tokens (128, 512 and 4096 rows): per case what
the compile path ran before (commit 098a891: the wgmma default with cp.async, or the mma.sync template where the GEMM
had fewer than 66 tiles), the knob space's first set now, its first two split-K tilings with both loads, and at
FFN down at 4096 rows two multi-wave split-K sets; beside cuBLAS. Split-K modules are also called twice (bitwise
equal outputs: deterministic) and replayed from a torch CUDA graph; the summary table comes last::

    .venv/bin/python scripts/bench_wgmma_small_k.py build --plan s9splitk
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation --no-index "
                "-e . && { python3 scripts/bench_wgmma_small_k.py run --plan s9splitk --only check "
                "--json $OUT/s9splitk_checks.json; python3 scripts/bench_wgmma_small_k.py run --plan s9splitk "
                "--only time --skip-failed-in $OUT/s9splitk_checks.json --json $OUT/s9splitk.json; }",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/s9splitk"], timeout_s=300)

``--plan s9wide`` (default folder ``out/s9wide``): the four GEMMs at 4096 rows, the knob space's first set ("old" in
the tables) against the model's 7 best-ranked others ("new"), for the FFN down that cuBLAS still beat and the model's
calibration; the same two-process command with ``--plan s9wide`` and ``out/s9wide`` carried.

``--plan s10gemm`` (issue 17; default folder ``out/s10gemm``): the tile schedules of :data:`S10_SCHEDULES`, 128 x 192
ping-pong tiles among them, at the four GEMMs at 4096 rows and the erf-GELU GEMM at 32768 rows: per case the knob
space's first set, then per schedule its staged TMA set, beside cuBLAS; every TMA module replayed from a CUDA graph.
(Session 10 ran it at 2a96759 with TMA multicast twins of each schedule too: 1.2-2.2x slower, since removed.) The
same two-process command with ``--plan s10gemm`` and ``out/s10gemm`` carried.

``--plan s10ragged`` (default folder ``out/s10ragged``): GEMMs whose m is not a multiple of the row tile, as the
compile path now runs them on wgmma without padding (ViT-Base at 1 x 197, 8 x 197 and 32 x 197 tokens: m = 197, 1576,
6304; its four GEMMs), per case the knob space's first set and the first set of another tile schedule, beside cuBLAS.
The GEMMs' outputs are the first m rows of a poisoned buffer :data:`GUARD_ROWS` rows longer, whose rows past m must
stay untouched (the partial last tile's stores are guarded); the QKV projection's [3, B, H, S, D] output is poisoned
whole. The same two-process command with ``--plan s10ragged`` and ``out/s10ragged`` carried.

``--plan s11big`` (issue 17; default folder ``out/s11big``): RoBERTa-base's four GEMMs at 16 x 2048 tokens (32768
rows), whose per-call times in the compile path's profile (session 10, call 7) were up to 20% above the best
standalone ones, and ViT-Base's FFN up + GELU and FFN down at 1576 and 6304 rows (0.85-0.93x cuBLAS in s10ragged):
per case the knob space's first set (the compile path's untuned pick) and :data:`BIG_CANDIDATES` (cp.async and TMA
loads, 128 x 192 / 256 x 192 ping-pong and cooperative, 128 x 256, stage counts; at ViT's rows 64-row ping-pong tiles
and split-K over several waves), beside cuBLAS; GEMM outputs in a poisoned buffer :data:`GUARD_ROWS` rows longer.
Each module and cuBLAS is also timed over sustained back-to-back samples and one call at a time between device
synchronisations, as ``stof-tvm bench --profile`` times a call (:func:`in_model_timings`); the table comparing every
set with the default comes last. The same two-process command with ``--plan s11big`` and ``out/s11big`` carried.

``--plan s11large`` (issue 17; default folder ``out/s11large``): the same for BERT-large's four GEMMs at 8 x 512 tokens
(4096 rows: QKV 3072 x 1024, attention output 1024 x 1024, FFN up + erf GELU 4096 x 1024, FFN down 1024 x 4096) and
GPT-2's tanh-GELU GEMM at 32768 and 4096 rows (:data:`LARGE_CANDIDATES`), and the shapes whose first set session 11's
knob order changed unmeasured, the new first set against the older one; ``--plan s11large``, ``out/s11large`` carried.

``--plan s12gelu`` (default folder ``out/s12gelu``): the FFN-up GEMM + erf / tanh GELU at 32768 and 4096 rows (n 3072,
k 768), the pick in its exp2 tail form against its ``gelu_form="tanh"`` twin (tanh.approx.f32:
:mod:`stof_tvm.schedules.templates.fast_gelu`) and its GELU-less twin (``gemm_bias_wgmma``, the same tiles), at 32768
rows also the 256 x 192 cooperative set with and without ``gelu_form="tanh"``, timed as in s11big; ``--plan s12gelu``,
``out/s12gelu`` carried.

``--plan s13small`` (issue 17; default folder ``out/s13small``, 20 modules): HF GPT-2's four GEMMs at 1 x 128 tokens
(128 rows, fp16, the compile path's forms: ``qkv_projection_wgmma`` 128 x 2304 x 768, ``gemm_bias_wgmma`` attention
output 128 x 768 x 768 and FFN down 128 x 768 x 3072, ``gemm_bias_gelu_tanh_wgmma`` 128 x 3072 x 768), whose picks
(split-K 128 x 128 tiles, cp.async) launch 72, 24, 96 and 48 blocks for the 132 SMs, so the weights stream at the
bandwidth of the few SMs used; and the attention output and FFN down at 1 x 512 (96 blocks, the split-K limit). Per case
the pick against at most 3 sets that launch >= 132 blocks or split k further (:data:`S13_CANDIDATES`): wgmma split-K
sets the knob space leaves out (2- or 1-step k slices, non-portable clusters of 12 and 16, more than 96 blocks) and
the mma.sync twin (weight [k, n], GPT-2's Conv1D layout) at 128 x 16, 64 x 32, 32 x 64, 32 x 16 or 16 x 32 tiles
(144-288 blocks); checked against torch float32, outputs in a poisoned buffer :data:`GUARD_ROWS` rows longer, split-K
bitwise deterministic, timed as in s11big (bursts, sustained, one call at a time); the same two-process command with
``--plan s13small`` and ``out/s13small`` carried.

``--plan s18small`` (issue 17; default folder ``out/s18small``, 45 modules): BERT-large's and BERT-base's four GEMMs at
1 x 128 tokens (128 rows, the compile path's forms), the pick against its twins with TMA loads, without the weight
prefetch and with ``early_weights``, and tilings that launch more blocks or wider tiles (:data:`S18_CANDIDATES`);
checked and timed as s13small, and also as a whole forward runs them (``graphed``: :data:`GRAPH_CALLS` calls in one
CUDA graph, each with a weight of its own, which is what the summary ranks by); ``--plan s18small`` and
``out/s18small`` carried.

``--plan s21gelu`` (issue 17; default folder ``out/s21gelu``, 6 modules): the erf GELU GEMM (n 3072, k 768) at 4096 and
32768 rows in its float32 tail form and its ``gelu_form="half"`` form (the GELU on float16 pairs), its GELU-less twin
and FFN down's pick at 4096 rows (:data:`S21_CASES`); timed as the default plan, and meant to run under ``ncu`` too
(``--only check`` launches each module once)::

    .venv/bin/python scripts/bench_wgmma_small_k.py build --plan s21gelu
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation --no-index "
                "-e . && python3 scripts/bench_wgmma_small_k.py run --plan s21gelu --json $OUT/s21.json && ncu "
                "--clock-control none -k regex:gemm_wgmma --set full -o $OUT/prof python3 "
                "scripts/bench_wgmma_small_k.py run --plan s21gelu --only check",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/s21gelu"], timeout_s=300)

``--plan s23tuned`` (issue 17; default folder ``out/s23tuned``, 3 modules): why tuning made ViT-Base 8x197 slower
(BENCHMARKS.md session 23). ViT-Base's QKV projection at 8 x 197 tokens, the untuned pick against the set stage 2
chose (:data:`S23_TUNED`, 13% faster timed back to back) and the cooperative 128-wide set; checked and timed as
s18small, the graph's calls each reading a weight of its own (cold in L2, as in a forward pass). If the tuned set
loses there, stage 2's back-to-back timing is what misled it; ``--only check`` then ``--only time``, ``out/s23tuned``
carried.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)
import check_wgmma_gpu as common  # noqa: E402  (the export, cubin, timing and hang helpers of the wgmma checks)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "wgmma_small_k"
DTYPE = "float16"
# (template, template shape): the compile path's forms of BERT-Base's layer GEMMs at 32768 tokens
CASES = [
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 768}),                                  # attention output
    ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768}),                   # FFN up + GELU
    ("gemm_wgmma", {"m": 32768, "n": 768, "k": 3072}),                                 # FFN down
    ("qkv_projection_wgmma", {"batch": 16, "seq": 2048, "heads": 12, "head_dim": 64}),  # QKV into [3, B, H, S, D]
]
TALL_PER_WIDTH = 2   # best-ranked 256-row knob sets per tile width
# --plan s8tma: RoBERTa-base's GEMMs (the compile path's forms) at 16 x 2048 and 8 x 512 tokens
TMA_CASES = [case for rows, (batch, seq) in ((32768, (16, 2048)), (4096, (8, 512))) for case in (
    ("qkv_projection_wgmma", {"batch": batch, "seq": seq, "heads": 12, "head_dim": 64}),
    ("gemm_bias_gelu_erf_wgmma", {"m": rows, "n": 3072, "k": 768}),
    ("gemm_wgmma", {"m": rows, "n": 768, "k": 3072}),
    ("gemm_wgmma", {"m": rows, "n": 768, "k": 768}))]
# --plan s9splitk: RoBERTa-base's GEMMs at 1 x 128, 1 x 512 and 8 x 512 tokens (128, 512 and 4096 rows)
SPLITK_CASES = [case for rows, (batch, seq) in ((128, (1, 128)), (512, (1, 512)), (4096, (8, 512))) for case in (
    ("qkv_projection_wgmma", {"batch": batch, "seq": seq, "heads": 12, "head_dim": 64}),
    ("gemm_bias_gelu_erf_wgmma", {"m": rows, "n": 3072, "k": 768}),
    ("gemm_wgmma", {"m": rows, "n": 768, "k": 3072}),
    ("gemm_wgmma", {"m": rows, "n": 768, "k": 768}))]
# --plan s9wide: the same GEMMs at 8 x 512 tokens (4096 rows, where cuBLAS still beat FFN down: 0.0306 against 0.0369
# ms), the default against the model's best-ranked other knob sets
WIDE_CASES = SPLITK_CASES[8:]
WIDE_RANKED = 7           # model-ranked knob sets per case besides the default
# --plan s10gemm: the 4096-row GEMMs and the erf-GELU GEMM at 32768 rows (ours 0.3087 ms, cuBLAS 0.2585 without the
# GELU); per case the tile schedules (block_m, block_n, persistent, pingpong) whose staged TMA set is timed;
# (256, 192, True, True): the 128 x 192 ping-pong tiles (block_m 256: two in flight)
S10_CASES = WIDE_CASES + [("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768})]
S10_SCHEDULES = {4096: ((128, 192, True, False), (128, 192, False, False), (256, 192, True, False),
                        (128, 128, True, False), (128, 256, True, False), (256, 192, True, True)),
                 32768: ((256, 192, True, False), (128, 192, True, False), (256, 192, True, True))}
# --plan s10ragged: ViT-Base's GEMMs (hidden 768, the compile path's forms) at 1, 8 and 32 x 197 tokens
RAGGED_CASES = [case for batch in (1, 8, 32) for case in (
    ("qkv_projection_wgmma", {"batch": batch, "seq": 197, "heads": 12, "head_dim": 64}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 197 * batch, "n": 3072, "k": 768}),
    ("gemm_bias_wgmma", {"m": 197 * batch, "n": 768, "k": 3072}),
    ("gemm_bias_wgmma", {"m": 197 * batch, "n": 768, "k": 768}))]
GUARD_ROWS = 128    # poisoned rows after a GEMM's m output rows, which its kernel must not write
# --plan s11big: RoBERTa-base's four GEMMs at 16 x 2048 tokens (32768 rows, the compile path's forms: the attention
# output and FFN down without bias, which the bias + residual LayerNorm adds) and ViT-Base's FFN up + GELU and FFN down
# at 8 and 32 x 197 tokens (1576 and 6304 rows, bias in the GEMM), where cuBLAS was 1.07-1.18x faster (s10ragged)
BIG_CASES = TMA_CASES[:4] + [case for case in RAGGED_CASES[4:] if case[0] != "qkv_projection_wgmma"
                             and case[1]["n"] * case[1]["k"] == 3072 * 768]
# ... per GEMM (m, n, k) the sets timed beside the knob space's first (the compile path's untuned pick), as (block_m,
# block_n, stages, pingpong, loads, split_k): unsplit sets are persistent and staged (fast_gelu for the GELU), split
# ones cooperative one tile a block. Ping-pong tiles are 128 x 128 at block_n 128, 64 rows at 192 and 256, and
# 128 x 192 with block_m 256 (two tiles in flight, one per consumer).
# At ViT's rows the candidates fill the SMs' waves better than the default: 64 x 192 / 64 x 256 ping-pong tiles (6304
# rows: 396 and 1188 tiles, whole waves of 132), 128 x 128 ping-pong, and split-K past the knob space's one-wave
# limit (clusters of 2-3 blocks: FFN down at 1576 rows has 52-78 tiles)
_COOP, _PP = False, True
BIG_CANDIDATES = {
    (32768, 2304, 768): [(256, 192, 3, _COOP, "tma", 1), (256, 192, 4, _PP, "tma", 1),
                         (256, 192, 4, _PP, "cp.async", 1), (128, 192, 4, _COOP, "tma", 1),
                         (128, 256, 4, _COOP, "tma", 1), (128, 128, 4, _PP, "tma", 1)],
    (32768, 3072, 768): [(256, 192, 4, _PP, "cp.async", 1), (256, 192, 5, _PP, "tma", 1),
                         (256, 192, 3, _COOP, "tma", 1), (128, 256, 4, _COOP, "tma", 1),
                         (128, 256, 4, _PP, "tma", 1), (128, 128, 4, _PP, "tma", 1)],
    (32768, 768, 3072): [(256, 192, 3, _COOP, "cp.async", 1), (256, 192, 4, _PP, "tma", 1),
                         (256, 192, 5, _PP, "tma", 1), (128, 192, 4, _COOP, "tma", 1),
                         (128, 256, 4, _COOP, "tma", 1), (128, 128, 4, _PP, "tma", 1)],
    (32768, 768, 768): [(256, 192, 3, _COOP, "cp.async", 1), (256, 192, 4, _PP, "tma", 1),
                        (128, 192, 4, _COOP, "tma", 1), (128, 192, 5, _COOP, "tma", 1),
                        (128, 256, 4, _COOP, "tma", 1), (128, 128, 4, _PP, "tma", 1)],
    (1576, 3072, 768): [(128, 128, 4, _PP, "tma", 1), (128, 192, 4, _COOP, "tma", 1), (128, 256, 4, _PP, "tma", 1)],
    (1576, 768, 3072): [(128, 192, 4, _PP, "tma", 1), (128, 192, 4, _COOP, "cp.async", 2),
                        (128, 256, 4, _COOP, "cp.async", 3), (128, 256, 4, _COOP, "cp.async", 2)],
    (6304, 3072, 768): [(128, 256, 4, _PP, "tma", 1), (128, 128, 4, _PP, "tma", 1), (128, 256, 4, _COOP, "tma", 1),
                        (128, 128, 4, _COOP, "tma", 1)],
    (6304, 768, 3072): [(128, 192, 4, _PP, "tma", 1), (128, 192, 4, _COOP, "cp.async", 3),
                        (128, 128, 4, _COOP, "cp.async", 2)],
}
# --plan s11large: BERT-large's four GEMMs at 8 x 512 tokens (4096 rows; hidden 1024, 16 heads, FFN 4096) and
# GPT-2's tanh-GELU GEMM at 16 x 2048 and 8 x 512 tokens (32768 and 4096 rows), each with its candidates as in
# BIG_CANDIDATES; then the shapes whose first set session 11's order changed without a measurement there (the 64 x 192
# ping-pong lead: ViT-Base's attention output at 1576 rows, the QKV projection and the erf-GELU GEMM at 512), the
# new first set against the older one
LARGE_CASES = [
    ("qkv_projection_wgmma", {"batch": 8, "seq": 512, "heads": 16, "head_dim": 64}),
    ("gemm_wgmma", {"m": 4096, "n": 1024, "k": 1024}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 4096, "k": 1024}),
    ("gemm_wgmma", {"m": 4096, "n": 1024, "k": 4096}),
    ("gemm_bias_gelu_tanh_wgmma", {"m": 32768, "n": 3072, "k": 768}),
    ("gemm_bias_gelu_tanh_wgmma", {"m": 4096, "n": 3072, "k": 768}),
    ("gemm_bias_wgmma", {"m": 1576, "n": 768, "k": 768}),
    ("qkv_projection_wgmma", {"batch": 1, "seq": 512, "heads": 12, "head_dim": 64}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 512, "n": 3072, "k": 768})]
_LARGE_TILES = [(128, 256, 4, _COOP, "tma", 1), (256, 128, 4, _COOP, "tma", 1), (128, 128, 4, _PP, "tma", 1),
                (128, 256, 4, _PP, "tma", 1)]
LARGE_CANDIDATES = {
    ("qkv_projection_wgmma", 4096, 3072, 1024): [(256, 192, 4, _PP, "tma", 1), (256, 192, 3, _COOP, "tma", 1),
                                                 (128, 192, 4, _COOP, "tma", 1), (128, 128, 4, _PP, "tma", 1),
                                                 (128, 256, 4, _COOP, "tma", 1)],
    ("gemm_wgmma", 4096, 1024, 1024): _LARGE_TILES,
    ("gemm_bias_gelu_erf_wgmma", 4096, 4096, 1024): _LARGE_TILES,
    ("gemm_wgmma", 4096, 1024, 4096): _LARGE_TILES,
    ("gemm_bias_gelu_tanh_wgmma", 32768, 3072, 768): [(256, 192, 3, _COOP, "tma", 1), (128, 128, 4, _PP, "tma", 1),
                                                      (128, 256, 4, _COOP, "tma", 1)],
    ("gemm_bias_gelu_tanh_wgmma", 4096, 3072, 768): [(256, 192, 3, _COOP, "tma", 1), (128, 192, 4, _COOP, "tma", 1),
                                                     (128, 128, 4, _PP, "tma", 1)],
    ("gemm_bias_wgmma", 1576, 768, 768): [(128, 128, 4, _COOP, "tma", 1)],
    ("qkv_projection_wgmma", 512, 2304, 768): [(128, 128, 4, _COOP, "tma", 1)],
    ("gemm_bias_gelu_erf_wgmma", 512, 3072, 768): [(128, 128, 4, _COOP, "tma", 1)],
}
# --plan s12gelu: the FFN-up GEMM + GELU (n 3072, k 768) at 16 x 2048 and 8 x 512 tokens, erf (RoBERTa) and tanh
# (GPT-2): the knob space's first set in its exp2 tail form against its gelu_form="tanh" twin (tanh.approx.f32), and
# at each row count the pick's GELU-less twin (gemm_bias_wgmma with the same tiles: what the epilogue's GELU costs)
S12_COOP_ROWS = 32768   # ... and there the 256 x 192 cooperative set (s11large's runner-up for the tanh GELU) with both
S12_COOP = {"block_m": 256, "block_n": 192, "stages": 3, "pingpong": False, "persistent": True, "staged": True,
            "fast_gelu": True, "loads": "tma"}
S12_CASES = [case for rows in (32768, 4096) for case in (
    ("gemm_bias_gelu_erf_wgmma", {"m": rows, "n": 3072, "k": 768}),
    ("gemm_bias_gelu_tanh_wgmma", {"m": rows, "n": 3072, "k": 768}),
    ("gemm_bias_wgmma", {"m": rows, "n": 3072, "k": 768}))]
# --plan s21gelu: the erf GELU GEMM (n 3072, k 768) at 8 x 512 and 16 x 2048 tokens, which at 4096 rows runs 1.25x
# longer than FFN down (4096 x 768 x 3072) at the same flops and the same busiest-SM work (H100 in place, session 20:
# 34.0 against 27.2 us; ncu: tensor pipe active 68% against 84-86% for the GELU-less twins): the pick, its
# gelu_form="half" twin (the GELU on float16 pairs, fewer epilogue instructions), its GELU-less twin, and FFN down's
# pick at 4096 rows; also run under ncu
S21_CASES = [("gemm_bias_gelu_erf_wgmma", {"m": 4096, "n": 3072, "k": 768}),
             ("gemm_bias_gelu_erf_wgmma", {"m": 32768, "n": 3072, "k": 768}),
             ("gemm_bias_wgmma", {"m": 4096, "n": 3072, "k": 768}),
             ("gemm_bias_wgmma", {"m": 4096, "n": 768, "k": 3072})]


def s21_knob_sets(name, shape, space) -> list[dict]:
    """``--plan s21gelu``: the knob space's first set; for the erf GELU in both forms, ``"tail"`` (the pick before
    session 21) and ``"half"``; at n 3072 without a GELU the erf GELU pick's tiles (the GELU-less twin)."""
    from stof_tvm.schedules.templates import get_template

    if "gelu" in name:
        return [dict(space[0], gelu_form="tail"), dict(space[0], gelu_form="half")]
    if shape["n"] == 3072:
        pick = get_template("gemm_bias_gelu_erf_wgmma").knob_space(shape, DTYPE)[0]
        return [{key: v for key, v in pick.items() if key not in ("fast_gelu", "gelu_form")}]
    return [space[0]]


# --plan s13small: HF GPT-2's four GEMMs at 1 x 128 tokens (128 rows; the compile path's forms, checked with
# scripts/count_launches.py --rows gpt2:1x128: QKV into [3, B, H, S, D], attention output and FFN down with their bias
# in the GEMM, FFN up + tanh GELU; Conv1D weights transposed to [n, k] at compile time), whose picks (the knob spaces'
# first sets: split-K, 128 x 128 tiles, cp.async) launch 72, 24, 96 and 48 blocks for the 132 SMs; and the attention
# output and FFN down at 1 x 512 (picks at the 96-block split-K limit). Per case the sets timed beside the pick: wgmma
# split-K sets the knob space leaves out (2-step or 1-step k slices at k = 768, non-portable clusters of 12 / 16 at
# k = 3072, more than 96 blocks), and the mma.sync twin (weight [k, n], as the Conv1D layout is) at tiles that launch
# >= 132 blocks: all 128 rows a block with 16 columns (the weight streamed once, A re-read from L2), 64 x 32, or the
# model's best-ranked mma.sync set of >= 132 blocks (QKV 32 x 32, FFN up 32 x 64, FFN down 16 x 32; at the attention
# output 32 x 16, the model's 16 x 16 pick being what session 9 measured slower at RoBERTa's 128 rows). Split-K sets
# are cooperative, one 128-row tile per block, cp.async (1.00-1.06x faster than TMA there, session 9).
_S13_SPLIT = {"block_n": 128, "persistent": False, "pingpong": False, "loads": "cp.async"}


def _s13_mma(warps_m, frag_m, warps_n, frag_n, stages=4):
    """An mma.sync knob set of the twin template: tile 16 * warps * frag a side, block_k 64, 8-wide epilogue."""
    return {"mma": {"warps_m": warps_m, "frag_m": frag_m, "warps_n": warps_n, "frag_n": frag_n, "k_frags": 4,
                    "stages": stages, "vec": 8}}


S13_CASES = [
    ("qkv_projection_wgmma", {"batch": 1, "seq": 128, "heads": 12, "head_dim": 64}),   # 128 x 2304 x 768
    ("gemm_bias_wgmma", {"m": 128, "n": 768, "k": 768}),                               # attention output
    ("gemm_bias_gelu_tanh_wgmma", {"m": 128, "n": 3072, "k": 768}),                    # FFN up + tanh GELU
    ("gemm_bias_wgmma", {"m": 128, "n": 768, "k": 3072}),                              # FFN down
    ("gemm_bias_wgmma", {"m": 512, "n": 768, "k": 768}),
    ("gemm_bias_wgmma", {"m": 512, "n": 768, "k": 3072})]
# ... per (template, m, n, k) the sets beside the pick, as (what it is, knobs); blocks launched in the comments
S13_CANDIDATES = {
    # pick: 128 x 128 split 4 (3 k steps a block), 72 blocks; 2 steps in clusters of 6 (108 blocks) measured 1.6x
    # slower at RoBERTa's same shape (session 9), so only mma.sync here: 144, 144, 288 blocks
    ("qkv_projection_wgmma", 128, 2304, 768): [_s13_mma(4, 2, 1, 1), _s13_mma(2, 2, 1, 2), _s13_mma(1, 2, 1, 2)],
    # pick: split 4, 24 blocks; split 6 (2 steps, 36 blocks), split 12 (1 step, 72 blocks, non-portable clusters),
    # mma.sync 32 x 16 (192 blocks)
    ("gemm_bias_wgmma", 128, 768, 768): [dict(_S13_SPLIT, stages=2, split_k=6), dict(_S13_SPLIT, stages=2, split_k=12),
                                         _s13_mma(2, 1, 1, 1)],
    # pick: split 4, 96 blocks; split 6 (2 steps, 144 blocks), mma.sync 128 x 16 and 32 x 64 (192 blocks each)
    ("gemm_bias_gelu_tanh_wgmma", 128, 3072, 768): [dict(_S13_SPLIT, stages=2, split_k=6), _s13_mma(4, 2, 1, 1),
                                                    _s13_mma(1, 2, 2, 2)],
    # pick: split 8 (6 steps), 48 blocks; split 12 (4 steps, 72 blocks) and 16 (3 steps, 96 blocks) in non-portable
    # clusters, mma.sync 16 x 32 (192 blocks, the whole k a block)
    ("gemm_bias_wgmma", 128, 768, 3072): [dict(_S13_SPLIT, stages=4, split_k=12),
                                          dict(_S13_SPLIT, stages=3, split_k=16), _s13_mma(1, 1, 2, 1, stages=3)],
    # 512 rows, picks split 4 at 96 blocks: split 6 at 144 (past one wave of clusters of 6)
    ("gemm_bias_wgmma", 512, 768, 768): [dict(_S13_SPLIT, stages=2, split_k=6)],
    ("gemm_bias_wgmma", 512, 768, 3072): [dict(_S13_SPLIT, stages=4, split_k=6)],
}
S13_MAX_MODULES = 20   # the build stays under ~10 minutes on a 2-core CPU
# --plan s18small: BERT-large's and BERT-base's GEMMs at 1 x 128 tokens (128 rows; the compile path's forms), where the
# in-place timeline (session 17) gave BERT-large's 5.8-8.7 us a call against 0.5-2.0 us of weight streaming. Each set
# is also timed as a whole forward runs it: GRAPH_CALLS calls captured in one CUDA graph, each with a weight of its
# own (so that every call streams its weight from HBM, as a model's layers do), under dependent launches. Beside the
# pick: its twins without the weight prefetch and with early_weights (what the kernel does before the dependent-launch
# wait), and tilings that launch more blocks (split further, non-portable clusters of 16 included) or wider tiles.
_S18 = {"persistent": False, "pingpong": False, "weight_prefetch": True, "loads": "cp.async"}


def _s18(block_n, stages, split, **extra):
    """A knob set of plan s18small (cooperative 128-row tile, split ``split`` ways, cp.async, the weight prefetch;
    ``extra`` overrides)."""
    knobs = dict(_S18, block_n=block_n, stages=stages, **extra)
    return dict(knobs, split_k=split) if split > 1 else knobs


S18_CASES = [
    ("qkv_projection_wgmma", {"batch": 1, "seq": 128, "heads": 16, "head_dim": 64}),   # 128 x 3072 x 1024
    ("gemm_bias_wgmma", {"m": 128, "n": 1024, "k": 1024}),                             # attention output
    ("gemm_bias_gelu_erf_wgmma", {"m": 128, "n": 4096, "k": 1024}),                    # FFN up + erf GELU
    ("gemm_bias_wgmma", {"m": 128, "n": 1024, "k": 4096}),                             # FFN down
    ("qkv_projection_wgmma", {"batch": 1, "seq": 128, "heads": 12, "head_dim": 64}),   # BERT-base: 128 x 2304 x 768
    ("gemm_bias_wgmma", {"m": 128, "n": 768, "k": 768}),
    ("gemm_bias_gelu_erf_wgmma", {"m": 128, "n": 3072, "k": 768}),
    ("gemm_bias_wgmma", {"m": 128, "n": 768, "k": 3072})]
# ... per (template, m, n, k) the sets beside the pick (the knob space's first set); blocks launched in the comments
S18_CANDIDATES = {
    # pick 128 x 128 split 4 (4 k steps a block), 96 blocks
    ("qkv_projection_wgmma", 128, 3072, 1024): [_s18(128, 4, 4, weight_prefetch=False),
                                                _s18(128, 4, 4, early_weights=True), _s18(128, 2, 8),   # 192
                                                _s18(192, 2, 8), _s18(256, 4, 4)],                      # 128, 48
    # pick split 4, 32 blocks; what the cluster costs: unsplit (8 blocks, 16 steps) and split 2 (16 blocks, 8 steps)
    ("gemm_bias_wgmma", 128, 1024, 1024): [_s18(128, 4, 4, weight_prefetch=False),
                                           _s18(128, 4, 4, early_weights=True), _s18(128, 2, 8),      # 64
                                           _s18(128, 2, 16), _s18(256, 2, 16),                        # 128, 64
                                           _s18(128, 4, 1), _s18(128, 4, 2),
                                           _s18(128, 4, 4, weight_prefetch=False, loads="tma")],
    # pick split 2 (8 steps), 64 blocks
    ("gemm_bias_gelu_erf_wgmma", 128, 4096, 1024): [_s18(128, 4, 2, early_weights=True), _s18(128, 4, 4),  # 128
                                                    _s18(256, 2, 8), _s18(256, 4, 4)],                     # 128, 64
    # pick split 8 (8 steps), 64 blocks
    ("gemm_bias_wgmma", 128, 1024, 4096): [_s18(128, 4, 8, weight_prefetch=False),
                                           _s18(128, 4, 8, early_weights=True), _s18(128, 4, 16),     # 128
                                           _s18(256, 4, 16)],                                         # 64
    # BERT-base, pick split 4 (3 steps), 72 blocks
    ("qkv_projection_wgmma", 128, 2304, 768): [_s18(128, 3, 4, early_weights=True), _s18(128, 2, 6)],  # 108
    # pick split 4, 24 blocks; unsplit: 6 blocks, 12 steps
    ("gemm_bias_wgmma", 128, 768, 768): [_s18(128, 2, 6), _s18(128, 2, 12), _s18(128, 4, 1)],        # 36, 72, 6
    # pick split 4, 96 blocks
    ("gemm_bias_gelu_erf_wgmma", 128, 3072, 768): [_s18(128, 2, 6)],                                  # 144
    # pick split 8 (6 steps), 48 blocks
    ("gemm_bias_wgmma", 128, 768, 3072): [_s18(128, 4, 12), _s18(128, 3, 16)],                        # 72, 96
}
# --plan s23tuned: ViT-Base's QKV projection at 8 x 197 tokens, the knob space's first set (the untuned pick) against
# the set stage 2 of tuning chose (13% faster timed back to back; the tuned forward ran 1-2% slower, session 23)
# and the cooperative 128-wide set, each also in a CUDA graph whose calls read weights of their own
S23_CASES = [("qkv_projection_wgmma", {"batch": 8, "seq": 197, "heads": 12, "head_dim": 64})]
S23_TUNED = {"block_n": 256, "stages": 3, "persistent": False, "pingpong": False, "staged": True, "loads": "tma",
             "early_weights": True}
S23_COOPERATIVE = {"block_n": 128, "stages": 4, "persistent": True, "pingpong": False, "staged": True, "loads": "tma"}
GRAPH_CALLS = 24   # s18small: calls per captured graph, as many as a 24-layer model runs of each GEMM
GRAPH_PLANS = ("s18small", "s23tuned")   # plans whose sets are also timed in a graph with a weight a call
BIG_PLANS = ("s11big", "s11large", "s12gelu", "s13small", "s18small", "s23tuned")   # timed sustained too
SUSTAINED_MS = 50.0   # BIG_PLANS: each sustained sample this long (back-to-back calls, as in a whole forward)
PROFILED_CALLS = 50   # BIG_PLANS: calls timed one by one between device synchronisations (as --profile does)
PLANS = {"small_k": (CASES, OUT), "s8tma": (TMA_CASES, ROOT / "out" / "s8gemm_tma"),
         "s9splitk": (SPLITK_CASES, ROOT / "out" / "s9splitk"), "s9wide": (WIDE_CASES, ROOT / "out" / "s9wide"),
         "s10gemm": (S10_CASES, ROOT / "out" / "s10gemm"), "s10ragged": (RAGGED_CASES, ROOT / "out" / "s10ragged"),
         "s11big": (BIG_CASES, ROOT / "out" / "s11big"), "s11large": (LARGE_CASES, ROOT / "out" / "s11large"),
         "s12gelu": (S12_CASES, ROOT / "out" / "s12gelu"), "s13small": (S13_CASES, ROOT / "out" / "s13small"),
         "s18small": (S18_CASES, ROOT / "out" / "s18small"), "s21gelu": (S21_CASES, ROOT / "out" / "s21gelu"),
         "s23tuned": (S23_CASES, ROOT / "out" / "s23tuned")}
# --plan s9splitk: the compile path's wgmma knobs before split-K and the knob order by wave efficiency (commit
# 098a891; GEMMs with fewer than WGMMA_MIN_TILES 128 x 128 tiles ran the mma.sync template the model ranks first)
HEAD_WGMMA = {"block_n": 192, "stages": 3, "persistent": True, "pingpong": False, "block_m": 256, "staged": True}
SPLITK_TILINGS = 2        # split-K tilings (block_n, split_k) timed per case, the knob space's first, both loads
# split-K sets not in the knob space: multi-wave where cuBLAS beat us (FFN down at 4096 rows), and the non-portable
# cluster sizes 12 and 16 where 8 leaves the SMs idle (FFN down, attention output at 128 rows: 48 and 36 blocks)
_SPLIT = {"persistent": False, "pingpong": False, "loads": "tma"}
EXTRA_SPLITS = {(4096, 768, 3072): [dict(_SPLIT, block_n=bn, stages=4, split_k=2) for bn in (128, 192)],
                (128, 768, 3072): [dict(_SPLIT, block_n=128, stages=3, split_k=16)],
                (128, 768, 768): [dict(_SPLIT, block_n=128, stages=2, split_k=12)]}
# --plan s8tma's whole-model check: a tiny HF RoBERTa (hidden 128, 2 layers) at 48 x 256 tokens (12288 rows: every
# GEMM on wgmma, the FFN unfused) compiled for CUDA with graphs, dense mask, once per loads value
MODEL_BATCH, MODEL_SEQ = 48, 256
MODEL_ROWS = (0, MODEL_BATCH - 1)   # batch rows whose float32 torch outputs travel (the last one padded)
MODEL_SEEDS = (0, 1, 0)             # the calls' input sets: capture, replay on new inputs, replay on the first


def is_new(knobs, plan: str = "", default: bool | None = None) -> bool:
    """Whether a knob set uses a value added by this work: 256-row tiles or the staged epilogue (``small_k``); TMA
    loads (``s8tma``: "new" is TMA, "old" cp.async, so the summary's best new / best old is TMA / cp.async); split-K
    (``plan`` s9splitk); every set but the knob space's first (s9wide, s10ragged, s11big, s11large)."""
    if plan == "s9splitk":
        return knobs.get("split_k", 1) > 1
    if plan in ("s9wide", "s10ragged", *BIG_PLANS):
        return default is False
    if plan == "s10gemm":   # the 128 x 192 ping-pong tiles (block_m 256 with pingpong)
        return knobs.get("pingpong", False) and knobs.get("block_m", 128) == 256
    if "loads" in knobs:
        return knobs["loads"] == "tma"
    return knobs.get("block_m", 128) != 128 or bool(knobs.get("staged"))


def knob_tag(knobs) -> str:
    if "mma" in knobs:   # an mma.sync template's knobs
        return "mma_" + "_".join(f"{key[:2]}{int(v) if isinstance(v, bool) else v}" for key, v in knobs["mma"].items())
    return (f"n{knobs['block_n']}_s{knobs['stages']}{'_p' if knobs['persistent'] else ''}"
            f"{'_pp' if knobs['pingpong'] else ''}{'_m256' if knobs.get('block_m', 128) != 128 else ''}"
            f"{'_st' if knobs.get('staged') else ''}{'_fast' if knobs.get('fast_gelu') else ''}"
            f"{'_k' + str(knobs['split_k']) if knobs.get('split_k', 1) > 1 else ''}"
            f"{'_' + knobs['loads'].replace('.', '') if 'loads' in knobs else ''}"
            f"{'_' + knobs['gelu_form'] if 'gelu_form' in knobs else ''}"
            f"{'_wp' if knobs.get('weight_prefetch') else ''}{'_ew' if knobs.get('early_weights') else ''}")


def splitk_knob_sets(name, shape, space) -> list[dict]:
    """``--plan s9splitk``: what the compile path ran before (HEAD's wgmma default with cp.async, or where the GEMM
    had too few tiles the mma.sync template's model-ranked first knobs, as ``{"mma": knobs}``), the knob space's
    first set now, its first :data:`SPLITK_TILINGS` split-K tilings with both loads (4 stages where the slice has
    them), and :data:`EXTRA_SPLITS`; each once, in that order."""
    from stof_tvm.cost_model.templates import rank_template
    from stof_tvm.schedules.templates import get_template

    m, n, k = gemm_dims(name, shape)
    if (m // 128) * (n // 128) >= 66:
        before = dict(HEAD_WGMMA, fast_gelu=True) if "gelu" in name else dict(HEAD_WGMMA)
    else:
        before = {"mma": rank_template(get_template(mma_twin(name)), shape)[0].candidate}
    sets = [before, space[0]]
    tilings = []
    for kn in space:
        tiling = (kn["block_n"], kn.get("split_k", 1))
        if tiling[1] > 1 and tiling not in tilings and len(tilings) < SPLITK_TILINGS:
            tilings.append(tiling)
            same = [other for other in space if (other["block_n"], other.get("split_k", 1)) == tiling]
            best = min(same, key=lambda other: abs(other["stages"] - 4))
            sets += [dict(best, loads=loads) for loads in ("tma", "cp.async")]
    sets += EXTRA_SPLITS.get((m, n, k), [])
    return [kn for i, kn in enumerate(sets) if kn not in sets[:i]]


def wide_knob_sets(name, shape, space) -> list[dict]:
    """``--plan s9wide``: the knob space's first set, then the model's best-ranked set of each other tile schedule
    (block_m, block_n, persistent, pingpong, staged), :data:`WIDE_RANKED` of them."""
    from stof_tvm.cost_model.templates import rank_template
    from stof_tvm.schedules.templates import get_template

    keys = ("block_m", "block_n", "persistent", "pingpong", "staged")
    schedule = lambda kn: tuple(kn.get(key) for key in keys)  # noqa: E731
    sets, seen = [space[0]], {schedule(space[0])}
    for r in rank_template(get_template(name), shape, knob_space=space):
        if schedule(r.candidate) not in seen and len(sets) <= WIDE_RANKED:
            seen.add(schedule(r.candidate))
            sets.append(r.candidate)
    return sets


def schedule_knob_sets(name, shape, space) -> list[dict]:
    """``--plan s10gemm``: the knob space's first set, then per tile schedule of :data:`S10_SCHEDULES` (for the
    case's rows) the space's first staged TMA set of it (the GELU's ``fast_gelu`` one); each set once."""
    from stof_tvm.schedules.templates import get_template

    m = get_template(name).gemm_dims(shape)[0]
    sets = [space[0]]
    for block_m, block_n, persistent, pingpong in S10_SCHEDULES[m]:
        base = next((kn for kn in space if kn.get("block_m", 128) == block_m and kn["block_n"] == block_n
                     and kn["persistent"] == persistent and kn["pingpong"] == pingpong and kn.get("staged")
                     and kn.get("fast_gelu") == space[0].get("fast_gelu") and kn["loads"] == "tma"
                     and kn.get("split_k", 1) == 1), None)
        if base is not None:
            sets.append(base)
    return [kn for i, kn in enumerate(sets) if kn not in sets[:i]]


def ragged_knob_sets(space) -> list[dict]:
    """``--plan s10ragged``: the knob space's first set and the first of another tile schedule (block_m, block_n,
    pingpong, split_k)."""
    schedule = lambda kn: (kn.get("block_m", 128), kn["block_n"], kn["pingpong"], kn.get("split_k", 1))  # noqa: E731
    other = next((kn for kn in space if schedule(kn) != schedule(space[0])), None)
    return [space[0]] + ([other] if other else [])


def big_knob_sets(name, space, candidates) -> list[dict]:
    """``--plan s11big`` / ``s11large``: the knob space's first set (the compile path's untuned pick), then the
    case's ``candidates`` (:data:`BIG_CANDIDATES`; in the space or not: cp.async twins of TMA sets, split-K past one
    wave); each set once."""
    sets = [space[0]]
    for block_m, block_n, stages, pingpong, loads, split in candidates:
        if split > 1:
            sets.append({"block_n": block_n, "stages": stages, "persistent": False, "pingpong": False,
                         "split_k": split, "loads": loads})
            continue
        knobs = {"block_n": block_n, "stages": stages, "persistent": True, "pingpong": pingpong, "staged": True,
                 "loads": loads}
        if block_m != 128:
            knobs["block_m"] = block_m
        if "gelu" in name:
            knobs["fast_gelu"] = True
        sets.append(knobs)
    return [kn for i, kn in enumerate(sets) if kn not in sets[:i]]


def gelu_knob_sets(name, shape, space) -> list[dict]:
    """``--plan s12gelu``: a GELU template's first set in its tail form (the compile path's pick when session 13
    measured it; the tanh GELU's pick has ``gelu_form="tanh"`` since) and its ``tanh`` twin (at
    :data:`S12_COOP_ROWS` also the cooperative :data:`S12_COOP` set and its ``tanh`` twin);
    for ``gemm_bias_wgmma`` the erf-GELU template's first set at the same shape without ``fast_gelu`` (the pick's
    GELU-less twin)."""
    from stof_tvm.schedules.templates import get_template

    if "gelu" in name:
        tail = [{key: v for key, v in kn.items() if key != "gelu_form"} for kn in space]
        sets = [tail[0], dict(tail[0], gelu_form="tanh")]
        if shape["m"] == S12_COOP_ROWS:   # the cooperative set, whose epilogue no other consumer's MMAs hide
            coop = next(kn for kn in tail if kn == dict(kn, **S12_COOP))
            sets += [coop, dict(coop, gelu_form="tanh")]
        return sets
    pick = get_template("gemm_bias_gelu_erf_wgmma").knob_space(shape, DTYPE)[0]
    return [{key: v for key, v in pick.items() if key not in ("fast_gelu", "gelu_form")}]


def small_rows_knob_sets(name, shape, space, plan="s13small") -> list[dict]:
    """``--plan s13small`` / ``s18small``: the knob space's first set (the compile path's untuned pick), then the
    case's candidates (:data:`S13_CANDIDATES`: wgmma split-K sets, or mma.sync twin sets as ``{"mma": knobs}``;
    :data:`S18_CANDIDATES` after the pick's TMA twin, whose host-side map encoding a CUDA graph does once); each set
    once."""
    m, n, k = gemm_dims(name, shape)
    if plan == "s18small":
        sets = [space[0], dict(space[0], loads="tma")] + [dict(kn) for kn in S18_CANDIDATES[name, m, n, k]]
    else:
        sets = [space[0]] + [dict(kn) for kn in S13_CANDIDATES[name, m, n, k]]
    return [kn for i, kn in enumerate(sets) if kn not in sets[:i]]


def mma_twin(name: str) -> str:
    """The mma.sync template (weight [k, n]) the compile path runs where a GEMM stays off wgmma."""
    return "qkv_projection_kn" if name == "qkv_projection_wgmma" else name.removesuffix("_wgmma") + "_kn"


def tma_knob_sets(space) -> list[dict]:
    """``--plan s8tma``: the first knob set of the space (the compile path's untuned choice) and the first staged
    cooperative 128-row set of another tile shape, each with ``loads="cp.async"`` and ``loads="tma"``."""
    tile = lambda kn: (kn.get("block_m", 128), kn["block_n"], kn["stages"])  # noqa: E731
    first = space[0]
    other = next((kn for kn in space if kn.get("staged") and not kn["pingpong"] and kn.get("block_m", 128) == 128
                  and tile(kn) != tile(first) and kn.get("fast_gelu") == first.get("fast_gelu")), None)
    return [dict(kn, loads=loads) for kn in [first] + ([other] if other else []) for loads in ("cp.async", "tma")]


def choose_knobs(space) -> list[dict]:
    """The older knob sets worth timing, then the new ones (module docstring), each once, in the space's order."""
    old = [kn for kn in space if not is_new(kn)]
    widths = sorted({kn["block_n"] for kn in old}, reverse=True)
    chosen = [old[0]]
    for pingpong in (False, True):
        chosen += [next(kn for kn in old if kn["persistent"] and kn["pingpong"] == pingpong and kn["block_n"] == bn)
                   for bn in widths if any(kn["pingpong"] == pingpong and kn["block_n"] == bn for kn in old)]
    chosen += [dict(kn, staged=True) for kn in chosen]
    tall = [kn for kn in space if kn.get("block_m", 128) != 128 and kn["persistent"] and not kn.get("staged")]
    for bn in sorted({kn["block_n"] for kn in tall}, reverse=True):
        best = [kn for kn in tall if kn["block_n"] == bn][:TALL_PER_WIDTH]
        chosen += best + [dict(kn, staged=True) for kn in best]
    unique = []
    for kn in chosen:
        if kn in space and kn not in unique:   # staged twins past the shared-memory limit are not in the space
            unique.append(kn)
    return unique


def gemm_dims(name, shape) -> tuple[int, int, int]:
    if name == "qkv_projection_wgmma":
        hidden = shape["heads"] * shape["head_dim"]
        return shape["batch"] * shape["seq"], 3 * hidden, hidden
    return shape["m"], shape["n"], shape["k"]


# ---- build (here) ----------------------------------------------------------------------------------------

def build(args) -> None:
    from stof_tvm.cost_model.templates import price_knobs
    from stof_tvm.schedules.templates import cuda_source, get_template
    from stof_tvm.schedules.templates.build import build as build_template
    from stof_tvm.schedules.templates.build import cuda_target
    from stof_tvm.schedules.templates.gemm_wgmma import build_kernel

    OUT.mkdir(parents=True, exist_ok=True)
    common.OUT = OUT
    manifest = {"suite": args.plan, "cases": [], "modules": {}, "built": bl.environment()}
    t0 = time.time()
    for name, shape in PLANS[args.plan][0]:
        m, n, k = gemm_dims(name, shape)
        ckey = f"{name}_{m}x{n}x{k}_{DTYPE}"
        entry = {"key": ckey, "template": name, "shape": shape, "gemm": [m, n, k], "modules": []}
        space = get_template(name).knob_space(shape, DTYPE)
        chosen = {"s8tma": tma_knob_sets, "s9splitk": lambda sp: splitk_knob_sets(name, shape, sp),
                  "s9wide": lambda sp: wide_knob_sets(name, shape, sp),
                  "s10gemm": lambda sp: schedule_knob_sets(name, shape, sp),
                  "s10ragged": ragged_knob_sets,
                  "s11big": lambda sp: big_knob_sets(name, sp, BIG_CANDIDATES[m, n, k]),
                  "s11large": lambda sp: big_knob_sets(name, sp, LARGE_CANDIDATES[name, m, n, k]),
                  "s12gelu": lambda sp: gelu_knob_sets(name, shape, sp),
                  "s13small": lambda sp: small_rows_knob_sets(name, shape, sp),
                  "s18small": lambda sp: small_rows_knob_sets(name, shape, sp, "s18small"),
                  "s23tuned": lambda sp: [sp[0], S23_TUNED, S23_COOPERATIVE],
                  "s21gelu": lambda sp: s21_knob_sets(name, shape, sp),
                  }.get(args.plan, choose_knobs)(space)
        for knobs in chosen:
            key = f"{ckey}__{knob_tag(knobs)}"
            if "mma" in knobs:
                template = get_template(mma_twin(name))
                ex = build_template(template.schedule(shape, DTYPE, knobs["mma"]), cuda_target())
                common._export(manifest, key, "mma", knobs, ex, "main")
            else:
                ex = build_kernel(name, shape, DTYPE, knobs)
                common._export(manifest, key, "wgmma", knobs, ex, "gemm_wgmma")
                manifest["modules"][key]["predicted_ms"] = 1e3 * float(
                    price_knobs(get_template(name), shape, DTYPE, [knobs])[0])
            manifest["modules"][key]["new"] = is_new(knobs, args.plan, knobs == space[0])
            manifest["modules"][key]["default"] = knobs == space[0]
            if args.plan == "s8tma":
                manifest["modules"][key]["sass"] = sass_counts(OUT / f"{common.source_key(cuda_source(ex))}.cubin")
            entry["modules"].append(key)
        manifest["cases"].append(entry)
    bad = {key: info for key, info in manifest["modules"].items()
           if info["spill_stores"] or info["spill_loads"] or info["stack_frame"] or info["warnings"]}
    if bad and args.plan in ("s9wide", "s10gemm", *BIG_PLANS):   # a sweep: report a spilling set, do not time it
        print(f"ptxas spilled or warned, dropped: {sorted(bad)}")
        manifest["dropped"] = sorted(bad)
        for case in manifest["cases"]:
            case["modules"] = [key for key in case["modules"] if key not in bad]
    elif bad:
        raise RuntimeError(f"ptxas spilled or warned for {sorted(bad)}")
    if args.plan == "s8tma":
        manifest["models"] = build_models()
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(path.stat().st_size for path in OUT.rglob("*") if path.is_file()) / 2 ** 20
    print(f"{len(manifest['modules'])} modules in {OUT} ({size:.1f} MiB, {time.time() - t0:.0f} s); no spills, "
          "no ptxas warnings")


@contextlib.contextmanager
def forced_loads(loads: str):
    """The compile path with ``loads`` added to every wgmma GEMM's knobs (the knob is in no knob space, so only
    this puts it into a whole model)."""
    from stof_tvm.compiler import template_choice as tc
    from stof_tvm.schedules.templates.gemm_wgmma import WgmmaKernelMixin

    chosen = tc.TemplateChooser._wgmma

    def with_loads(self, template, shape, dtype):
        choice = chosen(self, template, shape, dtype)
        if isinstance(template, WgmmaKernelMixin):
            return tc.KnobChoice(dict(choice.knobs, loads=loads), choice.source, choice.seconds)
        return choice

    tc.TemplateChooser._wgmma = with_loads
    try:
        yield
    finally:
        tc.TemplateChooser._wgmma = chosen


def build_models() -> dict:
    """``--plan s8tma``: the tiny RoBERTa compiled with each loads value (``roberta_<loads>/`` artifacts with their
    cubins; the weights once, in ``roberta_cpasync``), its inputs per seed and torch float32's outputs on
    :data:`MODEL_ROWS` (``model_*.npy``)."""
    import stof_tvm
    from stof_tvm.models import hf_export as hx

    with tempfile.TemporaryDirectory() as cache:
        path = hx.cached_export(Path(cache), "roberta", size="tiny", attn="eager", exporter="torchscript", opset=17,
                                batch=2, seq_len=64, dynamic=True)
        torch_model = hx.build_model("roberta", "tiny", "eager")
        for seed in sorted(set(MODEL_SEEDS)):
            inputs = hx.example_inputs("roberta", MODEL_BATCH, MODEL_SEQ, padded_rows=MODEL_BATCH // 2, seed=seed)
            for name, value in inputs.items():
                np.save(OUT / f"model_{name}_{seed}.npy", value, allow_pickle=False)
            np.save(OUT / f"model_reference_{seed}.npy", hx.torch_outputs(torch_model, inputs)[list(MODEL_ROWS)],
                    allow_pickle=False)
        models = {}
        for loads in ("cp.async", "tma"):
            with forced_loads(loads):
                art = stof_tvm.compile(path, mask="dense", batch=MODEL_BATCH, seq_len=MODEL_SEQ, target="cuda",
                                       dtype="float16", gemm="wgmma", cuda_graph=True)
            folder = f"roberta_{loads.replace('.', '')}"
            art.save(OUT / folder, weights=loads == "cp.async")
            stages = [stage for site in art.manifest["templates"]["sites"] for stage in site["stages"]]
            models[loads] = {"artifact": folder, "wgmma": [(st["template"], st["knobs"]) for st in stages
                                                            if st["template"].endswith("_wgmma")]}
            print(f"{folder}: {len(models[loads]['wgmma'])} wgmma GEMM stages with loads={loads}", flush=True)
    return models


def sass_counts(cubin: Path) -> dict | None:
    """What the TMA loads change in the SASS: TMA copies (UTMALDG), 16-byte cp.async (LDGSTS), memory barriers
    (MEMBAR: the consumers' proxy fences), wgmma (HGMMA), local memory (LDL / STL); None without a cuobjdump."""
    ops = bl.sass_opcodes(cubin)
    if ops is None:
        return None
    return {name: sum(op.split(".")[0] == name for op in ops)
            for name in ("UTMALDG", "LDGSTS", "MEMBAR", "HGMMA", "LDL", "STL")}


# ---- run (on the GPU) --------------------------------------------------------------------------------------

def torch_forms(torch, name, shape, a, w, bias):
    """(cuBLAS GEMM alone, torch eager's whole form) as callables on the case's inputs."""
    F = torch.nn.functional
    b = bias if name != "gemm_wgmma" else None
    gemm = lambda: F.linear(a, w, b)  # noqa: E731
    if name == "gemm_bias_gelu_erf_wgmma":
        return gemm, lambda: F.gelu(F.linear(a, w, b))
    if name == "gemm_bias_gelu_tanh_wgmma":
        return gemm, lambda: F.gelu(F.linear(a, w, b), approximate="tanh")
    if name == "qkv_projection_wgmma":
        B, S, H, D = (shape[key] for key in ("batch", "seq", "heads", "head_dim"))
        return gemm, lambda: F.linear(a, w, b).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4).contiguous()
    return gemm, gemm


def run(args) -> None:
    import torch
    import tvm
    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    if not ensure_cuda_runtime():
        raise RuntimeError("TVM's CUDA runtime could not be loaded")
    common.OUT = OUT
    misses = bl.PrebuiltCubins(OUT).misses   # source keys compiled here instead of prebuilt
    manifest = json.loads((OUT / "manifest.json").read_text())
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    passed, models = None, {}
    if args.skip_failed_in:
        checked = json.loads(Path(args.skip_failed_in).read_text())
        passed = {key: e for row in checked["results"] for key, e in row["kernels"].items() if e.get("correct")}
        models.update(checked.get("models") or {})   # the check process's whole-model results, carried over
    results, environment = [], bl.environment()
    report = lambda: {"plan": manifest.get("suite", "small_k"), "only": args.only, "results": results,  # noqa: E731
                      "models": models, "cubin_misses": misses, "iters": args.iters, "reps": args.reps,
                      "environment": environment}
    rows = {}
    # checks alone: the older ("new" False: cp.async) modules of every case before any other (a kernel that faults
    # ends the process; what was checked before it stays in the JSON)
    for new in ((False, True) if args.only == "check" else (None,)):
        for case in manifest["cases"]:
            keys = [key for key in case["modules"] if new is None or manifest["modules"][key]["new"] == new]
            rows[case["key"]] = run_case(case, keys, manifest["modules"], torch, tvm, args, passed,
                                         rows.get(case["key"]), lambda: save(args, report()))
            results[:] = list(rows.values())
            save(args, report())
    if manifest.get("models") and args.only != "time":   # last: a module that faults costs only this check
        models.update(bl.guarded(models, "model", model_check, manifest["models"]) or {})
        save(args, report())
    if args.only == "check":
        check_table(results)
    else:
        table(results)
        if manifest.get("suite") == "s8tma":
            table_tma(results)
        if manifest.get("suite") in BIG_PLANS:
            table_big(results, manifest["modules"])
        if manifest.get("suite") == "s9splitk":
            table_splitk(results, manifest["modules"])
            for call in models.get("calls", []):
                print(f"tiny RoBERTa (CUDA graph) inputs {call['seed']}: rel err vs torch float32 cp.async "
                      f"{call['cp.async_rel_err']:.2e} / TMA {call['tma_rel_err']:.2e}, TMA - cp.async max |diff| "
                      f"{call['tma_vs_cpasync_max_abs']:.2e}")
            if "model_failed" in models:
                print(f"tiny RoBERTa check failed: {models['model_failed']}")
    print(f"cubins compiled on the GPU machine instead of prebuilt: {len(misses)}")


def save(args, report) -> None:
    text = json.dumps(report, indent=1)
    (OUT / "results.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)


def case_inputs(torch, case, seed_offset=0):
    """The case's seeded float16 inputs: activations N(0, 1), weights N(0, 1/k), bias N(0, 1)."""
    dev = torch.device("cuda")
    m, n, k = case["gemm"]
    seed = (int(common.source_key(case["key"]), 16) + seed_offset) % 2 ** 31
    gen = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randn(m, k, device=dev, generator=gen).half()
    w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).half()
    bias = torch.randn(n, device=dev, generator=gen).half()
    return a, w, bias


def run_case(case, keys, modules, torch, tvm, args, passed, row, checkpoint) -> dict:
    """Check (and unless ``--only check``, time) modules ``keys`` of ``case``; ``passed``: the entries of the modules
    a previous check process passed (others are skipped; their graph replay results are carried over), None for
    all; ``row``: the case's row so far (the check process's second pass), else a new one."""
    import os

    dev = torch.device("cuda")
    m, n, k = case["gemm"]
    a, w, bias = case_inputs(torch, case)
    name, shape = case["template"], case["shape"]
    gemm, eager = torch_forms(torch, name, shape, a, w, bias)
    ref = torch_forms(torch, name, shape, a.float(), w.float(), bias.float())[1]()
    flops = 2 * m * n * k
    if row is None:
        row = {"case": case["key"], "template": name, "shape": shape, "flops": flops, "kernels": {}}
        if args.only != "check":
            row.update(cublas_ms=common.median_ms(gemm, args.iters, args.reps),
                       eager_ms=common.median_ms(eager, args.iters, args.reps))
            if args.plan in BIG_PLANS:
                row.update({f"cublas_{field}": ms for field, ms in in_model_timings(gemm, row["cublas_ms"]).items()})
    weights = weight_pool(torch, case, w) if args.plan in GRAPH_PLANS and args.only != "check" else []
    if weights and "cublas_graphed_ms" not in row:
        row["cublas_graphed_ms"] = graphed_ms(torch, [torch_forms(torch, name, shape, a, wi, bias)[0]
                                                      for wi in weights])
        row["cublas_kernels"] = sorted({e["name"][:160] for e in bl.trace_kernels(gemm, None, 3)})
        print(f"cuBLAS runs {row['cublas_kernels']}", flush=True)
    args_in = [a, w] + ([bias] if name != "gemm_wgmma" else [])
    w_kn = None
    for key in keys:
        info = modules[key]
        own_args = args_in
        if info["kind"] == "mma":   # the mma.sync templates take the weight as [k, n]
            w_kn = w.t().contiguous() if w_kn is None else w_kn
            own_args = [a, w_kn] + args_in[2:]
        entry = {"knobs": info["knobs"], "new": info["new"]}
        if passed is not None and key not in passed:
            row["kernels"][key] = dict(entry, error="skipped: not passed by the check process")
            continue
        print(f"{key}: launching", flush=True)  # a kernel that hangs or faults is the last one named
        row["kernels"][key] = dict(entry, error="launched, never finished (fault or hang)")
        checkpoint()
        try:
            func = tvm.runtime.load_module(str(OUT / info["library"]))[info["function"]]
        except Exception as err:  # a failed load is a result to report, not a reason to stop the run
            row["kernels"][key] = dict(entry, error=f"load: {err}"[:300])
            continue
        guard = GUARD_ROWS if ref.dim() == 2 and args.plan in ("s10ragged", *BIG_PLANS) else 0
        padded_out = torch.full((ref.shape[0] + guard, *ref.shape[1:]), float("nan"), device=dev,
                                dtype=torch.float16)
        out = padded_out[:ref.shape[0]]   # the first rows: the kernel's output; the rest must stay NaN
        tv = [tvm.runtime.from_dlpack(t) for t in own_args + [out]]
        try:
            func(*tv)
        except Exception as err:  # a launch the runtime refuses (e.g. a cluster it cannot place) is a result
            row["kernels"][key] = dict(entry, error=f"launch: {type(err).__name__}: {err}"[:300])
            continue
        if not common.bl.finished(common.HANG_S):
            row["kernels"][key] = dict(entry, error=f"hang: not finished after {common.HANG_S:.0f} s")
            print(f"{key}: HANG; stopping the run", flush=True)
            checkpoint()
            os._exit(3)
        err = float(torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref))
        entry.update(rel_err=err, finite=bool(torch.isfinite(out).all()))
        entry["correct"] = entry["finite"] and err < common.TOL[DTYPE]
        if guard:
            entry["rows_past_m_untouched"] = bool(torch.isnan(padded_out[ref.shape[0]:]).all())
            entry["correct"] = entry["correct"] and entry["rows_past_m_untouched"]
        split = info["knobs"].get("split_k", 1) > 1
        if split and args.only != "time":   # split-K sums in rank order: the same bits
            first = out.clone()
            out.fill_(float("nan"))
            func(*tv)
            entry["deterministic"] = bool(torch.equal(out, first))
            entry["correct"] = entry["correct"] and entry["deterministic"]
        if entry["correct"] and args.only != "check":
            entry["ms"] = common.median_ms(lambda: func(*tv), args.iters, args.reps)
            entry["tflops"] = flops / entry["ms"] / 1e9
            entry["vs_cublas"] = row["cublas_ms"] / entry["ms"]
            if args.plan in BIG_PLANS:
                entry.update(in_model_timings(lambda: func(*tv), entry["ms"]))
            if weights and info["kind"] == "wgmma":
                entry["graphed_ms"] = graphed_ms(torch, [tvm_call(func, [tv[0], tvm.runtime.from_dlpack(wi), *tv[2:]])
                                                         for wi in weights])
        elif not entry["correct"]:
            entry["diagnosis"] = common._diagnose(torch, out.float().reshape(-1, ref.shape[-1]),
                                                  ref.reshape(-1, ref.shape[-1]))
        if entry["correct"] and (info["knobs"].get("loads") == "tma" or split) and args.only != "time":
            entry.update(graph_replay(torch, func, case, args_in, out, tv))   # after the timing: cannot cost it
        elif passed is not None:
            entry.update({field: v for field, v in passed[key].items() if field.startswith("graph_")})
        row["kernels"][key] = entry
        print(f"{key}: err {err:.2e} {'ok' if entry['correct'] else 'WRONG'}"
              + (f", graph replay err {entry['graph_rel_err']:.2e}" if "graph_rel_err" in entry else "")
              + (f", {entry['ms']:.4f} ms" if "ms" in entry else ""), flush=True)
    for new in (False, True):
        timed = [(e["ms"], key) for key, e in row["kernels"].items() if e["new"] == new and "ms" in e]
        row["best_new" if new else "best_old"] = min(timed) if timed else None
    return row


def weight_pool(torch, case, w) -> list:
    """:data:`GRAPH_CALLS` weights for one case: ``w`` and seeded others of its shape and scale, so that each call of
    a captured graph reads a weight of its own from HBM (together larger than the H200's 50 MB L2 at these shapes
    but the smallest), as the layers of a model do."""
    gen = torch.Generator(device=w.device).manual_seed(int(common.source_key(case["key"] + "pool"), 16) % 2 ** 31)
    scale = w.shape[1] ** -0.5
    return [w] + [(torch.randn(w.shape, device=w.device, generator=gen) * scale).half()
                  for _ in range(GRAPH_CALLS - 1)]


def tvm_call(func, tv):
    """``func(*tv)`` as a no-argument callable launching on torch's current stream (a capturing one included)."""
    import tvm_ffi

    def call():
        with tvm_ffi.use_torch_stream():
            func(*tv)
    return call


def graphed_ms(torch, calls) -> float:
    """ms per call of ``calls`` (no-argument callables) captured back to back in one CUDA graph, as a whole forward
    runs its kernels: no launch overhead, each kernel's blocks scheduled under the one before (dependent launches),
    the median of 20 samples of 5 replays by CUDA events, divided by the calls."""
    replay, _ = bl.graphed(lambda: [call() for call in calls])
    return bl.time_ms(replay, warmup=3, samples=20, number=5).median_ms / len(calls)


def in_model_timings(fn, ms: float) -> dict:
    """:data:`BIG_PLANS`: a call (``ms`` per call in the usual timing) timed as a whole forward runs it and as
    ``stof-tvm bench --profile`` measures it: ``sustained_ms``, the median of 5 samples of back-to-back calls lasting
    :data:`SUSTAINED_MS` each (the clocks under a sustained load), and ``profiled_ms``, the median wall time of one call
    between device synchronisations (:data:`PROFILED_CALLS` of them: the launch, the host's work such as encoding
    TMA maps, and the synchronisation included)."""
    number = max(1, min(5000, round(SUSTAINED_MS / ms)))
    return {"sustained_ms": bl.time_ms(fn, warmup=5, samples=5, number=number).median_ms,
            "profiled_ms": bl.time_ms(fn, device="cuda-wall", warmup=5, samples=PROFILED_CALLS, number=1).median_ms}


def graph_replay(torch, func, case, args_in, out, tv) -> dict:
    """The TMA module (``tv``: its TVM arguments, views of ``args_in + [out]``) launched on torch's current stream
    and captured in a CUDA graph, new activations copied into the captured A, the output poisoned, the graph
    replayed: the maps the host encoded at capture must read the new values (relative error against torch float32
    on them). A is restored after."""
    import tvm_ffi

    def call():
        with tvm_ffi.use_torch_stream():
            func(*tv)

    a, w = args_in[0], args_in[1]
    bias = args_in[2] if len(args_in) > 2 else None
    saved = a.clone()
    try:
        replay, _ = bl.graphed(call)
        a.copy_(case_inputs(torch, case, seed_offset=1)[0])
        out.fill_(float("nan"))
        replay()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - a capture that fails is a result to report
        a.copy_(saved)
        return {"graph_error": f"{type(err).__name__}: {err}"[:300], "graph_correct": False}
    ref = torch_forms(torch, case["template"], case["shape"], a.float(), w.float(),
                      None if bias is None else bias.float())[1]()
    err = float(torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref))
    a.copy_(saved)
    return {"graph_rel_err": err, "graph_correct": bool(torch.isfinite(out).all()) and err < common.TOL[DTYPE]}


def model_check(built: dict) -> dict:
    """The tiny RoBERTa of each loads value (CUDA graphs; :func:`build_models`) called three times (capture, then
    replays on new and on the first inputs): each call's ``last_hidden_state`` against torch float32 on
    :data:`MODEL_ROWS` (kept positions; relative Frobenius error), and TMA against cp.async (max absolute
    difference: the same products in the same order, so 0 is expected)."""
    from stof_tvm.runtime import load

    with np.load(OUT / built["cp.async"]["artifact"] / "weights.npz", allow_pickle=False) as npz:
        weights = dict(npz)
    loaded = {loads: load(OUT / info["artifact"], weights=weights) for loads, info in built.items()}
    calls = []
    for seed in MODEL_SEEDS:
        inputs = {name: np.load(OUT / f"model_{name}_{seed}.npy") for name in ("input_ids", "attention_mask")}
        ref = np.load(OUT / f"model_reference_{seed}.npy").astype(np.float64)
        kept = inputs["attention_mask"][list(MODEL_ROWS)].astype(bool)
        outs = {loads: np.asarray(model(**inputs)["last_hidden_state"], np.float64)
                for loads, model in loaded.items()}
        call = {"seed": seed, "tma_vs_cpasync_max_abs": float(np.abs(outs["tma"] - outs["cp.async"]).max())}
        for loads, out in outs.items():
            got = out[list(MODEL_ROWS)][kept]
            call[f"{loads}_rel_err"] = float(np.linalg.norm(got - ref[kept]) / np.linalg.norm(ref[kept]))
            call[f"{loads}_finite"] = bool(np.isfinite(out).all())
        calls.append(call)
        print(f"tiny RoBERTa call (inputs {seed}): rel err vs torch float32 cp.async {call['cp.async_rel_err']:.2e}, "
              f"tma {call['tma_rel_err']:.2e}; TMA - cp.async max |diff| {call['tma_vs_cpasync_max_abs']:.2e}",
              flush=True)
    ok = all(c["tma_finite"] and c["tma_rel_err"] < 2 * c["cp.async_rel_err"] + 1e-3 for c in calls)
    return {"calls": calls, "tma_ok": ok}


def check_table(results) -> None:
    """``--only check``: per module, the error against torch float32 (and after a graph replay) and the verdict."""
    print(f"\n{'module':72s} {'rel err':>8s} {'graph':>8s}  verdict")
    for row in results:
        for key, e in row["kernels"].items():
            graph = f"{e['graph_rel_err']:8.1e}" if "graph_rel_err" in e else f"{'-':>8s}"
            verdict = "ok" if e.get("correct") else (e.get("error") or "WRONG")
            if e.get("graph_correct") is False:
                verdict += f"; graph replay {e.get('graph_error') or 'WRONG'}"
            print(f"{key:72s} {e.get('rel_err', float('nan')):8.1e} {graph}  {verdict}")


def table(results) -> None:
    for row in results:
        print(f"\n{row['case']}: cuBLAS F.linear {row['cublas_ms']:.4f} ms "
              f"({row['flops'] / row['cublas_ms'] / 1e9:.0f} TFLOP/s), torch eager {row['eager_ms']:.4f} ms")
        print(f"  {'knobs':22s} {'new':>3s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuBLAS':>8s} {'x eager':>8s} "
              f"{'rel err':>8s}")
        for key, e in row["kernels"].items():
            head = f"  {key.split('__')[1]:22s} {'yes' if e['new'] else '':>3s}"
            if "ms" in e:
                print(f"{head} {e['ms']:8.4f} {e['tflops']:8.0f} {e['vs_cublas']:8.2f} "
                      f"{row['eager_ms'] / e['ms']:8.2f} {e['rel_err']:8.1e}")
            else:
                print(f"{head} {e.get('error') or 'WRONG err %.1e' % e['rel_err']}")
    print(f"\n{'case':46s} {'cuBLAS ms':>9s} {'eager ms':>9s} {'best old':>9s} {'best new':>9s} {'new/old':>7s}  "
          "best old knobs / best new knobs")
    for row in results:
        old, new = row["best_old"], row["best_new"]
        print(f"{row['case']:46s} {row['cublas_ms']:9.4f} {row['eager_ms']:9.4f} "
              f"{old[0] if old else float('nan'):9.4f} {new[0] if new else float('nan'):9.4f} "
              f"{(old[0] / new[0]) if old and new else float('nan'):7.3f}  "
              f"{old[1].split('__')[1] if old else '-'} / {new[1].split('__')[1] if new else '-'}")
    print("(x cuBLAS = F.linear time / kernel time; x eager = torch eager's whole form / kernel time; new/old > 1: the "
          "best new knob set is faster than the best older one)")


def table_tma(results) -> None:
    """``--plan s8tma``, printed last: per case and knob set, the cp.async and TMA modules side by side with cuBLAS
    and torch eager."""
    print(f"\n{'case':44s} {'knobs':24s} {'cuBLAS':>7s} {'eager':>7s} {'cp.async':>8s} {'TMA':>7s} {'TMA x':>6s} "
          f"{'TFLOP/s':>7s} {'x cuBLAS':>8s} {'graph':>5s}")
    for row in results:
        for key, e in row["kernels"].items():
            if e["knobs"].get("loads") != "cp.async":
                continue
            twin = row["kernels"].get(key.removesuffix("_cpasync") + "_tma", {})
            cp, tma = e.get("ms"), twin.get("ms")
            best = min(t for t in (cp, tma, float("inf")) if t is not None)
            cell = lambda t: f"{t:.4f}" if t is not None else "-"  # noqa: E731
            speedup = f"{cp / tma:6.3f}" if cp and tma else f"{'-':>6s}"
            rate = (f"{row['flops'] / best / 1e9:7.0f} {row['cublas_ms'] / best:8.2f}" if best < float("inf")
                    else f"{'-':>7s} {'-':>8s}")
            graph = {True: "ok", False: "WRONG"}.get(twin.get("graph_correct"), "-")
            print(f"{row['case'].removesuffix('_' + DTYPE):44s} {key.split('__')[1].removesuffix('_cpasync'):24s} "
                  f"{row['cublas_ms']:7.4f} "
                  f"{row['eager_ms']:7.4f} {cell(cp):>8s} {cell(tma):>7s} {speedup} {rate} {graph:>5s}"
                  + ("" if tma is not None else f"  TMA: {twin.get('error') or 'WRONG'}"))
    print("(ms per call, CUDA events; cuBLAS = F.linear alone, eager = torch's whole form (+ F.gelu); TMA x = "
          "cp.async ms / TMA ms, > 1: TMA faster; TFLOP/s and x cuBLAS of the faster of the two; graph: the TMA "
          "module replayed from a CUDA graph on new activations)")


def table_splitk(results, modules) -> None:
    """``--plan s9splitk``, printed last: per case cuBLAS, what the compile path ran before (HEAD: the wgmma default
    with cp.async, or the mma.sync template), the knob space's first set now (its model prediction beside it), the
    best split-K set and the best of all."""
    print(f"\n{'case':44s} {'cuBLAS':>7s} {'before':>7s} {'default':>7s} {'pred':>7s} {'split':>7s} {'best':>7s} "
          f"{'x before':>8s} {'x cuBLAS':>8s}  default / best split / best knobs")
    for row in results:
        timed = {key: e["ms"] for key, e in row["kernels"].items() if "ms" in e}
        tag = lambda key: key.split("__")[1] if key else "-"  # noqa: E731
        before = next((key for key in row["kernels"] if not modules[key]["new"] and not modules[key]["default"]),
                      None)
        default = next((key for key in row["kernels"] if modules[key]["default"]), None)
        split = min((key for key in timed if modules[key]["new"]), key=timed.get, default=None)
        best = min(timed, key=timed.get, default=None)
        cell = lambda key: f"{timed[key]:7.4f}" if key in timed else f"{'-':>7s}"  # noqa: E731
        pred = modules[default].get("predicted_ms") if default else None
        ratio = lambda x, y: f"{x / y:8.2f}" if x and y else f"{'-':>8s}"  # noqa: E731
        print(f"{row['case'].removesuffix('_' + DTYPE):44s} {row['cublas_ms']:7.4f} {cell(before)} {cell(default)} "
              f"{pred if pred is not None else float('nan'):7.4f} {cell(split)} {cell(best)} "
              f"{ratio(timed.get(before), timed.get(best))} {ratio(row['cublas_ms'], timed.get(best))}  "
              f"{tag(default)} / {tag(split)} / {tag(best)}")
    print("(ms per call, CUDA events; before = the compile path at commit 098a891, default = the knob space's first "
          "set now, pred = the model's time for it, split = the fastest split-K set; x before = before / best)")


def table_big(results, modules) -> None:
    """:data:`BIG_PLANS`, printed last: per case cuBLAS, then every knob set (the default, the compile path's untuned
    pick, first) with its time against the default and cuBLAS, sustained and as the profiler measures it; then per
    case the fastest set."""
    print(f"\n{'case / knobs':58s} {'ms':>7s} {'TFLOP/s':>7s} {'x dflt':>6s} {'x cuBLAS':>8s} {'sustain':>7s} "
          f"{'profiled':>8s} {'graphed':>8s}")
    best = {}
    for row in results:
        print(f"{row['case'].removesuffix('_' + DTYPE):58s} {row['cublas_ms']:7.4f} "
              f"{row['flops'] / row['cublas_ms'] / 1e9:7.0f} {'':6s} {'(cuBLAS)':>8s} "
              f"{row.get('cublas_sustained_ms', float('nan')):7.4f} {row.get('cublas_profiled_ms', float('nan')):8.4f} "
              f"{row.get('cublas_graphed_ms', float('nan')):8.4f}")
        timed = {key: e for key, e in row["kernels"].items() if "ms" in e}
        field = "graphed_ms" if timed and all("graphed_ms" in e for e in timed.values()) else "ms"   # what ranks
        default = next((e["ms"] for key, e in timed.items() if modules[key]["default"]), None)
        for key, e in row["kernels"].items():
            tag = ("* " if modules[key]["default"] else "  ") + key.split("__")[1]
            if key not in timed:
                print(f"  {tag:56s} {e.get('error') or 'WRONG err %.1e' % e.get('rel_err', float('nan'))}")
                continue
            vs_default = f"{default / e['ms']:6.3f}" if default else f"{'-':>6s}"
            print(f"  {tag:56s} {e['ms']:7.4f} {e['tflops']:7.0f} {vs_default} {e['vs_cublas']:8.3f} "
                  f"{e.get('sustained_ms', float('nan')):7.4f} {e.get('profiled_ms', float('nan')):8.4f} "
                  f"{e.get('graphed_ms', float('nan')):8.4f}")
        if timed:
            key = min(timed, key=lambda key: timed[key][field])
            default = next((e[field] for key, e in timed.items() if modules[key]["default"]), None)
            best[row["case"]] = (key.split("__")[1], timed[key][field], default, row[f"cublas_{field}"])
    print(f"\n{'case':46s} {'default':>7s} {'best':>7s} {'x dflt':>6s} {'x cuBLAS':>8s}  best knobs (graphed where "
          "timed so)")
    for case, (tag, ms, default, cublas) in best.items():
        print(f"{case.removesuffix('_' + DTYPE):46s} {default or float('nan'):7.4f} {ms:7.4f} "
              f"{(default or float('nan')) / ms:6.3f} {cublas / ms:8.3f}  {tag}")
    print("(ms per call, CUDA events, median of the usual samples; * = the knob space's first set, the compile path's "
          "untuned pick; x dflt = default ms / ms; sustain = back-to-back for 50 ms a sample; profiled = one call "
          "between device synchronisations, as stof-tvm bench --profile times it; graphed = "
          f"{GRAPH_CALLS} calls in one CUDA graph, each with its own weight)")


def main(argv=None) -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("build", help="compile and export the kernels here (TVM compiler and nvcc)")
    r = sub.add_parser("run", help="check and time on the GPU")
    r.add_argument("--iters", type=int, default=30, help="timed samples per kernel (median reported)")
    r.add_argument("--reps", type=int, default=10, help="back-to-back calls per timed sample")
    r.add_argument("--json", default=None, help="also write the results here (e.g. $OUT/small_k.json)")
    r.add_argument("--only", choices=("check", "time"), default=None,
                   help="check: correctness only (older modules first); time: check and time (default: both)")
    r.add_argument("--skip-failed-in", default=None,
                   help="a --only check JSON: run only the modules it passed")
    for p in sub.choices.values():
        p.add_argument("--plan", choices=sorted(PLANS), default="small_k",
                       help="small_k: the session-4 knob sets; s8tma: cp.async vs TMA loads (issue 17); "
                            "s9splitk: split-K and the new defaults at 128-4096 rows (issue 17); "
                            "s9wide: the 4096-row defaults against the model's best-ranked sets; "
                            "s10gemm: the tile schedules at the 4096-row GEMMs; s10ragged: GEMMs of any m; "
                            "s11big: the 32768-row GEMMs and ViT-Base's at 1576 / 6304 rows; "
                            "s11large: BERT-large's 4096-row GEMMs, GPT-2's tanh GELU; "
                            "s12gelu: the GELU GEMM's epilogue forms (gelu_form); "
                            "s13small: GPT-2's GEMMs at 128 / 512 rows, sets that fill the SMs; "
                            "s18small: BERT-large's and BERT-base's at 128 rows, timed in a CUDA graph too; "
                            "s21gelu: the erf GELU GEMM at 4096 rows against its GELU-less twins and FFN down")
        p.add_argument("--out", type=Path, default=None,
                       help="artifact folder (default out/wgmma_small_k, --plan s8tma: out/s8gemm_tma)")
    args = parser.parse_args(argv)
    OUT = PLANS[args.plan][1] if args.out is None else args.out
    OUT = OUT if OUT.is_absolute() else ROOT / OUT
    build(args) if args.step == "build" else run(args)


if __name__ == "__main__":
    sys.exit(main())
