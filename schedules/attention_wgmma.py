"""Block-wise sparse attention on Hopper ``wgmma`` (sm_90a), FlashAttention-3 style, written at thread level.

The same inputs and semantics as :func:`.attention_blockwise.blockwise_attention_primfunc` (the tiled format of
:mod:`stof_tvm.sparse_formats.tiled`: per tile row CSR lists of *partial* tiles, walked first, whose 8x8 bitmaps
are applied exactly, then *full* tiles with no mask work; rows with no kept key give 0; per-batch/per-head mask
groups; ``bhsd`` or ``bshd`` output; Q/K/V may be views at any multiple of 8 elements), on the tensor cores of
sm_90a instead of ``mma.sync``. Its CPU twin is the block-wise kernel's llvm loop nest at the same tile shape
(:func:`cpu_twin_primfunc`).

A thread block works on one (batch, head, tile row of ``BM = 64 * consumers`` queries) at a time; one producer
and ``consumers`` (2, or 3 at head dim 64) consumer warpgroups (384 or 512 threads):

- warpgroup 0, the *producer* (``setmaxnreg`` down to 40 registers, 32 with three consumers): copies the Q tile
  once, then for each tile of the row the K tile (with the partial tile's bitmap words) and the V tile global ->
  shared with 16-byte ``cp.async`` into two ``stages``-deep rings (K and V apart, so K of the next tile can land
  while V of this one is still read), each thread arriving on the slot's *full* mbarrier with
  ``cp.async.mbarrier.arrive.noinc``. With ``loads="tma"`` one producer thread does it all instead: per 64
  head-dim columns one TMA box (``cp.async.bulk.tensor.3d``) of Q, K or V from tensor maps the host encodes at each
  call (:mod:`.tensor_maps`; rows past Sq / Sk zero-filled by the copy engine, in the panels' 128-byte swizzle), the
  bitmap words with one ``cp.async.bulk``, after one ``mbarrier.arrive.expect_tx`` of the slot's bytes; the
  consumers then read what the async proxy wrote, so they skip the per-turn ``fence.proxy.async``.
- warpgroups 1 .. consumers, the *consumers* (232 registers, 160 with three): consumer ``c`` owns query rows
  ``64c .. 64c+63``. ``S = Q K^T`` is one ``wgmma m64n{BN}k16`` per 16 head-dim columns with both operands in
  shared memory; ``O += P V`` is one ``wgmma m64n{D}k16`` per 16 keys with **P from registers** (the D fragment
  of S, rounded pairwise to 16 bits, is the A fragment of the next product: FlashAttention's register trick
  carried over to wgmma) and V read transposed from shared memory (``imm-trans-b``). The softmax runs in float32
  in base 2.
- Overlap, within a consumer: turn ``i`` issues ``S(i)`` and ``O += P(i-1) V(i-1)`` back to back, then waits for
  ``S(i)`` only and runs the mask and softmax of tile ``i``; ptxas, though, moves the wait for ``P(i-1) V(i-1)``
  above the tile's exponentials (to interleave the packs of ``P(i)``, which overwrite the product's A registers,
  with them), so the softmax runs once the consumer's own product has retired. Keeping it under the product (a
  try-wait between them, which ptxas does not schedule across) measured no faster on the H200, nor did moving
  some exponentials to the FMA pipe (session 11: scripts/NOTES_attention_wgmma.md). Between consumers
  (``pingpong``): they take turns issuing, round robin (named barriers 1 ..), so one's softmax runs under the
  others' products.
- The K slot is released (``empty`` mbarrier, one arrival per consumer thread) once the tile's mask has been
  read, the V slot once its product has retired; ring slots and phases count the block's tiles over all its work items.
- Work items are (batch, head, tile row), head by head, each head's tile rows last to first (causal-like masks put
  the most tiles in the last rows): the blocks running at once share the K and V of a few heads in L2. (80670e1
  ordered tile rows last to first across all heads, so every running block read another head's K and V, from
  DRAM once 132 heads' K and V outgrow the 60 MB L2; from 2161894 to 1241bac causal slowed 10% at D=64 B16 H12
  S4096 and 8% at D=128 B4 H16 S8192 on the H200.) One block per item, or (``persistent``) one block per SM
  walking units of two tile rows of one head (the heaviest left with the lightest left, so on causal masks
  every unit holds the same tiles; :func:`block_work_item`): the producer loads the next item's Q (after every
  consumer has released this one's, a second Q mbarrier) and first tiles while the consumers finish this item's
  products and write its rows.
  Ping-pong turns run on over items: consumer 0 waits before every turn but its first, the last consumer gives a
  turn after every one of its own, and consumer 0 takes the last of those after its last item.

Shared tiles are panels of head-dim columns whose rows are one swizzle span of the wgmma descriptors
(:func:`panel_cols`): 64 columns of 128-byte rows in the 128-byte swizzle at head dims 64, 128 and 256 (chunk ``c``
of row ``r`` at ``r * 128 + ((c ^ r % 8) * 16)``, the layout of :mod:`.templates.wgmma_kernel`), 32 columns of
64-byte rows in the 64-byte swizzle at 32 and 96 (``c ^ (r // 2) % 4``), 16 columns of 32-byte rows in the
32-byte swizzle at 80 (``c ^ (r // 4) % 2``; :func:`panel_offset`), so that no row is cut by a span and no k16
step by a panel; panels 1024-aligned. For ``S``, Q and K are K-major (head dim contiguous): the k16 steps advance
the start address by 32 bytes inside a panel row and move to the next panel every ``panel_cols / 16`` steps
(:func:`s_step_offset`). For ``P V``, V is MN-major (head dim contiguous, keys the reduction): a k16 step is 16 rows
(:func:`pv_step_offset`); the stride byte offset is eight key rows and the leading byte offset the panel size (the
next panel of head-dim columns; :func:`descriptor_bits`). wgmma takes ``N = D`` for any multiple of 8 up to 256,
so ``O += P V`` is one ``m64n{D}k16`` at every head dim. With TMA each panel is one box in the panel's swizzle
(:func:`.tensor_maps.panel_map`). Registers bound the tiles (:meth:`WgmmaAttentionConfig.fragment_registers`): at
head dim 256 O alone is 128 floats a consumer thread, so 64-key tiles; three consumers fit at head dims 32 and 64.

Everything comes from TVM 0.27's ``T.ptx`` table, as in the wgmma GEMM. Build for ``arch="sm_90a"``.

Head dims 32, 80, 96 and 256 are built and ptxas-checked here (HGMMA, no spills; the layouts read back through
the descriptors in ``tests/test_attention_wgmma_dims.py``) and were checked against float32 on the H200 in session
10 (plan ``s10dims``: 64- and 32-byte swizzles and padded panels, key padding, views, graph replays, bf16); causal
B16 H12 S4096: D32 0.849 ms (FlexAttention 0.927), D80 1.234 (SDPA 1.399), D96 1.257 (SDPA 1.446); D256 B4 H16
S4096 0.938 (SDPA 0.871, FlexAttention 1.900). The model and the compile path use the kernel at
:data:`CHECKED_HEAD_DIMS`, those checked on an H200.

Status: checked on an H200 at commit 2161894 (``scripts/check_attention_wgmma_gpu.py``; 7 masks x 3 shapes correct,
causal 0.83x / 0.85x SDPA at D 64 / 128; numbers in ``scripts/NOTES_attention_wgmma.md``; the head-by-head order
0.88x / 0.90x in session 7; three consumers at D64: causal 1.000 ms, 0.93x SDPA, in session 7's ``s7causal`` plan).
``kernel="auto"`` (:func:`stof_tvm.attention.decide_kernel`, the compile path's
:func:`stof_tvm.compiler.kernels.choose_kernel`) picks it on sm_90 targets where the analytical model predicts it
faster (:mod:`stof_tvm.cost_model.attention`: causal and dense masks; sparse ones stay on mma.sync). The key padding
(``padding=True``) is built and ptxas-checked here only; ``bench_attention.py``'s ``s8wgmma`` plan checks it on the
GPU, with the first timings of this kernel on sparse and document masks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from .attention_blockwise import BlockConfig, blockwise_attention_primfunc
from .attention_rowwise import check_kv_heads
from .key_padding import bit_words
from .tensor_maps import encode_tensor_map, panel_map
from .templates.wgmma_kernel import ALIGN, CONSUMER_REGS, PRODUCER_REGS, PTX_TYPE, wait_parity

__all__ = ["WgmmaAttentionConfig", "wgmma_attention_primfunc", "cpu_twin_primfunc", "SUPPORTED_HEAD_DIMS",
           "SUPPORTED_DTYPES", "ARCH", "CHECKED_HEAD_DIMS", "panel_cols", "panel_offset", "descriptor_bits",
           "s_step_offset", "pv_step_offset"]

ARCH = "sm_90a"
# Head dims the kernel builds (ptxas-checked here: HGMMA, no spills); CHECKED_HEAD_DIMS: those whose kernels were
# also checked against float32 on the H200, the only ones the analytical model and the compile path offer (32, 80,
# 96, 256 since session 10's s10dims run: 49/49 checks incl. key padding, views, graph replays, bf16).
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
CHECKED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
SUPPORTED_DTYPES = tuple(PTX_TYPE)
OUT_LAYOUTS = ("bhsd", "bshd")
BLOCK_M = 128            # default tile rows: two consumer warpgroups x 64 query rows
CONSUMER_CHOICES = (2, 3)
# Keys per tile. 160 and 192 (two consumers; 192 only below head dim 128, where S, O and P fit the registers) are
# FlashAttention-3's wider non-causal tiles, built clean with TMA loads (nvcc 13.0: no spill, HGMMA; cp.async's
# producer spills 4 bytes beside them), checked and timed on an H100 (bench_attention.py plan s36wide, session 36):
# the analytical model offers 160 at head dim 128 on dense masks only (cost_model.attention._wide_key_candidates)
BLOCK_N_CHOICES = (64, 128, 160, 192)
# How the producer fills shared memory: 16-byte cp.async from all its 128 threads, or TMA (one thread: tensor maps
# encoded on the host at each call, cp.async.bulk for the bitmap words)
LOAD_CHOICES = ("cp.async", "tma")
# Head dims whose cp.async producer builds clean (nvcc 13.0, sm_90a): at 80, 96 and 256 ptxas spills (100, 88 and 8
# spill stores with the default tiles); TMA, the default everywhere, builds clean at every head dim
CP_ASYNC_HEAD_DIMS = (32, 64, 128)
WG = 128
# setmaxnreg (producer, consumer) per consumer count: one block holds the whole register file (65536). Two
# consumers: 168 at launch, 40 + 2 x 232; three: 128 at launch, 32 + 3 x 160 (FlashAttention-3's D=64 split).
REGISTERS = {2: (PRODUCER_REGS, CONSUMER_REGS), 3: (32, 160)}
# Shared tiles are panels of head-dim columns whose rows are one swizzle span: 64 columns (128-byte rows) where the
# head dim is a multiple of 64, else 32 (64-byte rows: 32, 96) or 16 (32-byte rows: 80); wgmma descriptor layout
# type by row bytes (PTX ISA "Matrix Descriptor Format": 1 = 128-byte, 2 = 64-byte, 3 = 32-byte swizzle)
PANEL_COLS_CHOICES = (64, 32, 16)
LAYOUT_TYPE = {128: 1, 64: 2, 32: 3}
# Registers a consumer thread holds besides its fragments (S, O, P): addresses, row state, loop counters
FRAGMENT_SLACK = 32
ORDER_BAR = 1            # named barriers 1 and 2: consumer c may issue its next turn
VIEW_ALIGN = 8
PERSISTENT_GRID = 132    # blocks of a persistent grid at most (the H200's SMs; the compile path keeps this default)
# The model's key padding (stof_tvm.schedules.key_padding's pad_range / pad_bits) is applied by the consumers: keys
# outside a batch row's kept span, or at its holes, are masked by a column predicate in the tiles that reach them
# (the compile path reads this to offer the kernel to padded models; checked against float32 on the H200 in
# session 9: right/left padding with holes and empty rows, D64 and D128, fp16 and bf16, rel err <= 1.6e-3).
KEY_PADDING = True
_LOG2E = 1.4426950408889634
_FULL_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class WgmmaAttentionConfig:
    """Knobs: ``block_n`` keys per tile (wgmma N of ``S``), ``stages`` depth of the K and V rings, ``pingpong``
    (consumers take turns issuing their products), ``persistent`` (one block per SM walking work items, so the
    producer loads the next item's first tiles and Q under this item's last products and epilogue),
    ``consumers`` (consumer warpgroups of 64 query rows each: 3 at head dim 64 shares each K/V tile among 192
    queries and leaves two other consumers' products to hide one's softmax under), ``loads`` (``"cp.async"``: every
    producer thread copies 16-byte chunks and arrives on the slot's mbarrier, the consumers fence the generic proxy
    before each turn's products; ``"tma"``: one producer thread issues TMA copies from tensor maps encoded on the
    host at each call, and the bitmap words with one ``cp.async.bulk``, all completing on the slot's mbarrier by
    transaction bytes, so the consumers need no proxy fence), ``pad_panels`` (TMA only, head dims that are not
    multiples of 64: shared tiles of 64-column panels in the 128-byte swizzle as at head dims 64 and 128, the head
    dim padded to the next multiple of 64 with zeros, which the copy engine writes for the columns past ``D``;
    ``S`` reads the real columns only, ``O += P V`` runs over the padded width and only ``D`` columns are stored: the
    layout the H200 has checked since session 6, at the cost of the padded product). The tiled format must be built
    at ``block_m x block_n`` (``block_m = 64 * consumers``)."""

    block_n: int = 128
    stages: int = 2
    pingpong: bool = True
    persistent: bool = False
    consumers: int = 2
    loads: str = "cp.async"
    pad_panels: bool = False

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    def validate(self, head_dim: int) -> None:
        if self.block_n not in BLOCK_N_CHOICES:
            raise ValueError(f"block_n must be one of {BLOCK_N_CHOICES}, got {self.block_n!r}")
        if isinstance(self.consumers, bool) or self.consumers not in CONSUMER_CHOICES:
            raise ValueError(f"consumers must be one of {CONSUMER_CHOICES}, got {self.consumers!r}")
        if self.consumers == 3 and self.block_n != 128:
            raise ValueError(f"consumers=3 needs block_n 128, got {self.block_n}")
        limit = REGISTERS[self.consumers][1] - FRAGMENT_SLACK
        if self.fragment_registers(head_dim) > limit:
            raise ValueError(f"consumers={self.consumers} at head_dim {head_dim}, block_n {self.block_n}: S, O and P "
                             f"take {self.fragment_registers(head_dim)} registers a consumer thread, more than the "
                             f"{limit} its {REGISTERS[self.consumers][1]} leave beside them")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"stages must be an int >= 2, got {self.stages!r}")
        for name in ("pingpong", "persistent", "pad_panels"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.loads, str) or self.loads not in LOAD_CHOICES:
            raise ValueError(f"loads must be one of {LOAD_CHOICES}, got {self.loads!r}")
        if self.pad_panels and (self.loads != "tma" or head_dim % PANEL_COLS_CHOICES[0] == 0):
            raise ValueError(f"pad_panels needs loads='tma' (its zero fill) and a head dim that is not a multiple of "
                             f"64, got loads={self.loads!r}, head_dim {head_dim}")
        if self.loads == "cp.async" and self.block_n > 128:
            raise ValueError(f"block_n {self.block_n} needs loads='tma' (ptxas spills cp.async's producer beside "
                             f"160 and 192 keys)")
        if self.loads == "cp.async" and head_dim not in CP_ASYNC_HEAD_DIMS:
            raise ValueError(f"loads='cp.async' takes head dims {CP_ASYNC_HEAD_DIMS} (ptxas spills its producer at "
                             f"others), got {head_dim}; use loads='tma'")
        if self.shared_bytes(head_dim) > 227 * 1024:
            raise ValueError(f"{self} needs {self.shared_bytes(head_dim)} bytes of shared memory at head_dim "
                             f"{head_dim}, more than the 227 KiB of sm_90")

    def fragment_registers(self, head_dim: int) -> int:
        """32-bit registers of a consumer thread's fragments: S (block_n / 2 floats), O (head_dim / 2) and P
        (block_n / 4 packed pairs; O over the padded width with ``pad_panels``). 128 at head dim 64 with three
        consumers (ptxas: 155 in use of 160); 176 at head dim 256 with 64-key tiles and two consumers (of 232)."""
        return self.block_n // 2 + self.smem_head_dim(head_dim) // 2 + self.block_n // 4

    def smem_head_dim(self, head_dim: int) -> int:
        """Head-dim columns of the shared tiles (and of the P V product): ``head_dim``, or with ``pad_panels`` the
        next multiple of 64."""
        return -(-head_dim // 64) * 64 if self.pad_panels else head_dim

    def panel_cols(self, head_dim: int) -> int:
        """Head-dim columns of one shared panel (:func:`panel_cols`; 64 with ``pad_panels``)."""
        return PANEL_COLS_CHOICES[0] if self.pad_panels else panel_cols(head_dim)

    def layout(self, head_dim: int) -> dict:
        """Byte offsets of the shared regions from the 1024-aligned base."""
        q_bytes = self.block_m * self.smem_head_dim(head_dim) * 2
        kv_bytes = self.block_n * self.smem_head_dim(head_dim) * 2
        mw_bytes = self.block_m * self.block_n // 8
        k_off = q_bytes
        v_off = k_off + self.stages * kv_bytes
        m_off = v_off + self.stages * kv_bytes
        bar_off = m_off + self.stages * mw_bytes
        return {"kv_bytes": kv_bytes, "mw_bytes": mw_bytes, "k_off": k_off, "v_off": v_off, "m_off": m_off,
                "bar_off": bar_off, "end": bar_off + 8 * (2 + 4 * self.stages)}

    def shared_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory: Q, the K, V and bitmap rings, the mbarriers, and slack for the 1024 alignment."""
        return self.layout(head_dim)["end"] + ALIGN


