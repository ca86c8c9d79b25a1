"""Opt-in Hopper templates: the GEMM (+ bias) (+ activation) family on ``wgmma`` (sm_90a).

Names: ``gemm_wgmma``, ``gemm_bias_wgmma``, ``gemm_bias_<act>_wgmma`` (act in relu, gelu_erf, gelu_tanh); the
weight is [n, k] (``torch.nn.Linear``) only. Same parameters, semantics and float64 reference as the
mma.sync ``gemm*`` templates of :mod:`.gemm`, so they are drop-in alternatives on sm_90a.

**Where they are used.** ``stof_tvm.compile`` maps GEMM calls to these templates on sm_90 (``gemm="auto"`` or
``"wgmma"``), and the tuner measures their knob sets. Every knob set's numerics were checked on an H200 against torch
float32 (``scripts/check_wgmma_gpu.py``, ``scripts/bench_wgmma_small_k.py``; BENCHMARKS.md); CPU tests compile them
with nvcc for sm_90a (tests/test_templates_wgmma.py).

Why the Template API differs here: the kernel (:mod:`.wgmma_kernel`) is written at thread level, because
TensorIR's schedule primitives cannot produce it: warp-specialized roles with ``setmaxnreg``, mbarrier
phases across a shared-memory ring, wgmma matrix descriptors over a 128-byte-swizzled layout, and
accumulators whose register layout is the instruction's. So:

- :meth:`~.registry.Template.primfunc` gives the knob-free TensorIR definition (the same as ``gemm*``,
  llvm-buildable: the CPU numerics reference, same signature as the kernel);
- :meth:`WgmmaGemmTemplate.kernel` gives the CUDA kernel for a shape, dtype and knobs;
- ``apply`` / ``sample`` raise ValueError (there is nothing to schedule); knobs are chosen from
  :meth:`~.registry.Template.knob_space` and the kernel is rebuilt per choice.

Knobs: ``block_n`` (128, 192 or 256: wgmma N, output columns per tile), ``stages`` (2-5, ring depth),
``persistent`` (one block per SM looping over tiles, or one block per tile) and ``pingpong`` (consumer schedule,
persistent only: False = *cooperative*, a 128-row tile split between the two consumer warpgroups, 64 rows each;
True = *ping-pong*, each consumer owns alternate tiles of ``tile_m`` rows, 128 at ``block_n`` 128 and 64 at 192
and 256, so that one consumer's epilogue overlaps the other's MMAs; 128 at 192 with ``block_m = 256``, two tiles in
flight: :meth:`WgmmaKernelMixin.tall_pingpong_sets`, which lead where the H200 measured them fastest,
:data:`PINGPONG_FIRST`). ``block_k`` is 64. Knob sets without
``pingpong`` are cooperative (the kernels built before the knob existed, byte for byte). Three optional knobs, present
only in the knob sets that use them (so older sets keep their names and kernels): ``block_m = 256`` (cooperative
256-row tiles, 128 rows per consumer warpgroup; default 128), ``staged = True`` (the epilogue through shared memory
with 16-byte coalesced stores; default False) and, for the GELU templates, ``fast_gelu = True`` (staged only: the GELU
from one exp2 of a fitted polynomial, :mod:`.fast_gelu`, within 1e-5 / 3e-5 relative of the erf / tanh GELU; default
False: CUDA's ``erff`` / ``tanhf``). ``loads`` (``"tma"``: one producer thread issuing TMA boxes from tensor maps the
host encodes at each call, :mod:`.wgmma_kernel`; or ``"cp.async"``, the default of knob sets without it) is named by
every knob set of the space: TMA, measured faster on the H200 (:meth:`WgmmaKernelMixin.default_loads`), except the QKV
projection's 256-row tiles and the split-K sets (cp.async). ``split_k`` (2-8 in the space, 12 and 16 too in a knob set;
absent: 1) shares each 128-row tile's k steps between the blocks of one cluster, whose float32 partials are reduced
through distributed shared memory before the epilogue (:mod:`.wgmma_kernel`): the split-K sets
(:meth:`WgmmaKernelMixin.split_sets`, one wave of blocks) lead the space where the first unsplit set's tiles fill fewer
than half the SMs (RoBERTa-base at 1 x 128 tokens: 6-24 tiles, 24-96 blocks split, measured 1.17-1.60x faster than the
mma.sync templates on the H200, ``--plan s9splitk``), else they follow it. Clusters of 2 or 4 blocks sharing each W box
by TMA multicast (W through L2 once per cluster) were built and measured on the H200 1.2-2.2x slower than the same
sets without (session 10, ``--plan s10gemm`` at 2a96759: e.g. 128 x 192 at the QKV projection at 4096 rows 0.0344 /
0.0531 ms at 2 / 4 against 0.0255, FFN down 0.0494 / 0.0832 against 0.0283), and removed again.

Knob order (the first set is the untuned choice of the compile path): the staged sets come first, led by the ones the
H200 measured fastest (:data:`MEASURED_FIRST`, led by the first whose tiles leave the busiest SM about as few outputs as
the best: :func:`measured_order`), then the direct-store sets in their older order; a GELU template's
``fast_gelu`` twins of its staged sets lead them, in the same order. On the H200 every
staged cooperative set beat every direct-store one at BERT-Base's 32768-token GEMMs, by 1.40-2.24x best against best
(``scripts/bench_wgmma_small_k.py``; BENCHMARKS.md, session 4). Every shape has staged sets (the QKV projection's
``head_dim``, a multiple of 16, holds the 8 columns of a 16-byte store); where the device's shared memory takes none
of them, the first fitting set leads. Three ping-pong sets may take the lead where the H200 measured them faster: the
128 x 192 one (:data:`PINGPONG_FIRST`), a GELU template's 128 x 128 one (:data:`GELU_PINGPONG_MIN_WAVES`), and where
the first set's tiles fill less than one wave of the SMs the 64 x 192 one if its tiles leave the busiest SM fewer
outputs (:meth:`WgmmaKernelMixin._wave_lead`).
"""
from __future__ import annotations

import tvm
from tvm import te

