"""The template part of the analytical model: price every knob set of a fusion template, rank, prune.

A template (:mod:`stof_tvm.schedules.templates`) reports, per knob set, its thread-block resources
(``resources()``: threads, shared memory, accumulator and operand registers, grid, and for tiled main loops the
block tile ``block_m x block_n x block_k``), its useful flops and its arguments. From those:

- tensor-core flops per block = ``flops / grid`` (at the templates' own efficiency ``gemm_tc_eff``); where a template
  reports ``tiles`` (persistent blocks looping over tiles), the busiest block's whole tiles, ``ceil(tiles / grid)``
  of them; main-loop trips = those flops over one ``2*BM*BN*BK`` step, each with a fixed latency (shorter with
  deeper pipelines);
- shared-memory traffic per block: per trip, the ``cp.async`` fill of both panels ``(BM + BN) * BK`` and the
  warps' ``ldmatrix`` reads ``(BM * warps_n + BN * warps_m) * BK`` (small warp tiles re-read more), priced as
  CUDA-core issue slots (``smem_ops_per_byte``), plus epilogue operations per output element (where a template
  reports ``overlapped_epilogue``, e.g. the ping-pong wgmma kernel, only one tile's epilogue per block counts: the
  others run while the other consumer warpgroup's MMAs do);
- the wgmma kernels (resources ``wgmma``, ``narrow_stores``, ``launch_registers``): main loops at ``wgmma_tc_eff``
  (their tensor-core flops are scaled by ``gemm_tc_eff / wgmma_tc_eff``), ``narrow_store_ops`` more per output
  element where the epilogue stores one 2-byte element per instruction (not ``staged``; never overlapped), the
  registers per thread at launch (``setmaxnreg`` moves them to the consumers later), and ``activation_ops`` more
  per output element where the epilogue's activation costs more than the calibrated one (CUDA's ``erff`` GELU
  against the exp2-polynomial ``fast_gelu``; overlapped like the rest of the epilogue);
- L2 traffic = every block's A and W panels (``(BM + BN) * K``) plus its outputs; DRAM = the arguments once;
- registers = accumulators + operands + addressing; configurations past the register, shared-memory or thread
  limits are infeasible (the template's own space already drops most).

:func:`rank_template` sorts a template's knob space by predicted time; the stage-1 survivors are its head.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Mapping

import numpy as np

from ..hardware import H200, HardwareProfile
from .core import DEFAULT_CALIBRATION, Calibration, KernelWork, Prediction, predict, predict_uniform

__all__ = ["template_hardware", "template_calibration", "template_work", "price_knobs", "rank_template", "RankedKnobs"]

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_ADDRESSING_REGISTERS = 40


@dataclass(frozen=True)
class RankedKnobs:
    candidate: dict
    prediction: Prediction

    @property
    def time_s(self) -> float:
        return self.prediction.time_s


def template_hardware(hw: HardwareProfile):
    """The templates' own limits record (:class:`stof_tvm.schedules.templates.Hardware`) for ``hw``."""
    from ..schedules.templates import Hardware

    return Hardware(name=hw.name, sm_count=hw.sm_count, max_threads_per_block=hw.threads_per_block,
                    max_shared_bytes_per_block=hw.smem_per_block, registers_per_sm=hw.regs_per_sm,
                    max_registers_per_thread=hw.regs_per_thread)


def template_calibration(cal: Calibration) -> Calibration:
    """``cal`` as the templates' kernels are priced: the tensor-core efficiency of their main loops
    (``gemm_tc_eff``) in place of attention's ``tc_eff``; every other constant as it is."""
    return cal.replace(tc_eff=cal.gemm_tc_eff)


def _pipeline_factor(stages: np.ndarray) -> np.ndarray:
    """Main-loop latency factor per pipeline depth: 1 below 3 stages (0: no pipeline), 0.5*(1 + 1/(stages-1))."""
    return np.where(stages < 3, 1.0, 0.5 * (1.0 + 1.0 / np.maximum(stages - 1, 1)))


def _invariants(template, shape, dtype) -> tuple[float, float, float, float]:
    """(useful flops, DRAM bytes of all arguments, output bytes, output elements) of one template call."""
    args = template.arguments(shape, dtype)
    n_out = template.outputs()
    sizes = [float(np.prod(s)) for _, s, _ in args]
    nbytes = [n * _DTYPE_BYTES.get(dt, 2) for n, (_, _, dt) in zip(sizes, args)]
    return float(template.flops(shape)), sum(nbytes), sum(nbytes[-n_out:]), sum(sizes[-n_out:])