# The default configuration's producer loads and grid, by (head dim, key padding), from the H200 (session 9,
# bench_attention.py plans s8tma and s9attn, every check passed: TMA with key padding, Q/K/V views, fresh tensors,
# CUDA-graph replays). ms of s9attn, B16 H12 S4096 D64 / B4 H16 S8192 D128 (two timings: both, in run order):
# D64 3 consumers causal cp.async 1.005/1.034, TMA 0.976/0.985, TMA persistent 1.156 (before the walk's rotation);
# dense 1.653/1.727, 1.644/1.550, 1.843. D64 key-padded (2 consumers) causal 1.491, 1.433, persistent 1.348.
# D128 causal 1.975/2.226, 1.982/1.947, persistent 1.853 (s8tma 1.758); dense 3.984/4.184, 3.690/3.583, persistent
# 3.656 (s8tma 3.780); key-padded causal 2.307, 2.241, persistent 2.060. With the walk's rotation (session 9 call
# 14, same plan rebuilt, 42/42 checks): D64 3 consumers causal TMA 0.944/0.968, persistent 0.944; dense 1.741/1.728,
# persistent 1.580; D128 causal 1.985/2.009, persistent 1.925.
# Head dims 32, 80, 96 and 256 (session 10, plan s10dims, call 6: 49/49 checks; causal ms B16 H12 S4096, D256 B4
# H16 S4096; default / one block per item / padded panels): D32 0.849 / 0.865 / 0.935 (FlexAttention 0.927, SDPA
# causal 0.920, mma.sync 0.978); D80 1.263 / 1.287 / 1.234 (SDPA 1.399); D96 1.342 / 1.257 / 1.390 (SDPA 1.446); D256
# 0.948 / 0.938 (SDPA 0.871, FlexAttention 1.900). So one block per item at 96 and 256, padded panels at 80 (their
# key-padded forms, checked but not timed, keep the persistent grid and the head dim's own panels).
DEFAULT_LOADS = {(d, pad): "tma" for d in SUPPORTED_HEAD_DIMS for pad in (False, True)}
DEFAULT_PERSISTENT = {(d, pad): (d, pad) not in ((96, False), (256, False)) for d in SUPPORTED_HEAD_DIMS
                      for pad in (False, True)}
