"""A warp-specialized Hopper GEMM kernel on ``wgmma`` (sm_90a), written at thread level in TVMScript.

``out[m, n] = act(sum_k A[m, k] * W[n, k] (+ bias[n]))``: A [m, k] and W [n, k] (``torch.nn.Linear``) in
float16 or bfloat16, a float32 accumulator, the output in the input dtype.

Structure of one thread block (``block_m = 128`` rows x ``block_n`` columns of the output):

- 3 warpgroups (384 threads). Warpgroup 0 is the *producer*: its 128 threads copy the A and W tiles of
  each ``block_k = 64`` step global -> shared with 16-byte ``cp.async`` into a ``stages``-deep ring, and
  each thread signals completion on the slot's *full* mbarrier with ``cp.async.mbarrier.arrive.noinc``
  (the barrier expects 128 arrivals). Warpgroups 1 and 2 are *consumers*: each owns 64 output rows and
  issues four ``wgmma.mma_async.m64n{block_n}k16`` per step with both operands read from shared memory
  through matrix descriptors, the accumulators (``block_n / 2`` floats per thread) in registers.
- Slot reuse: a consumer keeps one ``wgmma`` batch in flight (``wgmma.wait_group 1``); once batch t-1 has
  retired, each consumer thread arrives on slot (t-1)'s *empty* mbarrier (256 arrivals), which the
  producer waits on before refilling that slot.
- ``setmaxnreg`` moves registers from the producer (40 per thread) to the consumers (232 per thread).
- Shared tiles are rows of 64 elements = 128 bytes in the 128-byte swizzle of the wgmma descriptors:
  16-byte chunk c of row r sits at ``r * 128 + ((c ^ (r % 8)) * 16)``, tiles aligned to 1024 bytes. A
  K-major descriptor with SWIZZLE_128B then has stride byte offset 1024 (eight rows) and the k16 steps
  inside the 128-byte row advance its start address by 32 bytes.
- ``cp.async`` writes through the generic proxy and ``wgmma`` reads through the async proxy: after its
  wait on the full barrier, each consumer thread runs ``fence.proxy.async.shared::cta`` before the batch.
- Epilogue from registers: bias, activation, rounding, and stores of the two adjacent columns a thread
  holds per n8 tile (the wgmma D fragment has the mma.sync C layout per warp: lane ``l`` of warp ``w``
  holds rows ``16w + l/4`` and ``+8``, columns ``2(l%4)`` and ``+1`` of each n8 tile).

Every instruction comes from TVM 0.27's ``T.ptx`` table (``wgmma``, ``mbarrier``, ``cp.async``, ``fence``, ``bar``,
``setmaxnreg``); the descriptors are computed with plain integer arithmetic (bit layout of PTX ISA
"Matrix Descriptor Format": start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29, stride byte
offset >> 4 in 32-45, layout type in 62-63 with 1 = 128-byte swizzle).

Consumer schedules (knob ``pingpong``):

- *cooperative* (the above): both consumer warpgroups work on the same 128-row tile, 64 rows each, and both run
  its epilogue at the same time, so the tensor cores idle during every epilogue.
- *ping-pong* (persistent only): each consumer owns whole tiles, the block's rounds alternating (consumer 1 the
  even rounds r = 0, 2, ..., consumer 2 the odd ones), so one consumer's epilogue runs while the other issues its
  MMAs. A tile is ``tile_m`` rows: 128 for ``block_n = 128`` (two m64 wgmma per k16 step, ``block_n``
  accumulators per thread) and 64 for 192 and 256 (``block_n / 2`` accumulators), which keeps the fragment within
  the 232 registers; with ``block_m = 256`` (two 128-row tiles in flight) 128 at 192 too (192 accumulators, as in
  the cooperative 256 x 192 tile). The producer fills the ring in tile order as before; a slot's *empty* mbarrier
  expects the 128 arrivals of the one warpgroup that consumed it. The main loops take turns through two named barriers
  (ids 1 and 2, 256 threads): a consumer starts round r > 0 only after the other has issued all of round r-1's
  MMAs (``bar.sync`` on its own id; the other ``bar.arrive``s on it). That order is also what keeps the
  full-barrier parities unambiguous: when a consumer waits for step g, step g - stages (the slot's previous
  phase, possibly the other consumer's tile) has already been waited for.

Two further knobs, both off by default (the kernels above are unchanged without them):

- ``block_m = 256`` (cooperative only): each consumer warpgroup computes 128 rows (two m64 wgmma per k16 step, like
  the 128-row ping-pong tile), so a block's tile is 256 rows. Per tile the ring carries 256 + ``block_n`` rows
  for 2 x 128 x ``block_n`` outputs: fewer bytes through L2 per flop (256 x 192: 22% fewer than 128 x 256) and half
  the tiles, so the per-tile costs (ring refill after the epilogue, the epilogue itself) are paid half as often.
  ``block_n`` 128 and 192 (``block_n`` accumulators per thread; 256 would not fit the 232 registers).
- ``staged`` (any schedule): the epilogue goes through shared memory instead of storing each output element from
  its accumulator register with a 2-byte store (one ``STG.E.U16`` per element: a warp's store covers 8 rows x 8
  bytes, eight partly written 32-byte sectors). Each consumer warp owns a 2 KiB buffer of 16 rows x 64 columns
  after the mbarriers; per 64-column chunk of its 16 rows it packs pairs of outputs (``cvt.rn.f16x2.f32``, the
  rounding of the plain casts), writes them with 4-byte ``st.shared`` in the 128-byte swizzle (conflict-free: the
  eight rows a store instruction covers land in distinct 16-byte chunks), syncs the warp, and reads back 16 bytes
  per lane to store them with ``st.global.v4``: eight lanes write one whole 128-byte line of a row. No barrier
  between warps is needed (each warp stages only the rows its own fragment holds).

A third, ``fast_gelu`` (GELU activations with ``staged`` only): the staged epilogue computes each GELU as
``max(y, 0) - |y| * 2 ** q(|y|)`` with one ``ex2.approx.ftz.f32`` (MUFU.EX2) and a fitted polynomial ``q``
(:mod:`.fast_gelu`: 7 FMAs for erf, 10 for tanh) instead of CUDA's ``erff`` / ``tanhf``: about half the epilogue's
instructions, within 1e-5 (erf) / 3e-5 (tanh) relative of the float64 GELU. Its ``gelu_form`` (``"tail"`` by default,
the above byte for byte) ``"tanh"`` takes ``0.5 y (1 + tanh(u))`` from one ``tanh.approx.f32`` instead (6 instead of 13
CUDA-core instructions per output for the tanh GELU, 8 instead of 10 for erf with a fitted argument): the tanh GELU's
knob sets take it (measured: ``scripts/bench_wgmma_small_k.py --plan s12gelu``); ``"half"`` evaluates the tail on
float16 pairs (``fma.rn.f16x2``, one ``ex2.approx.f16x2`` a pair: about 15 instructions per two outputs instead of ~23),
the erf GELU's float16 knob sets' form since session 21 (``--plan s21gelu``: the epilogue's instructions share each
sub-partition with the other consumer's wgmma, so fewer of them keep the tensor pipe busier).

A fourth, ``loads = "tma"`` (absent or ``"cp.async"``: the kernels above, byte for byte; the knob spaces' default since
the H200 measured it faster, :mod:`.gemm_wgmma`): one thread of the producer warpgroup (the other 127 leave after
``setmaxnreg``) fills each slot with two TMA boxes (``cp.async.bulk.tensor.2d``), 64 columns x ``tile_m`` rows of A and
64 x ``block_n`` rows of W, from tensor maps in the same 128-byte swizzle
(:func:`stof_tvm.schedules.tensor_maps.matrix_map`) that the host encodes from A's and W's device pointers at every call
(TVM's ``runtime.cuTensorMapEncodeTiled``; ``const __grid_constant__ CUtensorMap`` kernel parameters, passed by value,
so a CUDA graph replays the maps it captured with the pointers it captured). A slot's full mbarrier expects one arrival,
the producer's ``mbarrier.arrive.expect_tx`` of the slot's bytes, and completes when the copies have written them; the
consumers drop their per-step ``fence.proxy.async``: the copy engine and wgmma both use the async proxy, and nothing
writes the ring through the generic proxy.

A fifth, ``split_k`` (2, 3, 4, 6, 8, and the non-portable cluster sizes 12 and 16; 1 by default, the kernels above byte
for byte; cooperative 128-row tiles, not persistent, not staged): ``split_k`` blocks share each tile, one k slice of ``k
/ 64 / split_k`` steps each, launched as one thread-block cluster (TVM's ``clusterCtaIdx.x`` launch parameter: block
``bx`` is rank ``bx % split_k`` of tile ``bx // split_k``). After its main loop a block's consumers (after a named
barrier: both off the ring) write their float32 fragments into shared memory over the ring (rows padded by 32 bytes),
the cluster meets at ``barrier.cluster`` (release / acquire), and each consumer thread then sums 4 adjacent columns of
the tile over all the cluster's partial tiles (``mapa`` + ``ld.shared::cluster.v4.f32``, always in rank order 0, 1, ...:
the same bits whichever block sums, so the result is deterministic), applies bias and activation, rounds and stores 8
bytes; the ranks take turns over runs of 256 chunks. A second cluster barrier keeps every block's shared memory alive
until all have read it. Where a GEMM's tiles alone leave most SMs idle (RoBERTa-base at 1 x 128 tokens), the clusters
fill them.

A sixth, ``weight_prefetch`` (off by default: the kernels above byte for byte; on in the split-K knob sets,
:meth:`.gemm_wgmma.WgmmaKernelMixin.split_sets`): the kernel places its own programmatic
dependent launch wait (:mod:`stof_tvm.schedules.dependent_launch`). Before it, the producer warpgroup asks L2 for
the W rows of the block's first tile (its k slice under split-K) with ``cp.async.bulk.prefetch.L2``, one request
per row; then every thread runs ``griddepcontrol.wait`` and ``launch_dependents`` as the pass would have put them.
W does not depend on the kernel before (it is a weight), so its HBM reads overlap that kernel's tail instead of
following it; and a prefetch is only a hint: L2 is the GPU's point of coherence, so the loads after the wait see
the data as it is then whatever the prefetch fetched. At 1 x 128 tokens a GEMM's W slice is most of what a block
reads (RoBERTa-base's FFN: 128 x 192 x 2 bytes per block, A is 128 rows from L2) and each GEMM runs ~7 us.

A seventh, ``early_weights`` (off by default: the kernels above byte for byte; on in the unsplit knob sets of the
spaces, :meth:`.gemm_wgmma.WgmmaKernelMixin.default_weight_timing`): the kernel places its
own dependent launch wait after the W part of the ring's first ``min(stages, k steps)`` slots is on its way into
shared memory (the TMA thread announces each slot's A + W bytes and issues its W box; the cp.async producers issue
their W pieces), and A's loads follow the wait; the consumers wait before their stores (the kernel before may read
the buffer they write). Measured on whole models (BENCHMARKS.md, compile option ``gemm_knobs``): session 16, timed
one module after another, 0.98-0.99x at 1 x 128 tokens (split-K sets, already prefetching), 1.00-1.03x at 4096 rows
and 1576 (within the spread between runs), 1.00x at 32768; session 21, timed interleaved (the spread then 0.3%),
1.015x at 4096 rows, 1.038x at 1576 and 1.000x at 32768: so the unsplit sets take it.

Shapes must tile exactly: m % tile_m, n % block_n and k % 64 all zero, split_k must divide k / 64
(:func:`check_wgmma_shape`). Build for ``arch="sm_90a"`` (``wgmma`` and ``setmaxnreg`` exist
only there).
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from ..tensor_maps import encode_tensor_map, matrix_map
from .epilogue import GATED_ACT, activation, check_activation
from .fast_gelu import (HALF_SIGN_BITS, check_fast_gelu, check_gelu_form, check_half_form, gelu_from_tail,
                        gelu_from_tanh, half_tail_words, tail_exponent, tanh_argument)

BLOCK_M = 128            # two consumer warpgroups x 64 rows (the cooperative tile)
BLOCK_M_CHOICES = (128, 256)   # cooperative tile rows: 64 or 128 per consumer warpgroup
BLOCK_K = 64             # one 128-byte swizzle row of 16-bit elements
WG = 128                 # threads per warpgroup
THREADS = 3 * WG         # producer + two consumers
ROW_BYTES = BLOCK_K * 2  # bytes per shared row
CHUNKS = ROW_BYTES // 16
ALIGN = 1024             # 128-byte swizzle atoms (8 rows x 128 bytes) must start 1024-aligned
PRODUCER_REGS, CONSUMER_REGS = 40, 232
# Registers per thread at launch (ptxas reports 168 for these kernels): setmaxnreg then moves them from the producer
# warpgroup (40 each) to the two consumer warpgroups (232 each), so one block holds the whole register file.
LAUNCH_REGISTERS = (PRODUCER_REGS * WG + CONSUMER_REGS * (THREADS - WG)) // THREADS
BLOCK_N_CHOICES = (128, 192, 256)   # 64 leaves too few registers in use for setmaxnreg to apply (ptxas C7508)
STAGE_CHOICES = (2, 3, 4, 5)
PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
SWIZZLE_128B = 1         # descriptor layout type
# ping-pong tile rows per block_n: one warpgroup holds the whole tile's accumulators (tile_m / 64 * block_n / 2
# per thread; 128 x 192 would leave 40 of the 232 registers for everything else)
PINGPONG_TILE_M = {128: 128, 192: 64, 256: 64}
# ... or, with block_m = 256 (two 128-row tiles in flight, one per consumer), 128 rows at block_n 192: 192 accumulators
# per thread, as in the cooperative 256 x 192 tile
TALL_PINGPONG_N = 192
ORDER_BAR = 1            # named barriers ORDER_BAR + c (c = 0, 1): consumer c may start its next main loop
STAGED_COLS = 64         # staged epilogue: columns of a warp's chunk (one 128-byte swizzled row per output row)
STAGED_WARP_BYTES = 16 * STAGED_COLS * 2   # 16 rows (one warp's m16 slice of an m64 wgmma) x 64 fp16 columns
CONSUMER_WARPS = 2 * WG // 32
PACK_TYPE = {"float16": "f16x2", "bfloat16": "bf16x2"}
# How the producer fills a slot: 16-byte cp.async from its 128 threads, or two TMA boxes from one thread
LOAD_CHOICES = ("cp.async", "tma")
# split_k: thread blocks (one cluster) sharing a tile's k steps; above 8 (the portable cluster size) the runtime
# allows a non-portable cluster size, which a GPC of the H200 may not place
SPLIT_K_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)
PORTABLE_SPLIT_K = 8
PARTIAL_PAD = 32         # bytes after each float32 partial row: a warp's 8-byte fragment stores take 2 wavefronts
SPLIT_BAR = 1            # named barrier of the two consumer warpgroups before the ring is reused for partials
# norm_rows: a cluster of blocks side by side along n owns whole rows; each block keeps two float32 partials per tile
# row in shared memory (the row's sum, then its squared deviations from the mean), read by the cluster's blocks
NORM_SLOTS = 2
NORM_STATS_BYTES = NORM_SLOTS * BLOCK_M * 4
NORM_PARAMS = 3          # ... and the block's columns of bias, gamma and beta, as float32 (read in column pairs)
NORM_GROUP = 8           # n8 tiles whose gamma and beta one batch of shared-memory reads fetches (BN / 8 divides by it)
NORM_BAR = 1             # named barrier of the two consumer warpgroups: the block's bias, gamma and beta are in place
MAX_NORM_CLUSTER = 16    # blocks of one row tile: 8 is the portable cluster size, 16 needs the non-portable one


@dataclass(frozen=True)
class WgmmaConfig:
    """Knobs of the kernel: ``block_n`` output columns per block (wgmma N), ``stages`` ring depth, ``persistent``
    (one block per SM looping over tiles), ``pingpong`` (consumer schedule: each consumer warpgroup owns
    alternate tiles instead of half of every tile; persistent only), ``block_m`` (cooperative tile rows: 128, or
    256 with 128 rows per consumer), ``staged`` (epilogue through shared memory with 16-byte stores),
    ``fast_gelu`` (a GELU activation from one exp2 of a fitted polynomial, :mod:`.fast_gelu`; staged only) and its
    ``gelu_form`` (``"tail"``: that exp2; ``"tanh"``: one tanh.approx.f32 instead; ``"half"``: the tail on float16
    pairs, erf GELU and float16 only),
    ``loads`` (``"cp.async"``, or ``"tma"``: one producer thread issues TMA boxes from tensor maps the host encodes
    at each call), ``split_k`` (blocks of one cluster sharing a tile's k steps, reduced through distributed
    shared memory), ``weight_prefetch`` (W's first tile asked of L2 before the dependent launch wait) and
    ``early_weights`` (W's part of the ring's first slots loaded into shared memory before that wait).
    ``norm_rows`` is not a knob but the epilogue of the GEMM + bias + residual + LayerNorm template: the ``n / block_n``
    blocks of a row tile form one cluster and share their row statistics through distributed shared memory."""

    block_n: int = 128
    stages: int = 4
    persistent: bool = True
    pingpong: bool = False
    block_m: int = BLOCK_M
    staged: bool = False
    fast_gelu: bool = False
    gelu_form: str = "tail"
    loads: str = "cp.async"
    split_k: int = 1
    weight_prefetch: bool = False
    early_weights: bool = False
    norm_rows: bool = False

    def validate(self) -> None:
        if self.block_n not in BLOCK_N_CHOICES:
            raise ValueError(f"block_n must be one of {BLOCK_N_CHOICES}, got {self.block_n!r}")
        if self.stages not in STAGE_CHOICES:
            raise ValueError(f"stages must be one of {STAGE_CHOICES}, got {self.stages!r}")
        if self.persistent not in (True, False):
            raise ValueError(f"persistent must be a bool, got {self.persistent!r}")
        if self.pingpong not in (True, False):
            raise ValueError(f"pingpong must be a bool, got {self.pingpong!r}")
        if self.pingpong and not self.persistent:
            raise ValueError("pingpong needs persistent=True (the consumers alternate over a block's tiles)")
        if self.block_m not in BLOCK_M_CHOICES:
            raise ValueError(f"block_m must be one of {BLOCK_M_CHOICES}, got {self.block_m!r}")
        if self.block_m != BLOCK_M and self.pingpong and self.block_n != TALL_PINGPONG_N:
            raise ValueError(f"block_m=256 with pingpong gives each consumer 128-row tiles at block_n "
                             f"{TALL_PINGPONG_N} only; other ping-pong tiles follow block_n")
        if self.staged not in (True, False):
            raise ValueError(f"staged must be a bool, got {self.staged!r}")
        if self.fast_gelu not in (True, False):
            raise ValueError(f"fast_gelu must be a bool, got {self.fast_gelu!r}")
        if self.fast_gelu and not self.staged:
            raise ValueError("fast_gelu needs staged=True (its GELU is computed where the staged epilogue packs pairs)")
        check_gelu_form(self.gelu_form)
        if self.gelu_form != "tail" and not self.fast_gelu:
            raise ValueError(f"gelu_form={self.gelu_form!r} is a form of fast_gelu: it needs fast_gelu=True")
        if not isinstance(self.loads, str) or self.loads not in LOAD_CHOICES:
            raise ValueError(f"loads must be one of {LOAD_CHOICES}, got {self.loads!r}")
        if self.split_k not in SPLIT_K_CHOICES:
            raise ValueError(f"split_k must be one of {SPLIT_K_CHOICES}, got {self.split_k!r}")
        if self.split_k > 1 and (self.persistent or self.pingpong or self.block_m != BLOCK_M or self.staged):
            raise ValueError("split_k > 1 is one cooperative 128-row tile per block with the reduction's own "
                             "epilogue: persistent, pingpong, staged must be False and block_m 128")
        if self.weight_prefetch not in (True, False):
            raise ValueError(f"weight_prefetch must be a bool, got {self.weight_prefetch!r}")
        if self.early_weights not in (True, False):
            raise ValueError(f"early_weights must be a bool, got {self.early_weights!r}")
        if self.norm_rows not in (True, False):
            raise ValueError(f"norm_rows must be a bool, got {self.norm_rows!r}")
        if self.norm_rows and (self.persistent or self.pingpong or self.block_m != BLOCK_M or self.split_k > 1):
            raise ValueError("norm_rows is one cooperative 128-row tile per block, the row tile's blocks one cluster: "
                             "persistent and pingpong must be False, block_m 128 and split_k 1")

    @property
    def tile_m(self) -> int:
        """Output rows of one tile (one ring fill): ``block_m`` cooperative; ping-pong by ``block_n``, or 128 with
        ``block_m = 256`` (two tiles in flight)."""
        if self.pingpong:
            return self.block_m // 2 if self.block_m != BLOCK_M else PINGPONG_TILE_M[self.block_n]
        return self.block_m

    @property
    def consumer_rows(self) -> int:
        """Rows of a tile one consumer warpgroup computes (64 per m64 wgmma)."""
        return self.tile_m if self.pingpong else self.block_m // 2

    @property
    def stage_bytes(self) -> int:
        return (self.tile_m + self.block_n) * ROW_BYTES

    @property
    def staging_bytes(self) -> int:
        """Shared memory of the staged epilogue: one 16 x 64 buffer per consumer warp (0 without ``staged``)."""
        return CONSUMER_WARPS * STAGED_WARP_BYTES if self.staged else 0

    @property
    def partial_bytes(self) -> int:
        """``split_k``: the block's float32 partial tile (rows padded by :data:`PARTIAL_PAD`), over the ring once
        the main loop is done (0 without split-K)."""
        return self.tile_m * (self.block_n * 4 + PARTIAL_PAD) if self.split_k > 1 else 0

    @property
    def ring_bytes(self) -> int:
        """Shared memory before the mbarriers: the ring, or the partial tile where that is larger."""
        return max(self.stages * self.stage_bytes, self.partial_bytes)

    @property
    def shared_bytes(self) -> int:
        """The ring (or the larger partial tile), 2 mbarriers per slot, the staging buffers, the row partials of
        ``norm_rows``, and slack to align the ring to 1024 bytes at run time."""
        return self.ring_bytes + 16 * self.stages + self.staging_bytes + self.norm_bytes + ALIGN

    @property
    def norm_bytes(self) -> int:
        """``norm_rows``: the float32 row partials the cluster's blocks read, then the block's columns of bias, gamma
        and beta in float32 (0 without)."""
        return NORM_STATS_BYTES + NORM_PARAMS * self.block_n * 4 if self.norm_rows else 0

    @property
    def acc_registers(self) -> int:
        return self.consumer_rows // 64 * self.block_n // 2


def row_tiles(m: int, tile_m: int) -> int:
    """Row tiles of an m-row output: the last one partial where ``tile_m`` does not divide ``m`` (its rows past ``m``
    are loaded as zeros and never stored)."""
    return -(-m // tile_m)


def check_wgmma_shape(m: int, n: int, k: int, config: WgmmaConfig) -> None:
    """Raise ValueError unless the tiles divide the columns and k (rows may end in a partial tile)."""
    if m < 1:
        raise ValueError(f"gemm_wgmma: shape['m'] = {m} must be positive")
    for name, size, tile in (("n", n, config.block_n), ("k", k, BLOCK_K)):
        if size % tile:
            raise ValueError(f"gemm_wgmma: shape[{name!r}] = {size} must be a multiple of {tile} "
                             f"(block_m={config.tile_m}, block_n={config.block_n}, block_k={BLOCK_K})")
    if (k // BLOCK_K) % config.split_k:
        raise ValueError(f"gemm_wgmma: split_k={config.split_k} must divide the {k // BLOCK_K} k steps of k = {k}")


def grid_blocks(config: WgmmaConfig, tiles: int, sm_count: int) -> int:
    """Thread blocks the kernel launches for ``tiles`` output tiles: one per SM walking tiles (persistent), else one
    per tile and k slice."""
    if config.persistent:
        return min(tiles, sm_count)
    return tiles * config.split_k


def tile_origin(tile, grid_n: int, tile_m: int, block_n: int):
    """(first row, first column) of output tile ``tile`` (an int, or a TIR expression in the kernel) of a GEMM with
    ``grid_n`` column panels: row-major over the tiles."""
    return (tile // grid_n) * tile_m, (tile % grid_n) * block_n


def descriptor(addr):
    """64-bit K-major SWIZZLE_128B matrix descriptor of the tile starting at shared address ``addr``."""
    start = T.Cast("uint64", T.bitwise_and(T.shift_right(addr, T.uint32(4)), T.uint32(0x3FFF)))
    lead = T.uint64(1) << T.uint64(16)                   # unused for swizzled K-major; 1 by convention
    stride = T.uint64(ALIGN >> 4) << T.uint64(32)
    layout = T.uint64(SWIZZLE_128B) << T.uint64(62)
    return start | lead | stride | layout


def swizzled(row, chunk):
    """Byte offset of 16-byte chunk ``chunk`` of row ``row`` in a 128-byte-swizzled tile (rows of 128 bytes)."""
    return row * ROW_BYTES + T.bitwise_xor(chunk, T.bitwise_and(row, 7)) * 16


@T.macro
def wait_parity(flag, bar, parity):
    """Spin until the mbarrier at shared address ``bar`` completes phase ``parity`` (``flag``: a local uint32)."""
    flag[0] = T.uint32(0)
    while flag[0] == T.uint32(0):
        T.ptx["mbarrier.try_wait.parity.shared::cta.b64"](flag[0], bar, parity)


def whole_buffer(buf, words):
    """A pointer to ``buf`` that declares all ``words`` elements accessed. Taking ``address_of(buf[0])`` would
    tell buffer compaction that only element 0 is used: it then shrank the dynamic shared allocation to 8 bytes
    and the kernel ran off it (illegal address on the H200)."""
    return T.tvm_access_ptr(T.type_annotation("uint64"), buf.data, 0, words, 3)


def wgmma_gemm_primfunc(m: int, n: int, k: int, dtype: str, *, bias: bool, act: str, config: WgmmaConfig,
                        heads: tuple[int, int, int, int] | None = None, sm_count: int = 132,
                        norm_eps: float | None = None, norm_sum: bool = False) -> tvm.tirx.PrimFunc:
    """The thread-level CUDA PrimFunc (parameters ``A, W[, bias], out`` like the ``gemm`` templates).

    ``norm_eps`` (with ``config.norm_rows``, bias and no activation) makes it GEMM + bias + residual + LayerNorm:
    parameters ``A, W, bias, residual, gamma, beta, out`` and ``out = LayerNorm(A @ W^T + bias + residual) * gamma +
    beta`` with that epsilon (:func:`norm_epilogue` below says how the cluster's blocks share the rows). ``norm_sum``
    also stores the sum ``A @ W^T + bias + residual`` itself, rounded, to a ``sum_out`` parameter before ``out`` (a
    pre-LN model's next residual).
    ``heads = (batch, seq, heads, head_dim)`` makes it the QKV projection: ``n`` is ``3 * heads * head_dim``
    and the epilogue writes row ``b*seq + s``, column ``w*H*D + h*D + d`` to ``out[w, b, h, s, d]``
    ([3, B, H, S, D], what the attention kernels read) instead of ``out[row, col]``. ``m`` may exceed
    ``batch * seq`` (rows zero-padded up to the tile: ViT's 197 tokens); the rows past it are not stored."""
    if dtype not in PTX_TYPE:
        raise ValueError(f"dtype must be one of {sorted(PTX_TYPE)}, got {dtype!r}")
    GATED = act == GATED_ACT
    if not GATED:
        check_activation(act)
    config.validate()
    if GATED and (heads is not None or norm_eps is not None or config.staged or config.split_k > 1):
        raise ValueError(f"act={GATED_ACT!r} (gate and up columns interleaved, out[:, j] = silu(col 2j) * col 2j+1) "
                         "stores from the accumulators: heads, norm_eps, staged and split_k > 1 do not apply")
    if config.fast_gelu:
        check_fast_gelu(act)
    if config.gelu_form == "half":
        check_half_form(act, dtype)
    check_wgmma_shape(m, n, k, config)
    NORM = norm_eps is not None
    if NORM != config.norm_rows or (NORM and (not bias or act != "none" or heads is not None)) or (
            norm_sum and not NORM):
        raise ValueError("norm_eps and config.norm_rows go together, with a bias, no activation and no heads; "
                         "norm_sum needs them")
    if NORM and not 1 < n // config.block_n <= MAX_NORM_CLUSTER:
        raise ValueError(f"norm_rows: a row of n = {n} must span 2 to {MAX_NORM_CLUSTER} blocks of "
                         f"block_n = {config.block_n} (one cluster)")
    BN, ST, DT, TM = config.block_n, config.stages, dtype, config.tile_m
    NACC = BN // 2                       # accumulators of one m64 wgmma
    CR = config.consumer_rows
    HALVES = CR // 64                    # m64 wgmmas per k16 step of one consumer (2 for 128-row consumer tiles)
    KT = k // BLOCK_K
    SPLIT = config.split_k
    KS = KT // SPLIT                     # k steps of one block's slice (all of them without split-K)
    GRID_N = n // BN
    # blocks of one cluster (1: no cluster launch): a tile's k slices, or (norm_rows) a row tile's column panels
    CLUSTER = GRID_N if NORM else SPLIT
    NUM_TILES = GRID_N * row_tiles(m, TM)
    # m not a multiple of TM: the last row tile is partial. TMA loads its rows past m as zeros (A's map has m rows);
    # cp.async reads 0 bytes for them (zero-filled, from a row clamped to m - 1); the stores skip them (PADDED)
    RAGGED = m % TM != 0
    # persistent: one block per SM walks tiles bx, bx + GRID, ...; its producer fills the ring for the next
    # tile while the consumers run the epilogue of this one (one block per SM fits: setmaxnreg hands it the
    # whole register file, so without this the epilogue and the ring's refill are never overlapped).
    # split-K: SPLIT blocks per tile, one cluster (blocks bx = tile * SPLIT + rank), one k slice each
    GRID = grid_blocks(config, NUM_TILES, sm_count)
    ROUNDS = (NUM_TILES * SPLIT + GRID - 1) // GRID
    PINGPONG = config.pingpong
    # the consumers that read a slot: one (ping-pong) or both, every thread arriving
    EMPTY_ARRIVALS = WG if PINGPONG else 2 * WG
    A_BYTES = TM * ROW_BYTES
    STAGE = config.stage_bytes
    BAR_OFF = config.ring_bytes          # mbarriers after the ring: full[s] at +8s, empty[s] at +8(ST+s)
    STAGING_OFF = BAR_OFF + 16 * ST      # staged epilogue: consumer warp v's buffer at + v * STAGED_WARP_BYTES
    NORM_OFF = STAGING_OFF + config.staging_bytes   # norm_rows: slot q's partial of tile row i at + (q * 128 + i) * 4
    PARAM_OFF = NORM_OFF + NORM_STATS_BYTES         # norm_rows: parameter p's column c (float32) at + (p * BN + c) * 4
    PARTIAL_ROW = BN * 4 + PARTIAL_PAD   # split-K: bytes per row of a block's float32 partial tile
    TILE_CHUNKS = TM * BN // 4           # split-K: 16-byte chunks (4 columns) of a tile, reduced one per thread
    REDUCE_ROUNDS = -(-TILE_CHUNKS // (SPLIT * 2 * WG))
    SMEM_WORDS = config.shared_bytes // 8
    A_ITERS = TM * CHUNKS // WG
    B_ITERS = BN * CHUNKS // WG
    ab = PTX_TYPE[DT]
    MMA = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{ab}.{ab}"]
    CP_ASYNC_16 = T.ptx["cp.async.cg.shared.global"]
    TMA = config.loads == "tma"
    # a full mbarrier's phase completes on every producer thread's cp.async arrival, or on the issuing thread's
    # arrive.expect_tx and the boxes' transaction bytes (TMA)
    FULL_ARRIVALS = 1 if TMA else WG
    A_MAP, W_MAP = (matrix_map(m, k, TM, DT), matrix_map(n, k, BN, DT)) if TMA else (None, None)
    TMA_2D = T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"]
    EXPECT_TX = T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"]
    if heads is not None:
        HB, HS, HH, HD = heads
        if HB * HS > m or 3 * HH * HD != n or HD % 2:
            raise ValueError(f"heads={heads} does not match m={m}, n={n} (m = batch*seq, or more: padded rows; "
                             "n = 3*heads*head_dim, head_dim even)")
        if config.split_k > 1 and HD % 4:
            raise ValueError(f"split_k > 1 stores 4 columns at once: head_dim must be a multiple of 4, got {HD}")
        if config.staged and HD % 8:
            raise ValueError(f"staged=True stores 8 columns at once: head_dim must be a multiple of 8, got {HD}")
        OUT_SHAPE = (3, HB, HH, HS, HD)
    else:
        OUT_SHAPE = (m, n // 2) if GATED else (m, n)
    REAL_ROWS = m if heads is None else heads[0] * heads[1]
    PADDED = REAL_ROWS != row_tiles(m, TM) * TM    # rows past m or batch * seq: computed, never stored
    # ``acc + (-0.0)`` (exact for every value) as a *volatile* asm per accumulator after the final
    # wgmma.wait_group: nvcc keeps volatile asm in order, so the epilogue's reads, which depend on it, cannot
    # be hoisted above the wait (the wait names no registers). Without it nvcc moved the conversions of the
    # plain-GEMM epilogue up and ptxas serialized every wgmma (warning C7514).
    FENCE_REG = T.ptx["add.rn.f32"]
    # early_weights: the first EARLY k steps' W tiles go into their slots before the dependent launch wait
    EARLY = min(ST, KS) if config.early_weights else 0

    def tile_of(bx, r):
        """The output tile of block ``bx``'s round ``r``."""
        return bx + r * GRID if SPLIT == 1 else bx // SPLIT

    def tile_rows(tile):
        return tile_origin(tile, GRID_N, TM, BN)[0]

    def tile_cols(tile):
        return tile_origin(tile, GRID_N, TM, BN)[1]

    def k_col(bx, t):
        """The first column of A and W that block ``bx``'s k step ``t`` reads (its slice's under split-K)."""
        return t * BLOCK_K if SPLIT == 1 else ((bx % SPLIT) * KS + t) * BLOCK_K

    def full_bar(base, s):
        return base + T.uint32(BAR_OFF + 8 * s)

    def empty_bar(base, s):
        return base + T.uint32(BAR_OFF + 8 * (ST + s))

    def mma_step(acc, a_desc, b_desc, first=0):
        return MMA(*[acc[first + i] for i in range(NACC)], a_desc, b_desc, True, 1, 1, 0, 0)

    def biased(x, col, bias_buf):
        return x + T.Cast("float32", bias_buf[col]) if bias else x

    def epilogue_f32(x, col, bias_buf):
        """An output in float32 before rounding; ``norm_rows`` finished it in the accumulators already."""
        return x if NORM else activation(act, biased(x, col, bias_buf))

    def epilogue(x, col, bias_buf):
        return T.Cast(DT, epilogue_f32(x, col, bias_buf))

    def out_ptr(out, row, col):
        """Address of output element (row, col) of the GEMM (in [3, B, H, S, D] for the QKV projection)."""
        if heads is None:
            return T.address_of(out[row, col])
        return T.address_of(out[col // (HH * HD), row // HS, col % (HH * HD) // HD, row % HS, col % HD])

    @T.macro
    def store_head(x, out, bias_buf, row, col):
        """The QKV projection's store of one output element (row, col) at its [3, B, H, S, D] place."""
        out[col // (HH * HD), row // HS, col % (HH * HD) // HD, row % HS, col % HD] = epilogue(x, col, bias_buf)

    def gated(i, col, bias_buf, acc):
        """``act="silu_mul"``: the output of the thread's column pair (``col`` even: a gate column, then its up
        column) in float32, ``silu(gate) * up``."""
        gate = biased(acc[i], col, bias_buf)
        return gate / (T.float32(1) + T.exp(-gate)) * biased(acc[i + 1], col + 1, bias_buf)

    @T.macro
    def store_gated(acc, out, bias_buf, row0, col0, lane, first):
        """``act="silu_mul"``: one output per accumulator pair, at column ``col // 2``."""
        for j in T.unroll(BN // 8):
            for h in T.unroll(2):
                col: T.let = col0 + j * 8 + (lane % 4) * 2
                row: T.let = row0 + lane // 4 + 8 * h
                if PADDED:
                    if row < REAL_ROWS:
                        out[row, col // 2] = T.Cast(DT, gated(first + j * 4 + h * 2, col, bias_buf, acc))
                else:
                    out[row, col // 2] = T.Cast(DT, gated(first + j * 4 + h * 2, col, bias_buf, acc))

    @T.macro
    def store(acc, out, bias_buf, row0, col0, lane, first):
        for j in T.unroll(BN // 8):
            for h in T.unroll(2):
                for e in T.unroll(2):
                    col: T.let = col0 + j * 8 + (lane % 4) * 2 + e
                    row: T.let = row0 + lane // 4 + 8 * h
                    if heads is None and PADDED:
                        if row < REAL_ROWS:
                            out[row, col] = epilogue(acc[first + j * 4 + h * 2 + e], col, bias_buf)
                    elif heads is None:
                        out[row, col] = epilogue(acc[first + j * 4 + h * 2 + e], col, bias_buf)
                    elif PADDED:
                        if row < REAL_ROWS:
                            store_head(acc[first + j * 4 + h * 2 + e], out, bias_buf, row, col)
                    else:
                        store_head(acc[first + j * 4 + h * 2 + e], out, bias_buf, row, col)

    PACK = T.ptx[f"cvt.rn.{PACK_TYPE[DT]}.f32"]

    def pack_pair(words, acc, i, col, bias_buf):
        """Outputs ``acc[i]`` (column ``col``) and ``acc[i + 1]`` rounded to 16 bits and packed into ``words[0]``, the
        first in the low half (its address is the lower)."""
        return PACK(words[0], epilogue_f32(acc[i + 1], col + 1, bias_buf), epilogue_f32(acc[i], col, bias_buf))

    if config.gelu_form == "half":
        NEG_END, HALF_COEFFS = half_tail_words(act)
        assert len(HALF_COEFFS) == 6, "pack_pair_half_gelu writes out the Horner steps of a degree-5 polynomial"
    FMA2, MAX2 = T.ptx["fma.rn.f16x2"], T.ptx["max.f16x2"]

    @T.macro
    def pack_pair_half_gelu(words, acc, i, col, bias_buf):
        """:func:`pack_pair` with ``gelu_form="half"``: the pair rounded to f16x2 once, then the tail form on both
        halves at once (:mod:`.fast_gelu`): ``s = -|y|``, ``q(max(s, -T))`` by Horner, one ``ex2.approx.f16x2``,
        ``s * 2**q + max(y, 0)``."""
        pair = T.alloc_buffer((3,), "uint32", scope="local")   # y; max(s, -T), then max(y, 0); q, then 2**q
        PACK(pair[0], biased(acc[i + 1], col + 1, bias_buf), biased(acc[i], col, bias_buf))
        s: T.let = T.bitwise_or(pair[0], T.uint32(HALF_SIGN_BITS))
        MAX2(pair[1], s, T.uint32(NEG_END))
        FMA2(pair[2], T.uint32(HALF_COEFFS[0]), pair[1], T.uint32(HALF_COEFFS[1]))
        FMA2(pair[2], pair[2], pair[1], T.uint32(HALF_COEFFS[2]))
        FMA2(pair[2], pair[2], pair[1], T.uint32(HALF_COEFFS[3]))
        FMA2(pair[2], pair[2], pair[1], T.uint32(HALF_COEFFS[4]))
        FMA2(pair[2], pair[2], pair[1], T.uint32(HALF_COEFFS[5]))
        T.ptx["ex2.approx.f16x2"](pair[2], pair[2])
        MAX2(pair[1], pair[0], T.uint32(0))
        FMA2(words[0], s, pair[2], pair[1])

    @T.macro
    def pack_pair_fast_gelu(words, acc, i, col, bias_buf):
        """:func:`pack_pair` with the ``fast_gelu`` activation: per output, the tail exponent's ``ex2.approx.ftz``
        (one MUFU.EX2) into a register, then ``max(y, 0) - |y| * tail``; or (``gelu_form``) ``0.5 y (1 + t)`` from
        ``t = tanh.approx.f32(u(y))`` (:mod:`.fast_gelu`)."""
        vals = T.alloc_buffer((2,), "float32", scope="local")
        for e in T.unroll(2):
            y: T.let = biased(acc[i + e], col + e, bias_buf)
            if config.gelu_form == "tanh":
                T.ptx["tanh.approx.f32"](vals[e], tanh_argument(act, y))
                vals[e] = gelu_from_tanh(y, vals[e])
            else:
                T.ptx["ex2.approx.ftz.f32"](vals[e], tail_exponent(act, T.abs(y)))
                vals[e] = gelu_from_tail(y, T.abs(y), vals[e])
        PACK(words[0], vals[1], vals[0])

    @T.macro
    def store_chunk(out, row, col, words):
        """16 bytes (8 outputs of one row, packed in ``words``) to output element (row, col) on."""
        T.ptx["st.global.v4.b32"](out_ptr(out, row, col), words[0], words[1], words[2], words[3])

    @T.macro
    def store_staged(acc, out, bias_buf, row0, col0, lane, first, buf, words):
        """The ``staged`` epilogue of one warp's 16 rows (module docstring): per 64-column chunk, packed pairs into
        the warp's swizzled buffer at shared address ``buf``, then 16-byte rows out. ``words``: 4 local uint32."""
        for cc in T.unroll(BN // STAGED_COLS):
            for j in T.unroll(STAGED_COLS // 8):
                for h in T.unroll(2):
                    col: T.let = col0 + cc * STAGED_COLS + j * 8 + (lane % 4) * 2
                    if config.gelu_form == "half":
                        pack_pair_half_gelu(words, acc, first + (cc * STAGED_COLS // 8 + j) * 4 + h * 2, col, bias_buf)
                    elif config.fast_gelu:
                        pack_pair_fast_gelu(words, acc, first + (cc * STAGED_COLS // 8 + j) * 4 + h * 2, col, bias_buf)
                    else:
                        pack_pair(words, acc, first + (cc * STAGED_COLS // 8 + j) * 4 + h * 2, col, bias_buf)
                    T.ptx["st.shared.b32"](buf + T.Cast("uint32", swizzled(lane // 4 + 8 * h, j) + (lane % 4) * 4),
                                           words[0])
            T.ptx["bar.warp.sync"](T.uint32(0xFFFFFFFF))
            for it in T.unroll(16 * CHUNKS // 32):
                row: T.let = it * 4 + lane // CHUNKS
                T.ptx["ld.shared.v4.b32"](words[0], words[1], words[2], words[3],
                                          buf + T.Cast("uint32", swizzled(row, lane % CHUNKS)))
                if PADDED:
                    if row0 + row < REAL_ROWS:
                        store_chunk(out, row0 + row, col0 + cc * STAGED_COLS + (lane % CHUNKS) * 8, words)
                else:
                    store_chunk(out, row0 + row, col0 + cc * STAGED_COLS + (lane % CHUNKS) * 8, words)
            T.ptx["bar.warp.sync"](T.uint32(0xFFFFFFFF))

    @T.macro
    def store_tile(acc, out, bias_buf, row0, col0, base, wt, warp, words):
        """Store one consumer's ``CR`` rows of a tile from ``acc`` (first row ``row0``; ``warp``: the thread's consumer
        warp 0-7, which picks its staging buffer)."""
        for q in T.unroll(HALVES):
            if config.staged:
                store_staged(acc, out, bias_buf, row0 + q * 64 + (wt // 32) * 16, col0, wt % 32, q * NACC,
                             base + T.Cast("uint32", STAGING_OFF + warp * STAGED_WARP_BYTES), words)
            elif GATED:
                store_gated(acc, out, bias_buf, row0 + q * 64 + (wt // 32) * 16, col0, wt % 32, q * NACC)
            else:
                store(acc, out, bias_buf, row0 + q * 64 + (wt // 32) * 16, col0, wt % 32, q * NACC)

    @T.macro
    def release(bar):
        """A consumer thread done reading a slot (its warpgroup's wgmma batch retired) frees it: every thread arrives
        on the slot's empty mbarrier at shared address ``bar``."""
        T.ptx["mbarrier.arrive.shared::cta.b64"](bar)

    @T.macro
    def mma_tile(acc, flag, base, r, a_rows_offset, wt):
        """The consumer main loop of round ``r``'s tile: per k step, wait for its slot, issue the step's wgmma
        (operand A ``a_rows_offset`` bytes into the slot's A tile: this consumer's rows), keep one batch in flight and
        free the previous step's slot."""
        for t in range(KS):
            g: T.let = r * KS + t
            wait_parity(flag, full_bar(base, g % ST), T.Cast("uint32", (g // ST) % 2))
            if not TMA:   # cp.async wrote the slot through the generic proxy; wgmma reads it through the async one
                T.ptx["fence.proxy.async.shared::cta"]()
            a_tile: T.let = base + T.Cast("uint32", (g % ST) * STAGE + a_rows_offset)
            b_tile: T.let = base + T.Cast("uint32", (g % ST) * STAGE + A_BYTES)
            T.ptx["wgmma.fence.sync.aligned"]()
            for kk in T.unroll(BLOCK_K // 16):
                for q in T.unroll(HALVES):
                    mma_step(acc, descriptor(a_tile + T.uint32(q * 64 * ROW_BYTES + kk * 32)),
                             descriptor(b_tile + T.uint32(kk * 32)), q * NACC)
            T.ptx["wgmma.commit_group.sync.aligned"]()
            T.ptx["wgmma.wait_group.sync.aligned"](1)
            if t > 0:
                release(empty_bar(base, (g - 1) % ST))

    @T.macro
    def drain_and_store(acc, out, bias_buf, base, r, row0, col0, wt, warp, words):
        """After round ``r``'s main loop: retire the last wgmma batch, free the tile's last slot (the producer may
        refill it for the next tile) and store the tile's rows from ``row0``."""
        T.ptx["wgmma.wait_group.sync.aligned"](0)
        release(empty_bar(base, (r * KS + KS - 1) % ST))
        for i in T.unroll(HALVES * NACC):
            FENCE_REG(acc[i], acc[i], T.float32(-0.0))
        store_tile(acc, out, bias_buf, row0, col0, base, wt, warp, words)

    @T.macro
    def load_w_cp_async(W, dst, n0, bx, t, wt):
        """Thread ``wt``'s 16-byte cp.async pieces of the W tile of k step ``t`` (rows ``n0 ...``) into ``dst``."""
        for it in T.unroll(B_ITERS):
            row: T.let = (it * WG + wt) // CHUNKS
            ch: T.let = (it * WG + wt) % CHUNKS
            CP_ASYNC_16(dst + T.Cast("uint32", A_BYTES + swizzled(row, ch)),
                        T.address_of(W[n0 + row, k_col(bx, t) + ch * 8]), 16, T.uint32(16))

    @T.macro
    def produce_cp_async(A, W, base, flag, bx, wt):
        """The producer warpgroup's copies: per k step of each of the block's tiles, wait for the slot to be free,
        16-byte cp.async of the A and W tiles by all 128 threads, each arriving on the slot's full barrier.
        ``early_weights``: the first ``EARLY`` steps' W pieces before the dependent launch wait, A's after it."""
        if EARLY > 0:
            if tile_of(bx, 0) < NUM_TILES:
                for t in T.unroll(EARLY):
                    load_w_cp_async(W, base + T.Cast("uint32", t * STAGE), tile_cols(tile_of(bx, 0)), bx, t, wt)
            T.ptx["griddepcontrol.wait"]()
            T.ptx["griddepcontrol.launch_dependents"]()
        for r in range(ROUNDS):
            tile: T.let = tile_of(bx, r)
            if tile < NUM_TILES:
                m0: T.let = tile_rows(tile)
                n0: T.let = tile_cols(tile)
                for t in range(KS):
                    g: T.let = r * KS + t
                    if g >= ST:
                        wait_parity(flag, empty_bar(base, g % ST), T.Cast("uint32", (g // ST - 1) % 2))
                    a_dst: T.let = base + T.Cast("uint32", (g % ST) * STAGE)
                    for it in T.unroll(A_ITERS):
                        row: T.let = (it * WG + wt) // CHUNKS
                        ch: T.let = (it * WG + wt) % CHUNKS
                        if RAGGED:   # rows past m: 0 bytes read (zero-filled) from the last row
                            CP_ASYNC_16(a_dst + T.Cast("uint32", swizzled(row, ch)),
                                        T.address_of(A[T.min(m0 + row, m - 1), k_col(bx, t) + ch * 8]), 16,
                                        T.Select(m0 + row < m, T.uint32(16), T.uint32(0)))
                        else:
                            CP_ASYNC_16(a_dst + T.Cast("uint32", swizzled(row, ch)),
                                        T.address_of(A[m0 + row, k_col(bx, t) + ch * 8]), 16, T.uint32(16))
                    if EARLY == 0 or g >= EARLY:   # static where there are no early loads
                        load_w_cp_async(W, a_dst, n0, bx, t, wt)
                    T.ptx["cp.async.mbarrier.arrive.noinc.shared::cta.b64"](full_bar(base, g % ST))

    @T.macro
    def produce_tma(maps, base, flag, bx):
        """The TMA producer (one thread): per k step, wait for the slot, announce its bytes on the full barrier
        (``arrive.expect_tx``), then one box of A (``tile_m`` rows) and one of W (``block_n`` rows), 64 columns
        each, landing swizzled at the slot's A and W tiles. ``early_weights``: the first ``EARLY`` slots announced
        and their W boxes issued before the dependent launch wait, their A boxes after it."""
        T.ptx["prefetch.tensormap"](T.address_of(maps[0]))
        T.ptx["prefetch.tensormap"](T.address_of(maps[1]))
        if EARLY > 0:
            if tile_of(bx, 0) < NUM_TILES:
                for t in T.unroll(EARLY):
                    EXPECT_TX(full_bar(base, t), T.uint32(A_MAP.box_bytes + W_MAP.box_bytes))
                    TMA_2D(base + T.uint32(t * STAGE + A_BYTES), T.address_of(maps[1]), T.int32(k_col(bx, t)),
                           tile_cols(tile_of(bx, 0)), full_bar(base, t))
            T.ptx["griddepcontrol.wait"]()
            T.ptx["griddepcontrol.launch_dependents"]()
        for r in range(ROUNDS):
            tile: T.let = tile_of(bx, r)
            if tile < NUM_TILES:
                m0: T.let = tile_rows(tile)
                n0: T.let = tile_cols(tile)
                for t in range(KS):
                    g: T.let = r * KS + t
                    if g >= ST:
                        wait_parity(flag, empty_bar(base, g % ST), T.Cast("uint32", (g // ST - 1) % 2))
                    a_dst: T.let = base + T.Cast("uint32", (g % ST) * STAGE)
                    if EARLY == 0 or g >= EARLY:   # static where there are no early loads
                        EXPECT_TX(full_bar(base, g % ST), T.uint32(A_MAP.box_bytes + W_MAP.box_bytes))
                    TMA_2D(a_dst, T.address_of(maps[0]), T.int32(k_col(bx, t)), m0, full_bar(base, g % ST))
                    if EARLY == 0 or g >= EARLY:   # static where there are no early loads
                        TMA_2D(a_dst + T.uint32(A_BYTES), T.address_of(maps[1]), T.int32(k_col(bx, t)), n0,
                               full_bar(base, g % ST))

    def frag_row(wg, wt, h):
        """The tile row of half ``h`` of consumer thread ``wt``'s fragment in warpgroup ``wg`` (rows l/4 and + 8)."""
        return (wg - 1) * CR + (wt // 32) * 16 + (wt % 32) // 4 + 8 * h

    def frag_col(wt, j, e):
        """The tile column of element ``e`` of n8 tile ``j`` of consumer thread ``wt``'s fragment."""
        return j * 8 + (wt % 4) * 2 + e

    @T.macro
    def write_partial(acc, base, wg, wt):
        """split-K: the consumer thread's float32 fragment of the block's partial tile into shared memory (rows of
        ``4 * BN + PARTIAL_PAD`` bytes at ``base``, over the ring), two adjacent columns per 8-byte store."""
        for j in T.unroll(BN // 8):
            for h in T.unroll(2):
                row: T.let = frag_row(wg, wt, h)
                col: T.let = frag_col(wt, j, 0)
                T.ptx["st.shared.v2.f32"](base + T.Cast("uint32", row * PARTIAL_ROW + col * 4),
                                          acc[j * 4 + h * 2], acc[j * 4 + h * 2 + 1])

    @T.macro
    def reduce_and_store(out, bias_buf, base, bx, cr, ct, sums, parts, remote, words):
        """split-K, after the cluster barrier: consumer thread ``ct`` (0-255) of cluster rank ``cr`` sums 4
        consecutive float32 columns of the tile over the cluster's ``SPLIT`` partial tiles (read from each block's
        shared memory through ``mapa``), always in rank order 0, 1, ... (the same sum whichever block computes it),
        then bias, activation, rounding and one 8-byte store. The ranks take turns over 256-chunk runs of the
        tile's rows. A chunk's ``SPLIT`` remote reads are all issued (into ``parts``) before the sum, so their
        latencies overlap."""
        m0: T.let = tile_rows(tile_of(bx, 0))
        n0: T.let = tile_cols(tile_of(bx, 0))
        for it in range(REDUCE_ROUNDS):
            c: T.let = (it * SPLIT + cr) * (2 * WG) + ct
            if c < TILE_CHUNKS:
                row: T.let = c // (BN // 4)
                col: T.let = (c % (BN // 4)) * 4
                for s in T.unroll(SPLIT):
                    T.ptx["mapa.shared::cluster.u32"](remote[0], base + T.Cast("uint32", row * PARTIAL_ROW + col * 4),
                                                      T.uint32(s))
                    T.ptx["ld.shared::cluster.v4.f32"](parts[s * 4], parts[s * 4 + 1], parts[s * 4 + 2],
                                                       parts[s * 4 + 3], remote[0])
                for e in T.unroll(4):
                    sums[e] = T.float32(0)
                for s in T.unroll(SPLIT):
                    for e in T.unroll(4):
                        sums[e] = sums[e] + parts[s * 4 + e]
                for e in T.unroll(2):
                    PACK(words[e], epilogue_f32(sums[2 * e + 1], n0 + col + 2 * e + 1, bias_buf),
                         epilogue_f32(sums[2 * e], n0 + col + 2 * e, bias_buf))
                if PADDED:
                    if m0 + row < REAL_ROWS:
                        T.ptx["st.global.v2.b32"](out_ptr(out, m0 + row, n0 + col), words[0], words[1])
                else:
                    T.ptx["st.global.v2.b32"](out_ptr(out, m0 + row, n0 + col), words[0], words[1])

    @T.macro
    def prefetch_weights(W, bx, wt):
        """``weight_prefetch``: producer thread ``wt`` asks L2 for rows ``wt``, ``wt + 128``, ... of the W slab that
        block ``bx``'s first tile reads (``block_n`` rows of its ``KS`` k steps: one contiguous run each)."""
        tile: T.let = tile_of(bx, 0)
        if tile < NUM_TILES:
            for it in T.unroll(-(-BN // WG)):
                if it * WG + wt < BN:
                    T.ptx["cp.async.bulk.prefetch.L2.global"](
                        T.address_of(W[tile_cols(tile) + it * WG + wt, k_col(bx, 0)]), T.uint32(KS * ROW_BYTES))

    def read_row(row):
        """A row to read an input of the epilogue from: rows past m (a partial last tile) read row m - 1."""
        return T.min(row, m - 1) if RAGGED else row

    def norm_partial_addr(base, slot, row):
        return base + T.Cast("uint32", NORM_OFF + (slot * BLOCK_M + row) * 4)

    def param_addr(base, p, col):
        """Shared address of the block's column ``col`` of parameter ``p`` (0 bias, 1 gamma, 2 beta; float32)."""
        return base + T.Cast("uint32", PARAM_OFF + (p * BN + col) * 4)

    def half_of(word, upper):
        """The 16-bit element of a packed pair (the lower address's in the low half), as float32."""
        bits = T.shift_right(word, T.uint32(16)) if upper else T.bitwise_and(word, T.uint32(0xFFFF))
        return T.Cast("float32", T.reinterpret(DT, T.Cast("uint16", bits)))

    @T.macro
    def stage_params(bias_buf, gamma, beta, base, n0, ct):
        """``norm_rows``: consumer thread ``ct`` (0-255) copies its share of the block's ``block_n`` columns of bias,
        gamma and beta into shared memory as float32, so the epilogue reads each as one 8-byte pair of columns (a
        warp's read: four distinct words, broadcast to the rows) instead of a 2-byte global load per element."""
        for it in T.unroll(-(-BN // (2 * WG))):
            c: T.let = it * 2 * WG + ct
            if c < BN:
                T.ptx["st.shared.f32"](param_addr(base, 0, c), T.Cast("float32", bias_buf[n0 + c]))
                T.ptx["st.shared.f32"](param_addr(base, 1, c), T.Cast("float32", gamma[n0 + c]))
                T.ptx["st.shared.f32"](param_addr(base, 2, c), T.Cast("float32", beta[n0 + c]))

    @T.macro
    def add_bias_residual(acc, res, base, m0, n0, wg, wt, words, pair):
        """``norm_rows``: ``y = acc + bias + residual`` in float32 in the accumulators: the residual two columns per
        4-byte load, all ``block_n / 4`` of the thread's issued before any is used (the loads are volatile asm, kept
        in order: used one by one, each would wait for its own), a partial last tile's rows past m reading row
        m - 1 (never stored); bias from shared memory."""
        for j in T.unroll(BN // 8):
            for h in T.unroll(2):
                T.ptx["ld.global.b32"](words[j * 2 + h], T.address_of(res[read_row(m0 + frag_row(wg, wt, h)),
                                                                          n0 + frag_col(wt, j, 0)]))
        for j in T.unroll(BN // 8):
            T.ptx["ld.shared.v2.f32"](pair[0], pair[1], param_addr(base, 0, frag_col(wt, j, 0)))
            for h in T.unroll(2):
                acc[j * 4 + h * 2] = acc[j * 4 + h * 2] + pair[0] + half_of(words[j * 2 + h], False)
                acc[j * 4 + h * 2 + 1] = acc[j * 4 + h * 2 + 1] + pair[1] + half_of(words[j * 2 + h], True)

    @T.macro
    def write_row_partials(acc, base, slot, stat, part, wg, wt):
        """``norm_rows``: for each of the thread's two rows, this block's partial over its ``block_n`` columns into
        shared memory: slot 0 the sum of y, slot 1 the sum of (y - mean)^2 with the mean in ``stat[h]``. The quad of
        lanes holding a row reduces by shuffles, its first lane stores."""
        for h in T.unroll(2):
            part[0] = T.float32(0)
            for j in T.unroll(BN // 8):
                for e in T.unroll(2):
                    if slot == 0:
                        part[0] = part[0] + acc[j * 4 + h * 2 + e]
                    else:
                        part[0] = part[0] + (acc[j * 4 + h * 2 + e] - stat[h]) * (acc[j * 4 + h * 2 + e] - stat[h])
            for lane_mask in T.unroll(2):
                part[0] = part[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), part[0], lane_mask + 1, 32, 32)
            if wt % 4 == 0:
                T.ptx["st.shared.f32"](norm_partial_addr(base, slot, frag_row(wg, wt, h)), part[0])

    @T.macro
    def gather_rows(base, slot, stat, parts, remote, wg, wt):
        """``norm_rows``, after a cluster barrier: each of the thread's two rows' slot-``slot`` partials of all the
        cluster's blocks (``mapa`` + ``ld.shared::cluster``, all issued before the sum), summed in rank order (the
        same bits in every block) and divided by n, into ``stat[2 * slot + h]``."""
        for h in T.unroll(2):
            for s in T.unroll(CLUSTER):
                T.ptx["mapa.shared::cluster.u32"](remote[0], norm_partial_addr(base, slot, frag_row(wg, wt, h)),
                                                  T.uint32(s))
                T.ptx["ld.shared::cluster.f32"](parts[h * CLUSTER + s], remote[0])
        for h in T.unroll(2):
            stat[2 * slot + h] = T.float32(0)
            for s in T.unroll(CLUSTER):
                stat[2 * slot + h] = stat[2 * slot + h] + parts[h * CLUSTER + s]
            stat[2 * slot + h] = stat[2 * slot + h] * T.float32(1.0 / n)

    @T.macro
    def normalize(acc, base, stat, wt, pair):
        """``norm_rows``: the accumulators become ``(y - mean) * rsqrt(var + eps) * gamma + beta`` (``stat``: the two
        rows' means, then their variances; gamma and beta from shared memory, two columns per read, the reads of
        :data:`NORM_GROUP` n8 tiles issued before their use)."""
        for h in T.unroll(2):
            stat[2 + h] = T.rsqrt(stat[2 + h] + T.float32(norm_eps))
        for jg in T.unroll(BN // 8 // NORM_GROUP):
            for jj in T.unroll(NORM_GROUP):
                T.ptx["ld.shared.v2.f32"](pair[jj * 4], pair[jj * 4 + 1],
                                          param_addr(base, 1, frag_col(wt, jg * NORM_GROUP + jj, 0)))
                T.ptx["ld.shared.v2.f32"](pair[jj * 4 + 2], pair[jj * 4 + 3],
                                          param_addr(base, 2, frag_col(wt, jg * NORM_GROUP + jj, 0)))
            for jj in T.unroll(NORM_GROUP):
                for h in T.unroll(2):
                    for e in T.unroll(2):
                        i: T.let = (jg * NORM_GROUP + jj) * 4 + h * 2 + e
                        acc[i] = (acc[i] - stat[h]) * stat[2 + h] * pair[jj * 4 + e] + pair[jj * 4 + 2 + e]

    @T.macro
    def cluster_sync():
        T.ptx["barrier.cluster.arrive.release"]()
        T.ptx["barrier.cluster.wait.acquire"]()

    @T.macro
    def norm_epilogue(acc, out, bias_buf, norm, base, bx, wg, wt, tx, flag, words):
        """``norm_rows``: a consumer thread's epilogue. The cluster's ``n / block_n`` blocks hold one 128-row tile's
        whole rows. Each adds bias and residual (``norm_sum``: and stores that sum) and writes its row sums; after a
        cluster barrier each reads all the blocks' sums (the mean) and writes its sums of squared deviations (two
        passes: no cancellation as in E[y^2] - mean^2); after another it reads those (the variance), normalises its
        columns and stores them. A last barrier keeps every block's partials alive until all have read them. The
        producer warpgroup meets the same three barriers in its own branch (:func:`norm_barriers`): the accumulators
        are never live where its 40 registers would have to hold them."""
        stat = T.alloc_buffer((4,), "float32", scope="local")
        part = T.alloc_buffer((1,), "float32", scope="local")
        parts = T.alloc_buffer((2 * CLUSTER,), "float32", scope="local")
        res_words = T.alloc_buffer((BN // 4,), "uint32", scope="local")
        pair = T.alloc_buffer((4 * NORM_GROUP,), "float32", scope="local")
        T.ptx["bar.sync"](T.uint32(NORM_BAR), T.uint32(2 * WG))   # both consumers' parameter copies are in place
        add_bias_residual(acc, norm[0], base, tile_rows(bx), tile_cols(bx), wg, wt, res_words, pair)
        if norm_sum:
            store_tile(acc, norm[3], bias_buf, tile_rows(bx) + (wg - 1) * CR, tile_cols(bx), base, wt,
                       tx // 32 - WG // 32, words)
        write_row_partials(acc, base, 0, stat, part, wg, wt)
        cluster_sync()
        gather_rows(base, 0, stat, parts, flag, wg, wt)
        write_row_partials(acc, base, 1, stat, part, wg, wt)
        cluster_sync()
        gather_rows(base, 1, stat, parts, flag, wg, wt)
        normalize(acc, base, stat, wt, pair)
        store_tile(acc, out, bias_buf, tile_rows(bx) + (wg - 1) * CR, tile_cols(bx), base, wt, tx // 32 - WG // 32,
                   words)
        cluster_sync()

    @T.macro
    def norm_barriers():
        """``norm_rows``: the producer warpgroup's part in :func:`norm_epilogue`'s three cluster barriers (each counts
        every thread of the cluster that has not exited)."""
        for _ in T.unroll(3):
            cluster_sync()

    @T.macro
    def block(A, W, bias_buf, out, maps, norm, bx, cr, tx):
        """One thread block's work (``cr``: its rank in the split-K cluster, 0 without split-K)."""
        if config.weight_prefetch:   # W is a weight: ask for it before waiting for the kernel before (docstring)
            if tx < WG:
                prefetch_weights(W, bx, tx)
            if EARLY == 0:
                T.ptx["griddepcontrol.wait"]()
                T.ptx["griddepcontrol.launch_dependents"]()
        wgmma_smem = T.alloc_buffer((SMEM_WORDS,), "uint64", scope="shared.dyn")
        acc = T.alloc_buffer((HALVES * NACC,), "float32", scope="local")
        flag = T.alloc_buffer((1,), "uint32", scope="local")
        words = T.alloc_buffer((4,), "uint32", scope="local")
        raw: T.let = T.cuda.cvta_generic_to_shared(whole_buffer(wgmma_smem, SMEM_WORDS))
        base: T.let = T.bitwise_and(raw + T.uint32(ALIGN - 1), T.uint32(0xFFFFFFFF - (ALIGN - 1)))
        wg: T.let = tx // WG
        wt: T.let = tx % WG
        if tx == 0:
            for s in T.unroll(ST):
                T.ptx["mbarrier.init.shared::cta.b64"](full_bar(base, s), T.uint32(FULL_ARRIVALS))
                T.ptx["mbarrier.init.shared::cta.b64"](empty_bar(base, s), T.uint32(EMPTY_ARRIVALS))
            T.ptx["fence.mbarrier_init.release.cluster"]()
        T.tvm_storage_sync("shared")
        # g = r * KT + t counts k steps over all of this block's tiles: slot g % ST, phase g // ST
        if wg == 0:
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](PRODUCER_REGS)
            if TMA:
                if wt == 0:          # one thread issues every copy
                    produce_tma(maps, base, flag, bx)
            else:
                produce_cp_async(A, W, base, flag, bx, wt)
            if NORM:
                norm_barriers()
        else:
            T.ptx["setmaxnreg.inc.sync.aligned.u32"](CONSUMER_REGS)
            if EARLY > 0:   # the producer waits once its early W loads are out; the consumers before any store
                T.ptx["griddepcontrol.wait"]()
                T.ptx["griddepcontrol.launch_dependents"]()
            if PINGPONG:
                # consumer c = wg - 1 owns rounds c, c + 2, ...; main loops take turns (module docstring)
                for r in range(ROUNDS):
                    tile: T.let = bx + r * GRID
                    if r % 2 == wg - 1 and tile < NUM_TILES:
                        for i in T.unroll(HALVES * NACC):
                            acc[i] = T.float32(0)
                        if r > 0:  # the other consumer has issued round r - 1
                            T.ptx["bar.sync"](T.Cast("uint32", ORDER_BAR - 1 + wg), T.uint32(2 * WG))
                        mma_tile(acc, flag, base, r, 0, wt)
                        if tile + GRID < NUM_TILES:  # round r + 1 exists: the other consumer may start it
                            T.ptx["bar.arrive"](T.Cast("uint32", ORDER_BAR + 2 - wg), T.uint32(2 * WG))
                        drain_and_store(acc, out, bias_buf, base, r, tile_rows(tile),
                                        tile_cols(tile), wt, tx // 32 - WG // 32, words)
            elif SPLIT > 1 or NORM:
                for i in T.unroll(HALVES * NACC):
                    acc[i] = T.float32(0)
                if NORM:
                    stage_params(bias_buf, norm[1], norm[2], base, tile_cols(bx), tx - WG)
                mma_tile(acc, flag, base, 0, (wg - 1) * CR * ROW_BYTES, wt)
                T.ptx["wgmma.wait_group.sync.aligned"](0)
                for i in T.unroll(HALVES * NACC):
                    FENCE_REG(acc[i], acc[i], T.float32(-0.0))
                if SPLIT > 1:
                    T.ptx["bar.sync"](T.uint32(SPLIT_BAR), T.uint32(2 * WG))   # both consumers are off the ring
                    write_partial(acc, base, wg, wt)
                else:
                    norm_epilogue(acc, out, bias_buf, norm, base, bx, wg, wt, tx, flag, words)
            else:
                for r in range(ROUNDS):
                    tile: T.let = bx + r * GRID
                    if tile < NUM_TILES:
                        for i in T.unroll(HALVES * NACC):
                            acc[i] = T.float32(0)
                        mma_tile(acc, flag, base, r, (wg - 1) * CR * ROW_BYTES, wt)
                        drain_and_store(acc, out, bias_buf, base, r, tile_rows(tile) + (wg - 1) * CR,
                                        tile_cols(tile), wt, tx // 32 - WG // 32, words)
        if SPLIT > 1:
            # every block's partial tile written before any is read; none leaves while others read it
            cluster_sync()
            if wg > 0:
                parts = T.alloc_buffer((SPLIT * 4,), "float32", scope="local")
                reduce_and_store(out, bias_buf, base, bx, cr, tx - WG, acc, parts, flag, words)
            cluster_sync()

    @T.macro
    def body(A, W, bias_buf, out, maps, norm):
        for bx in T.thread_binding(GRID, thread="blockIdx.x"):
            if CLUSTER > 1:
                for cr in T.thread_binding(CLUSTER, thread="clusterCtaIdx.x"):
                    for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                        block(A, W, bias_buf, out, maps, norm, bx, cr, tx)
            else:
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    block(A, W, bias_buf, out, maps, norm, bx, 0, tx)

    @T.macro
    def launch(A, W, bias_buf, out, norm):
        """The kernel, after (TMA) the host-side encoding of A's and W's maps from their device pointers, at every
        call: the maps travel as ``__grid_constant__`` kernel parameters."""
        if TMA:
            a_map: T.let = T.tvm_stack_alloca("tensormap", 1)
            w_map: T.let = T.tvm_stack_alloca("tensormap", 1)
            T.evaluate(encode_tensor_map(a_map, T.address_of(A[0, 0]), A_MAP))
            T.evaluate(encode_tensor_map(w_map, T.address_of(W[0, 0]), W_MAP))
            body(A, W, bias_buf, out, (a_map, w_map), norm)
        else:
            body(A, W, bias_buf, out, (None, None), norm)

    @T.macro
    def launch_norm(a_h, w_h, bias_h, res_h, gamma_h, beta_h, sum_h, out_h):
        """``norm_rows``: the kernel's buffers (``sum_h`` None without ``norm_sum``), then :func:`launch`."""
        A = T.match_buffer(a_h, (m, k), DT)
        W = T.match_buffer(w_h, (n, k), DT)
        bias_buf = T.match_buffer(bias_h, (n,), DT)
        res = T.match_buffer(res_h, (m, n), DT)
        gamma = T.match_buffer(gamma_h, (n,), DT)
        beta = T.match_buffer(beta_h, (n,), DT)
        out = T.match_buffer(out_h, OUT_SHAPE, DT)
        if norm_sum:
            sum_out = T.match_buffer(sum_h, OUT_SHAPE, DT)
            launch(A, W, bias_buf, out, (res, gamma, beta, sum_out))
        else:
            launch(A, W, bias_buf, out, (res, gamma, beta))

    if norm_sum:
        @T.prim_func
        def kernel(a_h: T.handle, w_h: T.handle, bias_h: T.handle, res_h: T.handle, gamma_h: T.handle,
                   beta_h: T.handle, sum_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "global_symbol": "gemm_wgmma"})
            launch_norm(a_h, w_h, bias_h, res_h, gamma_h, beta_h, sum_h, out_h)
    elif NORM:
        @T.prim_func
        def kernel(a_h: T.handle, w_h: T.handle, bias_h: T.handle, res_h: T.handle, gamma_h: T.handle,
                   beta_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "global_symbol": "gemm_wgmma"})
            launch_norm(a_h, w_h, bias_h, res_h, gamma_h, beta_h, None, out_h)
    elif bias:
        @T.prim_func
        def kernel(a_h: T.handle, w_h: T.handle, bias_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "global_symbol": "gemm_wgmma"})
            A = T.match_buffer(a_h, (m, k), DT)
            W = T.match_buffer(w_h, (n, k), DT)
            bias_buf = T.match_buffer(bias_h, (n,), DT)
            out = T.match_buffer(out_h, OUT_SHAPE, DT)
            launch(A, W, bias_buf, out, None)
    else:
        @T.prim_func
        def kernel(a_h: T.handle, w_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "global_symbol": "gemm_wgmma"})
            A = T.match_buffer(a_h, (m, k), DT)
            W = T.match_buffer(w_h, (n, k), DT)
            out = T.match_buffer(out_h, OUT_SHAPE, DT)
            launch(A, W, None, out, None)
    return kernel
