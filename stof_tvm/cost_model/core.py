"""The kernel-level analytical model: occupancy, waves and the three limits (SMs, L2, DRAM).

Every kernel we generate is described the same way, by a :class:`KernelWork`: its launch (threads, shared
memory and registers per thread block) and the work of its thread blocks, grouped into *classes* of identical
blocks (a dense GEMM has one class; block-wise attention has one per mask group and tile row, since tile rows
visit different numbers of tiles). :func:`predict` turns that into a time:

- **occupancy**: resident blocks per SM from the shared-memory, register, thread and block limits; a
  configuration that exceeds a per-block limit (or spills registers) is *infeasible* and gets no time;
- **SM time**: each block's duration from its tensor-core flops, CUDA-core operations and fixed latencies
  (per loop iteration and per block), with the SM's issue rate scaled by how many warps are resident (latency
  hiding); blocks are spread over ``SMs x occupancy`` slots in waves, with the partly idle last wave counted,
  and, when the launch order is known, the blocks launched last (a long one among them ends the kernel late);
- **L2 and DRAM time**: bytes moved over calibrated bandwidths;
- ``time = launch + max(SM, L2, DRAM)``.

The few constants (efficiencies, fixed latencies, the wave tail) live in :class:`Calibration`; the attention
ones were fitted on the H200 by ``scripts/calibrate_model.py``. Everything is numpy over block classes, so a prediction
costs microseconds.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import numpy as np

from ..hardware import HardwareProfile

__all__ = ["Calibration", "DEFAULT_CALIBRATION", "KernelWork", "Prediction", "occupancy", "predict"]

# Hopper and Ampere reserve 1 KiB of shared memory per resident block; registers are allocated per warp in
# units of 256 (8 per thread).
_SMEM_RESERVED_PER_BLOCK = 1024
_REG_UNIT_PER_WARP = 256


@dataclass(frozen=True)
class Calibration:
    """Fitted constants of the model (dimensionless shares, cycles, seconds).

    Generic: ``tc_eff``/``cc_eff`` achieved share of the tensor-core / CUDA-core peak at full issue rate;
    ``warps_to_saturate`` resident warps per SM at which the issue rate saturates; ``dram_eff``/``l2_eff``
    achieved share of the bandwidths; ``launch_s`` per-kernel launch cost; ``tail`` how much of the last
    wave's idle slots are really lost (1 for identical blocks).
    Block-wise attention: ``softmax_ops`` CUDA-core operations per score element, ``mask_ops`` extra per element
    of a partial tile, ``tile_cycles`` fixed latency per visited tile, divided by ``1 + stage_gain * (stages -
    2)`` for deeper ``cp.async`` rings, ``block_cycles`` per thread block.
    Row-wise attention: ``pair_ops_per_dim`` operations per kept pair and head-dim element, ``pair_ops_fixed``
    per kept pair and lane, ``step_cycles`` latency per loop step (dependent index -> K -> V loads), ``row_cycles``
    per thread block.
    Fusion templates (:mod:`.templates`; their own constants, so that fitting them leaves the attention model
    as it is): ``gemm_tc_eff`` achieved share of the tensor-core peak in their main loops (``tc_eff`` of
    attention), ``gemm_iter_cycles`` fixed latency per K-loop iteration, ``gemm_block_cycles`` per thread block,
    ``smem_ops_per_byte`` issue cost of one byte moved through shared memory (``cp.async`` fills and ``ldmatrix``
    reads of the main loop) in CUDA-core operations, ``epilogue_ops`` per output element.
    The Hopper wgmma templates (:mod:`stof_tvm.schedules.templates.gemm_wgmma`): ``wgmma_tc_eff`` their main loops'
    rate as a share of ``tensor_flops`` (the ``mma.sync`` peak, so above 1: wgmma issues faster), ``narrow_store_ops``
    the extra cost, in CUDA-core operations, of an output element stored with one 2-byte store (the direct epilogue;
    the ``staged`` one stores 16 bytes per lane, coalesced). Both fitted by least squares on log(predicted /
    measured) to the 77 timings of ``scripts/bench_wgmma_small_k.py`` on the H200 (2026-11-30, session 4; 4 BERT-Base
    GEMMs at 32768 tokens x 18-21 knob sets, direct and staged: ``out/results/wgmma_small_k_s4.json``), the other
    constants as they are: rms log error 0.16 (0.32 before); the best predicted knob set is the measured best at the
    attention-output GEMM, the FFN down-projection and the QKV projection, and 4.9% behind it at the erf-GELU GEMM;
    the first 24 of each shape's 86-90 ranked knob sets are staged ones. What the store cost stands for: the direct
    epilogue measured 0.067-0.084 ms slower than the staged one per 25.2 M outputs (n = 768), 0.16-0.20 ms per
    75.5-100.7 M (n = 2304, 3072; 128-row persistent cooperative tiles of each width), about 200 CUDA-core
    operations (0.8 SM cycles) per element.
    The Hopper wgmma attention kernel (:mod:`stof_tvm.schedules.attention_wgmma`, priced by
    :mod:`.attention`): ``wgmma_attn_tc_eff`` its products' rate as a share of ``tensor_flops``,
    ``wgmma_softmax_ops`` CUDA-core operations per score element left exposed by the overlap with two consumer
    warpgroups (divided by ``consumers - 1``: each consumer's softmax runs under the others' products),
    ``wgmma_tile_cycles`` fixed latency per tile, divided by ``1 + wgmma_stage_gain * (stages - 2)``,
    ``wgmma_item_cycles`` per work item, ``wgmma_mask_ops`` the extra CUDA-core operations per element of a partial
    tile (the per-register bitmap shift, test and select). Fitted (``scripts/calibrate_model.py fit-wgmma``) to the
    18 distinct timings of the kernel on the H200 in session 9 (2026-12-01, ``bench_attention.py`` plan ``s8wgmma``:
    causal, dense, document, sliding, Longformer and BigBird masks at B16 H12 S4096 D64 (2 and 3 consumers) and
    B4 H16 S8192 D128): rms log error 0.036; the stage gain fits to 0, so the default ring wins ties.
    ``wgmma_tma_tile_cycles`` replaces ``wgmma_tile_cycles`` where the producer loads with TMA (one thread issues
    the copies, no proxy fence in the consumers), fitted alone (``fit-wgmma --constants wgmma_tma_tile_cycles
    --loads tma --persistent no``) to the 10 one-block-per-item TMA timings of session 9's ``s8tma`` and ``s9attn``
    runs (D64 3 consumers 2-4 stages, D128 64- and 128-key tiles; causal and dense): rms log error 0.048 -> 0.036.
    ``wgmma_persistent_item_cycles`` replaces ``wgmma_item_cycles`` in a persistent grid (its blocks walk the work
    items statically, priced block by block: the next item's Q and first tiles load under this one's last
    products), fitted alone to the 8 persistent D128 timings of those runs (cp.async and TMA, 64- and 128-key
    tiles, causal and dense): 6207 cycles, rms log error 0.058 -> 0.056; it does not capture that the persistent
    grid gains on causal masks only (D128 128-key TMA: causal 1.806 vs 1.964 ms, dense 3.718 vs 3.636, means of
    the two runs), so the default, first among the candidates, wins the near-ties.
    """

    # Fitted on the H200 (scripts/calibrate_model.py: 774 timings of 78 attention problems, 2026-11-30); the
    # fusion-template constants (gemm_*, smem_ops_per_byte, epilogue_ops) by scripts/calibrate_templates.py.
    tc_eff: float = 0.742
    cc_eff: float = 0.999
    warps_to_saturate: float = 1.0
    dram_eff: float = 0.553
    l2_eff: float = 0.590
    launch_s: float = 5.91e-6
    tail: float = 1.0
    softmax_ops: float = 10.82
    mask_ops: float = 6.12
    tile_cycles: float = 409.0
    stage_gain: float = 0.005
    block_cycles: float = 4068.0
    pair_ops_per_dim: float = 0.629
    pair_ops_fixed: float = 14.0
    step_cycles: float = 1026.0
    row_cycles: float = 1205.0
    gemm_tc_eff: float = 0.742
    gemm_iter_cycles: float = 200.0
    gemm_block_cycles: float = 4068.0
    smem_ops_per_byte: float = 0.0
    epilogue_ops: float = 4.0
    wgmma_tc_eff: float = 1.11
    narrow_store_ops: float = 191.0
    wgmma_attn_tc_eff: float = 1.2124
    wgmma_softmax_ops: float = 5.2013
    wgmma_mask_ops: float = 10.3687
    wgmma_tile_cycles: float = 603.902
    wgmma_item_cycles: float = 6748.96
    wgmma_stage_gain: float = 0.0
    wgmma_tma_tile_cycles: float = 421.6
    wgmma_persistent_item_cycles: float = 6206.7

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Calibration.{f.name} must be a finite number >= 0, got {value!r}")

    def replace(self, **changes) -> "Calibration":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def load(cls, path: str) -> "Calibration":
        """Read constants written by ``scripts/calibrate_model.py`` (a JSON object; unknown keys rejected)."""
        with open(path) as handle:
            data = json.load(handle)
        data = data.get("constants", data)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"calibration file {path}: unknown constants {unknown}")
        return cls(**data)


DEFAULT_CALIBRATION = Calibration()


@dataclass(frozen=True)
class KernelWork:
    """What one kernel launch does, in units the model prices.

    Per block class (1-D arrays of equal length): ``count`` blocks, each with ``tc_flops`` tensor-core flops,
    ``cuda_ops`` CUDA-core operations and ``latency_cycles`` of fixed latency (loop trips x cycles per trip
    plus per-block cost). Whole-kernel: ``dram_bytes`` (unique bytes to and from device memory) and
    ``l2_bytes`` (bytes the SMs read and write through L2, re-reads included). ``order`` (optional): the
    class of every block in launch order, when the kernel's launch order is known; then blocks launched last
    (a long block among them finishes late) are priced too.
    """

    name: str
    threads: int
    smem_bytes: int
    regs_per_thread: int
    count: np.ndarray
    tc_flops: np.ndarray
    cuda_ops: np.ndarray
    latency_cycles: np.ndarray
    dram_bytes: float
    l2_bytes: float
    useful_flops: float = 0.0
    order: np.ndarray | None = None

    def __post_init__(self):
        arrays = [np.atleast_1d(np.asarray(getattr(self, n), dtype=np.float64))
                  for n in ("count", "tc_flops", "cuda_ops", "latency_cycles")]
        if len({a.shape for a in arrays}) != 1:
            raise ValueError(f"KernelWork {self.name}: per-class arrays must have one shape, got "
                             f"{[a.shape for a in arrays]}")
        for name, array in zip(("count", "tc_flops", "cuda_ops", "latency_cycles"), arrays):
            object.__setattr__(self, name, array)
        if self.order is not None:
            order = np.asarray(self.order, dtype=np.int64)
            if order.size != int(arrays[0].sum()) or (order.size and not 0 <= order.min() <= order.max() <
                                                        arrays[0].size):
                raise ValueError(f"KernelWork {self.name}: order must list each block's class once "
                                 f"({int(arrays[0].sum())} blocks)")
            object.__setattr__(self, "order", order)

    @property
    def blocks(self) -> int:
        return int(self.count.sum())


@dataclass(frozen=True)
class Prediction:
    """A predicted time (seconds) with the terms that produced it; ``feasible`` False means ``time_s`` is inf
    and ``reason`` says which limit the configuration breaks."""

    name: str
    time_s: float
    feasible: bool
    reason: str = ""
    terms: dict = field(default_factory=dict)

    @property
    def bound(self) -> str:
        """The dominating term: ``sm``, ``l2`` or ``dram``."""
        if not self.feasible:
            return "infeasible"
        return max(("sm", "l2", "dram"), key=lambda k: self.terms.get(f"{k}_s", 0.0))


def occupancy(threads: int, smem_bytes: int, regs_per_thread: int, hw: HardwareProfile) -> tuple[int, str]:
    """Resident thread blocks per SM and the limit that sets it; (0, reason) if the block cannot run at all."""
    if threads < 1 or threads > hw.threads_per_block:
        return 0, f"{threads} threads per block (limit {hw.threads_per_block})"
    if smem_bytes > hw.smem_per_block:
        return 0, f"{smem_bytes} B shared memory per block (limit {hw.smem_per_block})"
    if regs_per_thread > hw.regs_per_thread:
        return 0, f"{regs_per_thread} registers per thread (limit {hw.regs_per_thread}: spills)"
    warps = -(-threads // hw.warp_size)
    regs_per_warp = -(-regs_per_thread * hw.warp_size // _REG_UNIT_PER_WARP) * _REG_UNIT_PER_WARP
    limits = {
        "blocks": hw.blocks_per_sm,
        "threads": hw.threads_per_sm // (warps * hw.warp_size),
        "registers": hw.regs_per_sm // (regs_per_warp * warps) if regs_per_thread else hw.blocks_per_sm,
        "shared memory": hw.smem_per_sm // (smem_bytes + _SMEM_RESERVED_PER_BLOCK),
    }
    which = min(limits, key=limits.get)
    if limits[which] < 1:
        return 0, f"no block fits on an SM ({which})"
    return limits[which], which


def predict(work: KernelWork, hw: HardwareProfile, cal: Calibration = DEFAULT_CALIBRATION) -> Prediction:
    """Predicted time of one launch of ``work`` on ``hw`` (see the module docstring for the model)."""
    occ, limit = occupancy(work.threads, work.smem_bytes, work.regs_per_thread, hw)
    if occ == 0:
        return Prediction(work.name, math.inf, False, limit, {})
    blocks = work.blocks
    if blocks == 0:
        return Prediction(work.name, cal.launch_s, True, "", {"launch_s": cal.launch_s, "sm_s": 0.0,
                                                              "l2_s": 0.0, "dram_s": 0.0})
    warps = -(-work.threads // hw.warp_size)
    resident = min(occ, -(-blocks // hw.sm_count))                 # blocks really co-resident on an SM
    issue = min(1.0, resident * warps / cal.warps_to_saturate)     # latency hiding by resident warps
    tc_rate = hw.per_sm(hw.tensor_flops) * cal.tc_eff * issue
    cc_rate = hw.per_sm(hw.cuda_flops) * cal.cc_eff * issue
    throughput_s = work.tc_flops / tc_rate + work.cuda_ops / cc_rate   # SM-seconds of one block
    latency_s = work.latency_cycles / hw.clock_hz
    duration = resident * throughput_s + latency_s                     # a block sharing its SM with others
    slots = hw.sm_count * resident
    waves = blocks / slots
    total = float((work.count * duration).sum())
    mean = total / blocks
    sm_s = max(total / slots + cal.tail * (math.ceil(waves) - waves) * mean, float(duration[work.count > 0].max()))
    if work.order is not None and blocks > slots:
        # The last wave's blocks start once the others are done (fluidly shared by all slots): a long block
        # launched late ends the kernel after everything else.
        last = duration[work.order[-slots:]]
        sm_s = max(sm_s, (total - float(last.sum())) / slots + float(last.max()))
    l2_s = work.l2_bytes / (hw.l2_bw * cal.l2_eff)
    dram_s = work.dram_bytes / (hw.dram_bw * cal.dram_eff)
    time_s = cal.launch_s + max(sm_s, l2_s, dram_s)
    terms = {
        "launch_s": cal.launch_s, "sm_s": sm_s, "l2_s": l2_s, "dram_s": dram_s,
        "tensor_s": float((work.count * work.tc_flops).sum()) / (tc_rate * slots / resident),
        "cuda_core_s": float((work.count * work.cuda_ops).sum()) / (cc_rate * slots / resident),
        "latency_s": float((work.count * latency_s).sum()) / slots,
        "blocks": blocks, "occupancy": occ, "occupancy_limit": limit, "resident": resident, "waves": waves,
        "issue_rate": issue, "threads": work.threads, "smem_bytes": work.smem_bytes,
        "regs_per_thread": work.regs_per_thread, "dram_bytes": work.dram_bytes, "l2_bytes": work.l2_bytes,
    }
    if work.useful_flops:
        terms["useful_tflops"] = work.useful_flops / time_s / 1e12
    return Prediction(work.name, time_s, True, "", terms)


def occupancy_many(threads, smem_bytes, regs_per_thread, hw: HardwareProfile) -> np.ndarray:
    """:func:`occupancy` over arrays of launches (resident blocks per SM; 0 where a limit is broken)."""
    threads, smem, regs = (np.asarray(a, dtype=np.int64) for a in (threads, smem_bytes, regs_per_thread))
    warps = -(-threads // hw.warp_size)
    regs_per_warp = -(-regs * hw.warp_size // _REG_UNIT_PER_WARP) * _REG_UNIT_PER_WARP
    occ = np.minimum.reduce([
        np.full(threads.shape, hw.blocks_per_sm),
        hw.threads_per_sm // np.maximum(warps * hw.warp_size, 1),
        np.where(regs > 0, hw.regs_per_sm // np.maximum(regs_per_warp * warps, 1), hw.blocks_per_sm),
        hw.smem_per_sm // (smem + _SMEM_RESERVED_PER_BLOCK),
    ])
    ok = (threads >= 1) & (threads <= hw.threads_per_block) & (smem <= hw.smem_per_block) & (
        regs <= hw.regs_per_thread)
    return np.where(ok, np.maximum(occ, 0), 0)


def predict_uniform(threads, smem_bytes, regs_per_thread, blocks, tc_flops, cuda_ops, latency_cycles, dram_bytes,
                    l2_bytes, hw: HardwareProfile, cal: Calibration = DEFAULT_CALIBRATION) -> np.ndarray:
    """:func:`predict`'s time for many kernels whose blocks are all alike (one class each), vectorised.

    Every argument is an array over the kernels (per-block ``tc_flops``/``cuda_ops``/``latency_cycles``).
    Infeasible kernels get ``inf``. Used to rank large knob spaces; equal to :func:`predict` term by term.
    """
    blocks = np.asarray(blocks, dtype=np.float64)
    occ = occupancy_many(threads, smem_bytes, regs_per_thread, hw).astype(np.float64)
    warps = -(-np.asarray(threads, dtype=np.int64) // hw.warp_size)
    resident = np.maximum(np.minimum(occ, np.ceil(blocks / hw.sm_count)), 1.0)
    issue = np.minimum(1.0, resident * warps / cal.warps_to_saturate)
    tc_rate = hw.per_sm(hw.tensor_flops) * cal.tc_eff * issue
    cc_rate = hw.per_sm(hw.cuda_flops) * cal.cc_eff * issue
    duration = resident * (np.asarray(tc_flops) / tc_rate + np.asarray(cuda_ops) / cc_rate) + np.asarray(
        latency_cycles) / hw.clock_hz
    slots = hw.sm_count * resident
    waves = blocks / slots
    sm_s = np.maximum(blocks * duration / slots + cal.tail * (np.ceil(waves) - waves) * duration, duration)
    sm_s = np.where(blocks > 0, sm_s, 0.0)
    l2_s = np.asarray(l2_bytes) / (hw.l2_bw * cal.l2_eff)
    dram_s = np.asarray(dram_bytes) / (hw.dram_bw * cal.dram_eff)
    time_s = cal.launch_s + np.maximum.reduce([sm_s, l2_s, dram_s])
    return np.where(occ > 0, time_s, np.inf)
