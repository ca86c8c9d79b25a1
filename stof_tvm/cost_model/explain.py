"""Human-readable reports of the model's predictions (``stof-tvm tune --explain``)."""
from __future__ import annotations

from .core import Prediction

__all__ = ["explain_prediction", "explain_ranking"]


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:9.2f} us"


def explain_prediction(prediction: Prediction) -> str:
    """The terms of one prediction: resources and occupancy, then each time component and the bound."""
    if not prediction.feasible:
        return f"{prediction.name}: infeasible ({prediction.reason})"
    t = prediction.terms
    lines = [
        f"{prediction.name}: {_us(prediction.time_s)} predicted, {prediction.bound}-bound",
        f"  launch: {t['blocks']} blocks x {t['threads']} threads, {t['smem_bytes']} B shared memory, "
        f"{t['regs_per_thread']} registers/thread",
        f"  occupancy: {t['occupancy']} blocks/SM (limited by {t['occupancy_limit']}), {t['resident']} resident, "
        f"{t['waves']:.2f} waves, issue rate {t['issue_rate']:.2f}",
        f"  SM time   {_us(t['sm_s'])}  = tensor cores {_us(t['tensor_s'])} + CUDA cores {_us(t['cuda_core_s'])} "
        f"+ latency {_us(t['latency_s'])} (per slot) + last-wave tail",
        f"  L2 time   {_us(t['l2_s'])}  ({t['l2_bytes'] / 1e6:.1f} MB through L2)",
        f"  DRAM time {_us(t['dram_s'])}  ({t['dram_bytes'] / 1e6:.1f} MB unique)",
        f"  launch    {_us(t['launch_s'])}",
    ]
    if "useful_tflops" in t:
        lines.append(f"  useful work: {t['useful_tflops']:.1f} TFLOP/s at the predicted time")
    return "\n".join(lines)


def explain_ranking(title: str, ranked, top: int = 5) -> str:
    """A table of the ``top`` candidates of a ranking (objects with ``candidate``/``prediction``), with the
    winner's terms in full."""
    lines = [title, f"  {'#':>3} {'predicted':>12} {'bound':>6} {'occ':>4}  candidate"]
    for i, entry in enumerate(ranked[:top]):
        p = entry.prediction
        lines.append(f"  {i + 1:>3} {_us(p.time_s):>12} {p.bound:>6} {p.terms.get('occupancy', 0):>4}  "
                     f"{entry.candidate}")
    if ranked:
        lines.append(explain_prediction(ranked[0].prediction))
    return "\n".join(lines)
