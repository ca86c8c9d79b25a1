"""Block-wise sparse attention (STOF's FlashAttention-style kernel) as TensorIR.

One thread block owns one (batch, head, tile row of ``BM`` queries). It walks the tile row's *partial* tiles,
applying their 8x8-sub-tile bitmaps exactly (masked scores become -inf before the online softmax), then its
*full* tiles (no mask work), with an online softmax in float32 and both products on tensor cores. Empty tiles
are never loaded. Inputs follow the tiled-format contract of :mod:`stof_tvm.sparse_formats.tiled`.

Two PrimFuncs with the same signature and semantics are built here:

- ``target_kind="cuda"`` (sm_80+, tuned for sm_90): a **thread-level** TVMScript kernel. Each warp owns ``16 * MT``
  query rows; ``QK^T`` and ``PV`` run on ``mma.sync.m16n8k16`` (fp32 accumulate) fed by ``ldmatrix`` from
  conflict-free shared memory (XOR-swizzled rows; an odd row stride where rows are not a multiple of 128 bytes); K/V
  tiles (and the bitmaps of partial tiles) stream in through a ``stages``-deep ``cp.async`` ring; Q's fragments stay
  in registers (reloaded from shared memory per tile where they would not fit beside the accumulators: large head
  dims); the probabilities stay in registers and are repacked as the A operand of the ``PV`` product
  (FlashAttention-2's trick); the output is staged through shared memory and written with 16-byte stores. It is
  written at thread level because TensorIR's schedule primitives cannot express this kernel: the tile walk is data
  dependent (two CSR lists per tile row), the softmax state must live in the registers of the very threads that hold
  the ``mma`` accumulators (a layout ``tensorize`` does not expose), and the mask is applied per accumulator
  register. TVM 0.27's ``T.ptx`` dialect provides every instruction used (see :mod:`stof_tvm.schedules.mma`).
- ``target_kind="llvm"``: a plain loop nest (parallel over tile rows, scalar online softmax per query row) that
  computes the same function, so correctness of the format walk and of the masking semantics is tested on the
  CPU. The CUDA kernel itself is checked against a float reference on the GPU (``scripts/bench_attention.py``;
  with a score bias ``scripts/check_bias_gpu.py``) and its generated source is compiled for sm_90 with nvcc in
  the CPU tests.

Semantics (both targets): ``out[b, h, i] = sum_j softmax_j(scale * q_i . k_j (+ bias[b, h, i, j]) over kept j) v_j``
(the optional score bias, e.g. T5's position bias, as in the row-wise kernel), where kept
pairs come from mask group ``g = (b if mask_batch > 1 else 0) * mask_heads + (h if mask_heads > 1 else 0)``;
rows with no kept key give exactly 0. Format arrays must have at least one element: pass a dummy entry
(e.g. ``[0]`` and one all-zero bitmap) when a mask has no full or no partial tile; ``n_full`` / ``n_part`` are
symbolic, so one compiled kernel serves every mask of the same shape and group layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from .mma import (CP_ASYNC_16, EX2, LD_SHARED_V4, LDMATRIX_X4, LDMATRIX_X4_TRANS, ST_GLOBAL_V4, chunk_offset,
                  chunk_stride, mma_m16n8k16, pack_f32x2)
from .attention_rowwise import check_kv_heads, check_score_bias
from .key_padding import bit_words

__all__ = ["BlockConfig", "default_block_config", "blockwise_attention_primfunc", "SUPPORTED_DTYPES",
           "SUPPORTED_HEAD_DIMS", "OUT_LAYOUTS", "ROW_SUMS"]

SUPPORTED_DTYPES = ("float16", "bfloat16")
# Every multiple of 16 from 32 to 256: a k16 step of QK^T and two n8 tiles of PV per 16 channels.
SUPPORTED_HEAD_DIMS = tuple(range(32, 257, 16))
OUT_LAYOUTS = ("bhsd", "bshd")
ROW_SUMS = ("mma", "fadd")       # BlockConfig.row_sums: P's row sums on the tensor cores or by float adds
VIEW_ALIGN = 8           # Q/K/V may start at any multiple of 8 elements (16 bytes: the kernel's cp.async width)
_LOG2E = 1.4426950408889634
_FULL_MASK = 0xFFFFFFFF
# Fragment-register estimate above which Q is reloaded per tile at head dims > 128: ptxas (nvcc 13, sm_90) spilled
# at estimates 236 (D=224, 64x32 tiles) and 248 (D=208, 128x64), never at 232 or below.
_Q_REGISTER_LIMIT = 232
_BASE_REGISTERS = 40     # addresses, loop counters, softmax row state beyond the fragments
# Lazy rescaling of the online softmax (FlashAttention-4's trick): a row's running max, in log2 units, is raised
# only when a tile's max exceeds it by more than this, so probabilities stay <= 2^8 (fine in fp16 / bf16, and fp32
# sums) and the O accumulators are rescaled only in the rare tiles where some row of the warp raised its max.
_LAZY_RESCALE_LOG2 = 8.0


@dataclass(frozen=True)
class BlockConfig:
    """Tile shape and parallelism of the block-wise kernel.

    ``block_m`` queries per thread block (a tile row), ``block_n`` keys per tile, ``num_warps`` warps per
    block (each owns ``block_m / num_warps`` query rows, 16 or 32), ``stages`` K/V tiles in flight
    (``cp.async`` ring depth, >= 2). The tiled format must be built with the same ``block_m`` x ``block_n``.

    ``heavy_first`` changes the launch order. By default each (batch, head) launches its tile rows last to
    first (right for causal-like masks, whose last rows carry the most tiles). With ``heavy_first`` the grid
    launches, across all heads, the tile rows holding more than twice their group's mean tile count first
    (the global rows of Longformer/BigBird), then the others last to first; each thread block finds its row
    from the format's row pointers (two extra barriers), so one long row no longer starts at the very end.

    ``kv_splits`` > 1 (split-KV, with ``heavy_first`` only): the first ``split_rows`` heavy tile rows of each
    (batch, head) are each shared by ``kv_splits`` thread blocks, launched first, each walking one contiguous
    slice of the row's tile list and writing its rows' normalised partial output and log-sum-exp (float32) to a
    workspace; a second kernel merges the slices exactly. Where a long row would otherwise run alone while the
    rest of the grid is done (B=1 Longformer/BigBird global rows at long S), its time drops by about
    ``kv_splits``. A mask with fewer heavy rows leaves the extra blocks idle; more heavy rows are walked whole.

    ``min_blocks`` > 0 asks ptxas (``__launch_bounds__(threads, min_blocks)``) to fit that many blocks on an SM,
    i.e. at most ``65536 / (threads * min_blocks)`` registers a thread (it spills beyond); 0 leaves the register
    count to ptxas, whose choice moves with small code changes (96 or 122 for the same 64x32 kernel, nvcc 13).

    ``row_sums`` is how the softmax's row sums of P are formed: ``"mma"`` on the tensor cores (P times a column
    of ones, one more ``mma`` per k16 step, no float add per score and no quad reduction at the end) or
    ``"fadd"`` (a float add per score, the four lanes of a row reduced once at the end). The first issues fewer
    instructions per tile but needs more registers (ptxas: 169-184 instead of ~128 at 32x32 tiles, one warp);
    the H200 ranks the two per configuration (session 7: 32x32x1x2 was 11-17% slower on the tensor cores).

    ``reverse_full`` walks each tile row's full tiles last column first (the partial tiles still come first, in
    their order; the result is the same, the online softmax does not depend on the order). With ``heavy_first``
    the global rows of Longformer/BigBird start at once and run about as long as the whole launch, while the other
    rows go last to first: walking the global rows' keys from the last too, both meet the same K/V tiles at about
    the same time, so the global rows read them from L2 instead of a second time from DRAM. H200 (session 10,
    s10sparse, B16 H12 S4096 D64, 32x32x2x2 heavy-first): BigBird 0.1998 -> 0.1860 ms (min_blocks 10: 0.1970 ->
    0.1863), Longformer 0.2433 -> 0.2409 (0.2399 -> 0.2376); the model's heavy-first candidates and the sparse
    default set it.

    ``lean_padding`` (with the key padding inputs only) changes how the padding enters each tile. Without it every
    tile loads its column index again (a dependent global load before the tile's skip test) to test the tile
    against the batch row's kept span, and a tile that needs the padding predicate loads one ``pad_bits`` word per
    score element behind a branch each (16 loads a tile at 32x32, two warps). With it the span tests run only in
    batch rows that drop some key (``lo > 0``, ``hi < Sk`` or holes: a block-uniform branch, so an unpadded row,
    e.g. a model's all-ones ``attention_mask``, runs the unpadded tile loop's work), and the predicate loads the
    tile's ``ceil(block_n / 32)`` words once and tests bits in registers.
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    stages: int = 2
    heavy_first: bool = False
    kv_splits: int = 1
    split_rows: int = 1
    min_blocks: int = 0
    row_sums: str = "mma"
    reverse_full: bool = False
    lean_padding: bool = False

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def m_tiles_per_warp(self) -> int:
        return self.block_m // (16 * self.num_warps)

    def validate(self, head_dim: int) -> None:
        """Raise ValueError unless this configuration can be compiled for ``head_dim``."""
        for name in ("heavy_first", "reverse_full", "lean_padding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BlockConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("block_m", "block_n", "num_warps", "stages", "kv_splits", "split_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockConfig.{name} must be a positive int, got {value!r}")
        if self.block_n % 16:
            raise ValueError(f"BlockConfig.block_n must be a multiple of 16, got {self.block_n}")
        if self.block_m % (16 * self.num_warps) or self.m_tiles_per_warp not in (1, 2):
            raise ValueError(f"BlockConfig.block_m ({self.block_m}) must be 16 or 32 rows per warp "
                             f"times num_warps ({self.num_warps})")
        if self.stages < 2:
            raise ValueError(f"BlockConfig.stages must be >= 2, got {self.stages}")
        if isinstance(self.min_blocks, bool) or not isinstance(self.min_blocks, int) or self.min_blocks < 0:
            raise ValueError(f"BlockConfig.min_blocks must be an int >= 0, got {self.min_blocks!r}")
        if self.row_sums not in ROW_SUMS:
            raise ValueError(f"BlockConfig.row_sums must be one of {ROW_SUMS}, got {self.row_sums!r}")
        if self.kv_splits > 1 and not self.heavy_first:
            raise ValueError("BlockConfig.kv_splits > 1 needs heavy_first=True (the split rows are the heavy ones)")
        if self.block_n * head_dim // 8 < self.threads:
            raise ValueError(f"a {self.block_n}x{head_dim} K/V tile must give each of the {self.threads} threads "
                             "at least one 16-byte copy")
        if self.shared_bytes(head_dim) > 227 * 1024:
            raise ValueError(f"BlockConfig {self} needs {self.shared_bytes(head_dim)} bytes of shared memory, "
                             f"more than the 227 KiB of sm_90")

    def shared_bytes(self, head_dim: int) -> int:
        """Shared memory of the CUDA kernel: the Q tile plus ``stages`` K, V and bitmap tiles (16-bit data, rows
        padded to :func:`~stof_tvm.schedules.mma.chunk_stride`); ``heavy_first`` adds a few words for the row
        selection."""
        row_bytes = shared_row_bytes(head_dim)
        kv = self.block_n * row_bytes
        return self.block_m * row_bytes + self.stages * (2 * kv + self.block_m * self.block_n // 8)

    def fragment_registers(self, head_dim: int, q_in_registers: bool = True) -> int:
        """Per-thread registers the kernel's fragments take (mma.m16n8k16 layouts) plus a fixed base: fp32 S
        and O accumulators, Q's A operands (all k16 steps when ``q_in_registers``, else one), P repacked."""
        mt = self.m_tiles_per_warp
        q_steps = head_dim // 16 if q_in_registers else 1
        return (mt * (self.block_n // 8) * 4 + mt * (head_dim // 8) * 4 + mt * q_steps * 4
                + mt * (self.block_n // 16) * 4 + 4 * mt + _BASE_REGISTERS)

    def q_in_registers(self, head_dim: int) -> bool:
        """Whether Q's fragments are loaded once and kept in registers, else reloaded from shared memory at each
        tile (one more ``ldmatrix`` per k16 step). They are reloaded only for head dims above 128 with one m16
        tile per warp, where keeping them would put the estimate above ``_Q_REGISTER_LIMIT`` (from D=192 with
        64-key tiles, D=224 with 32-key tiles); at 128 and below every configuration keeps them (measured
        spill-free), and two m16 tiles per warp at such head dims are over the register limit anyway."""
        return (self.m_tiles_per_warp == 2 or head_dim <= 128
                or self.fragment_registers(head_dim, True) <= _Q_REGISTER_LIMIT)

    def registers(self, head_dim: int) -> int:
        """The kernel's per-thread register estimate for ``head_dim`` (the cost model's feasibility input); with
        ``min_blocks``, at most the launch bounds' limit, which ptxas keeps to (builds are checked for spills: the
        estimate runs above what ptxas needs, 116 vs 96 for 64x32 tiles at D=64)."""
        estimate = self.fragment_registers(head_dim, self.q_in_registers(head_dim))
        return min(estimate, self.register_limit) if self.min_blocks else estimate

    @property
    def register_limit(self) -> int:
        """Registers a thread may use under ``min_blocks`` (65536 per SM, allocated in units of 8); 255 without."""
        return min(255, 65536 // (self.threads * self.min_blocks) // 8 * 8) if self.min_blocks else 255


def shared_row_bytes(head_dim: int) -> int:
    """Bytes one 16-bit Q/K/V row of ``head_dim`` channels takes in shared memory (conflict-free layout)."""
    return chunk_stride(head_dim // 8) * 16


def default_row_sums(head_dim: int) -> str:
    """``BlockConfig.row_sums`` of the candidates and defaults: ``"fadd"`` at head dim 32, where with the
    tensor-core row sums ptxas (nvcc 13.0, sm_90) gives the 64 x 32 heavy-first kernel 64 registers and a 4-byte
    spill (72 registers and none with float adds), ``"mma"`` elsewhere."""
    return "fadd" if head_dim == 32 else "mma"


def default_block_config(head_dim: int, dtype: str, seq_q: int, *, sparse: bool = False) -> BlockConfig:
    """A good starting configuration for the H200 (fp16 and bf16 run at the same rate).

    Measured there (scripts/NOTES_attention.md, BENCHMARKS.md): masks made mostly of full tiles (dense, causal)
    run best with 128-row tiles and two m16 tiles per warp; sparse masks (``sparse=True``: sliding windows,
    Longformer, BigBird, random) with 64x32 tiles, four warps and the heavy-first launch order, which starts
    the long global rows first, walking their full tiles last column first (``reverse_full``: up to 7% faster on
    BigBird, session 10). Head dims above 64 take one m16 tile per warp (eight warps for 128-row tiles),
    so the output accumulators of the wider rows fit in registers.
    """
    _check_dtype(dtype)
    _check_head_dim(head_dim)
    _check_positive("seq_q", seq_q)
    if sparse:
        return BlockConfig(block_m=64, block_n=32, num_warps=4, stages=2, heavy_first=True,
                           row_sums=default_row_sums(head_dim), reverse_full=True)
    if head_dim > 64:
        return BlockConfig(block_m=128, block_n=64, num_warps=8, stages=2)
    if seq_q <= 64:
        return BlockConfig(block_m=64, block_n=64, num_warps=4, stages=2)
    return BlockConfig(block_m=128, block_n=64, num_warps=4, stages=2)


def _check_dtype(dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")


def _check_head_dim(head_dim) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be a multiple of 16 from 32 to 256, got {head_dim!r}")


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def blockwise_attention_primfunc(*, batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: str,
                                 mask_batch: int, mask_heads: int, scale: float | None = None,
                                 config: BlockConfig | None = None, target_kind: str = "cuda",
                                 out_layout: str = "bhsd", bias: tuple[int, int, str] | None = None,
                                 padding: bool = False, kv_heads: int | None = None) -> tvm.tirx.PrimFunc:
    """The block-wise attention PrimFunc for one problem shape.

    Parameters (in order): ``q[B,H,Sq,D], k[B,Hkv,Sk,D], v[B,Hkv,Sk,D], full_indptr[G*TR+1] int32,
    full_indices[n_full] int32, part_indptr[G*TR+1] int32, part_indices[n_part] int32,
    part_bitmaps[n_part, BM/8, BN/8] uint64, out`` with ``G = mask_batch * mask_heads``,
    ``TR = ceil(Sq / BM)``; ``n_full`` and ``n_part`` are symbolic (>= 1: pad empty lists with one dummy entry).
    ``scale`` defaults to ``1/sqrt(head_dim)`` and must be positive. ``target_kind`` is ``"cuda"`` (tensor-core
    kernel, thread bindings included) or ``"llvm"`` (CPU loop nest).

    ``out_layout``: ``"bhsd"`` writes ``out[B,H,Sq,D]``; ``"bshd"`` writes ``out[B,Sq,H,D]``, the layout a
    transformer's output projection reads, so the graph's transpose back from heads disappears. Q, K and V may
    start at any multiple of 8 elements into their allocation (views of one fused QKV projection output).

    ``bias = (bias_batch, bias_heads, dtype)`` adds a parameter ``bias[Bb, Hb, Sq, Sk]`` between the format
    arrays and ``out`` (Bb 1 or B, Hb 1 or H; float16, bfloat16 or float32), as in the row-wise kernel: it is
    added to each kept score after scaling (T5's position bias) and read only in the tiles the format lists
    (never at rows >= Sq or keys >= Sk); values at keys the mask drops are ignored, whatever they are.

    ``padding=True`` (self-attention, Sq == Sk) adds ``pad_range[B, 3] int32, pad_bits[B, ceil(Sk/32)] uint32``
    after the format arrays (:mod:`stof_tvm.schedules.key_padding`): batch b keeps only keys in
    ``[lo, hi)`` whose bit is set (the bits are read only where ``holes``), at every query row (padded query rows
    too, as the model computes them). Key tiles wholly outside the range are neither loaded nor computed; the
    tiles that cross it, and every tile of a row with holes, are masked by a column predicate.

    ``kv_heads`` (``Hkv``, default ``heads``; a divisor of it): grouped-query attention, query head ``h`` reading
    key/value head ``h // (heads / kv_heads)`` (Llama, Qwen2, Mistral), so K and V are read as the projection wrote
    them instead of repeated to every query head.
    """
    if out_layout not in OUT_LAYOUTS:
        raise ValueError(f"out_layout must be one of {OUT_LAYOUTS}, got {out_layout!r}")
    for name, value in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k)):
        _check_positive(name, value)
    _check_head_dim(head_dim)
    _check_dtype(dtype)
    if mask_batch not in (1, batch):
        raise ValueError(f"mask_batch must be 1 or batch ({batch}), got {mask_batch!r}")
    if mask_heads not in (1, heads):
        raise ValueError(f"mask_heads must be 1 or heads ({heads}), got {mask_heads!r}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not (scale > 0.0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    config = default_block_config(head_dim, dtype, seq_q) if config is None else config
    if not isinstance(config, BlockConfig):
        raise TypeError(f"config must be a BlockConfig, got {type(config).__name__}")
    config.validate(head_dim)
    bias = check_score_bias(bias, batch, heads)
    if bias is not None and bias[0] * bias[1] * seq_q * seq_k >= 2 ** 31:
        raise ValueError(f"bias: [{bias[0]}, {bias[1]}, {seq_q}, {seq_k}] has 2**31 elements or more (the kernel "
                         "indexes it with 32-bit integers)")
    if padding not in (False, True) or (padding and seq_q != seq_k):
        raise ValueError(f"padding must be a bool and needs seq_q == seq_k, got {padding!r} ({seq_q} x {seq_k})")
    shape = _Shape(batch, heads, seq_q, seq_k, head_dim, dtype, mask_batch, mask_heads, scale, config,
                   out_layout == "bshd", bias, bool(padding), check_kv_heads(kv_heads, heads))
    if target_kind == "cuda":
        return _cuda_kernel(shape)
    if target_kind == "llvm":
        return _cpu_kernel(shape)
    raise ValueError(f"target_kind must be 'cuda' or 'llvm', got {target_kind!r}")


@dataclass(frozen=True)
class _Shape:
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str
    mask_batch: int
    mask_heads: int
    scale: float
    config: BlockConfig
    rows_then_heads: bool           # out_layout "bshd"
    bias: tuple | None = None       # (bias_batch, bias_heads, dtype) of the score bias input
    padding: bool = False           # pad_range / pad_bits inputs (key padding applied in the kernel)
    kv_heads: int = 0               # key/value heads (0: as many as query heads)

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head: query head ``h`` reads key/value head ``h // kv_group``."""
        return self.heads // self.kv_heads if self.kv_heads else 1

    @property
    def kv_shape(self) -> tuple:
        return self.batch, self.kv_heads or self.heads, self.seq_k, self.head_dim

    @property
    def bias_select(self) -> tuple[int, int]:
        """(batch, head) multipliers giving the bias's (batch, head) index of (b, h): ``b * sb``, ``h * sh``."""
        bias_batch, bias_heads, _ = self.bias
        return (1 if bias_batch > 1 else 0), (1 if bias_heads > 1 else 0)

    @property
    def out_shape(self) -> tuple:
        if self.rows_then_heads:
            return self.batch, self.seq_q, self.heads, self.head_dim
        return self.batch, self.heads, self.seq_q, self.head_dim

    @property
    def tile_rows(self) -> int:
        return -(-self.seq_q // self.config.block_m)

    @property
    def groups(self) -> int:
        return self.mask_batch * self.mask_heads

    @property
    def group_strides(self) -> tuple[int, int]:
        """(batch, head) multipliers of the mask group id: ``g = b * gb + h * gh``."""
        return (self.mask_heads if self.mask_batch > 1 else 0), (1 if self.mask_heads > 1 else 0)


class _Padding:
    """Expressions of the key padding inputs of batch row ``b`` (``padding=True``). Without padding they are the
    constants of an unpadded row (every key kept, no holes), so the padding code of both kernels folds away."""

    def __init__(self, p: _Shape):
        self.on, self.seq_k, self.words = p.padding, p.seq_k, bit_words(p.seq_k)

    def lo(self, pad_range, b):
        return pad_range[b, 0] if self.on else 0

    def hi(self, pad_range, b):
        return pad_range[b, 1] if self.on else self.seq_k

    def holes(self, pad_range, b):
        return pad_range[b, 2] if self.on else 0

    def overlaps(self, lo, hi, start, length):
        """Positions ``[start, start + length)`` meet the kept span ``[lo, hi)``."""
        return tvm.tirx.all(start < hi, start + length > lo) if self.on else True


    def loads(self, key, lo, hi):
        """Key row ``key`` is read from memory: inside Sk and, with padding, inside the kept span (hi <= Sk; the
        others are zero-filled and masked)."""
        return tvm.tirx.all(lo <= key, key < hi) if self.on else key < self.seq_k

    def needs_predicate(self, lo, hi, holes, start, length):
        """Some position of ``[start, start + length)`` (a key tile) is dropped by the padding."""
        return tvm.tirx.any(start < lo, start + length > hi, holes != 0) if self.on else False

    def key_kept(self, pad_bits, b, lo, hi, holes, key):
        """Key ``key`` survives the padding: inside ``[lo, hi)`` and, when the span has holes, its bit set."""
        if not self.on:
            return True
        return self.kept_by_word(pad_bits[b, T.min(key // 32, self.words - 1)], lo, hi, holes, key)

    @staticmethod
    def kept_by_word(word, lo, hi, holes, key):
        """:meth:`key_kept` with the ``pad_bits`` word holding ``key`` already loaded."""
        bit = T.bitwise_and(T.shift_right(word, T.Cast("uint32", key % 32)), T.uint32(1))
        return tvm.tirx.all(lo <= key, key < hi, tvm.tirx.any(holes == 0, bit != T.uint32(0)))



def _cuda_kernel(p: _Shape) -> tvm.tirx.PrimFunc:
    cfg = p.config
    B, H, SQ, SK, D, DT = p.batch, p.heads, p.seq_q, p.seq_k, p.head_dim, p.dtype
    KVG = p.kv_group
    BM, BN, ST, NT, MT = cfg.block_m, cfg.block_n, cfg.stages, cfg.threads, cfg.m_tiles_per_warp
    TR, NROWS = p.tile_rows, p.groups * p.tile_rows + 1
    GB, GH = p.group_strides
    NJ, KD, ND = BN // 8, D // 16, D // 8         # n8 tiles of S, k16 steps of QK^T, n8 tiles of O
    CPR, ROW_BYTES = D // 8, shared_row_bytes(D)  # 16-byte chunks per Q/K/V row, bytes per row in shared memory
    QREG = cfg.q_in_registers(D)                  # Q's A fragments loaded once (else per tile, from shared memory)
    KV_BYTES = BN * ROW_BYTES                     # one K (or V) tile in shared memory
    MW_BYTES = BM * BN // 8                       # one bitmap tile (BM/8 x BN/8 uint64 words)
    MW_CHUNKS = MW_BYTES // 16
    Q_OFF, K_OFF = 0, BM * ROW_BYTES
    V_OFF = K_OFF + ST * KV_BYTES
    M_OFF = V_OFF + ST * KV_BYTES
    KV_ITERS, Q_ITERS = -(-BN * CPR // NT), BM * CPR // NT
    KV_EVEN = BN * CPR % NT == 0                  # else the last K/V copy pass runs on the first threads only
    M_ITERS = -(-MW_CHUNKS // NT)
    VOTE_ITERS = -(-(MT * NJ) // 32)              # 16-byte bitmap chunks a lane reads for its warp's skip vote
    OUT_ITERS = MT * 16 * CPR // 32
    NW = cfg.num_warps
    HF = 1 if cfg.heavy_first else 0              # heavy_first: grid (B*H, TR) and in-kernel row selection
    HEAVY = cfg.heavy_first
    MIN_BLOCKS = cfg.min_blocks                   # > 0: __launch_bounds__(NT, MIN_BLOCKS)
    MMA_SUMS = cfg.row_sums == "mma"              # P's row sums on the tensor cores (else a float add per score)
    SPLIT = cfg.kv_splits > 1                     # split-KV (heavy_first only): KS blocks on each of SR heavy rows
    KS, SR = cfg.kv_splits, min(cfg.split_rows, TR)
    GX, GY = (B * H, TR + (SR * (KS - 1) if SPLIT else 0)) if HF else (TR, B * H)
    RI = -(-TR // NT)                             # row-selection passes: each thread rates rows tx, tx+NT, ..
    SEL_W = (M_OFF + ST * MW_BYTES) // 4          # shared word of the selected row, then RI*NW warp counts
    HEAVY_W = SEL_W + 1 + RI * NW                 # split-KV: the group's number of heavy rows
    ROW_W = HEAVY_W + (1 if SPLIT else 0)         # heavy_first: the selected row's f0, p0, partial and all tiles
    SMEM_WORDS = SEL_W + (1 + RI * NW + 4) * HF + (1 if SPLIT else 0)
    COMBINE_ITERS = BM * D // NT                  # split-KV merge: output elements per thread of a split row
    SL = p.scale * _LOG2E                         # softmax in base 2: exp(s*scale - m) = 2^(s*SL - m*SL)
    NEG_INF = T.float32(float("-inf"))
    MMA, PACK = mma_m16n8k16(DT), pack_f32x2(DT)
    ONES = T.uint32(0x3C003C00 if DT == "float16" else 0x3F803F80)   # a pair of 1.0 in DT: the row-sum B operand
    OUT_SHAPE, BSHD = p.out_shape, p.rows_then_heads
    # Score bias: each thread reads its own C-fragment elements (rows g, g+8 of each m-tile, columns 2*qd, 2*qd+1
    # of each n8 tile), divided by the scale so scores and bias share the softmax's log2 scaling. A 16-bit bias
    # keeps a column pair in one 32-bit register (low half: column 2*qd), loaded as one word when Sk is even
    # (PAIR), else as two halves. STAGE (16-bit bias, at most 16 pairs per thread): every pair is loaded before
    # QK^T, so the loads overlap it, and added after it; otherwise (float32 bias, or two m16 tiles of 8 n8 tiles,
    # whose registers would not fit beside S and O) the bias is the initial value of the QK^T accumulators.
    HAS_BIAS = p.bias is not None
    BB, BHB, BIAS_DT = p.bias if HAS_BIAS else (1, 1, "float32")
    BSB, BSH = p.bias_select if HAS_BIAS else (0, 0)
    WIDE = BIAS_DT == "float32"
    PAIR = HAS_BIAS and not WIDE and SK % 2 == 0
    STAGE = HAS_BIAS and not WIDE and MT * 2 * NJ <= 16
    INV_SCALE = T.float32(1.0 / p.scale)
    pad = _Padding(p)
    PAD = p.padding
    # lean_padding: the span tests only in batch rows that drop a key; the predicate's pad_bits words loaded once a
    # tile (PAD_WORDS of them) where each score column's word is known statically (block_n a multiple of 32, or 16:
    # a 16-aligned tile of 16 keys lies in one word), else one load per element as without the knob.
    LEAN = PAD and cfg.lean_padding
    PAD_WORDS = max(1, BN // 32)
    LEAN_WORDS = LEAN and (BN % 32 == 0 or BN == 16)
    # Every key row of a listed tile is inside Sk and kept by the padding (none): no clamp, no zero-fill predicate.
    KEYS_IN_RANGE = not PAD and SK % BN == 0

    def word_of_n8(j):         # lean_padding: which of the tile's pad_bits words holds n8 tile j's columns
        return j // 4 if BN % 32 == 0 else 0

    def swz(row, chunk):
        return chunk_offset(row, chunk, CPR)

    def full_at(f0, t, n_part_row, row_tiles):   # full_indices position of the row's tile t (t >= n_part_row)
        return f0 + row_tiles - 1 - t if cfg.reverse_full else f0 + t - n_part_row

    def tile_col(part_indices, full_indices, p0, f0, t, n_part_row, row_tiles):   # column tile of the row's tile t
        return T.if_then_else(t < n_part_row, part_indices[p0 + t],
                              full_indices[full_at(f0, t, n_part_row, row_tiles)])

    def mask_word(smem, t, warp, g, mt, hh, j):
        # The 32-bit half g//4 of the uint64 word of sub-tile (rows hh*8.. of m-tile mt, n8 tile j): it holds the
        # thread's row hh*8+g (bit r*8+c holds row r, column c); the thread's two columns are mask_bit(g, qd) << e.
        return smem[(M_OFF + (t % ST) * MW_BYTES) // 4 + ((warp * (MT * 2) + mt * 2 + hh) * NJ + j) * 2 + g // 4]

    def mask_bit(g, qd):       # bit of the thread's first score column (row g % 4 of the half, column 2*qd)
        return T.shift_left(T.uint32(1), T.Cast("uint32", (g % 4) * 8 + qd * 2))

    def quad_xor(value, lane_mask):    # value of lane ^ lane_mask (1, 2: the four lanes sharing a score row)
        return T.tvm_warp_shuffle_xor(T.uint32(_FULL_MASK), value, lane_mask, 32, 32)

    def tile_row(smem, bx):    # the tile row this thread block owns (heavy_first: chosen in shared memory)
        return T.Cast("int32", smem[SEL_W]) if HF else TR - 1 - bx

    # Split-KV: blockIdx.y < SR*KS are the KS slices of launch positions 0..SR-1 (slice by % KS of position
    # by // KS); the others walk positions SR.. whole. A slice block of a position past the group's heavy rows is
    # idle except slice 0, which walks that (light) row whole.
    def position(by):          # launch position (heavy rows first) of the tile row block `by` works on
        return T.Select(by < SR * KS, by // KS, by - SR * (KS - 1)) if SPLIT else by

    def heavy_rows(smem):      # split-KV: the group's heavy row count, written before the second barrier
        return T.Cast("int32", smem[HEAVY_W]) if SPLIT else 0

    def split_block(n_heavy, by):      # this block walks one slice of a split heavy row
        return T.And(by < SR * KS, by // KS < n_heavy)

    def idle_block(n_heavy, by):
        return T.And(T.And(by < SR * KS, by // KS >= n_heavy), by % KS > 0)

    def first_tile(n_heavy, by, n_tiles):      # the block's tiles are [first_tile, end_tile) of its row's list
        if not SPLIT:
            return 0
        return T.Select(split_block(n_heavy, by), T.min((by % KS) * ((n_tiles + KS - 1) // KS), n_tiles), 0)

    def end_tile(n_heavy, by, n_tiles):
        if not SPLIT:
            return n_tiles
        return T.Select(split_block(n_heavy, by), T.min((by % KS + 1) * ((n_tiles + KS - 1) // KS), n_tiles),
                        T.Select(idle_block(n_heavy, by), 0, n_tiles))

    def tile_at(first, s):     # the s-th tile of the block's slice
        return first + s if SPLIT else s

    def writes_out(n_heavy, by, row):      # the block writes output row `row` (split slices: the workspace)
        if not SPLIT:
            return row < SQ
        return T.And(row < SQ, T.Not(T.Or(split_block(n_heavy, by), idle_block(n_heavy, by))))

    def split_slot(bh, by):    # workspace slot of a split slice: ((b*H + h) * SR + position) * KS + slice
        return (bh * SR + by // KS) * KS + by % KS

    def heavy_count(smem):     # the group's heavy rows: the sum of the warp counts of the row selection
        total = T.Cast("int32", smem[SEL_W + 1])
        for j in range(1, RI * NW):
            total = total + T.Cast("int32", smem[SEL_W + 1 + j])
        return total

    def s_at(mt, j, e):        # score accumulator: m-tile mt, n8 tile j, register e
        return (mt * NJ + j) * 4 + e

    def o_at(mt, dn, e):       # output accumulator: m-tile mt, n8 tile dn of the head dim, register e
        return (mt * ND + dn) * 4 + e

    def kv_copy_live(it, tx):  # copy pass it of a K/V tile has a chunk for thread tx (always when it splits evenly)
        return True if KV_EVEN else it * NT + tx < BN * CPR

    def q_at(mt, kk):          # first register of Q's A fragment for m-tile mt, k16 step kk (QREG: all kept)
        return (mt * KD + kk) * 4 if QREG else mt * 4

    def bias_at(bias, b, h, tr, warp, g, mt, hh, key):   # bias of the thread's row hh*8+g of m-tile mt, clamped
        return bias[b * BSB, h * BSH, T.min(tr * BM + warp * (MT * 16) + mt * 16 + hh * 8 + g, SQ - 1),
                    T.min(key, SK - 1)]

    def bias_slot(mt, hh, j):  # register of a column pair's 16-bit bias: all pairs staged, or one at a time
        return (mt * 2 + hh) * NJ + j if STAGE else 0

    def bias_value(bias_reg, mt, hh, j, e):    # float32 bias / scale of score register hh*2+e of n8 tile j
        word = bias_reg[bias_slot(mt, hh, j)]
        if BIAS_DT == "bfloat16":            # a bf16 value is the upper half of the float32 it rounds
            return T.reinterpret("float32", T.bitwise_and(T.shift_left(word, T.Cast("uint32", 16 - 16 * e)),
                                                          T.uint32(0xFFFF0000))) * INV_SCALE
        return T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", T.shift_right(
            word, T.Cast("uint32", 16 * e))))) * INV_SCALE

    @T.macro
    def load_bias_pair(bias, bias_reg, b, h, tr, warp, g, qd, bcol, mt, hh, j):
        # The 16-bit bias of the thread's column pair in n8 tile j, row hh*8+g of m-tile mt, of the tile at column
        # tile bcol; rows >= Sq and keys >= Sk (never kept) are clamped to stay inside the bias.
        if PAIR:
            bias_words = T.decl_buffer((BB * BHB * SQ * SK // 2,), "uint32", data=bias.data)
            bias_reg[bias_slot(mt, hh, j)] = bias_words[
                (((b * BSB) * BHB + h * BSH) * SQ + T.min(tr * BM + warp * (MT * 16) + mt * 16 + hh * 8 + g, SQ - 1))
                * (SK // 2) + T.min(bcol * (BN // 2) + j * 4 + qd, SK // 2 - 1)]
        else:
            bias_reg[bias_slot(mt, hh, j)] = T.bitwise_or(
                T.Cast("uint32", T.reinterpret("uint16", bias_at(bias, b, h, tr, warp, g, mt, hh,
                                                                 bcol * BN + j * 8 + qd * 2))),
                T.shift_left(T.Cast("uint32", T.reinterpret("uint16", bias_at(
                    bias, b, h, tr, warp, g, mt, hh, bcol * BN + j * 8 + qd * 2 + 1))), T.uint32(16)))

    @T.macro
    def load_q_fragment(q_frag, q_base, warp, lane, mt, kk):
        # Q's A fragment of m-tile mt, k16 step kk (the warp's own rows of the Q tile) by one ldmatrix.x4.
        LDMATRIX_X4(q_frag[q_at(mt, kk)], q_frag[q_at(mt, kk) + 1], q_frag[q_at(mt, kk) + 2], q_frag[q_at(mt, kk) + 3],
                    q_base + T.Cast("uint32", swz(warp * (MT * 16) + mt * 16 + lane % 16, kk * 2 + lane // 16)))

    @T.macro
    def issue_tile(tt, n_tiles, n_part_row, p0, f0, tx, b, h, k_base, v_base, m_base, k, v, part_indices,
                   full_indices, part_bitmaps, lo, hi, row_tiles):
        # cp.async of tile tt's K, V (rows >= Sk, or outside the batch row's kept key span [lo, hi), zero-filled:
        # a zero-byte source reads no memory) and, for a partial tile, its bitmap words. ``n_tiles``: the end of
        # the block's tiles (a split slice's), ``row_tiles``: the row's tile count.
        if tt < n_tiles:
            slot: T.let = tt % ST
            col: T.let = tile_col(part_indices, full_indices, p0, f0, tt, n_part_row, row_tiles)
            for it in T.unroll(KV_ITERS):
                if kv_copy_live(it, tx):
                    row: T.let = (it * NT + tx) // CPR
                    key: T.let = col * BN + row
                    dst: T.let = T.Cast("uint32", slot * KV_BYTES + swz(row, (it * NT + tx) % CPR))
                    fill: T.let = T.uint32(16) if KEYS_IN_RANGE else T.Cast("uint32", T.Select(
                        pad.loads(key, lo, hi), 16, 0))
                    src_key: T.let = key if KEYS_IN_RANGE else T.min(key, SK - 1)
                    CP_ASYNC_16(k_base + dst, T.address_of(k[b, h // KVG, src_key, ((it * NT + tx) % CPR) * 8]),
                                16, fill)
                    CP_ASYNC_16(v_base + dst, T.address_of(v[b, h // KVG, src_key, ((it * NT + tx) % CPR) * 8]),
                                16, fill)
            if tt < n_part_row:
                for it in T.unroll(M_ITERS):
                    if it * NT + tx < MW_CHUNKS:
                        CP_ASYNC_16(m_base + T.Cast("uint32", slot * MW_BYTES + (it * NT + tx) * 16),
                                    T.address_of(part_bitmaps[p0 + tt, ((it * NT + tx) * 2) // NJ,
                                                              ((it * NT + tx) * 2) % NJ]),
                                    16, T.uint32(16))
        T.ptx.cp.async_.commit_group()

    @T.macro
    def lean_predicate(s_acc, pad_word, pad_bits, b, lo, hi, holes, col, qd):
        # lean_padding: scores of keys the padding drops become -inf. LEAN_WORDS: the tile's pad_bits words loaded
        # once (n8 tile j's columns lie in word j // 4 of them; one word for 16-key tiles), else one per element.
        if LEAN_WORDS:
            for i in T.unroll(PAD_WORDS):
                pad_word[i] = pad_bits[b, T.min(col * BN // 32 + i, pad.words - 1)]
        for j in T.unroll(NJ):
            for e in T.unroll(2):
                for mt in T.unroll(MT):
                    for hh in T.unroll(2):
                        if LEAN_WORDS:
                            s_acc[s_at(mt, j, hh * 2 + e)] = T.Select(
                                pad.kept_by_word(pad_word[word_of_n8(j)], lo, hi, holes,
                                                 col * BN + j * 8 + qd * 2 + e),
                                s_acc[s_at(mt, j, hh * 2 + e)], NEG_INF)
                        else:
                            s_acc[s_at(mt, j, hh * 2 + e)] = T.Select(
                                pad.key_kept(pad_bits, b, lo, hi, holes, col * BN + j * 8 + qd * 2 + e),
                                s_acc[s_at(mt, j, hh * 2 + e)], NEG_INF)

    @T.macro
    def kernel_body(q, k, v, full_indptr, full_indices, part_indptr, part_indices, part_bitmaps, pad_range,
                    pad_bits, bias, out):
        if SPLIT:   # per split slice: its rows' normalised partial output and log2-sum-exp; the split rows' ids
            ws_o = T.alloc_buffer((B * H * SR * KS * BM * D,), "float32", scope="global")
            ws_lse = T.alloc_buffer((B * H * SR * KS * BM,), "float32", scope="global")
            ws_row = T.alloc_buffer((B * H * SR,), "int32", scope="global")
        for bx in T.thread_binding(GX, thread="blockIdx.x"):
            for by in T.thread_binding(GY, thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if MIN_BLOCKS > 0:
                        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MIN_BLOCKS)
                    smem = T.alloc_buffer((SMEM_WORDS,), "uint32", scope="shared.dyn")
                    q_frag = T.alloc_buffer((MT * (KD if QREG else 1) * 4,), "uint32", scope="local")
                    b_frag = T.alloc_buffer((4,), "uint32", scope="local")
                    p_frag = T.alloc_buffer((MT * 4,), "uint32", scope="local")
                    s_acc = T.alloc_buffer((MT * NJ * 4,), "float32", scope="local")
                    o_acc = T.alloc_buffer((MT * ND * 4,), "float32", scope="local")
                    m_run = T.alloc_buffer((MT * 2,), "float32", scope="local")
                    # Row sums of P. MMA_SUMS: accumulated on the tensor cores as P times a column of ones (C
                    # fragment of an m16n8 tile per m-tile: every column holds the sum of its row, rows g and g+8,
                    # registers mt*4 + hh*2 (+1)); else the thread's share of rows g, g+8 (register mt*4 + hh*2),
                    # by float adds, summed over the quad's four lanes at the end.
                    l_acc = T.alloc_buffer((MT * 4,), "float32", scope="local")
                    red = T.alloc_buffer((4 if MMA_SUMS else 5,), "float32", scope="local")   # red[4]: a row's tile sum
                    word = T.alloc_buffer((2,), "uint32", scope="local")
                    if LEAN:
                        pad_word = T.alloc_buffer((PAD_WORDS,), "uint32", scope="local")
                    if HAS_BIAS and not WIDE:
                        bias_reg = T.alloc_buffer((MT * 2 * NJ if STAGE else 1,), "uint32", scope="local")
                    rank = T.alloc_buffer((RI * 2,), "uint32", scope="local")
                    live = T.alloc_buffer((1,), "int32", scope="local")
                    before = T.alloc_buffer((1,), "int32", scope="local")
                    bh: T.let = bx * HF + by * (1 - HF)
                    b: T.let = bh // H
                    h: T.let = bh % H
                    warp: T.let = tx // 32
                    lane: T.let = tx % 32
                    gbase: T.let = (b * GB + h * GH) * TR
                    if HF == 1:
                        # Heavy-first: position `by` in the order [rows with > 2x the group's mean tile count,
                        # ascending] + [other rows, descending]. rank[2i] = heavy flag of row i*NT+tx,
                        # rank[2i+1] = its warp ballot; warp counts go through shared memory.
                        tot: T.let = (full_indptr[gbase + TR] - full_indptr[gbase]
                                      + part_indptr[gbase + TR] - part_indptr[gbase])
                        for it in T.unroll(RI):
                            rr: T.let = T.min(it * NT + tx, TR - 1)
                            rank[it * 2] = T.Cast("uint32", T.Select(
                                it * NT + tx < TR and (full_indptr[gbase + rr + 1] - full_indptr[gbase + rr]
                                                       + part_indptr[gbase + rr + 1] - part_indptr[gbase + rr])
                                * TR > 2 * tot, 1, 0))
                            rank[it * 2 + 1] = T.cuda.ballot_sync(T.uint32(_FULL_MASK),
                                                                  T.Cast("int32", rank[it * 2]))
                            if lane == 0:
                                smem[SEL_W + 1 + it * NW + warp] = T.Cast("uint32", T.popcount(rank[it * 2 + 1]))
                        T.tvm_storage_sync("shared")
                        if SPLIT:
                            if tx == 0:
                                smem[HEAVY_W] = T.Cast("uint32", heavy_count(smem))
                        for it in T.unroll(RI):
                            # before[0] = heavy rows with a lower index; a heavy row's position is that count, a
                            # light row's is TR-1-row+count (light rows go last to first after the heavy ones).
                            before[0] = T.Cast("int32", T.popcount(T.bitwise_and(
                                rank[it * 2 + 1], T.shift_left(T.uint32(1), T.Cast("uint32", lane)) - T.uint32(1))))
                            for j in T.unroll(RI * NW):
                                before[0] = before[0] + T.Select(j < it * NW + warp,
                                                                 T.Cast("int32", smem[SEL_W + 1 + j]), 0)
                            if it * NT + tx < TR:
                                if T.Select(rank[it * 2] == T.uint32(1), before[0],
                                            TR - 1 - (it * NT + tx) + before[0]) == position(by):
                                    smem[SEL_W] = T.Cast("uint32", it * NT + tx)
                                    # The row's list bounds too (this thread has just read them), so the block
                                    # does not wait for another round trip to global memory after the barrier.
                                    sel: T.let = gbase + it * NT + tx
                                    smem[ROW_W] = T.Cast("uint32", full_indptr[sel])
                                    smem[ROW_W + 1] = T.Cast("uint32", part_indptr[sel])
                                    smem[ROW_W + 2] = T.Cast("uint32", part_indptr[sel + 1] - part_indptr[sel])
                                    smem[ROW_W + 3] = T.Cast("uint32", full_indptr[sel + 1] - full_indptr[sel]
                                                             + part_indptr[sel + 1] - part_indptr[sel])
                        T.tvm_storage_sync("shared")
                    # Default order: last tile row first (causal-like masks put the most tiles there).
                    tr: T.let = tile_row(smem, bx)
                    r: T.let = gbase + tr
                    f0: T.let = T.Cast("int32", smem[ROW_W]) if HEAVY else full_indptr[r]
                    p0: T.let = T.Cast("int32", smem[ROW_W + 1]) if HEAVY else part_indptr[r]
                    n_part_row: T.let = T.Cast("int32", smem[ROW_W + 2]) if HEAVY else part_indptr[r + 1] - p0
                    n_tiles: T.let = (T.Cast("int32", smem[ROW_W + 3]) if HEAVY
                                      else n_part_row + full_indptr[r + 1] - f0)
                    # Padding: batch row b keeps keys [lo, hi), minus its holes.
                    lo: T.let = pad.lo(pad_range, b)
                    hi: T.let = pad.hi(pad_range, b)
                    holes: T.let = pad.holes(pad_range, b)
                    if LEAN:    # the batch row drops some key (else its tiles need no span test or predicate)
                        row_drops: T.let = pad.needs_predicate(lo, hi, holes, 0, SK)
                    n_heavy: T.let = heavy_rows(smem)
                    if SPLIT:   # the slice bounds, held in registers (not re-derived at every use)
                        span = T.alloc_buffer((2,), "int32", scope="local")
                        span[0] = first_tile(n_heavy, by, n_tiles)
                        span[1] = end_tile(n_heavy, by, n_tiles)
                        t_first: T.let = span[0]
                        t_end: T.let = span[1]
                    else:
                        t_first: T.let = 0
                        t_end: T.let = n_tiles
                    if SPLIT:   # slice 0 of each split position records the row it split (-1: not split)
                        if T.And(T.And(tx == 0, by < SR * KS), by % KS == 0):
                            ws_row[bh * SR + by // KS] = T.Select(split_block(n_heavy, by), tr, -1)
                    g: T.let = lane // 4
                    qd: T.let = lane % 4
                    # The thread's two bits in each bitmap word it reads, computed once (no shift per word).
                    bit_first: T.let = mask_bit(g, qd)
                    bit_second: T.let = T.shift_left(bit_first, T.uint32(1))
                    q_base: T.let = T.cuda.cvta_generic_to_shared(T.address_of(smem[0]))
                    k_base: T.let = q_base + T.uint32(K_OFF)
                    v_base: T.let = q_base + T.uint32(V_OFF)
                    m_base: T.let = q_base + T.uint32(M_OFF)
                    # Q tile (its own commit group, rows >= Sq zero-filled), then the first STAGES-1 tiles.
                    for it in T.unroll(Q_ITERS):
                        qrow: T.let = tr * BM + (it * NT + tx) // CPR
                        CP_ASYNC_16(q_base + T.Cast("uint32", swz((it * NT + tx) // CPR, (it * NT + tx) % CPR)),
                                    T.address_of(q[b, h, T.min(qrow, SQ - 1), ((it * NT + tx) % CPR) * 8]),
                                    16, T.Cast("uint32", T.Select(qrow < SQ, 16, 0)))
                    T.ptx.cp.async_.commit_group()
                    for s in T.unroll(ST - 1):
                        issue_tile(tile_at(t_first, s), t_end, n_part_row, p0, f0, tx, b, h, k_base, v_base,
                                   m_base, k, v, part_indices, full_indices, part_bitmaps, lo, hi, n_tiles)
                    for i in T.unroll(MT * ND * 4):
                        o_acc[i] = T.float32(0)
                    for i in T.unroll(MT * 2):
                        m_run[i] = NEG_INF
                    for i in T.unroll(MT * 4):
                        l_acc[i] = T.float32(0)
                    T.ptx.cp.async_.wait_group(ST - 1)
                    T.tvm_storage_sync("shared")
                    if QREG:
                        for mt in T.unroll(MT):
                            for kk in T.unroll(KD):
                                load_q_fragment(q_frag, q_base, warp, lane, mt, kk)
                    for t in range(t_first, t_end):
                        # Tile t has landed for every thread, and every thread is done with tile t-1's slot,
                        # which the copy of tile t+STAGES-1 now refills.
                        T.ptx.cp.async_.wait_group(ST - 2)
                        T.tvm_storage_sync("shared")
                        issue_tile(t + ST - 1, t_end, n_part_row, p0, f0, tx, b, h, k_base, v_base, m_base,
                                   k, v, part_indices, full_indices, part_bitmaps, lo, hi, n_tiles)
                        kv_off: T.let = T.Cast("uint32", (t % ST) * KV_BYTES)
                        # A partial tile whose bitmap keeps nothing in this warp's rows is skipped by the warp. The
                        # warp's rows own MT*NJ consecutive 16-byte chunks of the bitmap tile: lane l reads chunk l
                        # (clamped: repeats are harmless), so the vote costs one 16-byte load a lane.
                        live[0] = 1
                        if t < n_part_row:
                            word[0] = T.uint32(0)
                            for it in T.unroll(VOTE_ITERS):
                                LD_SHARED_V4(b_frag[0], b_frag[1], b_frag[2], b_frag[3], m_base + T.Cast(
                                    "uint32", (t % ST) * MW_BYTES + (warp * (MT * NJ)
                                                                    + T.min(it * 32 + lane, MT * NJ - 1)) * 16))
                                word[0] = T.bitwise_or(word[0], T.bitwise_or(T.bitwise_or(b_frag[0], b_frag[1]),
                                                                             T.bitwise_or(b_frag[2], b_frag[3])))
                            live[0] = T.cuda.any_sync(T.uint32(_FULL_MASK), T.Cast("int32", word[0] != T.uint32(0)))
                        if LEAN:                # a key tile outside the batch row's kept span is skipped too
                            if row_drops:
                                tcol: T.let = tile_col(part_indices, full_indices, p0, f0, t, n_part_row, n_tiles)
                                live[0] = T.Select(pad.overlaps(lo, hi, tcol * BN, BN), live[0], 0)
                        elif PAD:
                            tcol: T.let = tile_col(part_indices, full_indices, p0, f0, t, n_part_row, n_tiles)
                            live[0] = T.Select(pad.overlaps(lo, hi, tcol * BN, BN), live[0], 0)
                        if live[0] != 0:
                            if HAS_BIAS:        # column tile of tile t; STAGE: the bias of all pairs, before QK^T
                                bcol: T.let = tile_col(part_indices, full_indices, p0, f0, t, n_part_row, n_tiles)
                                if STAGE:
                                    for mt in T.unroll(MT):
                                        for hh in T.unroll(2):
                                            for j in T.unroll(NJ):
                                                load_bias_pair(bias, bias_reg, b, h, tr, warp, g, qd, bcol, mt, hh, j)
                            # S = Q K^T (fp32 accumulators in registers; unless staged, the bias is their start).
                            if HAS_BIAS and not STAGE:
                                for mt in T.unroll(MT):
                                    for hh in T.unroll(2):
                                        for j in T.unroll(NJ):
                                            if WIDE:
                                                for e in T.unroll(2):
                                                    s_acc[s_at(mt, j, hh * 2 + e)] = bias_at(
                                                        bias, b, h, tr, warp, g, mt, hh, bcol * BN + j * 8 + qd * 2 + e
                                                    ) * INV_SCALE
                                            else:
                                                load_bias_pair(bias, bias_reg, b, h, tr, warp, g, qd, bcol, mt, hh, j)
                                                for e in T.unroll(2):
                                                    s_acc[s_at(mt, j, hh * 2 + e)] = bias_value(bias_reg, mt, hh, j, e)
                            else:
                                for i in T.unroll(MT * NJ * 4):
                                    s_acc[i] = T.float32(0)
                            for kk in T.unroll(KD):
                                if not QREG:
                                    for mt in T.unroll(MT):
                                        load_q_fragment(q_frag, q_base, warp, lane, mt, kk)
                                for jp in T.unroll(NJ // 2):
                                    LDMATRIX_X4(b_frag[0], b_frag[1], b_frag[2], b_frag[3],
                                                k_base + kv_off + T.Cast("uint32", swz(
                                                    jp * 16 + (lane // 16) * 8 + lane % 8, kk * 2 + (lane // 8) % 2)))
                                    for mt in T.unroll(MT):
                                        for half in T.unroll(2):
                                            MMA(s_acc[s_at(mt, 2 * jp + half, 0)], s_acc[s_at(mt, 2 * jp + half, 1)],
                                                s_acc[s_at(mt, 2 * jp + half, 2)], s_acc[s_at(mt, 2 * jp + half, 3)],
                                                q_frag[q_at(mt, kk)], q_frag[q_at(mt, kk) + 1],
                                                q_frag[q_at(mt, kk) + 2], q_frag[q_at(mt, kk) + 3],
                                                b_frag[half * 2], b_frag[half * 2 + 1],
                                                s_acc[s_at(mt, 2 * jp + half, 0)], s_acc[s_at(mt, 2 * jp + half, 1)],
                                                s_acc[s_at(mt, 2 * jp + half, 2)], s_acc[s_at(mt, 2 * jp + half, 3)])
                            if STAGE:           # scores + bias / scale (masked ones become -inf below)
                                for mt in T.unroll(MT):
                                    for hh in T.unroll(2):
                                        for j in T.unroll(NJ):
                                            for e in T.unroll(2):
                                                s_acc[s_at(mt, j, hh * 2 + e)] = s_acc[s_at(mt, j, hh * 2 + e)] \
                                                    + bias_value(bias_reg, mt, hh, j, e)
                            # Partial tile: register e of n8 tile j covers sub-tile (row block, j); the thread's two
                            # columns are bits (g%4)*8 + 2*qd (+1) of the 32-bit half g//4 of that sub-tile's word.
                            if t < n_part_row:
                                for mt in T.unroll(MT):
                                    for hh in T.unroll(2):
                                        for j in T.unroll(NJ):
                                            word[0] = mask_word(smem, t, warp, g, mt, hh, j)
                                            s_acc[s_at(mt, j, hh * 2)] = T.Select(
                                                T.bitwise_and(word[0], bit_first) != T.uint32(0),
                                                s_acc[s_at(mt, j, hh * 2)], NEG_INF)
                                            s_acc[s_at(mt, j, hh * 2 + 1)] = T.Select(
                                                T.bitwise_and(word[0], bit_second) != T.uint32(0),
                                                s_acc[s_at(mt, j, hh * 2 + 1)], NEG_INF)
                            if LEAN:            # keys the padding drops, in a row that drops some
                                if row_drops:
                                    lcol: T.let = tile_col(part_indices, full_indices, p0, f0, t, n_part_row,
                                                           n_tiles)
                                    if pad.needs_predicate(lo, hi, holes, lcol * BN, BN):
                                        lean_predicate(s_acc, pad_word, pad_bits, b, lo, hi, holes, lcol, qd)
                            elif PAD:           # keys the padding drops: in a tile crossing [lo, hi), or at holes
                                pcol: T.let = tile_col(part_indices, full_indices, p0, f0, t, n_part_row, n_tiles)
                                if pad.needs_predicate(lo, hi, holes, pcol * BN, BN):
                                    for j in T.unroll(NJ):
                                        for e in T.unroll(2):
                                            for mt in T.unroll(MT):
                                                for hh in T.unroll(2):
                                                    s_acc[s_at(mt, j, hh * 2 + e)] = T.Select(
                                                        pad.key_kept(pad_bits, b, lo, hi, holes,
                                                                     pcol * BN + j * 8 + qd * 2 + e),
                                                        s_acc[s_at(mt, j, hh * 2 + e)], NEG_INF)
                            # Online softmax, one pass per query row the thread holds (rows g and g+8 of each m-tile);
                            # the four lanes of a quad share a row. red = [tile max, new max, base, correction].
                            # Lazy rescaling: the running max is raised only when the tile's max exceeds it by more
                            # than _LAZY_RESCALE_LOG2 (log2 units), so the probabilities stay <= 2^_LAZY_RESCALE_LOG2
                            # (exact: l and O share the stale max, O / l is unchanged); O's rows g (or g+8) are
                            # rescaled only when one of them in the warp raised its max, rare after a row's first tiles.
                            for mt in T.unroll(MT):
                                for hh in T.unroll(2):
                                    red[0] = T.max(s_acc[s_at(mt, 0, hh * 2)], s_acc[s_at(mt, 0, hh * 2 + 1)])
                                    for j in T.unroll(1, NJ):
                                        red[0] = T.max(red[0], T.max(s_acc[s_at(mt, j, hh * 2)],
                                                                     s_acc[s_at(mt, j, hh * 2 + 1)]))
                                    red[0] = T.max(red[0], quad_xor(red[0], 1))
                                    red[0] = T.max(red[0], quad_xor(red[0], 2))
                                    raise_max: T.let = red[0] * T.float32(SL) > (
                                        m_run[mt * 2 + hh] * T.float32(SL) + T.float32(_LAZY_RESCALE_LOG2))
                                    red[1] = T.Select(raise_max, red[0], m_run[mt * 2 + hh])
                                    red[2] = T.Select(red[1] == NEG_INF, T.float32(0), red[1] * T.float32(SL))
                                    EX2(red[3], m_run[mt * 2 + hh] * T.float32(SL) - red[2])
                                    red[3] = T.Select(raise_max, red[3], T.float32(1))
                                    m_run[mt * 2 + hh] = red[1]
                                    if not MMA_SUMS:
                                        red[4] = T.float32(0)
                                    for j in T.unroll(NJ):
                                        for e in T.unroll(2):
                                            EX2(s_acc[s_at(mt, j, hh * 2 + e)],
                                                s_acc[s_at(mt, j, hh * 2 + e)] * T.float32(SL) - red[2])
                                            if not MMA_SUMS:
                                                red[4] = red[4] + s_acc[s_at(mt, j, hh * 2 + e)]
                                    if not MMA_SUMS:
                                        l_acc[mt * 4 + hh * 2] = l_acc[mt * 4 + hh * 2] * red[3] + red[4]
                                    if T.cuda.any_sync(T.uint32(_FULL_MASK), T.Cast("int32", raise_max)) != 0:
                                        if MMA_SUMS:
                                            for e in T.unroll(2):
                                                l_acc[mt * 4 + hh * 2 + e] = l_acc[mt * 4 + hh * 2 + e] * red[3]
                                        for dn in T.unroll(ND):
                                            for e in T.unroll(2):
                                                o_acc[o_at(mt, dn, hh * 2 + e)] = \
                                                    o_acc[o_at(mt, dn, hh * 2 + e)] * red[3]
                            # O += P V: P (fp32 C fragments) repacked pairwise as the A fragment of each k16 step.
                            for kk in T.unroll(NJ // 2):
                                for mt in T.unroll(MT):
                                    for a in T.unroll(4):
                                        PACK(p_frag[mt * 4 + a], s_acc[s_at(mt, 2 * kk + a // 2, (a % 2) * 2 + 1)],
                                             s_acc[s_at(mt, 2 * kk + a // 2, (a % 2) * 2)])
                                    if MMA_SUMS:
                                        MMA(l_acc[mt * 4], l_acc[mt * 4 + 1], l_acc[mt * 4 + 2], l_acc[mt * 4 + 3],
                                            p_frag[mt * 4], p_frag[mt * 4 + 1], p_frag[mt * 4 + 2],
                                            p_frag[mt * 4 + 3], ONES, ONES, l_acc[mt * 4], l_acc[mt * 4 + 1],
                                            l_acc[mt * 4 + 2], l_acc[mt * 4 + 3])
                                for dp in T.unroll(ND // 2):
                                    LDMATRIX_X4_TRANS(b_frag[0], b_frag[1], b_frag[2], b_frag[3],
                                                      v_base + kv_off + T.Cast("uint32", swz(
                                                          kk * 16 + ((lane // 8) % 2) * 8 + lane % 8,
                                                          dp * 2 + lane // 16)))
                                    for mt in T.unroll(MT):
                                        for half in T.unroll(2):
                                            MMA(o_acc[o_at(mt, 2 * dp + half, 0)], o_acc[o_at(mt, 2 * dp + half, 1)],
                                                o_acc[o_at(mt, 2 * dp + half, 2)], o_acc[o_at(mt, 2 * dp + half, 3)],
                                                p_frag[mt * 4], p_frag[mt * 4 + 1], p_frag[mt * 4 + 2],
                                                p_frag[mt * 4 + 3], b_frag[half * 2], b_frag[half * 2 + 1],
                                                o_acc[o_at(mt, 2 * dp + half, 0)], o_acc[o_at(mt, 2 * dp + half, 1)],
                                                o_acc[o_at(mt, 2 * dp + half, 2)], o_acc[o_at(mt, 2 * dp + half, 3)])
                    T.ptx.cp.async_.wait_group(0)
                    # Epilogue: O / l (0 for rows with no kept key), staged through this warp's own Q rows. With two
                    # m16 tiles per warp the tile row is read again (heavy_first: from shared memory) rather than
                    # held across the tile loop, where ptxas spilled it (nvcc 13, 32x32 tiles, one warp).
                    tr_out: T.let = tile_row(smem, bx) if MT == 2 else tr
                    for mt in T.unroll(MT):
                        for hh in T.unroll(2):
                            red[0] = l_acc[mt * 4 + hh * 2]
                            if not MMA_SUMS:
                                red[0] = red[0] + quad_xor(red[0], 1)
                                red[0] = red[0] + quad_xor(red[0], 2)
                            red[1] = T.Select(red[0] > T.float32(0), T.float32(1) / red[0], T.float32(0))
                            if SPLIT:   # a split slice: normalised partial rows and their log2-sum-exp
                                if split_block(n_heavy, by):
                                    for dn in T.unroll(ND):
                                        for e in T.unroll(2):
                                            ws_o[(split_slot(bh, by) * BM + warp * (MT * 16) + mt * 16 + hh * 8 + g)
                                                 * D + dn * 8 + qd * 2 + e] = o_acc[o_at(mt, dn, hh * 2 + e)] * red[1]
                                    if qd == 0:
                                        ws_lse[split_slot(bh, by) * BM + warp * (MT * 16) + mt * 16 + hh * 8 + g] = \
                                            T.Select(red[0] > T.float32(0),
                                                     m_run[mt * 2 + hh] * T.float32(SL) + T.log2(red[0]), NEG_INF)
                            for dn in T.unroll(ND):
                                PACK(word[1], o_acc[o_at(mt, dn, hh * 2 + 1)] * red[1],
                                     o_acc[o_at(mt, dn, hh * 2)] * red[1])
                                smem[(Q_OFF + swz(warp * (MT * 16) + mt * 16 + hh * 8 + g, dn)) // 4 + qd] = word[1]
                    T.cuda.warp_sync()
                    for it in T.unroll(OUT_ITERS):
                        orow: T.let = warp * (MT * 16) + (it * 32 + lane) // CPR
                        if writes_out(n_heavy, by, tr_out * BM + orow):
                            LD_SHARED_V4(b_frag[0], b_frag[1], b_frag[2], b_frag[3],
                                         q_base + T.Cast("uint32", swz(orow, (it * 32 + lane) % CPR)))
                            if BSHD:
                                ST_GLOBAL_V4(T.address_of(out[b, tr_out * BM + orow, h, ((it * 32 + lane) % CPR) * 8]),
                                             b_frag[0], b_frag[1], b_frag[2], b_frag[3])
                            else:
                                ST_GLOBAL_V4(T.address_of(out[b, h, tr_out * BM + orow, ((it * 32 + lane) % CPR) * 8]),
                                             b_frag[0], b_frag[1], b_frag[2], b_frag[3])
        if SPLIT:   # merge: out = sum_p 2^(lse_p - max) O_p / sum_p 2^(lse_p - max); 0 where no slice kept a key
            for cb in T.thread_binding(B * H, thread="blockIdx.x"):
                for cr in T.thread_binding(SR, thread="blockIdx.y"):
                    for ctx in T.thread_binding(NT, thread="threadIdx.x"):
                        merge = T.alloc_buffer((4,), "float32", scope="local")   # max, weight sum, sum, weight
                        crow: T.let = ws_row[cb * SR + cr]
                        slot0: T.let = (cb * SR + cr) * KS          # workspace slot of the row's slice 0
                        if crow >= 0:
                            for it in range(COMBINE_ITERS):
                                ma: T.let = (it * NT + ctx) // D
                                col: T.let = (it * NT + ctx) % D
                                if crow * BM + ma < SQ:
                                    merge[0] = NEG_INF
                                    for sp in T.unroll(KS):
                                        merge[0] = T.max(merge[0], ws_lse[(slot0 + sp) * BM + ma])
                                    merge[1] = T.float32(0)
                                    merge[2] = T.float32(0)
                                    for sp in T.unroll(KS):
                                        lse: T.let = ws_lse[(slot0 + sp) * BM + ma]
                                        merge[3] = T.Select(lse == NEG_INF, T.float32(0), T.exp2(lse - merge[0]))
                                        merge[1] = merge[1] + merge[3]
                                        merge[2] = merge[2] + merge[3] * ws_o[((slot0 + sp) * BM + ma) * D + col]
                                    merge[2] = T.Select(merge[1] > T.float32(0), merge[2] / merge[1], T.float32(0))
                                    if BSHD:
                                        out[cb // H, crow * BM + ma, cb % H, col] = T.Cast(DT, merge[2])
                                    else:
                                        out[cb // H, cb % H, crow * BM + ma, col] = T.Cast(DT, merge[2])

    return _entry(p, kernel_body)


def _cpu_kernel(p: _Shape) -> tvm.tirx.PrimFunc:
    cfg = p.config
    B, H, SQ, SK, D, DT = p.batch, p.heads, p.seq_q, p.seq_k, p.head_dim, p.dtype
    KVG = p.kv_group
    BM, BN = cfg.block_m, cfg.block_n
    TR, NROWS = p.tile_rows, p.groups * p.tile_rows + 1
    GB, GH = p.group_strides
    SCALE = p.scale
    NEG_INF = T.float32(float("-inf"))
    OUT_SHAPE, BSHD = p.out_shape, p.rows_then_heads
    HAS_BIAS = p.bias is not None
    BSB, BSH = p.bias_select if HAS_BIAS else (0, 0)
    pad = _Padding(p)
    PAD = p.padding

    @T.macro
    def kernel_body(q, k, v, full_indptr, full_indices, part_indptr, part_indices, part_bitmaps, pad_range,
                    pad_bits, bias, out):
        for task in T.parallel(B * H * TR):
            q_row = T.alloc_buffer((D,), "float32", scope="local")
            acc = T.alloc_buffer((D,), "float32", scope="local")
            # st = [running max, running sum, score, rescale factor, probability]
            st = T.alloc_buffer((5,), "float32", scope="local")
            kept = T.alloc_buffer((1,), "int32", scope="local")
            b: T.let = task // (H * TR)
            h: T.let = task // TR % H
            tr: T.let = task % TR
            r: T.let = (b * GB + h * GH) * TR + tr
            f0: T.let = full_indptr[r]
            p0: T.let = part_indptr[r]
            n_part_row: T.let = part_indptr[r + 1] - p0
            n_tiles: T.let = n_part_row + full_indptr[r + 1] - f0
            lo: T.let = pad.lo(pad_range, b)
            hi: T.let = pad.hi(pad_range, b)
            holes: T.let = pad.holes(pad_range, b)
            for a in range(BM):
                if tr * BM + a < SQ:
                    st[0] = NEG_INF
                    st[1] = T.float32(0)
                    for d in range(D):
                        q_row[d] = T.Cast("float32", q[b, h, tr * BM + a, d]) * T.float32(SCALE)
                        acc[d] = T.float32(0)
                    for t in range(n_tiles):
                        col: T.let = T.if_then_else(t < n_part_row, part_indices[p0 + t],
                                                    full_indices[f0 + t - n_part_row])
                        for c in range(BN):
                            kept[0] = T.int32(1)
                            if t < n_part_row:
                                kept[0] = T.Cast("int32", T.bitwise_and(T.shift_right(
                                    part_bitmaps[p0 + t, a // 8, c // 8], T.Cast("uint64", (a % 8) * 8 + c % 8)),
                                    T.uint64(1)))
                            if PAD:
                                kept[0] = T.Select(pad.key_kept(pad_bits, b, lo, hi, holes, col * BN + c), kept[0], 0)
                            if kept[0] != 0 and col * BN + c < SK:
                                st[2] = T.float32(0)
                                for d in range(D):
                                    st[2] = st[2] + q_row[d] * T.Cast("float32", k[b, h // KVG, col * BN + c, d])
                                if HAS_BIAS:     # the model's score bias, read at kept keys only
                                    st[2] = st[2] + T.Cast("float32", bias[b * BSB, h * BSH, tr * BM + a,
                                                                           col * BN + c])
                                if st[2] > st[0]:
                                    st[3] = T.exp(st[0] - st[2])
                                    st[1] = st[1] * st[3]
                                    for d in range(D):
                                        acc[d] = acc[d] * st[3]
                                    st[0] = st[2]
                                st[4] = T.exp(st[2] - st[0])
                                st[1] = st[1] + st[4]
                                for d in range(D):
                                    acc[d] = acc[d] + st[4] * T.Cast("float32", v[b, h // KVG, col * BN + c, d])
                    for d in range(D):
                        if BSHD:
                            out[b, tr * BM + a, h, d] = T.Cast(
                                DT, T.Select(st[1] > T.float32(0), acc[d] / st[1], T.float32(0)))
                        else:
                            out[b, h, tr * BM + a, d] = T.Cast(
                                DT, T.Select(st[1] > T.float32(0), acc[d] / st[1], T.float32(0)))

    return _entry(p, kernel_body)


def _entry(p: _Shape, kernel_body) -> tvm.tirx.PrimFunc:
    """The PrimFunc around a target's kernel body: buffers of the parameter list, with ``pad_range, pad_bits``
    after the format arrays when the problem has padding and ``bias`` before ``out`` when it has a score bias
    (written once with every parameter; the ones the problem does not have are dropped)."""
    B, H, SQ, SK, D, DT = p.batch, p.heads, p.seq_q, p.seq_k, p.head_dim, p.dtype
    BM, BN = p.config.block_m, p.config.block_n
    NROWS, OUT_SHAPE = p.groups * p.tile_rows + 1, p.out_shape
    BB, BH, BIAS_DT = p.bias if p.bias is not None else (1, 1, "float32")
    KW = bit_words(SK)
    HAS_BIAS, PAD = p.bias is not None, p.padding
    KV_SHAPE = p.kv_shape

    @T.prim_func
    def blockwise_attention(q_h: T.handle, k_h: T.handle, v_h: T.handle, full_indptr_h: T.handle,
                            full_indices_h: T.handle, part_indptr_h: T.handle, part_indices_h: T.handle,
                            part_bitmaps_h: T.handle, pad_range_h: T.handle, pad_bits_h: T.handle,
                            bias_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "global_symbol": "blockwise_attention"})
        n_full = T.int32()
        n_part = T.int32()
        q = T.match_buffer(q_h, (B, H, SQ, D), DT, offset_factor=VIEW_ALIGN)
        k = T.match_buffer(k_h, KV_SHAPE, DT, offset_factor=VIEW_ALIGN)
        v = T.match_buffer(v_h, KV_SHAPE, DT, offset_factor=VIEW_ALIGN)
        full_indptr = T.match_buffer(full_indptr_h, (NROWS,), "int32")
        full_indices = T.match_buffer(full_indices_h, (n_full,), "int32")
        part_indptr = T.match_buffer(part_indptr_h, (NROWS,), "int32")
        part_indices = T.match_buffer(part_indices_h, (n_part,), "int32")
        part_bitmaps = T.match_buffer(part_bitmaps_h, (n_part, BM // 8, BN // 8), "uint64")
        pad_range = T.match_buffer(pad_range_h, (B, 3), "int32")
        pad_bits = T.match_buffer(pad_bits_h, (B, KW), "uint32")
        bias = T.match_buffer(bias_h, (BB, BH, SQ, SK), BIAS_DT)
        out = T.match_buffer(out_h, OUT_SHAPE, DT)
        kernel_body(q, k, v, full_indptr, full_indices, part_indptr, part_indices, part_bitmaps,
                    pad_range if PAD else None, pad_bits if PAD else None, bias if HAS_BIAS else None, out)

    dropped = ({"pad_range", "pad_bits"} if not PAD else set()) | ({"bias"} if not HAS_BIAS else set())
    params = [param for param in blockwise_attention.params if param.name not in dropped]
    return tvm.tirx.PrimFunc(params, blockwise_attention.body, blockwise_attention.ret_type,
                             blockwise_attention.attrs)
