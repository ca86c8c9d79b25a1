"""The attention part of the analytical model: the work of each kernel kind and configuration, and the choice.

For one attention problem (shapes, dtype, mask) every candidate ``(kind, config)`` becomes a
:class:`~stof_tvm.cost_model.core.KernelWork` priced by :func:`~stof_tvm.cost_model.core.predict`:

- **block-wise** (:class:`~stof_tvm.schedules.attention_blockwise.BlockConfig`): one thread block per
  (batch, head, tile row). A block's work is what its tile row visits: ``4*BM*BN*D`` tensor-core flops and
  ``BM*BN`` softmax element operations per full or partial tile, bitmap work on partial tiles only, a fixed
  latency per tile (shorter with deeper ``cp.async`` pipelines) and per block. K and V tiles stream through
  L2 once per visiting tile row. Shared memory and registers come from the kernel's own formulas
  (``BlockConfig.shared_bytes`` / ``registers``: the fragments each thread holds, score and output
  accumulators, Q and P operands), so configurations that would spill are infeasible.
- **wgmma** (:class:`~stof_tvm.schedules.attention_wgmma.WgmmaAttentionConfig`, Hopper only): the block-wise
  walk at ``64 * consumers`` x ``block_n`` tiles on wgmma, one block of ``consumers + 1`` warpgroups per SM (it
  holds the whole register file), one work item (batch, head, tile row) per block, head by head, each head's
  rows last to first. Its own constants (``wgmma_*`` in :class:`~stof_tvm.cost_model.core.Calibration`): the
  products at ``wgmma_attn_tc_eff`` of the mma.sync peak, ``wgmma_softmax_ops`` *exposed* CUDA-core operations
  per score element (the softmax runs under the other consumers' products, so this is what the overlap leaves),
  ``wgmma_tile_cycles`` per tile (``wgmma_tma_tile_cycles`` with TMA loads: one producer thread issues the copies
  and the consumers fence no proxy; divided by ``1 + wgmma_stage_gain * (stages - 2)``) and ``wgmma_item_cycles``
  per work item (Q load, the first ``S`` and last ``P V`` that nothing overlaps, the stores). Fitted on causal, dense
  and sparse masks (:func:`scripts.calibrate_model.fit_wgmma`), with ``wgmma_mask_ops`` its extra cost per element
  of a partial tile.
  A persistent grid (``persistent``) is priced per block of its static walk (:func:`_persistent_sums`), with
  ``wgmma_persistent_item_cycles`` per item. Each head's units are rotated (``k = (u + u // half) % half``): without
  that, at D64 with three consumers (132 blocks, 11-unit heads) a block met one pair of tile rows in every head and
  a causal mask's partial tiles piled up on some blocks (s7causal: 1.218 vs 1.000 ms; s9attn 1.156 vs 0.976); with
  it the persistent grid measured 0.944 ms causal, 1.580 dense, against 0.944-0.968 / 1.723-1.741 (session 9, call
  14). Persistent grids are candidates (128-row tiles measured faster in session 9: D128 causal 1.853 vs
  1.947-1.982 ms, key-padded D64 1.348 vs 1.433, D128 2.060 vs 2.241). Non-ping-pong grids are not candidates
  (never timed).
- **row-wise** (:class:`~stof_tvm.schedules.attention_rowwise.RowConfig`): ``rows_per_block`` query rows per
  thread block, ``key_groups * keys_per_step`` key slots per loop step. Work counts key *slots* (padding of
  the last step included) at CUDA-core rates, latency counts the block's longest row in steps, and L2
  traffic counts the distinct keys of the block's rows (neighbouring rows share keys in L1).

:func:`rank_attention` prices the whole candidate space and sorts it; :func:`choose_attention` returns the
best. STOF's rule (:func:`stof_tvm.sparse_formats.stof_rule`) only picks a kind; this picks kind and
configuration from the work really done.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..hardware import H200, HardwareProfile
from ..schedules.attention_blockwise import SUPPORTED_HEAD_DIMS as BLOCK_HEAD_DIMS
from ..schedules.attention_blockwise import BlockConfig, default_row_sums
from ..schedules.attention_rowwise import SUPPORTED_HEAD_DIMS as ROW_HEAD_DIMS
from ..schedules.attention_rowwise import RowConfig, cuda_config_fits, cuda_lanes
from ..schedules.attention_wgmma import PERSISTENT_GRID as WGMMA_PERSISTENT_GRID
from ..schedules.attention_wgmma import REGISTERS as WGMMA_REGISTERS
from ..schedules.attention_wgmma import SUPPORTED_DTYPES as WGMMA_DTYPES
from ..schedules.attention_wgmma import CHECKED_HEAD_DIMS as WGMMA_HEAD_DIMS
from ..schedules.attention_wgmma import WgmmaAttentionConfig
from ..schedules.attention_wgmma import default_config as wgmma_default_config
from .core import DEFAULT_CALIBRATION, Calibration, KernelWork, Prediction, predict
from .mask_profile import MaskProfile

__all__ = ["AttentionProblem", "AttentionCandidate", "RankedCandidate", "block_candidates", "row_candidates",
           "wgmma_candidates", "attention_candidates", "attention_work", "rank_attention", "choose_attention",
           "decide_attention", "AttentionDecision"]

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_BLOCK_M = (16, 32, 64, 128, 256)
_BLOCK_N = (16, 32, 64, 128)
_WARPS = (1, 2, 4, 8)
_STAGES = (2, 3, 4)
_KEY_GROUPS = (1, 2, 4, 8, 16)
_KEYS_PER_STEP = (1, 2, 4)
_ROWS_PER_BLOCK = (1, 2, 4, 8)
_HEAVY_SELECT_CYCLES = 600  # heavy-first: rating the rows, two barriers, the selection loop
_KV_SPLITS = (4, 16)        # split-KV: thread blocks per split heavy row
_MAX_SPLIT_ROWS = 4         # split-KV: heavy rows per (batch, head) split at most
_MERGE_CYCLES_PER_SLICE = 40   # split-KV merge: per output element and slice (two loads, exp2, fma)
_WGMMA_STAGES = (2, 3, 4, 5)
_WGMMA_SPACE_HEAD_DIMS = (64, 128)   # head dims where the wgmma knob space was timed (sessions 7-9)
# Block-wise predictions at the head dims the constants were not fitted at (fitted at 64 and 128) are multiplied by
# the smallest measured / predicted ratio of the model's block-wise picks there (the kernel was at least that much
# slower than priced in every case): plan s36kinds (session 37, an H100, B8 H12 S4096, B4 H8 at 256; sliding,
# document, BigBird AND causal, per-head 64 x 64 tiles at 40%) measured 32: 1.08-1.50, 80: 1.22-1.38, 96: 1.22-1.28,
# 256: 1.16-1.31, the wgmma forms 0.96-1.19 (and the block-wise picks at 64 on the same H100 0.95, plan s37goals).
# Session 35's H200 run pointed the same way (BigBird's split-KV picks 1.41-1.80). The correction moves document
# masks at 80 and 96, and the sliding window and the 40% tiles at 256, onto wgmma, measured 1.05-1.36x faster there;
# BigBird AND causal at 256 moves too, where wgmma measured 3% slower (its block-wise price equals the sliding
# window's: the model cannot tell the two apart).
_BLOCK_HEAD_DIM_FACTOR = {32: 1.08, 80: 1.22, 96: 1.22, 256: 1.16}
_WIDE_KEY_HEAD_DIM, _WIDE_KEY_TILE = 128, 160   # see _wide_key_candidates
# Registers ptxas gives the block-wise kernel's heavy-first forms at head dim 64 with one m16 tile a warp on 16- or
# 32-key tiles (2 or 4 warps), where the estimate (BlockConfig.registers: 104-116) runs above it: 96 without launch
# bounds and without spills (nvcc 13.0, sm_90; 32x32x2x2, 64x32x4x2 and 32x16x2x2, with and without key padding,
# session 30). Until session 29 the model offered these forms bounded to 96 (``min_blocks``), which ptxas then needed
# (session 9: 116 unbounded); the bound now makes the padded forms spill 4 bytes, and the H200 ran RoBERTa-base
# 16x2048's pick 0.0979 ms unbounded against 0.1016 bounded (s30regs).
_MEASURED_REGISTERS = 96
_WARPGROUP = 128
_BASE_REGISTERS = 40        # addresses, loop counters, softmax row state beyond the fragments
_VECTOR_BYTES = 16


@dataclass(frozen=True)
class AttentionProblem:
    """One multi-head attention call: ``[batch, heads, seq_q|seq_k, head_dim]`` tensors and a profiled mask;
    ``padding``: the kernel also applies a model's key padding (the wgmma kernel's column predicate; the mask
    profile does not include it, as the padding is only known at run time)."""

    batch: int
    heads: int
    head_dim: int
    dtype: str
    mask: MaskProfile
    padding: bool = False
    kv_heads: int = 0       # key/value heads (grouped-query attention: fewer than heads); 0: as many as heads

    def __post_init__(self):
        for name in ("batch", "heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionProblem.{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"AttentionProblem.dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.mask, MaskProfile):
            raise TypeError(f"AttentionProblem.mask must be a MaskProfile, got {type(self.mask).__name__}")
        if self.mask.mask_batch not in (1, self.batch) or self.mask.mask_heads not in (1, self.heads):
            raise ValueError(f"mask groups [{self.mask.mask_batch}, {self.mask.mask_heads}] do not broadcast to "
                             f"batch={self.batch}, heads={self.heads}")
        if self.kv_heads and (self.kv_heads < 0 or self.heads % self.kv_heads):
            raise ValueError(f"AttentionProblem.kv_heads must divide heads ({self.heads}), got {self.kv_heads!r}")
        if self.kv_heads == self.heads:     # one form of "no groups", so equal problems compare and name alike
            object.__setattr__(self, "kv_heads", 0)

    @classmethod
    def build(cls, mask, *, batch: int, heads: int, seq_len: int, head_dim: int = 64,
              dtype: str = "float16", kv_heads: int = 0) -> "AttentionProblem":
        """Problem from any mask form (spec string, array, lengths, callable) at ``seq_len`` queries and keys."""
        profile = mask if isinstance(mask, MaskProfile) else MaskProfile.from_spec(
            mask, seq_q=seq_len, batch=batch, heads=heads)
        return cls(batch=batch, heads=heads, head_dim=head_dim, dtype=dtype, mask=profile, kv_heads=kv_heads)

    @property
    def seq_q(self) -> int:
        return self.mask.seq_q

    @property
    def seq_k(self) -> int:
        return self.mask.seq_k

    @property
    def replicas(self) -> int:
        """(batch, head) pairs that read each mask group."""
        return self.batch * self.heads // self.mask.groups

    @property
    def element_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def useful_flops(self) -> float:
        """Flops of the kept pairs only (``4 * kept * D`` per head), the measure design.md reports."""
        return 4.0 * self.mask.kept * self.replicas * self.head_dim

    def dram_floor_bytes(self) -> float:
        """Q, K, V read once and O written once (K and V of each key/value head once: the query heads sharing
        one run one after another, so its tiles are read again from L2)."""
        kv_heads = self.kv_heads or self.heads
        return float(self.batch * self.head_dim * self.element_bytes * 2 * (self.heads * self.seq_q
                                                                            + kv_heads * self.seq_k))


@dataclass(frozen=True)
class AttentionCandidate:
    """A kernel kind (``"block"``, ``"row"`` or ``"wgmma"``) and its configuration."""

    kind: str
    config: object

    def __str__(self) -> str:
        c = self.config
        if self.kind == "block":
            return (f"block BM={c.block_m} BN={c.block_n} warps={c.num_warps} stages={c.stages}"
                    + (" heavy-first" if c.heavy_first else "")
                    + (f" split-KV {c.kv_splits}x{c.split_rows}" if c.kv_splits > 1 else "")
                    + (f" min_blocks {c.min_blocks}" if c.min_blocks else ""))
        if self.kind == "wgmma":
            return (f"wgmma consumers={c.consumers} BN={c.block_n} stages={c.stages}"
                    + (" persistent" if c.persistent else "") + (" TMA" if c.loads == "tma" else ""))
        return f"row KG={c.key_groups} U={c.keys_per_step} rows/block={c.rows_per_block}"


@dataclass(frozen=True)
class RankedCandidate:
    candidate: AttentionCandidate
    prediction: Prediction

    @property
    def time_s(self) -> float:
        return self.prediction.time_s


def block_candidates(head_dim: int, hw: HardwareProfile = H200,
                     heavy_first=(False,)) -> list[AttentionCandidate]:
    """Every block-wise configuration the kernel accepts for ``head_dim`` within ``hw``'s shared memory, for
    each launch order in ``heavy_first``. Heavy-first ones walk their full tiles last column first
    (``reverse_full``): the global rows then meet each K/V tile when the other rows do, in L2 (H200, session 10
    call 4, s10sparse, B16 H12 S4096 D64: BigBird 32x32x2x2 hf 0.1998 -> 0.1860 ms, with min_blocks 10 0.1970 ->
    0.1863; Longformer 0.2433 -> 0.2409, 0.2399 -> 0.2376; split-KV 4 slices 0.2206 -> 0.2156, 0.2656 -> 0.2647;
    all 21 timed cases checked vs float32). The model has no term for it: prices are the same either way."""
    out = []
    for bm in _BLOCK_M:
        for bn in _BLOCK_N:
            for warps in _WARPS:
                for stages in _STAGES:
                    for heavy in heavy_first:
                        config = BlockConfig(block_m=bm, block_n=bn, num_warps=warps, stages=stages,
                                             heavy_first=heavy, row_sums=default_row_sums(head_dim),
                                             reverse_full=heavy)
                        try:
                            config.validate(head_dim)
                        except ValueError:
                            continue
                        if config.shared_bytes(head_dim) <= hw.smem_per_block:
                            out.append(AttentionCandidate("block", config))
    return out


def block_registers(config: BlockConfig, head_dim: int) -> int:
    """Registers a thread of ``config``'s kernel takes: ptxas's measured count where the estimate is known to run
    above it (:data:`_MEASURED_REGISTERS`), else the kernel's estimate."""
    estimate = config.registers(head_dim)
    if (head_dim == 64 and config.heavy_first and config.m_tiles_per_warp == 1 and config.block_n <= 32
            and config.num_warps in (2, 4) and not config.min_blocks):
        return min(estimate, _MEASURED_REGISTERS)
    return estimate