DEFAULT_PAD_PANELS = {(d, pad): (d, pad) == (80, False) for d in SUPPORTED_HEAD_DIMS for pad in (False, True)}


def default_config(head_dim: int, padding: bool = False) -> WgmmaAttentionConfig:
    """128-key tiles (64 at head dim 256: 128 would not fit S, O and P in the registers, nor two ring stages in
    shared memory); ring stages 2 at head dims 128 and 256, 4 at 32, else 3; three consumers at head dims 32 and 64
    unless the kernel applies key padding (``padding``: its column predicate makes three consumers spill at 64); the
    loads, grid and panels of :data:`DEFAULT_LOADS`, :data:`DEFAULT_PERSISTENT` and :data:`DEFAULT_PAD_PANELS` (with
    padded panels the stages of the padded width: 2 at head dim 80, as at 128).

    Three consumers at head dim 64 measured on the H200 (session 7, ``bench_attention.py`` plan ``s7causal``, B16 H12
    S4096): causal 1.000 ms against 1.103 with two, dense 1.800 against 1.968. At head dim 128 three consumers do not
    fit the registers; two stay."""
    key = (head_dim, bool(padding))
    pad_panels = DEFAULT_PAD_PANELS[key]
    knobs = dict(loads=DEFAULT_LOADS[key], persistent=DEFAULT_PERSISTENT[key], pad_panels=pad_panels)
    width = -(-head_dim // 64) * 64 if pad_panels else head_dim
    stages = {32: 4, 128: 2, 256: 2}.get(width, 3)
    if head_dim <= 64 and not padding:
        return WgmmaAttentionConfig(block_n=128, stages=stages, consumers=3, **knobs)
    return WgmmaAttentionConfig(block_n=64 if head_dim == 256 else 128, stages=stages, **knobs)


def _check_problem(batch, heads, seq_q, seq_k, head_dim, dtype, mask_batch, mask_heads, out_layout):
    for name, value in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    if mask_batch not in (1, batch):
        raise ValueError(f"mask_batch must be 1 or batch ({batch}), got {mask_batch!r}")
    if mask_heads not in (1, heads):
        raise ValueError(f"mask_heads must be 1 or heads ({heads}), got {mask_heads!r}")
    if out_layout not in OUT_LAYOUTS:
        raise ValueError(f"out_layout must be one of {OUT_LAYOUTS}, got {out_layout!r}")


def _scale(scale, head_dim) -> float:
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not (scale > 0.0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return scale


def cpu_twin_primfunc(*, batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: str,
                      mask_batch: int, mask_heads: int, scale: float | None = None,
                      config: WgmmaAttentionConfig | None = None, out_layout: str = "bhsd",
                      padding: bool = False, kv_heads: int | None = None) -> tvm.tirx.PrimFunc:
    """The llvm PrimFunc computing the same function with the same parameters (the block-wise kernel's CPU loop
    nest at this kernel's tile shape)."""
    config = default_config(head_dim) if config is None else config
    return blockwise_attention_primfunc(
        batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim, dtype=dtype, mask_batch=mask_batch,
        mask_heads=mask_heads, scale=scale,
        config=BlockConfig(block_m=config.block_m, block_n=config.block_n, num_warps=config.block_m // 32),
        target_kind="llvm", out_layout=out_layout, padding=padding, kv_heads=kv_heads)


def wgmma_attention_primfunc(*, batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: str,
                             mask_batch: int, mask_heads: int, scale: float | None = None,
                             config: WgmmaAttentionConfig | None = None, out_layout: str = "bhsd",
                             sm_count: int = PERSISTENT_GRID, padding: bool = False,
                             kv_heads: int | None = None) -> tvm.tirx.PrimFunc:
    """The sm_90a PrimFunc ``wgmma_attention(q, k, v, full_indptr, full_indices, part_indptr, part_indices,
    part_bitmaps, out)``: the parameter list of the block-wise kernel without a score bias, the format built at
    ``config.block_m x config.block_n``. ``sm_count``: blocks of a persistent grid (the H200's 132 SMs).
    ``padding=True`` (self-attention, Sq == Sk) adds ``pad_range[B, 3] int32, pad_bits[B, ceil(Sk/32)] uint32``
    after the format arrays, as in the block-wise kernel: batch b keeps only the keys in ``[lo, hi)`` whose bit is
    set where the span has holes, at every query row; every listed tile is still loaded and computed (the
    predicate masks the dropped keys of the tiles that reach them). ``kv_heads``: grouped-query K and V
    ``[B, kv_heads, Sk, D]``, query head ``h`` reading key/value head ``h // (heads / kv_heads)`` (as in the block-wise
    kernel)."""
    _check_problem(batch, heads, seq_q, seq_k, head_dim, dtype, mask_batch, mask_heads, out_layout)
    if padding not in (False, True) or (padding and seq_q != seq_k):
        raise ValueError(f"padding must be a bool and needs seq_q == seq_k, got {padding!r} ({seq_q} x {seq_k})")
    scale = _scale(scale, head_dim)
    config = default_config(head_dim) if config is None else config
    if not isinstance(config, WgmmaAttentionConfig):
        raise TypeError(f"config must be a WgmmaAttentionConfig, got {type(config).__name__}")
    config.validate(head_dim)
    return _kernel(batch, heads, seq_q, seq_k, head_dim, dtype, mask_batch, mask_heads, scale, config,
                   out_layout == "bshd", sm_count, bool(padding), check_kv_heads(kv_heads, heads))


def panel_cols(head_dim: int) -> int:
    """Head-dim columns of one shared panel: the widest of 64, 32, 16 that divides ``head_dim``, so that each row
    of a panel is one swizzle span (128, 64 or 32 bytes) and a panel boundary never splits a k16 step."""
    return next(cols for cols in PANEL_COLS_CHOICES if head_dim % cols == 0)


def panel_offset(row, chunk, row_bytes: int):
    """Byte offset of 16-byte chunk ``chunk`` of row ``row`` in a panel of ``row_bytes``-byte rows swizzled with
    that span (the copy engine's and wgmma's swizzle on address bits, panels aligned to 8 rows): the chunk index
    is XORed with address bits 7 and up, ``(row * row_bytes >> 7) % chunks``. For 128-byte rows ``chunk ^ row % 8``,
    64-byte ``chunk ^ (row // 2) % 4``, 32-byte ``chunk ^ (row // 4) % 2``. ``row``, ``chunk``: ints or TIR."""
    chunks = row_bytes // 16
    return row * row_bytes + (chunk ^ ((row * chunks // 8) % chunks)) * 16


def s_step_offset(kk, cols: int, panel_bytes: int):
    """Bytes from a K-major Q or K tile's start to k16 step ``kk`` of ``S = Q K^T`` (16 head-dim columns) in panels
    of ``cols`` columns: the steps advance 32 bytes inside a panel row, and move to the next panel (``panel_bytes``
    on) every ``cols / 16`` steps."""
    steps = cols // 16
    return (kk // steps) * panel_bytes + (kk % steps) * 32


def pv_step_offset(kk, cols: int):
    """Bytes from an MN-major V tile's start (panels of ``cols`` columns) to k16 step ``kk`` of ``O += P V`` (keys
    ``16 kk ..``): 16 rows."""
    return kk * 16 * 2 * cols


def descriptor_bits(row_bytes: int, leading_bytes: int) -> int:
    """The fields of a wgmma shared-memory descriptor besides its start address, for panels of ``row_bytes``-byte
    rows in the swizzle of that span: leading byte offset ``leading_bytes`` (>> 4, bits 16-29; 16 by convention
    for K-major operands, where the swizzled layout does not read it; MN-major: the next panel), stride byte
    offset one eight-row group (``8 * row_bytes`` >> 4, bits 32-45), layout type (bits 62-63)."""
    return ((leading_bytes >> 4) << 16) | ((8 * row_bytes >> 4) << 32) | (LAYOUT_TYPE[row_bytes] << 62)


def descriptor(addr, row_bytes: int, leading_bytes: int = 16):
    """64-bit wgmma matrix descriptor at shared address ``addr`` (:func:`descriptor_bits`)."""
    start = T.Cast("uint64", T.bitwise_and(T.shift_right(addr, T.uint32(4)), T.uint32(0x3FFF)))
    low = descriptor_bits(row_bytes, leading_bytes) & ((1 << 62) - 1)     # a uint64 immediate must fit int64
    return start | T.uint64(low) | (T.uint64(LAYOUT_TYPE[row_bytes]) << T.uint64(62))


def mask_word(c, w, g, hh, j, n8_tiles: int):
    """32-bit word, within a tile's bitmap (``BM/8 x BN/8`` uint64, little-endian), holding the mask bits of the
    accumulator registers of n8 tile ``j``, row half ``hh`` for consumer ``c``, warp ``w`` (of its warpgroup),
    lane group ``g = lane // 4``: that row's 8x8 sub-tile is (row block ``8c + 2w + hh``, column block ``j``) and
    its row ``g`` sits in the low (``g < 4``) or high half of the uint64."""
    return ((c * 8 + w * 2 + hh) * n8_tiles + j) * 2 + g // 4


def mask_bit(g, qd, e):
    """Bit of that word for register ``e`` (column ``2 qd + e`` of the n8 tile) of row ``g``."""
    return (g % 4) * 8 + qd * 2 + e


def fragment_position(c, w, lane, j, hh, e):
    """(row in the tile, column in the tile) of accumulator register ``j * 4 + hh * 2 + e`` of consumer ``c``,
    warp ``w``, ``lane``: the wgmma D fragment (per warp the mma.sync C layout, warp w holding rows 16w..16w+15
    of its warpgroup's 64)."""
    return c * 64 + w * 16 + hh * 8 + lane // 4, j * 8 + (lane % 4) * 2 + e


def grid_shape(tile_rows: int, heads: int, sm_count: int, persistent: bool) -> tuple[int, int]:
    """(blocks, work items per block at most) for ``tile_rows`` tile rows of ``heads`` (batch x head) heads."""
    if not persistent:
        return tile_rows * heads, 1
    units = heads * -(-tile_rows // 2)
    grid = min(units, sm_count)
    return grid, 2 * -(-units // grid)


def block_work_item(bx, j, tile_rows: int, heads: int, grid: int, persistent: bool):
    """(is there one, head (batch-major), tile row) of block ``bx``'s ``j``-th work item, head by head (the blocks
    running at once share the K and V of a few heads in L2); ``bx``, ``j`` ints or TIR expressions. One block per
    item: each head's tile rows last to first (causal-like masks put the most tiles in the last rows, which then
    start first). Persistent: block ``bx`` walks units ``bx, bx + grid, ...`` of one head's tile rows, the
    heaviest left with the lightest left: ``(TR-1-k, k)`` where the head has an even number ``TR`` of them, else
    ``TR-1`` alone and then ``(TR-1-k, k-1)``. On a causal mask every unit then holds the same tiles (``TR + 1``,
    or ``TR``), so the static walk stays balanced (round-robin over single rows gives blocks whose rows repeat
    mod 4 up to 12% more tiles than the mean at 32 tile rows, 132 blocks). Unit ``u`` of head ``u // half`` is
    pair ``k = (u + u // half) % half``: rotated by the head, so that a block whose units are ``grid`` apart
    does not meet the same ``k`` in every head when ``grid`` is a multiple of ``half`` (132 blocks, 11-unit heads
    at D64 S4096: without the rotation the edge row's partial tiles piled up on 12 blocks, and the persistent grid
    measured 1.156 vs 0.976 ms causal; with it 0.944 vs 0.944-0.968, session 9 call 14, checked vs float32)."""
    if not persistent:
        return True, bx // tile_rows, tile_rows - 1 - bx % tile_rows
    half = -(-tile_rows // 2)
    unit = bx + (j // 2) * grid
    k = (unit % half + unit // half) % half
    second = k - tile_rows % 2
    if isinstance(unit, int):
        return unit < heads * half and (j % 2 == 0 or second >= 0), unit // half, \
            tile_rows - 1 - k if j % 2 == 0 else second
    return (T.And(unit < heads * half, T.Or(j % 2 == 0, second >= 0)), unit // half,
            T.Select(j % 2 == 0, tile_rows - 1 - k, second))


def _kernel(B, H, SQ, SK, D, DT, MB, MH, scale, cfg: WgmmaAttentionConfig, bshd: bool,
            sm_count: int, PAD: bool = False, HKV: int | None = None) -> tvm.tirx.PrimFunc:
    BM, BN, ST, PP, NC = cfg.block_m, cfg.block_n, cfg.stages, cfg.pingpong, cfg.consumers
    HKV = H if HKV is None else HKV
    KVG = H // HKV                     # query heads per key/value head: head h reads K and V of head h // KVG
    THREADS = (NC + 1) * WG
    P_REGS, C_REGS = REGISTERS[NC]
    TR = -(-SQ // BM)
    NROWS = MB * MH * TR + 1
    GRID, ROUNDS = grid_shape(TR, B * H, sm_count, cfg.persistent)
    # The last tile row leaves some consumer without a query row (consume()). Not in the persistent kernel: there
    # the branch to the idle consumer's path made ptxas serialise every wgmma (C7520).
    IDLE_ROWS = TR * BM - SQ >= 64 and not cfg.persistent
    GB, GH = (MH if MB > 1 else 0), (1 if MH > 1 else 0)
    lay = cfg.layout(D)
    KV_BYTES, MW_BYTES = lay["kv_bytes"], lay["mw_bytes"]
    K_OFF, V_OFF, M_OFF, BAR_OFF = lay["k_off"], lay["v_off"], lay["m_off"], lay["bar_off"]
    SMEM_WORDS = cfg.shared_bytes(D) // 4
    CPR = D // 8                       # 16-byte chunks per Q/K/V row
    DS = cfg.smem_head_dim(D)          # head-dim columns of the shared tiles and of O (D, or padded to 64s)
    PC = cfg.panel_cols(D)             # head-dim columns of a panel, its rows one swizzle span of RB bytes
    RB = 2 * PC
    CPP, NP = RB // 16, DS // PC       # 16-byte chunks of a panel row, panels
    Q_PANEL, KV_PANEL = BM * RB, BN * RB
    Q_ITERS, KV_ITERS = BM * CPR // WG, BN * CPR // WG
    MW_CHUNKS = MW_BYTES // 16
    M_ITERS = -(-MW_CHUNKS // WG)
    NJ, KD, KN, ND = BN // 8, D // 16, BN // 16, DS // 8   # n8 tiles of S, k16 steps of S and of PV, n8 tiles of O
    NS, NO = BN // 2, DS // 2          # accumulators per thread: S and O
    SL = scale * _LOG2E
    NEG_INF = T.float32(float("-inf"))
    ab = PTX_TYPE[DT]
    MMA_S = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{ab}.{ab}"]
    MMA_PV = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{DS}k16.f32.{ab}.{ab}"]
    PACK = T.ptx[f"cvt.rn.{ab}x2.f32"]
    CP_ASYNC_16 = T.ptx["cp.async.cg.shared.global"]
    TMA = cfg.loads == "tma"
    # arrivals completing a full mbarrier's phase: every producer thread's (cp.async), or the issuing thread's
    # arrive.expect_tx, the phase then waiting for the copies' transaction bytes too (TMA)
    FULL_ARRIVALS = 1 if TMA else WG
    Q_MAP, KV_MAP = ((panel_map(B * H, SQ, D, BM, DT, PC, cfg.pad_panels),
                      panel_map(B * HKV, SK, D, BN, DT, PC, cfg.pad_panels)) if TMA else (None, None))
    TMA_3D = T.ptx["cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"]
    BULK = T.ptx["cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"]
    EXPECT_TX = T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"]
    EX2 = T.ptx["ex2.approx.ftz.f32"]
    OUT_SHAPE = (B, SQ, H, D) if bshd else (B, H, SQ, D)
    KW = bit_words(SK)

    def q_bar(base, empty=0):          # Q tile landed (128 arrivals) / read by both consumers (256)
        return base + T.uint32(BAR_OFF + 8 * empty)

    def ring_bar(base, ring, gt):      # ring 0..3 = k_full, k_empty, v_full, v_empty; slot of block tile gt
        return base + T.Cast("uint32", BAR_OFF + 16 + 8 * (ring * ST + gt % ST))

    def phase(gt):                     # parity of block tile gt's phase of its slot
        return T.Cast("uint32", (gt // ST) % 2)

    def quad_xor(value, lane_mask):
        return T.tvm_warp_shuffle_xor(T.uint32(_FULL_MASK), value, lane_mask, 32, 32)

    def out_word(b, h, row, col):      # index of the 32-bit word holding out[.., row, .., col:col+2]
        if bshd:
            return ((b * SQ + row) * H + h) * (D // 2) + col // 2
        return ((b * H + h) * SQ + row) * (D // 2) + col // 2

    @T.macro
    def tma_rows(tmap, dst, panel_bytes, row0, bh, bar):
        """TMA: rows ``row0 ..`` of (batch x head) ``bh`` into the panels at ``dst``, one box per panel (rows past
        the operand's end zero-filled), completing on mbarrier ``bar``."""
        for p in T.unroll(NP):
            TMA_3D(dst + T.uint32(p * panel_bytes), T.address_of(tmap), T.int32(p * PC), row0, bh, bar)

    @T.macro
    def load_q(q, q_map, base, b, h, tr, wt):
        if TMA:
            EXPECT_TX(q_bar(base), T.uint32(Q_MAP.box_bytes * NP))
            tma_rows(q_map, base, Q_PANEL, tr * BM, b * H + h, q_bar(base))
        else:
            for it in T.unroll(Q_ITERS):
                row: T.let = (it * WG + wt) // CPR
                ch: T.let = (it * WG + wt) % CPR
                qrow: T.let = tr * BM + row
                CP_ASYNC_16(base + T.Cast("uint32", (ch // CPP) * Q_PANEL + panel_offset(row, ch % CPP, RB)),
                            T.address_of(q[b, h, T.min(qrow, SQ - 1), ch * 8]), 16,
                            T.Cast("uint32", T.Select(qrow < SQ, 16, 0)))
            T.ptx["cp.async.mbarrier.arrive.noinc.shared::cta.b64"](q_bar(base))

    @T.macro
    def load_kv(src, src_map, dst_off, base, b, h, col, gt, wt, bar):
        """K or V rows of column tile ``col`` into block tile ``gt``'s slot (keys >= Sk zero-filled); TMA: completing
        on ``bar``."""
        if TMA:
            tma_rows(src_map, base + T.Cast("uint32", dst_off + (gt % ST) * KV_BYTES), KV_PANEL, col * BN,
                     b * HKV + h // KVG, bar)
        else:
            for it in T.unroll(KV_ITERS):
                row: T.let = (it * WG + wt) // CPR
                ch: T.let = (it * WG + wt) % CPR
                key: T.let = col * BN + row
                CP_ASYNC_16(base + T.Cast("uint32", dst_off + (gt % ST) * KV_BYTES + (ch // CPP) * KV_PANEL
                                          + panel_offset(row, ch % CPP, RB)),
                            T.address_of(src[b, h // KVG, T.min(key, SK - 1), ch * 8]), 16,
                            T.Cast("uint32", T.Select(key < SK, 16, 0)))

    @T.macro
    def load_bitmap(part_bitmaps, base, p, gt, wt):
        """The bitmap words of partial tile ``p`` into block tile ``gt``'s slot: 16 bytes a producer thread, or one
        bulk copy completing on the K slot's mbarrier (TMA)."""
        if TMA:
            BULK(base + T.Cast("uint32", M_OFF + (gt % ST) * MW_BYTES), T.address_of(part_bitmaps[p, 0, 0]),
                 T.uint32(MW_BYTES), ring_bar(base, 0, gt))
        else:
            for it in T.unroll(M_ITERS):
                if it * WG + wt < MW_CHUNKS:
                    CP_ASYNC_16(base + T.Cast("uint32", M_OFF + (gt % ST) * MW_BYTES + (it * WG + wt) * 16),
                                T.address_of(part_bitmaps[p, ((it * WG + wt) * 2) // NJ, ((it * WG + wt) * 2) % NJ]),
                                16, T.uint32(16))

    @T.macro
    def producer(q, k, v, maps, full_indices, part_indices, part_bitmaps, base, flag, b, h, tr, wt, n_tiles,
                 n_part_row, p0, f0, g0, jq):
        """One work item's copies: its Q tile, once the consumers have read the previous item's (``jq``: the block's
        items with tiles before this one), then its tiles into the rings (block tiles g0 ..). ``maps``: the Q, K
        and V tensor maps (TMA)."""
        if n_tiles > 0:
            if jq > 0:
                wait_parity(flag, q_bar(base, 1), T.Cast("uint32", (jq - 1) % 2))
            load_q(q, maps[0], base, b, h, tr, wt)
        for t in range(n_tiles):
            gt: T.let = g0 + t
            col: T.let = T.if_then_else(t < n_part_row, part_indices[p0 + t], full_indices[f0 + t - n_part_row])
            if gt >= ST:
                wait_parity(flag, ring_bar(base, 1, gt), T.Cast("uint32", (gt // ST - 1) % 2))
            if TMA:
                EXPECT_TX(ring_bar(base, 0, gt), T.Cast("uint32", T.Select(t < n_part_row, KV_BYTES + MW_BYTES,
                                                                           KV_BYTES)))
            load_kv(k, maps[1], K_OFF, base, b, h, col, gt, wt, ring_bar(base, 0, gt))
            if t < n_part_row:
                load_bitmap(part_bitmaps, base, p0 + t, gt, wt)
            if not TMA:
                T.ptx["cp.async.mbarrier.arrive.noinc.shared::cta.b64"](ring_bar(base, 0, gt))
            if gt >= ST:
                wait_parity(flag, ring_bar(base, 3, gt), T.Cast("uint32", (gt // ST - 1) % 2))
            if TMA:
                EXPECT_TX(ring_bar(base, 2, gt), T.uint32(KV_BYTES))
            load_kv(v, maps[2], V_OFF, base, b, h, col, gt, wt, ring_bar(base, 2, gt))
            if not TMA:
                T.ptx["cp.async.mbarrier.arrive.noinc.shared::cta.b64"](ring_bar(base, 2, gt))

    @T.macro
    def turn_start(o_acc, corr, c, rescale, wait_turn, compute):
        """Before a consumer issues: tile i-1's rescale of O (idle: the previous turn retired its product), then
        (ping-pong) its turn. ``wait_turn``: False only for consumer 0's first turn in the block. ``compute=False``:
        the turn alone (an idle consumer's path holds no wgmma instruction)."""
        if rescale:
            for dn in T.unroll(ND):
                for hh in T.unroll(2):
                    for e in T.unroll(2):
                        o_acc[dn * 4 + hh * 2 + e] = o_acc[dn * 4 + hh * 2 + e] * corr[hh]
        if PP:
            if wait_turn:
                T.ptx["bar.sync"](T.Cast("uint32", ORDER_BAR + c), T.uint32(2 * WG))
        if compute:
            T.ptx["wgmma.fence.sync.aligned"]()

    @T.macro
    def turn_end(c):
        """After a consumer has issued: the next consumer's turn (ping-pong; turns go round c = 0, 1, .., NC-1).
        The last consumer gives one turn more than consumer 0 takes; consumer 0 takes it after its last item
        (:func:`body`), so the counts of every named barrier match."""
        if PP:
            T.ptx["bar.arrive"](T.Cast("uint32", ORDER_BAR + (c + 1) % NC), T.uint32(2 * WG))

    def advance(desc, offset):
        """The descriptor ``desc`` moved ``offset`` bytes (a multiple of 16) on: its start-address field (address
        >> 4, 14 bits) grows by ``offset >> 4`` and every shared address stays below 256 KiB, so no carry leaves it."""
        return desc + T.Cast("uint64", offset // 16)

    @T.macro
    def issue_s(s_acc, q_desc, k_desc, i):
        """S(i) = Q K(i)^T: one m64n{BN}k16 per 16 head-dim columns, both operands from shared memory."""
        for kk in T.unroll(KD):
            MMA_S(*[s_acc[x] for x in range(NS)], advance(q_desc, s_step_offset(kk, PC, Q_PANEL)),
                  advance(k_desc, (i % ST) * KV_BYTES + s_step_offset(kk, PC, KV_PANEL)), kk > 0, 1, 1, 0, 0)
        T.ptx["wgmma.commit_group.sync.aligned"]()

    @T.macro
    def issue_pv(o_acc, p_frag, v_desc, i):
        """O += P(i) V(i): one m64n{DS}k16 per 16 keys, P from registers, V transposed from shared memory."""
        for kk in T.unroll(KN):
            MMA_PV(*[o_acc[x] for x in range(NO)], p_frag[kk * 4], p_frag[kk * 4 + 1], p_frag[kk * 4 + 2],
                   p_frag[kk * 4 + 3], advance(v_desc, (i % ST) * KV_BYTES + pv_step_offset(kk, PC)), True, 1, 1, 1)
        T.ptx["wgmma.commit_group.sync.aligned"]()

    @T.macro
    def retire_pv(o_acc, base, i, compute):
        """Wait for every product (``compute``: there are some), then free V(i)'s slot."""
        if compute:
            T.ptx["wgmma.wait_group.sync.aligned"](0)
        T.ptx["mbarrier.arrive.shared::cta.b64"](ring_bar(base, 3, i))

    @T.macro
    def softmax(s_acc, corr, m_run, l_run, red, word, smem, mw0, c, w, g, qd, i, n_part_row, pads, b, col):
        """Tile i's mask (partial tiles; with padding, the keys of column tile ``col`` that batch row ``b`` drops,
        where the tile crosses its kept span or the span has holes) and online softmax on S(i) in place; tile i's
        rescale into ``corr``."""
        if i < n_part_row:
            # register e of n8 tile j, row half hh: sub-tile (row block 8c + 2w + hh, column block j); bit
            # g * 8 + 2 qd + e of its uint64, i.e. bit (g % 4) * 8 + 2 qd + e of the 32-bit half g // 4
            for hh in T.unroll(2):
                for j in T.unroll(NJ):
                    word[0] = T.shift_right(smem[mw0 + mask_word(c, w, g, hh, j, NJ)],
                                            T.Cast("uint32", mask_bit(g, qd, 0)))
                    s_acc[j * 4 + hh * 2] = T.Select(T.bitwise_and(word[0], T.uint32(1)) != T.uint32(0),
                                                     s_acc[j * 4 + hh * 2], NEG_INF)
                    s_acc[j * 4 + hh * 2 + 1] = T.Select(T.bitwise_and(word[0], T.uint32(2)) != T.uint32(0),
                                                         s_acc[j * 4 + hh * 2 + 1], NEG_INF)
        if PAD:
            if tvm.tirx.any(col * BN < pads[0][b, 0], col * BN + BN > pads[0][b, 1], pads[0][b, 2] != 0):
                # register (4 jw + jj) * 4 + hh * 2 + e holds key col * BN + 32 jw + 8 jj + 2 qd + e: bit
                # 8 jj + 2 qd + e of the kept bits of keys col * BN + 32 jw .. + 31 (the span [lo, hi) as a bit
                # range, and pad_bits word col * BN / 32 + jw where the span has holes)
                for jw in T.unroll(BN // 32):
                    word[0] = T.Cast("uint32", T.shift_left(T.uint64(1), T.Cast("uint64", T.max(T.min(
                        pads[0][b, 1] - (col * BN + jw * 32), 32), 0))) - T.shift_left(T.uint64(1), T.Cast(
                            "uint64", T.max(T.min(pads[0][b, 0] - (col * BN + jw * 32), 32), 0))))
                    word[0] = T.shift_right(T.bitwise_and(word[0], T.if_then_else(
                        pads[0][b, 2] != 0, pads[1][b, T.min(col * (BN // 32) + jw, KW - 1)],
                        T.uint32(_FULL_MASK))), T.Cast("uint32", qd * 2))
                    for jj in T.unroll(4):
                        for e in T.unroll(2):
                            for hh in T.unroll(2):
                                s_acc[(jw * 4 + jj) * 4 + hh * 2 + e] = T.Select(
                                    T.bitwise_and(word[0], T.uint32(1 << (jj * 8 + e))) != T.uint32(0),
                                    s_acc[(jw * 4 + jj) * 4 + hh * 2 + e], NEG_INF)
        for hh in T.unroll(2):
            red[0] = T.max(s_acc[hh * 2], s_acc[hh * 2 + 1])
            for j in T.unroll(1, NJ):
                red[0] = T.max(red[0], T.max(s_acc[j * 4 + hh * 2], s_acc[j * 4 + hh * 2 + 1]))
            red[0] = T.max(red[0], quad_xor(red[0], 1))
            red[0] = T.max(red[0], quad_xor(red[0], 2))
            red[1] = T.max(m_run[hh], red[0])
            red[2] = T.Select(red[1] == NEG_INF, T.float32(0), red[1] * T.float32(SL))
            EX2(corr[hh], m_run[hh] * T.float32(SL) - red[2])
            m_run[hh] = red[1]
            red[3] = T.float32(0)
            for j in T.unroll(NJ):
                for e in T.unroll(2):
                    EX2(s_acc[j * 4 + hh * 2 + e], s_acc[j * 4 + hh * 2 + e] * T.float32(SL) - red[2])
                    red[3] = red[3] + s_acc[j * 4 + hh * 2 + e]
            l_run[hh] = l_run[hh] * corr[hh] + red[3]

    @T.macro
    def pack_p(s_acc, p_frag):
        # A fragment of k16 step kk: a0 = row g of n8 tile 2kk, a1 = row g+8 of it, a2 / a3 the same of 2kk+1
        for kk in T.unroll(KN):
            for a in T.unroll(4):
                PACK(p_frag[kk * 4 + a], s_acc[(2 * kk + a // 2) * 4 + (a % 2) * 2 + 1],
                     s_acc[(2 * kk + a // 2) * 4 + (a % 2) * 2])

    @T.macro
    def store_rows(out_words, o_acc, l_run, red, word, b, h, tr, c, w, g, qd):
        for hh in T.unroll(2):
            red[0] = l_run[hh]
            red[0] = red[0] + quad_xor(red[0], 1)
            red[0] = red[0] + quad_xor(red[0], 2)
            red[1] = T.Select(red[0] > T.float32(0), T.float32(1) / red[0], T.float32(0))
            row: T.let = tr * BM + fragment_position(c, w, g * 4, 0, hh, 0)[0]
            if row < SQ:
                for dn in T.unroll(D // 8):      # the head dim's columns (with pad_panels O is wider)
                    PACK(word[0], o_acc[dn * 4 + hh * 2 + 1] * red[1], o_acc[dn * 4 + hh * 2] * red[1])
                    out_words[out_word(b, h, row, dn * 8 + qd * 2)] = word[0]

    def work_item(bx, j):
        return block_work_item(bx, j, TR, B * H, GRID, cfg.persistent)

    def tile_col(tiles, i, n_part_row):
        """Column tile of the item's tile i (``tiles``: part_indices, full_indices, the row's first of each)."""
        return T.if_then_else(i < n_part_row, tiles[0][tiles[2] + i], tiles[1][tiles[3] + i - n_part_row])

    @T.macro
    def consume(s_acc, o_acc, p_frag, corr, m_run, l_run, red, word, flag, started, smem, base, mw0, q_desc, k_desc,
                v_desc, c, w, g, qd, n_tiles, n_part_row, g0, jq, compute, pads, b, tiles):
        """One work item's turns (block tiles g0 ..): S(0); then S(i) with P(i-1) V(i-1); then P(n-1) V(n-1).
        ``compute=False`` (a consumer whose 64 rows all lie past Sq: the last tile row of three consumers, one
        block per item) keeps only the waits, turns and slot releases, in the same order (the other consumers'
        phases and turns count on them). ``pads``, ``b``, ``tiles``: the padding inputs, the item's batch row and
        where its tiles' columns are listed (:func:`tile_col`; read only with padding)."""
        wait_parity(flag, q_bar(base), T.Cast("uint32", jq % 2))
        wait_parity(flag, ring_bar(base, 0, g0), phase(g0))
        if compute and not TMA:
            T.ptx["fence.proxy.async.shared::cta"]()
        turn_start(o_acc, corr, c, False, c != 0 or started[0] != 0, compute)
        started[0] = 1
        if compute:
            issue_s(s_acc, q_desc, k_desc, g0)
        turn_end(c)
        if compute:
            T.ptx["wgmma.wait_group.sync.aligned"](0)
            softmax(s_acc, corr, m_run, l_run, red, word, smem, mw0 + (M_OFF + (g0 % ST) * MW_BYTES) // 4, c, w, g,
                    qd, 0, n_part_row, pads, b, tile_col(tiles, 0, n_part_row))
        T.ptx["mbarrier.arrive.shared::cta.b64"](ring_bar(base, 1, g0))
        if compute:
            pack_p(s_acc, p_frag)
        for i in range(1, n_tiles):
            gi: T.let = g0 + i
            wait_parity(flag, ring_bar(base, 0, gi), phase(gi))
            wait_parity(flag, ring_bar(base, 2, gi - 1), phase(gi - 1))
            if compute and not TMA:
                T.ptx["fence.proxy.async.shared::cta"]()
            turn_start(o_acc, corr, c, compute, True, compute)
            if compute:
                issue_s(s_acc, q_desc, k_desc, gi)
                issue_pv(o_acc, p_frag, v_desc, gi - 1)
            turn_end(c)
            if compute:
                T.ptx["wgmma.wait_group.sync.aligned"](1)
                softmax(s_acc, corr, m_run, l_run, red, word, smem, mw0 + (M_OFF + (gi % ST) * MW_BYTES) // 4, c, w,
                        g, qd, i, n_part_row, pads, b, tile_col(tiles, i, n_part_row))
            T.ptx["mbarrier.arrive.shared::cta.b64"](ring_bar(base, 1, gi))
            retire_pv(o_acc, base, gi - 1, compute)
            if compute:
                pack_p(s_acc, p_frag)
        wait_parity(flag, ring_bar(base, 2, g0 + n_tiles - 1), phase(g0 + n_tiles - 1))
        if compute and not TMA:
            T.ptx["fence.proxy.async.shared::cta"]()
        turn_start(o_acc, corr, c, compute, True, compute)
        if compute:
            issue_pv(o_acc, p_frag, v_desc, g0 + n_tiles - 1)
        turn_end(c)
        retire_pv(o_acc, base, g0 + n_tiles - 1, compute)
        T.ptx["mbarrier.arrive.shared::cta.b64"](q_bar(base, 1))    # this item's Q is no longer read

    @T.macro
    def produce_all(q, k, v, maps, full_indptr, full_indices, part_indptr, part_indices, part_bitmaps, base, flag,
                    done, bx, wt):
        """Every work item of block ``bx``, in order."""
        for j in range(ROUNDS):
            if work_item(bx, j)[0]:
                b: T.let = work_item(bx, j)[1] // H
                h: T.let = work_item(bx, j)[1] % H
                tr: T.let = work_item(bx, j)[2]
                r: T.let = (b * GB + h * GH) * TR + tr
                n_part_row: T.let = part_indptr[r + 1] - part_indptr[r]
                n_tiles: T.let = n_part_row + full_indptr[r + 1] - full_indptr[r]
                producer(q, k, v, maps, full_indices, part_indices, part_bitmaps, base, flag, b, h, tr, wt,
                         n_tiles, n_part_row, part_indptr[r], full_indptr[r], done[0], done[1])
                done[0] = done[0] + n_tiles
                done[1] = done[1] + T.Select(n_tiles > 0, 1, 0)

    @T.macro
    def body(q, k, v, full_indptr, full_indices, part_indptr, part_indices, part_bitmaps, out, maps, pads):
        for bx in T.thread_binding(GRID, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                smem = T.alloc_buffer((SMEM_WORDS,), "uint32", scope="shared.dyn")
                s_acc = T.alloc_buffer((NS,), "float32", scope="local")
                o_acc = T.alloc_buffer((NO,), "float32", scope="local")
                p_frag = T.alloc_buffer((BN // 4,), "uint32", scope="local")
                m_run = T.alloc_buffer((2,), "float32", scope="local")
                l_run = T.alloc_buffer((2,), "float32", scope="local")
                corr = T.alloc_buffer((2,), "float32", scope="local")
                red = T.alloc_buffer((4,), "float32", scope="local")
                word = T.alloc_buffer((1,), "uint32", scope="local")
                flag = T.alloc_buffer((1,), "uint32", scope="local")
                # block tiles and items with tiles so far (ring and Q phases); has consumer 0 issued yet
                done = T.alloc_buffer((2,), "int32", scope="local")
                started = T.alloc_buffer((1,), "int32", scope="local")
                out_words = T.decl_buffer((B * H * SQ * D // 2,), "uint32", data=out.data)
                raw: T.let = T.cuda.cvta_generic_to_shared(
                    T.tvm_access_ptr(T.type_annotation("uint32"), smem.data, 0, SMEM_WORDS, 3))
                base: T.let = T.bitwise_and(raw + T.uint32(ALIGN - 1), T.uint32(0xFFFFFFFF - (ALIGN - 1)))
                wg: T.let = tx // WG
                if tx == 0:
                    T.ptx["mbarrier.init.shared::cta.b64"](q_bar(base), T.uint32(FULL_ARRIVALS))
                    T.ptx["mbarrier.init.shared::cta.b64"](q_bar(base, 1), T.uint32(NC * WG))
                    for s in T.unroll(ST):
                        T.ptx["mbarrier.init.shared::cta.b64"](ring_bar(base, 0, s), T.uint32(FULL_ARRIVALS))
                        T.ptx["mbarrier.init.shared::cta.b64"](ring_bar(base, 1, s), T.uint32(NC * WG))
                        T.ptx["mbarrier.init.shared::cta.b64"](ring_bar(base, 2, s), T.uint32(FULL_ARRIVALS))
                        T.ptx["mbarrier.init.shared::cta.b64"](ring_bar(base, 3, s), T.uint32(NC * WG))
                    T.ptx["fence.mbarrier_init.release.cluster"]()
                T.tvm_storage_sync("shared")
                done[0] = 0
                done[1] = 0
                if wg == 0:
                    T.ptx["setmaxnreg.dec.sync.aligned.u32"](P_REGS)
                    if TMA:
                        if tx == 0:          # one thread issues every copy
                            T.ptx["prefetch.tensormap"](T.address_of(maps[0]))
                            T.ptx["prefetch.tensormap"](T.address_of(maps[1]))
                            T.ptx["prefetch.tensormap"](T.address_of(maps[2]))
                            produce_all(q, k, v, maps, full_indptr, full_indices, part_indptr, part_indices,
                                        part_bitmaps, base, flag, done, bx, tx)
                    else:
                        produce_all(q, k, v, maps, full_indptr, full_indices, part_indptr, part_indices, part_bitmaps,
                                    base, flag, done, bx, tx % WG)
                else:
                    T.ptx["setmaxnreg.inc.sync.aligned.u32"](C_REGS)
                    c: T.let = wg - 1
                    w: T.let = (tx % WG) // 32
                    g: T.let = (tx % 32) // 4
                    qd: T.let = tx % 4
                    mw0: T.let = T.Cast("int32", (base - raw) // T.uint32(4))   # smem word of the aligned base
                    q_desc: T.let = descriptor(base + T.Cast("uint32", c * (64 * RB)), RB)   # this consumer's rows
                    k_desc: T.let = descriptor(base + T.uint32(K_OFF), RB)
                    v_desc: T.let = descriptor(base + T.uint32(V_OFF), RB, KV_PANEL)    # MN-major: panels apart
                    started[0] = 0
                    for j in range(ROUNDS):
                        if work_item(bx, j)[0]:
                            b: T.let = work_item(bx, j)[1] // H
                            h: T.let = work_item(bx, j)[1] % H
                            tr: T.let = work_item(bx, j)[2]
                            r: T.let = (b * GB + h * GH) * TR + tr
                            n_part_row: T.let = part_indptr[r + 1] - part_indptr[r]
                            n_tiles: T.let = n_part_row + full_indptr[r + 1] - full_indptr[r]
                            for x in T.unroll(NO):
                                o_acc[x] = T.float32(0)
                            for hh in T.unroll(2):
                                m_run[hh] = NEG_INF
                                l_run[hh] = T.float32(0)
                            if n_tiles > 0:
                                if IDLE_ROWS and tr * BM + c * 64 >= SQ:
                                    consume(s_acc, o_acc, p_frag, corr, m_run, l_run, red, word, flag, started, smem,
                                            base, mw0, q_desc, k_desc, v_desc, c, w, g, qd, n_tiles, n_part_row,
                                            done[0], done[1], False, pads, b,
                                            (part_indices, full_indices, part_indptr[r], full_indptr[r]))
                                else:
                                    consume(s_acc, o_acc, p_frag, corr, m_run, l_run, red, word, flag, started, smem,
                                            base, mw0, q_desc, k_desc, v_desc, c, w, g, qd, n_tiles, n_part_row,
                                            done[0], done[1], True, pads, b,
                                            (part_indices, full_indices, part_indptr[r], full_indptr[r]))
                            store_rows(out_words, o_acc, l_run, red, word, b, h, tr, c, w, g, qd)
                            done[0] = done[0] + n_tiles
                            done[1] = done[1] + T.Select(n_tiles > 0, 1, 0)
                    if PP:
                        if c == 0 and started[0] != 0:   # the last consumer's arrival after its last turn
                            T.ptx["bar.sync"](T.uint32(ORDER_BAR), T.uint32(2 * WG))

    @T.prim_func
    def wgmma_attention(q_h: T.handle, k_h: T.handle, v_h: T.handle, full_indptr_h: T.handle,
                        full_indices_h: T.handle, part_indptr_h: T.handle, part_indices_h: T.handle,
                        part_bitmaps_h: T.handle, pad_range_h: T.handle, pad_bits_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "global_symbol": "wgmma_attention"})
        n_full = T.int32()
        n_part = T.int32()
        q = T.match_buffer(q_h, (B, H, SQ, D), DT, offset_factor=VIEW_ALIGN)
        k = T.match_buffer(k_h, (B, HKV, SK, D), DT, offset_factor=VIEW_ALIGN)
        v = T.match_buffer(v_h, (B, HKV, SK, D), DT, offset_factor=VIEW_ALIGN)
        full_indptr = T.match_buffer(full_indptr_h, (NROWS,), "int32")
        full_indices = T.match_buffer(full_indices_h, (n_full,), "int32")
        part_indptr = T.match_buffer(part_indptr_h, (NROWS,), "int32")
        part_indices = T.match_buffer(part_indices_h, (n_part,), "int32")
        part_bitmaps = T.match_buffer(part_bitmaps_h, (n_part, BM // 8, BN // 8), "uint64")
        pad_range = T.match_buffer(pad_range_h, (B, 3), "int32")
        pad_bits = T.match_buffer(pad_bits_h, (B, KW), "uint32")
        out = T.match_buffer(out_h, OUT_SHAPE, DT)
        if TMA:
            # encoded on the host at each call, from the operands' real addresses (view offsets included)
            q_map: T.let = T.tvm_stack_alloca("tensormap", 1)
            k_map: T.let = T.tvm_stack_alloca("tensormap", 1)
            v_map: T.let = T.tvm_stack_alloca("tensormap", 1)
            T.evaluate(encode_tensor_map(q_map, T.address_of(q[0, 0, 0, 0]), Q_MAP))
            T.evaluate(encode_tensor_map(k_map, T.address_of(k[0, 0, 0, 0]), KV_MAP))
            T.evaluate(encode_tensor_map(v_map, T.address_of(v[0, 0, 0, 0]), KV_MAP))
            body(q, k, v, full_indptr, full_indices, part_indptr, part_indices, part_bitmaps, out,
                 (q_map, k_map, v_map), (pad_range, pad_bits))
        else:
            body(q, k, v, full_indptr, full_indices, part_indptr, part_indices, part_bitmaps, out, (None, None, None),
                 (pad_range, pad_bits))

    if PAD:
        return wgmma_attention
    params = [param for param in wgmma_attention.params if param.name not in ("pad_range", "pad_bits")]
    return tvm.tirx.PrimFunc(params, wgmma_attention.body, wgmma_attention.ret_type, wgmma_attention.attrs)