def _launch_columns(template, shape, dtype: str, space, invariants, cal: Calibration) -> list[np.ndarray]:
    """(threads, smem, registers, grid, tc flops/block, CUDA ops/block, latency cycles/block, DRAM, L2) of every
    knob set in ``space``, one float64 column each.

    Computed from :meth:`Template.resource_columns` as array arithmetic: stage 1 prices every knob set of every
    GEMM of a model (about a thousand each), where a Python call per knob set dominated the model's time."""
    from ..schedules.templates import Template

    flops, dram, out_bytes, out_elems = invariants
    # a duck-typed template with only resources() gets the Template base's one-call-per-knob-set columns
    columns = getattr(template, "resource_columns", None) or partial(Template.resource_columns, template)
    res = columns(shape, dtype, space)
    stages = np.array([knobs.get("stages") or 0 for knobs in space])
    warps_m = np.array([knobs.get("warps_m", 1) for knobs in space], dtype=np.float64)
    warps_n = np.array([knobs.get("warps_n", 1) for knobs in space], dtype=np.float64)
    grid = np.maximum(res["grid"], 1)
    eb = _DTYPE_BYTES.get(dtype, 2)
    # units of work: one per block, or the tiles that persistent blocks loop over (the busiest block: whole tiles)
    units = np.maximum(res["tiles"], 1) if "tiles" in res else grid
    per_unit = flops / units
    rounds = np.ceil(units / grid)
    per_block = per_unit * rounds
    if "block_m" in res:  # a tiled main loop: count its k steps and the panels every tile reads through L2
        bm, bn, bk = res["block_m"], res["block_n"], res["block_k"]
        trips = per_block / (2.0 * bm * bn * bk)
        l2 = units * (per_unit / (2.0 * bm * bn * bk)) * (bm + bn) * bk * eb + out_bytes
        smem = trips * bk * eb * ((bm + bn) + bm * warps_n + bn * warps_m)
    else:
        trips, l2, smem = 0.0, dram, 0.0
    regs = res.get("acc_registers", 0) + res.get("operand_registers", 0) + _ADDRESSING_REGISTERS
    if "launch_registers" in res:  # a kernel that redistributes registers between warps (setmaxnreg)
        regs = res["launch_registers"]
    latency = trips * cal.gemm_iter_cycles * _pipeline_factor(stages) + cal.gemm_block_cycles
    block_elems = out_elems / units * rounds
    epilogue_elems = block_elems
    if "overlapped_epilogue" in res:  # hidden behind tensor-core work except the block's last tile
        epilogue_elems = np.where(res["overlapped_epilogue"], out_elems / np.maximum(res["tiles"], 1), block_elems)
    # operations per output element: the calibrated epilogue, plus where reported an activation's extra cost
    epilogue = (cal.epilogue_ops + res.get("activation_ops", 0.0)) * epilogue_elems
    if "narrow_stores" in res:  # one 2-byte store per element: not hidden by the ping-pong overlap
        epilogue = epilogue + np.where(res["narrow_stores"], cal.narrow_store_ops * block_elems, 0.0)
    if "wgmma" in res:  # priced at wgmma's main-loop efficiency instead of gemm_tc_eff (mma.sync-equivalent flops)
        per_block = np.where(res["wgmma"], per_block * (cal.gemm_tc_eff / cal.wgmma_tc_eff), per_block)
    cuda_ops = epilogue + cal.smem_ops_per_byte * smem
    terms = (res["threads"], res["shared_bytes"], regs, grid, per_block, cuda_ops, latency, dram, l2)
    return [np.broadcast_to(np.asarray(term, dtype=np.float64), grid.shape) for term in terms]


def template_work(template, shape: Mapping[str, int], dtype: str, knobs: Mapping,
                  cal: Calibration = DEFAULT_CALIBRATION) -> KernelWork:
    """The :class:`KernelWork` of ``template`` at ``shape``/``dtype`` with ``knobs`` (price it with
    :func:`predict` under :func:`template_calibration` of the same ``cal``)."""
    invariants = _invariants(template, shape, dtype)
    threads, smem, regs, grid, tc, cuda, latency, dram, l2 = (
        float(column[0]) for column in _launch_columns(template, shape, dtype, [knobs], invariants, cal))
    return KernelWork(
        name=f"{template.name} " + " ".join(f"{k}={v}" for k, v in knobs.items()), threads=int(threads),
        smem_bytes=int(smem), regs_per_thread=int(regs), count=np.array([grid]), tc_flops=np.array([tc]),
        cuda_ops=np.array([cuda]), latency_cycles=np.array([latency]), dram_bytes=dram, l2_bytes=l2,
        useful_flops=invariants[0])


def price_knobs(template, shape: Mapping[str, int], dtype: str, space, hw: HardwareProfile = H200,
                cal: Calibration = DEFAULT_CALIBRATION) -> np.ndarray:
    """Predicted seconds of every knob set in ``space`` (non-empty), in its order; ``inf`` where infeasible."""
    space = list(space)
    if not space:
        raise ValueError("space must hold at least one knob set")
    invariants = _invariants(template, shape, dtype)
    return predict_uniform(*_launch_columns(template, shape, dtype, space, invariants, cal), hw=hw,
                           cal=template_calibration(cal))


def rank_template(template, shape: Mapping[str, int], dtype: str = "float16", hw: HardwareProfile = H200,
                  cal: Calibration = DEFAULT_CALIBRATION, knob_space=None, explain_top: int = 8) -> list[RankedKnobs]:
    """Every feasible knob set of ``template`` (default: its whole knob space for ``hw``), fastest first.

    The whole space is priced at once (:func:`predict_uniform`); the ``explain_top`` best also get the full
    :class:`Prediction` with its terms, the others a time-only one.
    """
    space = template.knob_space(shape, dtype, template_hardware(hw)) if knob_space is None else list(knob_space)
    if not space:
        return []
    priced = template_calibration(cal)
    times = price_knobs(template, shape, dtype, space, hw, cal)
    order = np.argsort(times, kind="stable")
    order = order[np.isfinite(times[order])].tolist()
    seconds = times.tolist()  # Python floats: indexing numpy scalars a thousand times costs milliseconds
    ranked = []
    for rank, i in enumerate(order):
        if rank < explain_top:
            prediction = predict(template_work(template, shape, dtype, space[i], cal), hw, priced)
        else:
            prediction = Prediction(f"{template.name} {space[i]}", seconds[i], True)
        ranked.append(RankedKnobs(dict(space[i]), prediction))
    return ranked