def row_candidates(head_dim: int, dtype: str, hw: HardwareProfile = H200) -> list[AttentionCandidate]:
    """Every row-wise configuration that the CUDA schedule accepts
    (:func:`~stof_tvm.schedules.attention_rowwise.cuda_config_fits` within ``hw``'s threads per block)."""
    out = []
    for groups in _KEY_GROUPS:
        for step in _KEYS_PER_STEP:
            for rows in _ROWS_PER_BLOCK:
                config = RowConfig(key_groups=groups, keys_per_step=step, rows_per_block=rows)
                if cuda_config_fits(config, head_dim, dtype, hw.threads_per_block):
                    out.append(AttentionCandidate("row", config))
    return out


def wgmma_candidates(head_dim: int, hw: HardwareProfile = H200, padding: bool = False) -> list[AttentionCandidate]:
    """The wgmma kernel's configurations for ``head_dim`` on ``hw`` (none off Hopper, compute capability 9.x, or
    at head dims whose kernels were not checked on a GPU, ``CHECKED_HEAD_DIMS``): the default
    (:func:`~stof_tvm.schedules.attention_wgmma.default_config`) first, so that it wins ties, then 2 / 3 consumers
    x 64 / 128 keys x 2-5 ring stages that fit (the kernel's register and shared-memory checks); ping-pong, the
    default's loads, one block per work item and persistent (see the module docstring for what is left out and
    why). Left out because ptxas builds them badly (nvcc 13.0, sm_90a): 64-key tiles below head dim 128
    (setmaxnreg dropped: C7508 at 64; at 80 and 96 no USETMAXREG in the SASS, 126 / 131 registers for every
    warpgroup) and, with ``padding``, three consumers (the padding predicate makes their 160 registers spill: 12-48 spill stores);
    with padding at head dim 64 the first is then two consumers. At head dims 32, 80, 96 and 256 the default alone:
    the measured best of the forms timed there (one H200 run, session 10; the model, which does not price padded
    panels or tell the grids apart within a few percent, would pick untimed neighbours)."""
    if head_dim not in WGMMA_HEAD_DIMS or not hw.compute_version.startswith("9."):
        return []
    default = wgmma_default_config(head_dim, padding)
    if head_dim not in _WGMMA_SPACE_HEAD_DIMS:
        return [AttentionCandidate("wgmma", default)]
    out = [default]
    for consumers in ((2,) if padding else (3, 2)):
        for block_n in ((128,) if head_dim < 128 else (128, 64)):
            for stages in _WGMMA_STAGES:
                for persistent in (False, True):
                    config = WgmmaAttentionConfig(block_n=block_n, stages=stages, consumers=consumers,
                                                  persistent=persistent, loads=default.loads)
                    try:
                        config.validate(head_dim)
                    except ValueError:
                        continue
                    if config != default and config.shared_bytes(head_dim) <= hw.smem_per_block:
                        out.append(config)
    return [AttentionCandidate("wgmma", c) for c in out]


