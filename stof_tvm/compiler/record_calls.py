"""The calls of a compile that a tuning record can decide, each with whether one did.

The manifest's ``tuning`` entry counts them (:meth:`stof_tvm.records.RecordUsage.summary`): every template
stage (its knobs came from the ``database`` or not) and the sparse attention kernel (its choice was ``tuned`` or
not; a dense site, one with a score bias and the wgmma kernel, which is not tuned, take no record).
"""
from __future__ import annotations

__all__ = ["record_calls"]


def record_calls(template_entry: dict, choice, sites) -> list[tuple[str, bool]]:
    """``[(label, decided by a record)]`` for a compile's template entry, kernel ``choice`` (None: no attention
    site was rewritten) and attention ``sites``."""
    calls = []
    for entry in template_entry.get("sites", []):
        for stage in entry["stages"]:
            shape = ",".join(f"{k}={v}" for k, v in stage["shape"].items())
            eps = f" eps={stage['eps']:g}" if "eps" in stage else ""
            calls.append((f"{stage['template']} {shape} {stage['dtype']}{eps}", stage["source"] == "database"))
    if choice is not None and sites and choice.kind not in ("dense", "wgmma") and choice.bias is None:
        site = sites[0]
        label = f"attention B{site.batch} H{site.heads} S{site.seq_q} D{site.head_dim} {site.dtype}"
        calls.append((label, choice.reason.startswith("tuned")))
    return calls