from .epilogue import ACTIVATIONS, LN_EPS
from .fast_gelu import FAST_GELU_ACTIVATIONS
from .gemm import GemmTemplate
from .gemm_layernorm import GemmLayerNormTemplate
from .layernorm import layernorm_compute
from .qkv import QKVTemplate
from .registry import H200, Hardware, Template, register
from .wgmma_kernel import (BLOCK_K, BLOCK_M, BLOCK_M_CHOICES, BLOCK_N_CHOICES, CONSUMER_REGS, LAUNCH_REGISTERS,
                           MAX_NORM_CLUSTER, PINGPONG_TILE_M, PORTABLE_SPLIT_K, SPLIT_K_CHOICES, STAGE_CHOICES,
                           TALL_PINGPONG_N, THREADS, WgmmaConfig, check_wgmma_shape, grid_blocks, row_tiles,
                           wgmma_gemm_primfunc)

ARCH = "sm_90a"
TALL_BLOCK_M = max(BLOCK_M_CHOICES)   # 256-row cooperative tiles: 128 rows per consumer warpgroup
TALL_BLOCK_N = (128, 192)             # block_n accumulators per thread: 256 would not fit the 232 registers
# The staged knob sets measured fastest on the H200 (scripts/bench_wgmma_small_k.py at BERT-Base's 32768-token GEMMs,
# out/results/wgmma_small_k_s4.json; BENCHMARKS.md, session 4), as (block_m, block_n, stages, persistent) in order of
# preference, cooperative: 256 x 192 with 3 stages was the fastest of 19-21 timed sets at the attention-output GEMM
# (0.0621 ms), the FFN down-projection (0.2344 ms) and the QKV projection (0.1882 ms); 128 x 128 with 4 stages at the
# erf-GELU GEMM (0.3536 ms), which is not offered 256 x 192 staged (ptxas spilled) - it is the first choice wherever
# 256 x 192 is not offered (also m not a multiple of 256). 128 x 192 with 4 stages: the fastest of 8 timed sets at
# three of RoBERTa-base's GEMMs at 4096 rows (H200 session 10, --plan s9wide: QKV 0.0249 ms against 128 x 128's
# 0.0286 and cuBLAS 0.0277, FFN down 0.0277 against 0.0355 and 0.0308, attention output 0.0101 against 0.0122 at 5
# stages), where its busiest SM computes one tile (3 at QKV: 24576 and 73728 outputs), 128 x 128's 33% (11%) more and
# 256 x 192's 100% (33%) more; at FFN up + GELU (as many outputs on the busiest SM for all three) it tied 256 x 192
# (0.0360 against 0.0357).
MEASURED_FIRST = ((256, 192, 3, True), (128, 192, 4, True), (128, 128, 4, True))
# ... the first of them whose busiest SM computes at most this share more outputs than the least busy's leads
# (:func:`busiest_sm_outputs`: whole waves of tiles). H200, session 9 (scripts/bench_wgmma_small_k.py --plan s8tma,
# 4096 rows): with 20% more (QKV), 50% more (FFN down, attention output) on the busiest SM 256 x 192 was 1.17-1.37x
# slower than 128 x 128; with as many (FFN up + GELU) and with 0-3% more at 32768 rows 1.04-1.16x faster.
WAVE_MARGIN = 0.1
# CUDA-core instructions per output element that CUDA's erff / tanhf GELU costs over the fast_gelu one (SASS of the
# staged kernels at 32768 x 3072 x 768: erf 2255 vs 1287 instructions for 64 outputs a thread at 128 x 128, tanh 5511
# vs 3782 for 192 at 256 x 192), for the cost model (resource ``activation_ops``)
LIBM_GELU_EXTRA_OPS = {"gelu_erf": 15.0, "gelu_tanh": 9.0}
# split-K (knob ``split_k``): the cluster's reduction per output element and per block of the split, in CUDA-core
# operations for the cost model (a float32 partial written to shared memory, read back through the cluster and
# added: assumed, not yet fitted to H200 timings)
SPLIT_K_OPS = 3.0
# split-K sets lead the knob space where the first unsplit set's tiles fill fewer SMs than this share of the GPU
# (the same half as the compile path's wgmma gate, :data:`stof_tvm.compiler.linear_match.WGMMA_MIN_TILES`)
SPLIT_K_FILL = 0.5
# k steps per block of a split at least. H200, session 9 (--plan s9splitk): RoBERTa-base's QKV projection at 128 rows
# ran 0.0069 ms in clusters of 4 (3 steps each) and 0.0112 ms in clusters of 6 (2 steps)
SPLIT_K_MIN_STEPS = 3
# Most blocks of a split-K launch, as a share of the SMs: a cluster's blocks must share a GPC, and the H200 ran 108
# blocks in clusters of 6 and 128 in clusters of 8 1.6-1.7x slower than 72-96 in clusters of 4 (--plan s9splitk:
# QKV at 128 rows, FFN down at 512 rows), as if in two waves; 96 blocks of 132 SMs
SPLIT_K_MAX_SHARE = 96 / 132
# The staged 128 x 192 ping-pong set with 4 stages (block_m 256: two 128-row tiles in flight, one per consumer) leads
# the space where the measured order's lead is a cooperative tile (block_m, block_n) here. Adopted where it was faster
# in the geometric mean of the two timings (10-call bursts and sustained 50 ms samples, which narrow every gap).
# H200, session 10 (--plan s10gemm, bursts), against the space's first set then: the QKV projection at 4096 rows 0.0226
# ms against 128 x 192's 0.0255 (cuBLAS 0.0281), FFN down 0.0280 against 0.0283, attention output 0.0105 against
# 0.0104 (ties); the erf GELU GEMM 0.0345 against 256 x 192's 0.0355 at 4096 rows, 0.2710 against 0.2740 at 32768.
# Session 11 (--plan s11big / s11large, against 256 x 192; burst / sustained ms): at 32768 rows the QKV projection
# 0.1789 / 0.2032 against 0.1800 / 0.2082, the attention output 0.0589 / 0.0676 against 0.0677 / 0.0718, FFN down
# 0.2374 / 0.2477 against 0.2456 / 0.2443, the tanh GELU GEMM 0.3049 / 0.3078 against 0.3214 / 0.3071 (0.0384 /
# 0.0403 against 0.0442 / 0.0397 at 4096 rows); BERT-large's QKV projection at 4096 rows (k = 1024) 0.0417 / 0.0441
# against 0.0418 / 0.0455.
PINGPONG_FIRST = ((128, 192), (256, 192))
# A GELU template's staged 128 x 128 ping-pong set with 4 stages leads where 128 x 128 cooperative leads and there are
# tiles for two waves at least (each consumer then has tiles of its own to alternate over): BERT-large's FFN up + erf
# GELU at 8 x 512 tokens (4096 x 4096 x 1024: 192 divides no 4096 columns) 0.0606 / 0.0670 ms against 0.0680 / 0.0697
# (cuBLAS without the GELU 0.0636 / 0.0593; session 11, --plan s11large). Without the GELU the same pair measured no
# faster: BERT-large's attention output 0.0157 / 0.0162 against 0.0154 / 0.0155, FFN down 0.0548 / 0.0590 against
# 0.0589 / 0.0585.
GELU_PINGPONG_MIN_WAVES = 2
PINGPONG_FIRST_STAGES = 4
# The staged 128 x 256 one-block-per-tile set with 3 stages leads a template without GELU where its tiles fit one wave
# of the SMs while the first set's need more, its busiest SM computing no more outputs
# (:meth:`WgmmaKernelMixin._one_wave_lead`). H100, session 24: ViT-Base's QKV projection at 8 x 197 tokens (1576 x 2304
# x 768: 117 tiles of 128 x 256 against 234 of 128 x 128, the same 32768 outputs on the busiest SM; --plan s23tuned)
# 0.0139 against 0.0154 ms back to back, 0.0127 against 0.0144 in a CUDA graph of 24 calls each reading its own
# weight, the whole forward 1.004-1.023x faster in three runs, timed interleaved; BERT-large's attention output and FFN
# down at 8 x 512 (4096 x 1024 x 1024 / 4096: 128 tiles against 256) the whole forward 1.026x faster (5.362 against
# 5.502 ms; bench_e2e --ours-variants, BENCHMARKS.md).
ONE_WAVE_TILE = (256, 3)   # (block_n, stages)
# Staged sets with this many accumulators a thread or more spill where a tile's stores are guarded (rows not stored)
GUARDED_STAGED_MAX_ACC = 192