def attention_candidates(problem: AttentionProblem, hw: HardwareProfile = H200,
                         kinds=("block", "row")) -> list[AttentionCandidate]:
    """The candidate space of ``problem``: block-wise, row-wise and (asked for, on Hopper, 16-bit) wgmma
    configurations."""
    unknown = set(kinds) - {"block", "row", "wgmma"}
    if unknown:
        raise ValueError(f"kinds must be among 'block', 'row' and 'wgmma', got {sorted(unknown)}")
    out = []
    if "block" in kinds and problem.head_dim in BLOCK_HEAD_DIMS and problem.dtype != "float32":
        # The heavy-first launch order only differs where some tile row holds > 2x its group's mean tiles, at the
        # candidate's own tile shape (BigBird at S = 512 has such rows in 32-row tiles, none in 64-row ones)
        blocks = [c for c in block_candidates(problem.head_dim, hw, (False, True))
                  if not c.config.heavy_first or _has_heavy_rows(problem.mask, c.config.block_m, c.config.block_n)]
        out += blocks + _split_candidates(problem, blocks)
    if "row" in kinds and problem.head_dim in ROW_HEAD_DIMS:
        out += row_candidates(problem.head_dim, problem.dtype, hw)
    if "wgmma" in kinds and problem.dtype in WGMMA_DTYPES:
        out += wgmma_candidates(problem.head_dim, hw, problem.padding) + _wide_key_candidates(problem, hw)
    return out


def _wide_key_candidates(problem: AttentionProblem, hw: HardwareProfile) -> list[AttentionCandidate]:
    """The default wgmma configuration at head dim 128 widened to 160-key tiles, offered where the mask has no
    partial tile at the default's 128 x 128 grid (dense attention, masks aligned to 128) and no key padding.

    Measured in one run (plan s36wide, session 36, an H100, B4 H16 S8192, checks passed), each form's median alone
    and, in brackets, interleaved round by round with the other: dense 3.328 ms against the default's 3.808 (3.730
    against 3.907), faster both ways; causal 1.885 against 1.776 (1.982 against 2.033), the two ways disagreeing.
    The per-tile terms price the two forms within 1% of each other on both masks (no constant of theirs fits the
    dense gain), so the wide form is a candidate only on the masks where it measured faster both ways; the model then
    ranks it against the rest as usual (FlashAttention-3's tile table makes the same split: wider key tiles for
    non-causal head dim 128)."""
    if problem.head_dim != _WIDE_KEY_HEAD_DIM or problem.padding or not hw.compute_version.startswith("9."):
        return []
    default = wgmma_default_config(problem.head_dim)
    if problem.mask.tile_counts(default.block_m, default.block_n)[1].any():
        return []
    wide = dataclasses.replace(default, block_n=_WIDE_KEY_TILE)
    return [AttentionCandidate("wgmma", wide)] if wide.shared_bytes(problem.head_dim) <= hw.smem_per_block else []