def busiest_sm_outputs(m: int, n: int, block_m: int, block_n: int, sm_count: int) -> int:
    """Outputs the busiest SM computes when an m x n output's block_m x block_n tiles run in whole waves over
    ``sm_count`` SMs: waves x tile size (below one wave, one tile)."""
    tiles = (m // block_m) * (n // block_n)
    return -(-tiles // sm_count) * block_m * block_n


def measured_order(m: int, n: int, sm_count: int) -> tuple:
    """:data:`MEASURED_FIRST` ordered for an m x n output: first the first of its tiles that divide the output whose
    busiest SM computes at most :data:`WAVE_MARGIN` more outputs than the least busy's (:func:`busiest_sm_outputs`),
    then the other dividing ones, least busy first (ties in the preference order), then those that do not divide it."""
    fits = [tile for tile in MEASURED_FIRST if m % tile[0] == 0 and n % tile[1] == 0]
    if not fits:
        return MEASURED_FIRST
    busiest = {tile: busiest_sm_outputs(m, n, tile[0], tile[1], sm_count) for tile in fits}
    lead = next(tile for tile in fits if busiest[tile] <= (1 + WAVE_MARGIN) * min(busiest.values()))
    rest = sorted((tile for tile in fits if tile != lead), key=busiest.get)
    return (lead, *rest, *(tile for tile in MEASURED_FIRST if tile not in fits))


def split_k_tilings(m: int, n: int, k: int, sm_count: int):
    """The (block_n, split_k) pairs a split-K knob set of an m x n x k GEMM may take: 128-row tiles of block_n columns,
    ``split_k`` blocks (one cluster) per tile on k slices of :data:`SPLIT_K_MIN_STEPS` steps or more, all blocks in
    one wave (tiles x split_k at most :data:`SPLIT_K_MAX_SHARE` of the SMs), clusters of the portable size (8) at
    most."""
    steps = k // BLOCK_K
    for bn in BLOCK_N_CHOICES:
        tiles = (m // BLOCK_M) * (n // bn)
        for split in SPLIT_K_CHOICES[1:]:
            if split <= PORTABLE_SPLIT_K and not (m % BLOCK_M or n % bn or k % BLOCK_K or steps % split
                                                  or steps // split < SPLIT_K_MIN_STEPS
                                                  or tiles * split > SPLIT_K_MAX_SHARE * sm_count):
                yield bn, split


def split_k_blocks(m: int, n: int, k: int, sm_count: int = H200.sm_count) -> int:
    """The most blocks a split-K knob set of an m x n x k GEMM launches (0 where none applies): what the compile
    path's wgmma gate counts for GEMMs with too few tiles of their own (a partial last row tile counts whole)."""
    m = space_rows(m)
    return max(((m // BLOCK_M) * (n // bn) * split for bn, split in split_k_tilings(m, n, k, sm_count)), default=0)


def space_rows(m: int) -> int:
    """The rows the knob space is built for: ``m`` rounded up to whole 128-row tiles (the kernel computes a partial
    last tile whole, loading its rows past ``m`` as zeros and storing none of them)."""
    return row_tiles(m, BLOCK_M) * BLOCK_M


def _measured_rank(knobs, order=MEASURED_FIRST) -> int:
    """Position of a cooperative knob set's tile in ``order`` (after them all when absent)."""
    tile = (knobs.get("block_m", BLOCK_M), knobs["block_n"], knobs["stages"], knobs["persistent"])
    return order.index(tile) if tile in order else len(order)


class WgmmaKernelMixin:
    """What every wgmma template shares: knobs (``block_n``, ``stages``, ``persistent``, ``pingpong``, and where set
    ``block_m`` and ``staged``), resources, and the kernel build.
    A template using it defines ``gemm_dims(shape) -> (m, n, k)`` (how its shape maps to the GEMM) and
    ``kernel_options(shape) -> dict`` (the rest of :func:`.wgmma_kernel.wgmma_gemm_primfunc`'s arguments);
    its ``primfunc`` stays the knob-free TensorIR definition."""

    knob_names = ("block_n", "stages", "persistent", "pingpong")
    persistent_first = True
    norm_rows = False           # the GEMM + bias + residual + LayerNorm epilogue (a cluster of blocks per row tile)
    head_major_stores = False   # the QKV projection's epilogue stores into [3, B, H, S, D]

    def _check_tiles(self, shape):
        _, n, k = self.gemm_dims(shape)   # any m: a partial last row tile
        if not any(n % bn == 0 for bn in BLOCK_N_CHOICES):
            raise ValueError(f"{self.name}: the GEMM's n = {n} must be a multiple of one of the tile widths "
                             f"{BLOCK_N_CHOICES} (shape {shape})")
        if k % BLOCK_K:
            raise ValueError(f"{self.name}: the GEMM's k = {k} must be a multiple of {BLOCK_K} (shape {shape})")

    def config(self, knobs) -> WgmmaConfig:
        """The kernel configuration of ``knobs`` (ValueError naming a missing or bad knob)."""
        missing = [key for key in ("block_n", "stages") if key not in knobs]
        if missing:
            raise ValueError(f"{self.name}: knobs missing {missing}")
        config = WgmmaConfig(block_n=knobs["block_n"], stages=knobs["stages"],
                             persistent=knobs.get("persistent", True), pingpong=knobs.get("pingpong", False),
                             block_m=knobs.get("block_m", BLOCK_M), staged=knobs.get("staged", False),
                             fast_gelu=knobs.get("fast_gelu", False), gelu_form=knobs.get("gelu_form", "tail"),
                             loads=knobs.get("loads", "cp.async"), split_k=knobs.get("split_k", 1),
                             weight_prefetch=knobs.get("weight_prefetch", False),
                             early_weights=knobs.get("early_weights", False), norm_rows=self.norm_rows)
        config.validate()
        return config

    def kernel(self, shape, dtype="float16", knobs=None, **options) -> tvm.tirx.PrimFunc:
        """The thread-level CUDA PrimFunc (build for ``arch="sm_90a"``); knobs default to the first choice;
        ``options`` those of the definition (:meth:`~.registry.Template.primfunc`: a LayerNorm's ``eps``)."""
        func = self.primfunc(shape, dtype, **options)  # validates shape and dtype
        knobs = self.default_knobs(shape, dtype) if knobs is None else knobs
        config = self.config(knobs)
        m, n, k = self.gemm_dims(shape)
        check_wgmma_shape(m, n, k, config)
        kernel = wgmma_gemm_primfunc(m, n, k, dtype, config=config, sm_count=H200.sm_count,
                                     **self.kernel_options(shape, **options))
        return kernel.with_attr("stof.spec", func.attrs["stof.spec"])

    def _knob_space(self, shape, dtype, hw: Hardware = H200):
        m, n, _ = self.gemm_dims(shape)
        m = space_rows(m)
        space = [{"block_n": bn, "stages": st, "persistent": p, "pingpong": pp}
                 for p, pp in ((True, False), (False, False), (True, True)) for bn in BLOCK_N_CHOICES
                 for st in STAGE_CHOICES if n % bn == 0 and m % (PINGPONG_TILE_M[bn] if pp else BLOCK_M) == 0]
        # The direct-store sets: cooperative first (ping-pong measured no faster on the H200). Then the tile width
        # with the least work on the busiest SM (waves of 128-row tiles x columns per tile: n = 768 takes one wave at
        # width 192, two at 128), the wider on a tie; then persistence where the H200 measured it faster
        # (BENCHMARKS.md: by 2-4% with >= 4 waves of tiles; slower for the QKV projection's scattered stores); then
        # 4 stages. The cooperative 256-row sets of width 128 and 192 follow where m allows.
        tiles = lambda kn: (m // BLOCK_M) * (n // kn["block_n"])  # noqa: E731
        busiest = lambda kn: -(-tiles(kn) // hw.sm_count) * kn["block_n"]  # noqa: E731
        persist = lambda kn: self.persistent_first and tiles(kn) >= 4 * hw.sm_count  # noqa: E731
        space = sorted(space, key=lambda kn: (kn["pingpong"], busiest(kn), -kn["block_n"],
                                              kn["persistent"] != persist(kn), abs(kn["stages"] - 4)))
        direct = space + [dict(kn, block_m=TALL_BLOCK_M) for kn in space if not kn["pingpong"]
                          and kn["block_n"] in TALL_BLOCK_N and m % TALL_BLOCK_M == 0]
        unsplit = self._staged_sets(direct, measured_order(m, n, hw.sm_count), dtype) + direct
        split = self.split_sets(shape, hw)
        first_tiles = (m // self.config(unsplit[0]).tile_m) * (n // unsplit[0]["block_n"])
        ordered = split + unsplit if first_tiles < SPLIT_K_FILL * hw.sm_count else unsplit + split
        loaded = [dict(kn, loads=self.default_loads(kn), **self.default_weight_timing(kn)) for kn in ordered
                  if not self._spills_with_guarded_rows(shape, kn)]
        tall_pingpong = [kn for kn in self.tall_pingpong_sets(loaded)
                         if not self._spills_with_guarded_rows(shape, kn)]
        space = loaded + tall_pingpong
        lead = (self._pingpong_lead(loaded[0], tall_pingpong)
                or self._gelu_pingpong_lead(loaded, m, n, hw.sm_count) or self._wave_lead(loaded, m, n, hw.sm_count)
                or self._one_wave_lead(loaded, m, n, hw.sm_count))
        return ([lead] if lead else []) + [kn for kn in space if kn is not lead]

    def _pingpong_lead(self, first, tall_pingpong) -> dict | None:
        """The 128 x 192 ping-pong set (4 stages, ``fast_gelu`` as ``first``) that leads the space in place of the
        cooperative set ``first`` where the H200 measured it faster (:data:`PINGPONG_FIRST`): where ``first`` is staged
        128 x 192 or 256 x 192 cooperative; else None."""
        tile = (first.get("block_m", BLOCK_M), first["block_n"])
        if not first.get("staged") or first["pingpong"] or tile not in PINGPONG_FIRST:
            return None
        return next((kn for kn in tall_pingpong if kn["stages"] == PINGPONG_FIRST_STAGES
                     and kn.get("fast_gelu") == first.get("fast_gelu")), None)

    def _gelu_pingpong_lead(self, space, m: int, n: int, sm_count: int) -> dict | None:
        """A GELU template's staged 128 x 128 ping-pong set (4 stages, ``fast_gelu`` as the first set) where the first
        set is staged 128 x 128 cooperative with :data:`GELU_PINGPONG_MIN_WAVES` waves of tiles or more; else
        None."""
        first = space[0]
        if (getattr(self, "act", "none") not in LIBM_GELU_EXTRA_OPS or not first.get("staged") or first["pingpong"]
                or (first.get("block_m", BLOCK_M), first["block_n"], first.get("split_k", 1)) != (BLOCK_M, 128, 1)
                or (m // BLOCK_M) * (n // 128) < GELU_PINGPONG_MIN_WAVES * sm_count):
            return None
        return next((kn for kn in space if kn["pingpong"] and kn["block_n"] == 128 and kn.get("staged")
                     and kn["stages"] == PINGPONG_FIRST_STAGES and kn.get("fast_gelu") == first.get("fast_gelu")),
                    None)

    def _wave_lead(self, space, m: int, n: int, sm_count: int) -> dict | None:
        """The staged 64 x 192 ping-pong set (4 stages) that leads the space of a template without GELU where the
        first set is unsplit with fewer tiles than SMs (one partial wave) and the 64-row tiles leave the busiest SM
        fewer outputs (:func:`busiest_sm_outputs`, ``m`` in whole 128-row tiles); else None. H200, session 11 (--plan
        s11big / s11large; burst / sustained ms): ViT-Base's FFN down at 8 x 197 tokens (1576 x 768 x 3072; 78 tiles
        of 128 x 128, 100 of 64 x 192) 0.0150 / 0.0154 against 0.0193 / 0.0175 (cuBLAS 0.0182 / 0.0157), its attention
        output 0.0067 / 0.0061 against 0.0075 / 0.0069, RoBERTa-base's QKV projection at 1 x 512 0.0072 / 0.0066
        against 0.0074 / 0.0068; but the erf GELU GEMM at 512 rows 0.0091 / 0.0084 against 0.0084 / 0.0077. With
        whole waves the 64-row tiles gain nothing sure: at 6304 rows 0.0565 / 0.0585 against 128 x 192 ping-pong's
        0.0627 / 0.0560."""
        first = space[0]
        config = self.config(first)
        if (getattr(self, "act", "none") in LIBM_GELU_EXTRA_OPS or config.split_k > 1
                or (m // config.tile_m) * (n // config.block_n) >= sm_count):
            return None
        wave = next((kn for kn in space if kn["pingpong"] and kn["block_n"] == 192 and "block_m" not in kn
                     and kn.get("staged") and kn["stages"] == PINGPONG_FIRST_STAGES), None)
        if wave is None or (busiest_sm_outputs(m, n, self.config(wave).tile_m, 192, sm_count)
                            >= busiest_sm_outputs(m, n, config.tile_m, config.block_n, sm_count)):
            return None
        return wave

    def _one_wave_lead(self, space, m: int, n: int, sm_count: int) -> dict | None:
        """The staged 128 x 256 set with 3 stages, one block per tile (:data:`ONE_WAVE_TILE`), of a template without
        GELU, where the first set is unsplit with more tiles than SMs and the 256-wide tiles fit one wave with no more
        outputs on the busiest SM (:func:`busiest_sm_outputs`, ``m`` in whole 128-row tiles): half the tiles, each
        reading its A rows once for twice the columns, for the same work on the busiest SM. Else None (the GELU
        GEMMs' epilogue was not measured in it)."""
        first = space[0]
        config = self.config(first)
        block_n, stages = ONE_WAVE_TILE
        if (getattr(self, "act", "none") in LIBM_GELU_EXTRA_OPS or config.split_k > 1 or n % block_n
                or (m // config.tile_m) * (n // config.block_n) <= sm_count
                or (m // BLOCK_M) * (n // block_n) > sm_count
                or busiest_sm_outputs(m, n, BLOCK_M, block_n, sm_count)
                > busiest_sm_outputs(m, n, config.tile_m, config.block_n, sm_count)):
            return None
        return next((kn for kn in space if kn["block_n"] == block_n and kn["stages"] == stages
                     and not kn["persistent"] and kn.get("staged") and "block_m" not in kn), None)

    def stored_rows(self, shape) -> int:
        """Rows of the output the kernel stores (the GEMM's m; the QKV projection's batch * seq)."""
        return self.gemm_dims(shape)[0]

    def _spills_with_guarded_rows(self, shape, knobs) -> bool:
        """Whether ptxas spills ``knobs``' kernel where some rows of its tiles are not stored (:meth:`stored_rows` not
        a multiple of the tile's rows: every store of the tile guarded by its row): the staged sets with
        :data:`GUARDED_STAGED_MAX_ACC` accumulators a thread, cooperative (256 x 192: 36 bytes at ViT-Base's 6304 rows,
        56 for the QKV projection, also at its older 6400 padded rows) and for the QKV projection's head-major stores
        ping-pong too (128 x 192: 56 bytes; the GEMMs' 0), and split-K 3 of 192 columns with CUDA's erff / tanhf GELU
        (56 bytes at 197 rows). Measured with nvcc 13.0 -O3 for sm_90a; the same sets without guarded rows do not
        spill."""
        config = self.config(knobs)
        if not self.stored_rows(shape) % config.tile_m:
            return False
        libm_gelu = getattr(self, "act", "none") in LIBM_GELU_EXTRA_OPS
        wide_staged = config.staged and config.acc_registers >= GUARDED_STAGED_MAX_ACC
        return ((wide_staged and (not config.pingpong or self.head_major_stores))
                or (libm_gelu and config.split_k == 3 and config.block_n == 192))

    def tall_pingpong_sets(self, space) -> list[dict]:
        """The ``block_m = 256`` twins of the space's staged 192-wide ping-pong sets: each consumer warpgroup owns
        whole 128 x 192 tiles (instead of 64 x 192), so one consumer's epilogue overlaps the other's MMAs on tiles of
        the width the H200 measured fastest at 4096 rows (cooperative); not the erf GELU's CUDA ``erff`` form (ptxas
        spilled 4 bytes, like the cooperative 256 x 192 tile's), its ``fast_gelu`` twin only. One of them may lead
        the space (:meth:`_pingpong_lead`); the others close it."""
        erf = getattr(self, "act", "none") == "gelu_erf"
        return [dict(kn, block_m=TALL_BLOCK_M) for kn in space if kn["pingpong"] and kn["block_n"] == TALL_PINGPONG_N
                and kn.get("staged") and "block_m" not in kn and not (erf and not kn.get("fast_gelu"))]

    def default_loads(self, knobs) -> str:
        """How a knob set of the space loads its tiles: TMA (one producer thread, tensor maps), measured faster than
        cp.async on the H200 at every measured knob set of the GEMMs (session 9, ``--plan s8tma``: 4096 and 32768
        rows, 1.01-1.10x) and of the QKV projection at 128 x 128 tiles (1.07-1.09x). The QKV projection's 256 x 192
        tiles keep cp.async: TMA measured slower there at 32768 rows (0.1949 against 0.1798 ms); so do the split-K
        sets (``--plan s9splitk`` at 128 and 512 rows: cp.async 1.00-1.06x faster, the host's map encoding at each
        call included)."""
        return "cp.async" if knobs.get("split_k", 1) > 1 else "tma"

    def default_weight_timing(self, knobs) -> dict:
        """When a knob set of the space loads its weights, as knobs to add: the unsplit sets take ``early_weights``
        (the W part of the ring's first slots issued before the dependent launch wait, A's after it), measured in
        whole models on an H100 with the modules timed interleaved (session 21, ours / with it, the same module built
        twice within 0.3%): RoBERTa-base 1.015x faster at 8 x 512 tokens, ViT-Base 1.038x at 8 x 197, 1.000x at
        16 x 2048 (where a GEMM runs long enough to hide the wait). The split-K sets ask L2 for their weights before
        the wait instead (``weight_prefetch``, :meth:`split_sets`), which measured faster at 1 x 128 tokens than
        with ``early_weights`` too (session 16: 0.98-0.99x with both)."""
        return {} if knobs.get("split_k", 1) > 1 else {"early_weights": True}

    def split_sets(self, shape, hw: Hardware = H200) -> list[dict]:
        """The split-K knob sets (``split_k`` blocks of one cluster per 128-row tile, each on its own k slice of at
        least :data:`SPLIT_K_MIN_STEPS` steps; one wave: :func:`split_k_tilings`), least work on a block first
        (columns x k steps of its slice), then fewer splits (less reduction), then 4 stages (at most the slice's
        steps, 2 at least). Each asks L2 for its W slice before its dependent launch wait (``weight_prefetch``): at
        1 x 128 tokens, where the split sets lead every GEMM, the H200 ran whole forwards 1.02-1.03x faster with it
        (session 15: RoBERTa-base 0.392 -> 0.380 ms, BERT-large 0.891 -> 0.870, GPT-2 0.399 -> 0.386, T5-base 0.388
        -> 0.380); on every wgmma GEMM at 8 x 512 it was 0.935x (RoBERTa-base 1.579 -> 1.689 ms), so only these sets
        take it."""
        m, n, k = self.gemm_dims(shape)
        m, steps = space_rows(m), k // BLOCK_K
        sets = [{"block_n": bn, "stages": stages, "persistent": False, "pingpong": False, "split_k": split,
                 "weight_prefetch": True}
                for bn, split in split_k_tilings(m, n, k, hw.sm_count)
                for stages in sorted({min(st, steps // split) for st in STAGE_CHOICES if st <= 4})]
        return sorted(sets, key=lambda kn: (kn["block_n"] * steps // kn["split_k"], kn["split_k"],
                                              abs(kn["stages"] - 4)))

    def _staged_sets(self, direct, order=MEASURED_FIRST, dtype="float16"):
        """The staged twin of every direct-store set that takes it, to come first: cooperative before ping-pong
        (slower staged too at every measured shape), the measured winners (:data:`MEASURED_FIRST`) first among them,
        the rest in the direct order (``order``: :data:`MEASURED_FIRST`, or as :func:`measured_order` gives it for
        the shape). Not offered: 256 x 192 with the erf GELU (its 192 accumulators and the erf left
        too few of the 232 registers: ptxas spilled 28 bytes). Only keys that differ from the defaults are written, so
        direct sets keep their names.

        A GELU template first has the ``fast_gelu`` twin of every staged set, in the same order (256 x 192 with the erf
        GELU included: the exp2-polynomial GELU leaves it no spills): the same kernel with about half the epilogue's
        instructions (the erf GELU's SASS at 128 x 128: 1304 instructions instead of 2272), so never slower than its
        twin (not yet measured on the H200). The tanh GELU's twins take ``gelu_form="tanh"`` (its own argument through
        one tanh.approx.f32): on the H200 (session 13, s12gelu) its 128 x 192 ping-pong pick ran 1.17x / 1.20x faster
        than with the exp2 tail at 32768 / 4096 rows (0.3051 -> 0.2604 ms, 0.0396 -> 0.0330), sustained 1.13x / 1.11x;
        for the erf GELU the tail stays (its tanh form was 0.91x). With float16 outputs the erf GELU's twins take
        ``gelu_form="half"`` (the tail on float16 pairs, :mod:`.fast_gelu`): on an H100 (session 21, s21gelu) its
        4096-row pick ran 0.0356 -> 0.0321 ms, as fast as its GELU-less twin (0.0318; tensor pipe active 68% -> 76%
        under ncu), and RoBERTa-base's whole forward 1.031x faster at 8 x 512 tokens, 1.024x at 16 x 2048 (timed
        interleaved with the tail form; the same module built twice within 0.2%), model errors 1.10e-3 -> 1.15e-3."""
        key = lambda kn: (kn["pingpong"], _measured_rank(kn, order))  # noqa: E731
        act = getattr(self, "act", "none")
        staged = sorted((dict(kn, staged=True) for kn in direct
                         if not (act == "gelu_erf" and kn.get("block_m") == TALL_BLOCK_M and kn["block_n"] == 192)),
                        key=key)
        if act not in FAST_GELU_ACTIVATIONS:
            return staged
        form = ({"gelu_form": "tanh"} if act == "gelu_tanh" else {"gelu_form": "half"} if dtype == "float16"
                else {})
        return sorted((dict(kn, staged=True, fast_gelu=True, **form) for kn in direct), key=key) + staged

    def resources(self, shape, dtype, knobs):
        config = self.config(knobs)
        m, n, _ = self.gemm_dims(shape)
        # split-K: a tile's k steps are shared by split_k blocks, each a unit of work of 1 / split_k of the flops
        tiles = row_tiles(m, config.tile_m) * (n // config.block_n) * config.split_k
        split_ops = SPLIT_K_OPS * config.split_k if config.split_k > 1 else 0.0
        return {"block_m": config.tile_m, "block_n": config.block_n, "block_k": BLOCK_K, "threads": THREADS,
                "shared_bytes": config.shared_bytes, "acc_registers": config.acc_registers,
                "max_registers_per_thread": CONSUMER_REGS, "launch_registers": LAUNCH_REGISTERS,
                "grid": grid_blocks(config, tiles // config.split_k, H200.sm_count), "tiles": tiles,
                # ping-pong: a tile's epilogue runs under the other consumer's MMAs (the cost model hides it)
                "overlapped_epilogue": config.pingpong,
                # for the cost model: wgmma's main-loop rate; one 2-byte store per output element unless staged;
                # the activation's extra epilogue operations per output element (CUDA's GELU over fast_gelu)
                # (split-K: 8-byte stores after the reduction, whose operations count with the activation's)
                "wgmma": True, "narrow_stores": not config.staged and config.split_k == 1,
                "activation_ops": split_ops + (0.0 if config.fast_gelu
                                               else LIBM_GELU_EXTRA_OPS.get(getattr(self, "act", ""), 0.0))}

    def resource_columns(self, shape, dtype, space):
        # not the mma.sync main-loop formulas: these resources come from WgmmaConfig, one knob set at a time
        return Template.resource_columns(self, shape, dtype, space)

    def _fits_space(self, shape, dtype, space, hw: Hardware):
        # setmaxnreg gives the consumers 232 registers and the producer 40 (the per-SM file holds one block)
        res = self.resource_columns(shape, dtype, space)
        return ((res["threads"] <= hw.max_threads_per_block) & (res["shared_bytes"] <= hw.max_shared_bytes_per_block)
                & (res["acc_registers"] + 40 <= CONSUMER_REGS))

    def _schedule(self, sch, spec, knobs):
        raise ValueError(f"{self.name} is a thread-level kernel with nothing to schedule: build "
                         f"get_template({self.name!r}).kernel(shape, dtype, knobs) for arch {ARCH!r}")


class WgmmaGemmTemplate(WgmmaKernelMixin, GemmTemplate):
    """GEMM (+ bias) (+ activation) as the warp-specialized wgmma kernel of :mod:`.wgmma_kernel`."""

    family = "gemm_wgmma"

    def __init__(self, bias: bool, act: str):
        super().__init__(bias=bias, act=act, w_layout="nk")
        self.name = self.name + "_wgmma"
        self.description += " (wgmma, sm_90a)"

    def _check(self, shape):
        self._check_tiles(shape)

    def gemm_dims(self, shape):
        return shape["m"], shape["n"], shape["k"]

    def kernel_options(self, shape):
        return {"bias": self.bias, "act": self.act}


class WgmmaQKVTemplate(WgmmaKernelMixin, QKVTemplate):
    """The QKV projection into [3, B, H, S, D] (the ``qkv_projection`` definition, W [3*H*D, H*D]) on wgmma:
    the same kernel as the GEMMs, with the epilogue storing each element at its head-major place."""

    family = "qkv_wgmma"
    persistent_first = False
    head_major_stores = True
    row_multiple = 1            # x's rows: batch * seq (a partial last row tile loads zeros past them, stores none)

    def __init__(self):
        super().__init__(w_layout="nk")
        self.name = "qkv_projection_wgmma"
        self.description += " (wgmma, sm_90a)"

    def _check(self, shape):
        super()._check(shape)
        self._check_tiles(shape)
        if shape["head_dim"] % 2:
            raise ValueError(f"{self.name}: head_dim must be even, got {shape['head_dim']}")

    def gemm_dims(self, shape):
        hidden = shape["heads"] * shape["head_dim"]
        return self.rows(shape), 3 * hidden, hidden

    def kernel_options(self, shape):
        return {"bias": True, "act": "none",
                "heads": tuple(shape[key] for key in ("batch", "seq", "heads", "head_dim"))}

    def stored_rows(self, shape) -> int:
        return shape["batch"] * shape["seq"]

    def default_loads(self, knobs) -> str:
        tall = knobs.get("block_m", BLOCK_M) == TALL_BLOCK_M and not knobs.get("pingpong")   # 256-row tiles
        return "cp.async" if tall else super().default_loads(knobs)


def norm_widths(n: int) -> list[int]:
    """The tile widths at which ``n / block_n`` blocks (one cluster, 2 to :data:`.wgmma_kernel.MAX_NORM_CLUSTER`)
    hold a row of n outputs: the GEMM + LayerNorm template's ``block_n`` choices."""
    return [bn for bn in BLOCK_N_CHOICES if n % bn == 0 and 2 <= n // bn <= MAX_NORM_CLUSTER]


class WgmmaGemmLayerNormTemplate(WgmmaKernelMixin, GemmLayerNormTemplate):
    """GEMM + bias + residual + LayerNorm on the wgmma kernel (``norm_rows``): the ``n / block_n`` blocks of a 128-row
    tile form one cluster and share their row sums through distributed shared memory, so the sum ``y = A @ W^T + bias +
    residual`` never leaves the SMs and the LayerNorm needs no kernel of its own (the unfused pair writes y and reads
    it back with the residual: at BERT-Base's 4096 rows 12.6 of the LayerNorm's 18.9 MB).

    ``keep_sum`` (``gemm_bias_residual_sum_layernorm_wgmma``, pre-LN models: GPT-2, ViT) also stores y, rounded, as a
    first output: the next residual add reads it. It replaces the GEMM + ``residual_layernorm`` pair."""

    family = "gemm_layernorm_wgmma"
    norm_rows = True

    def __init__(self, keep_sum: bool = False):
        super().__init__(w_layout="nk")
        self.keep_sum = keep_sum
        self.name = "gemm_bias_residual_sum_layernorm_wgmma" if keep_sum else "gemm_bias_residual_layernorm_wgmma"
        self.description = ("(A @ W^T + bias + residual, its LayerNorm)" if keep_sum else self.description) + (
            " (wgmma, sm_90a; a row tile's blocks one cluster)")

    def outputs(self) -> int:
        return 2 if self.keep_sum else 1

    def arguments(self, shape, dtype="float16"):
        args = super().arguments(shape, dtype)
        return args[:-1] + [("sum", (shape["m"], shape["n"]), dtype)] + args[-1:] if self.keep_sum else args

    def _primfunc(self, shape, dtype, eps: float = LN_EPS):
        if not self.keep_sum:
            return super()._primfunc(shape, dtype, eps)
        inputs, y = self.residual_sum(shape, dtype)
        total = te.compute(y.shape, lambda i, j: y[i, j].astype(dtype), name="sum")
        _, _, out = layernorm_compute(y, inputs[4], inputs[5], dtype, eps)
        return te.create_prim_func(inputs + [total, out])

    def reference(self, shape, inputs):
        normed = super().reference(shape, inputs)
        return [self.residual_sum_np(inputs)] + normed if self.keep_sum else normed

    def _check(self, shape):
        self._check_tiles(shape)
        if not norm_widths(shape["n"]):
            raise ValueError(f"{self.name}: no tile width of {BLOCK_N_CHOICES} splits n = {shape['n']} into 2 to "
                             f"{MAX_NORM_CLUSTER} blocks")

    def gemm_dims(self, shape):
        return shape["m"], shape["n"], shape["k"]

    def kernel_options(self, shape, eps: float = LN_EPS):
        return {"bias": True, "act": "none", "norm_eps": eps, "norm_sum": self.keep_sum}

    def _knob_space(self, shape, dtype, hw: Hardware = H200):
        """One cooperative 128-row tile per block. Widths: portable clusters (8 blocks or fewer) first; then, where the
        widest tiles fill half the SMs, wider first (fewer blocks a cluster: on an H100, session 19, 4096 rows of 768
        columns ran 0.0211 ms in 96 blocks of 256 columns, clusters of 3, against 0.0308 in 128 blocks of 192,
        clusters of 4, as if in two waves), else narrower first (more blocks: 1576 rows 0.0179 at 192 against 0.0216
        at 256); then the staged epilogue before direct stores, TMA before cp.async, 4 stages first."""
        n = shape["n"]
        tiles = -(-shape["m"] // BLOCK_M)
        wide = tiles * (n // max(norm_widths(n) or [1])) >= hw.sm_count // 2
        widths = sorted(norm_widths(n), key=lambda bn: (n // bn > PORTABLE_SPLIT_K, -bn if wide else bn))
        return [{"block_n": bn, "stages": st, "persistent": False, "pingpong": False, "staged": staged, "loads": loads}
                for bn in widths for staged in (True, False) for loads in ("tma", "cp.async")
                for st in sorted(STAGE_CHOICES, key=lambda st: (abs(st - 4), st))]


register(WgmmaGemmTemplate(bias=False, act="none"))
for _act in ACTIVATIONS:
    register(WgmmaGemmTemplate(bias=True, act=_act))
register(WgmmaQKVTemplate())
register(WgmmaGemmLayerNormTemplate())
register(WgmmaGemmLayerNormTemplate(keep_sum=True))


def build_kernel(name: str, shape, dtype: str = "float16", knobs=None):
    """Compile template ``name``'s wgmma kernel (a GEMM's, the QKV projection's or the fused FFN's) with TVM for
    CUDA sm_90a (host llvm); returns the executable, whose CUDA module is compiled from source when loaded (or
    from a cubin, see :func:`nvcc_cubin`)."""
    from .build import cuda_target
    from .registry import get_template

    template = get_template(name)
    if not name.endswith("_wgmma") or not callable(getattr(template, "kernel", None)):
        raise ValueError(f"{name!r} is not a wgmma template (names end in '_wgmma')")
    return tvm.compile(tvm.IRModule({"main": template.kernel(shape, dtype, knobs)}), target=cuda_target(ARCH))


def nvcc_cubin(src: str, cubin_path, nvcc: str = "nvcc") -> dict:
    """Compile CUDA source for sm_90a with nvcc into ``cubin_path``; returns ptxas' figures (registers,
    stack_frame, spill_stores, spill_loads) and its performance warnings (``C75xx`` lines, e.g. a wgmma
    serialization or an ignored setmaxnreg). Raises RuntimeError with nvcc's output when it fails.

    ``-gencode=arch=compute_90a,code=sm_90a`` rather than ``-arch=sm_90a``: with nvcc 13.0 the shorthand also
    runs a plain sm_90 pass, which rejects wgmma and setmaxnreg."""
    import re
    import subprocess
    from pathlib import Path

    cubin_path = Path(cubin_path)
    cu = cubin_path.with_suffix(".cu")
    cu.write_text(src)
    proc = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-Xptxas", "-v",
                           "-o", str(cubin_path), str(cu)], capture_output=True, text=True)
    cu.unlink()
    text = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"nvcc failed for {cubin_path.name}:\n{text[-3000:]}")
    figures = {key: int(re.search(pattern, text).group(1)) for key, pattern in (
        ("registers", r"Used (\d+) registers"), ("stack_frame", r"(\d+) bytes stack frame"),
        ("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads"))}
    figures["warnings"] = [line.strip() for line in text.splitlines() if re.search(r"\(C75\d\d\)", line)]
    return figures