def _heavy_rows(mask: MaskProfile, block_m: int, block_n: int) -> np.ndarray:
    """[G, TR] flags of the heavy tile rows (more than twice their group's mean tile count), as the kernel's
    heavy-first selection finds them."""
    full, part = mask.tile_counts(block_m, block_n)
    tiles = full + part
    return tiles * tiles.shape[1] > 2 * tiles.sum(axis=1, keepdims=True)


def _split_candidates(problem: AttentionProblem, blocks: list[AttentionCandidate]) -> list[AttentionCandidate]:
    """Split-KV variants of the heavy-first, 2-stage block configurations: each of the mask's heavy rows per group
    (at most _MAX_SPLIT_ROWS) shared by each of _KV_SPLITS blocks. None when the mask has no heavy row."""
    out = []
    for cand in blocks:
        c = cand.config
        if not c.heavy_first or c.stages != 2:
            continue
        rows = int(_heavy_rows(problem.mask, c.block_m, c.block_n).sum(axis=1).max())
        if rows == 0:
            continue
        for splits in _KV_SPLITS:
            out.append(AttentionCandidate("block", BlockConfig(
                block_m=c.block_m, block_n=c.block_n, num_warps=c.num_warps, stages=c.stages, heavy_first=True,
                kv_splits=splits, split_rows=min(rows, _MAX_SPLIT_ROWS), row_sums=c.row_sums,
                reverse_full=c.reverse_full)))
    return out


def _has_heavy_rows(mask: MaskProfile, block_m: int, block_n: int) -> bool:
    full, part = mask.tile_counts(block_m, block_n)
    tiles = full + part
    return bool((tiles * tiles.shape[1] > 2 * tiles.sum(axis=1, keepdims=True)).any())


def _group_of_heads(problem: AttentionProblem) -> np.ndarray:
    """The mask group read by each (batch, head) pair, in (batch, head) order."""
    bh = np.arange(problem.batch * problem.heads)
    b = bh // problem.heads if problem.mask.mask_batch > 1 else np.zeros_like(bh)
    h = bh % problem.heads if problem.mask.mask_heads > 1 else np.zeros_like(bh)
    return b * problem.mask.mask_heads + h


def _block_order(problem: AttentionProblem, tiles: np.ndarray, heavy_first: bool) -> np.ndarray:
    """Classes (g * TR + tile row) of the block-wise kernel's thread blocks in launch order.

    Default grid (TR, B*H): per (batch, head), tile rows last to first. Heavy-first grid (B*H, TR): position
    by position across all heads, where a group's positions list its heavy rows (> 2x the group's mean tiles)
    ascending, then the others descending.
    """
    rows = tiles.shape[1]
    g = _group_of_heads(problem)
    if not heavy_first:
        return (g[:, None] * rows + np.arange(rows - 1, -1, -1)[None, :]).ravel()
    heavy = tiles * rows > 2 * tiles.sum(axis=1, keepdims=True)
    # Sort key per (group, row): heavy rows by ascending index first, then light rows by descending index.
    key = np.where(heavy, np.arange(rows)[None, :], rows + (rows - 1 - np.arange(rows))[None, :])
    position_rows = np.argsort(key, axis=1, kind="stable")          # [G, TR]: row at each position
    return (g[None, :] * rows + position_rows[g].T).ravel()


def _block_work(problem: AttentionProblem, config: BlockConfig, cal: Calibration) -> KernelWork:
    bm, bn, d, eb = config.block_m, config.block_n, problem.head_dim, problem.element_bytes
    full2d, part2d = problem.mask.tile_counts(bm, bn)
    order = problem.mask.memo(("block_order", bm, bn, config.heavy_first, problem.batch, problem.heads),
                              lambda: _block_order(problem, full2d + part2d, config.heavy_first))
    full, part = full2d.ravel().astype(np.float64), part2d.ravel().astype(np.float64)
    tiles = full + part
    count = np.full(tiles.shape, float(problem.replicas))
    merge = None
    if config.kv_splits > 1:
        full, part, count, order, merge = _split_kv(problem, config, full2d, part2d, order)
        tiles = full + part
    pipeline = 1.0 / (1.0 + cal.stage_gain * (config.stages - 2))   # deeper cp.async rings hide more of the wait
    bitmap_bytes = bm * bn / 8
    per_block_l2 = tiles * 2 * bn * d * eb + part * bitmap_bytes + 2 * bm * d * eb
    format_bytes = (part.sum() * (bitmap_bytes + 4) + full.sum() * 4 + 8 * (tiles.size + 1))
    latency = (tiles * cal.tile_cycles * pipeline + cal.block_cycles
               + (_HEAVY_SELECT_CYCLES if config.heavy_first else 0.0))
    workspace_bytes = 0.0
    if merge is not None:      # the merge kernel's blocks: the last class, launched after every other block
        latency[-1] = cal.launch_s * H200.clock_hz + cal.block_cycles + merge["cycles"]   # its own launch
        workspace_bytes = merge["bytes"]
    return KernelWork(
        name=str(AttentionCandidate("block", config)), threads=config.threads,
        smem_bytes=config.shared_bytes(d), regs_per_thread=block_registers(config, d), count=count,
        tc_flops=tiles * 4.0 * bm * bn * d,
        cuda_ops=(tiles * cal.softmax_ops + part * cal.mask_ops) * bm * bn,
        latency_cycles=latency,
        dram_bytes=problem.dram_floor_bytes() + format_bytes + workspace_bytes,
        l2_bytes=float((count * per_block_l2).sum()) + workspace_bytes, useful_flops=problem.useful_flops,
        order=order)


def _wgmma_work(problem: AttentionProblem, config: WgmmaAttentionConfig, cal: Calibration) -> KernelWork:
    """The wgmma kernel's blocks: one per (batch, head, tile row), launched in the block-wise kernel's default
    order. Every listed tile is computed whole (no warp skips rows that keep nothing in it); its products are
    priced at the wgmma rate by scaling their flops by ``tc_eff / wgmma_attn_tc_eff`` (:func:`predict` prices
    tensor-core flops at ``tc_eff``)."""
    bm, bn, d, eb = config.block_m, config.block_n, problem.head_dim, problem.element_bytes
    full2d, part2d = problem.mask.tile_counts(bm, bn)
    order = problem.mask.memo(("block_order", bm, bn, False, problem.batch, problem.heads),
                              lambda: _block_order(problem, full2d + part2d, False))
    full, part = full2d.ravel().astype(np.float64), part2d.ravel().astype(np.float64)
    tiles = full + part
    count = np.full(tiles.shape, float(problem.replicas))
    pipeline = 1.0 / (1.0 + cal.wgmma_stage_gain * (config.stages - 2))
    tile_cycles = cal.wgmma_tma_tile_cycles if config.loads == "tma" else cal.wgmma_tile_cycles
    bitmap_bytes = bm * bn / 8
    per_block_l2 = tiles * 2 * bn * d * eb + part * bitmap_bytes + 2 * bm * d * eb
    format_bytes = part.sum() * (bitmap_bytes + 4) + full.sum() * 4 + 8 * (tiles.size + 1)
    threads = (config.consumers + 1) * _WARPGROUP
    producer, consumer = WGMMA_REGISTERS[config.consumers]
    launch_registers = (producer + config.consumers * consumer) // (config.consumers + 1)   # before setmaxnreg
    l2_bytes = float((count * per_block_l2).sum())
    items = np.ones_like(tiles)
    item_cycles = cal.wgmma_item_cycles
    if config.persistent:                   # one block per SM walking its share of the items (same tiles, same L2)
        tiles, part, items = (_persistent_sums(problem, a.reshape(full2d.shape), WGMMA_PERSISTENT_GRID)
                              for a in (tiles, part, items))
        count, order, item_cycles = np.ones_like(tiles), None, cal.wgmma_persistent_item_cycles
    return KernelWork(
        name=str(AttentionCandidate("wgmma", config)), threads=threads, smem_bytes=config.shared_bytes(d),
        regs_per_thread=launch_registers, count=count,
        tc_flops=tiles * 4.0 * bm * bn * d * (cal.tc_eff / cal.wgmma_attn_tc_eff),
        cuda_ops=(tiles * cal.wgmma_softmax_ops / (config.consumers - 1) + part * cal.wgmma_mask_ops) * bm * bn,
        latency_cycles=tiles * tile_cycles * pipeline + items * item_cycles,
        dram_bytes=problem.dram_floor_bytes() + format_bytes, l2_bytes=l2_bytes, useful_flops=problem.useful_flops,
        order=order)


def _persistent_sums(problem: AttentionProblem, per_row: np.ndarray, sm_count: int) -> np.ndarray:
    """Per block of the persistent grid, the sum of ``per_row`` (``[mask groups, tile rows]``) over the work items
    it walks: :func:`~stof_tvm.schedules.attention_wgmma.block_work_item`'s static walk (block ``bx`` takes units
    ``bx, bx + grid, ...``; unit ``u`` is head ``u // half``'s tile rows ``TR-1-k`` and ``k - TR % 2``, the latter
    absent when negative, ``k = (u + u // half) % half``)."""
    tile_rows = per_row.shape[1]
    half = -(-tile_rows // 2)
    heads = problem.batch * problem.heads
    grid = min(heads * half, sm_count)
    unit = np.arange(heads * half)
    head = unit // half
    k = (unit % half + head) % half
    b, h = head // problem.heads, head % problem.heads
    mb, mh = problem.mask.mask_batch, problem.mask.mask_heads
    group = (b % mb) * mh + h % mh
    second = k - tile_rows % 2
    work = per_row[group, tile_rows - 1 - k] + np.where(second >= 0, per_row[group, np.maximum(second, 0)], 0.0)
    return np.bincount(unit % grid, weights=work, minlength=grid)


def _split_kv(problem: AttentionProblem, config: BlockConfig, full2d: np.ndarray, part2d: np.ndarray,
              order: np.ndarray):
    """Block classes of the split-KV launch: each split heavy row's class becomes ``kv_splits`` blocks of a
    ``1/kv_splits`` slice of its tiles, launched first; the merge kernel's blocks are one more class (zero
    tiles), launched last, whose cost ``merge`` gives (cycles per block, workspace bytes written and read)."""
    groups, rows = full2d.shape
    splits, split_rows = config.kv_splits, min(config.split_rows, rows)
    heavy = _heavy_rows(problem.mask, config.block_m, config.block_n)
    split = np.zeros((groups, rows), bool)
    for g in range(groups):
        split[g, np.flatnonzero(heavy[g])[:split_rows]] = True
    tiles2d = full2d + part2d
    share = np.where(split, np.ceil(tiles2d / splits) / np.maximum(tiles2d, 1), 1.0)
    full = np.append((full2d * share).ravel(), 0.0)
    part = np.append((part2d * share).ravel(), 0.0)
    merge_blocks = problem.batch * problem.heads * split_rows
    count = np.append(np.where(split, splits, 1).ravel() * float(problem.replicas), float(merge_blocks))
    is_split = split.ravel()
    extra = np.repeat(order[is_split[order]], splits - 1)          # the other slices of the split rows
    order = np.concatenate([extra, order, np.full(merge_blocks, full.size - 1)])
    split_count = float(split.sum()) * problem.replicas
    elements = config.block_m * problem.head_dim
    merge = {"cycles": elements / config.threads * splits * _MERGE_CYCLES_PER_SLICE,
             "bytes": split_count * splits * (elements + config.block_m) * 4 * 2}
    return full, part, count, order, merge


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _row_work(problem: AttentionProblem, config: RowConfig, cal: Calibration) -> KernelWork:
    d, eb, mask = problem.head_dim, problem.element_bytes, problem.mask
    lanes = cuda_lanes(d, problem.dtype)
    rows = _largest_divisor_at_most(problem.seq_q, config.rows_per_block)   # as the schedule does
    per_step = config.key_groups * config.keys_per_step
    steps = -(-mask.keys_per_row // per_step)                               # [G, Sq]
    runs = steps.reshape(mask.groups, -1, rows)
    slots = runs.sum(axis=-1).ravel().astype(np.float64) * per_step
    longest = runs.max(axis=-1).ravel().astype(np.float64)
    union = mask.block_union(rows).ravel()
    count = np.full(slots.shape, float(problem.replicas))
    n_runs = runs.shape[1]
    order = (_group_of_heads(problem)[:, None] * n_runs + np.arange(n_runs)[None, :]).ravel()
    vec = _VECTOR_BYTES // eb                 # channels per lane (lanes past the row's last vector idle)
    registers = 2 * vec + config.keys_per_step * vec + 3 * config.keys_per_step + _BASE_REGISTERS
    kept_keys = mask.keys_per_row.reshape(mask.groups, -1, rows).sum(axis=-1).ravel()
    per_block_l2 = union * 2 * d * eb + kept_keys * 4 + 2 * rows * d * eb
    merge_ops = rows * d * config.key_groups * 6.0
    return KernelWork(
        name=str(AttentionCandidate("row", config)), threads=lanes * config.key_groups * rows,
        smem_bytes=rows * config.key_groups * (d + 2) * 4, regs_per_thread=int(registers), count=count,
        tc_flops=np.zeros_like(slots),
        cuda_ops=slots * (cal.pair_ops_per_dim * lanes * vec + cal.pair_ops_fixed * lanes) + merge_ops,
        latency_cycles=longest * cal.step_cycles + cal.row_cycles,
        dram_bytes=problem.dram_floor_bytes() + mask.kept * 4.0 + 4.0 * (mask.groups * problem.seq_q + 1),
        l2_bytes=float((count * per_block_l2).sum()), useful_flops=problem.useful_flops, order=order)


def attention_work(problem: AttentionProblem, candidate: AttentionCandidate,
                   cal: Calibration = DEFAULT_CALIBRATION) -> KernelWork:
    """The :class:`KernelWork` of ``candidate`` on ``problem``."""
    if candidate.kind == "block":
        return _block_work(problem, candidate.config, cal)
    if candidate.kind == "row":
        return _row_work(problem, candidate.config, cal)
    if candidate.kind == "wgmma":
        return _wgmma_work(problem, candidate.config, cal)
    raise ValueError(f"candidate kind must be 'block', 'row' or 'wgmma', got {candidate.kind!r}")


def rank_attention(problem: AttentionProblem, hw: HardwareProfile = H200, cal: Calibration = DEFAULT_CALIBRATION,
                   candidates=None, *, keep_infeasible: bool = False) -> list[RankedCandidate]:
    """Predict every candidate (default: :func:`attention_candidates`) and sort fastest first.

    Infeasible candidates (over a shared-memory, register or thread limit) are dropped unless
    ``keep_infeasible``, in which case they come last with an infinite time and the reason.
    """
    candidates = attention_candidates(problem, hw) if candidates is None else list(candidates)
    ranked = [RankedCandidate(c, _head_dim_corrected(predict(attention_work(problem, c, cal), hw, cal), c,
                                                     problem.head_dim)) for c in candidates]
    if not keep_infeasible:
        ranked = [r for r in ranked if r.prediction.feasible]
    ranked.sort(key=lambda r: _rank_key(r, problem.padding))
    return _more_warps_first(ranked)


def _head_dim_corrected(prediction: Prediction, candidate: AttentionCandidate, head_dim: int) -> Prediction:
    """A block-wise ``prediction`` times :data:`_BLOCK_HEAD_DIM_FACTOR` at the head dims it lists (the factor kept in
    its terms as ``head_dim_factor``); any other prediction as it is."""
    factor = _BLOCK_HEAD_DIM_FACTOR.get(head_dim) if candidate.kind == "block" else None
    if factor is None or not prediction.feasible:
        return prediction
    return dataclasses.replace(prediction, time_s=prediction.time_s * factor,
                               terms={**prediction.terms, "head_dim_factor": factor})


def _more_warps_first(ranked: list[RankedCandidate]) -> list[RankedCandidate]:
    """The leading block-wise candidate's twin with twice the warps (each warp one m16 row of the tile instead of
    two), moved to the front where the model prices the two the same (a bandwidth bound), whatever their SM terms:
    measured faster each time (plan s36wide, session 36, an H100, sliding window B16 H12 S4096 D64, interleaved:
    32x32 tiles with two warps 0.1464 ms median against one warp's 0.1512, whose fastest sample was 0.1491; session 9,
    H200, BigBird: 0.196 against 0.240)."""
    if not ranked or ranked[0].candidate.kind != "block":
        return ranked
    lead = ranked[0]
    twin = dataclasses.replace(lead.candidate.config, num_warps=lead.candidate.config.num_warps * 2)
    for i, r in enumerate(ranked[1:], start=1):
        if r.candidate.kind == "block" and r.candidate.config == twin and r.time_s <= lead.time_s * (1 + 1e-9):
            return [r] + ranked[:i] + ranked[i + 1:]
    return ranked


def _rank_key(ranked: RankedCandidate, padded: bool = False) -> tuple:
    """Fastest predicted first. Where a shared bandwidth bound gives candidates the same time (sparse masks at
    32-row tiles: the L2 or DRAM term), the smaller SM term goes first, then more co-resident warps (latency the
    model's issue rate does not see; session 9 on the H200: 10 one-warp blocks an SM ran BigBird 0.240 ms, 10
    two-warp ones 0.196). With a model's key padding (``padded``) the co-resident warps go before the SM term, which
    comes from a register estimate above what ptxas uses for two-warp tiles (116 vs 96: 8 resident blocks priced
    instead of 10): session 11 (call 7, s11gpt2) on GPT-2's BigBird AND causal mask with key padding, B16 H12 S2048
    D64, measured 32x32 two-warp tiles 0.064 ms against the one-warp tiles the SM term ranked first, 0.075. Unpadded,
    :func:`_more_warps_first` then puts the leading tile's two-warp twin first where it ties."""
    terms = ranked.prediction.terms
    sm = terms.get("sm_s", 0.0)
    warps = -terms.get("resident", 0) * terms.get("threads", 0) / 32
    return (ranked.time_s, warps, sm) if padded else (ranked.time_s, sm, warps)


def choose_attention(problem: AttentionProblem, hw: HardwareProfile = H200,
                     cal: Calibration = DEFAULT_CALIBRATION, kinds=("block", "row")) -> RankedCandidate:
    """The fastest predicted candidate of ``kinds`` for ``problem`` (:func:`decide_attention`'s pick)."""
    return decide_attention(problem, hw, cal, kinds).best


@dataclass(frozen=True)
class AttentionDecision:
    """The chosen candidate and why, in words (the compile path's ``KernelChoice.reason``)."""

    best: RankedCandidate
    reason: str


def decide_attention(problem: AttentionProblem, hw: HardwareProfile = H200,
                     cal: Calibration = DEFAULT_CALIBRATION, kinds=("block", "row")) -> AttentionDecision:
    """The fastest predicted candidate of ``kinds``; where wgmma is among them the reason names its prediction and
    the best mma.sync kernel's."""
    ranked = rank_attention(problem, hw, cal, attention_candidates(problem, hw, kinds))
    if not ranked:
        raise ValueError(f"no feasible attention kernel for head_dim={problem.head_dim}, dtype={problem.dtype} "
                         f"on {hw.name}")
    best = ranked[0]
    others = [r for r in ranked if r.candidate.kind != "wgmma"]
    if "wgmma" not in kinds or not others:
        return AttentionDecision(best, f"analytical model: {best.candidate} predicted {best.time_s * 1e3:.3f} ms")
    wgmma = next((r for r in ranked if r.candidate.kind == "wgmma"), None)
    if wgmma is None:
        return AttentionDecision(best, f"analytical model: {best.candidate} predicted {best.time_s * 1e3:.3f} ms "
                                       f"(no wgmma configuration for head dim {problem.head_dim}, {problem.dtype})")
    rival = others[0]
    versus = f"{wgmma.candidate} {wgmma.time_s * 1e3:.3f} ms vs {rival.candidate} {rival.time_s * 1e3:.3f} ms"
    if wgmma is not best:
        return AttentionDecision(best, f"analytical model: mma.sync predicted faster ({versus})")
    return AttentionDecision(best, f"analytical model: wgmma predicted faster ({versus})")
