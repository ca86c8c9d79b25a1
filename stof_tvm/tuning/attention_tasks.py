"""Stage 1 for attention: rank every kernel configuration with the model, keep the top K as tuning tasks.

Our attention kernels are written per configuration (the block-wise kernel is thread-level TensorIR; the
row-wise kernel's key groups shape its loop nest), so each surviving configuration is its own workload: a
task with no knobs left, measured as it is. All tasks of one problem share a ``group``
(:func:`stof_tvm.records.attention_group`); after stage 2 the group's fastest task is the problem's kernel choice
(:meth:`TuningDatabase.group_choice`). The first task is the compile's untuned choice (``baseline``, marked
``meta["untuned"]``): it is measured first, and the group only gets a choice once it is, so a tuned compile never
runs a slower kernel than an untuned one.

Each workload is specialised to the mask's format sizes (``n_full``/``n_part``/``nnz`` are symbolic in the
kernels; MetaSchedule's runners need static shapes), and the format arrays ride along as fixed arguments so
the measured kernel walks the real mask.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import tvm

from ..cost_model import AttentionProblem, Calibration, DEFAULT_CALIBRATION, attention_candidates, rank_attention
from ..hardware import H200, HardwareProfile
from ..records import attention_group
from ..sparse_formats import build_rows, build_tiled
from .task import TuningTask

__all__ = ["attention_group", "attention_tasks", "attention_workload"]

# Parameter positions of the format arrays (after q, k, v; before out).
_BLOCK_FORMAT = ("full_indptr", "full_indices", "part_indptr", "part_indices", "part_bitmaps")
_ROW_FORMAT = ("indptr", "indices")


def _short(config: dict) -> dict:
    """Config fields under short names for task names (block_m -> bm, key_groups -> kg, ...); the split-KV
    fields only where the config splits, ``min_blocks`` only where set, ``row_sums`` only where not the tensor
    cores' default, ``reverse_full`` and ``lean_padding`` only where set, so other tasks keep the names they had
    before those fields existed."""
    if config.get("kv_splits", 1) == 1:
        config = {k: v for k, v in config.items() if k not in ("kv_splits", "split_rows")}
    if config.get("min_blocks", 0) == 0:
        config = {k: v for k, v in config.items() if k != "min_blocks"}
    if config.get("row_sums", "mma") == "mma":
        config = {k: v for k, v in config.items() if k != "row_sums"}
    for flag in ("reverse_full", "lean_padding"):
        if not config.get(flag, False):
            config = {k: v for k, v in config.items() if k != flag}
    return {"".join(part[0] for part in key.split("_")): value for key, value in config.items()}


def _padded(arrays):
    """Format arrays with empty lists padded by one dummy entry (the kernels' contract; never read)."""
    return [a if a.shape[0] else np.zeros((1,) + a.shape[1:], a.dtype) for a in arrays]


def attention_workload(problem: AttentionProblem, kind: str, config, target_kind: str,
                       scale: float | None = None) -> tuple[tvm.tirx.PrimFunc, dict[int, np.ndarray]]:
    """The static-shaped kernel of ``(kind, config)`` for ``problem`` and its format arrays by parameter index."""
    common = dict(batch=problem.batch, heads=problem.heads, seq_q=problem.seq_q, seq_k=problem.seq_k,
                  head_dim=problem.head_dim, dtype=problem.dtype, mask_batch=problem.mask.mask_batch,
                  mask_heads=problem.mask.mask_heads, scale=scale, config=config, target_kind=target_kind,
                  kv_heads=problem.kv_heads or None)
    mask = np.ascontiguousarray(problem.mask.mask)
    if kind == "block":
        from ..schedules.attention_blockwise import blockwise_attention_primfunc

        func = blockwise_attention_primfunc(**common)
        fmt = build_tiled(mask, config.block_m, config.block_n)
        arrays = _padded([fmt.full_indptr, fmt.full_indices, fmt.part_indptr, fmt.part_indices, fmt.part_bitmaps])
        names = _BLOCK_FORMAT
    elif kind == "row":
        from ..schedules.attention_rowwise import rowwise_attention_primfunc

        func = rowwise_attention_primfunc(**common)
        fmt = build_rows(mask)
        arrays = _padded([fmt.indptr, fmt.indices])
        names = _ROW_FORMAT
    else:
        raise ValueError(f"kind must be 'block' or 'row', got {kind!r}")
    by_name = {p.name: i for i, p in enumerate(func.params)}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"the {kind}-wise kernel has no parameters {missing}")
    fixed = {by_name[n]: a for n, a in zip(names, arrays)}
    # Symbolic list lengths become the mask's: specialise every format buffer to its array's shape.
    params = {func.params[i]: tvm.tirx.decl_buffer(a.shape, str(a.dtype), func.params[i].name)
              for i, a in fixed.items() if any(not isinstance(s, tvm.tirx.IntImm) for s in func.params[i].shape)}
    if params:
        func = func.specialize(params)
    return func, fixed


def _selection_order(ranked, margin: float, baseline=None):
    """Ranked candidates, with the best of the other kernel kind moved up to second place when it is predicted
    within ``margin`` of the winner: stage 2 then measures the kind decision, not only configurations.
    ``baseline`` (an :class:`AttentionCandidate`) goes first, unranked (``time_s`` None) when the model has not
    ranked it."""
    if ranked:
        best = ranked[0]
        rival = next((r for r in ranked if r.candidate.kind != best.candidate.kind), None)
        if rival is not None and rival.time_s <= margin * best.time_s:
            ranked = [best, rival] + [r for r in ranked[1:] if r is not rival]
    if baseline is None:
        return ranked
    same = [r for r in ranked if r.candidate == baseline]
    first = same[0] if same else SimpleNamespace(candidate=baseline, time_s=None)
    return [first] + [r for r in ranked if r is not first]


def attention_tasks(problem: AttentionProblem, target, *, top_k: int = 8, hw: HardwareProfile = H200,
                    cal: Calibration = DEFAULT_CALIBRATION, kinds=("block", "row"), scale: float | None = None,
                    weight: float = 1.0, name: str = "attention", margin: float = 2.0,
                    ranked=None, baseline=None) -> list[TuningTask]:
    """Tasks for the ``top_k`` best-predicted distinct kernels of ``problem`` on ``target``.

    The best kernel of the other kind is included when predicted within ``margin`` x of the best. On ``llvm``
    the kernels are the CPU twins (several GPU configurations collapse into one CPU kernel; duplicates are
    skipped so the K tasks are distinct workloads). ``ranked``: a ranking from :func:`rank_attention` to
    reuse instead of ranking again. ``baseline``: the compile's untuned choice (an :class:`AttentionCandidate`),
    made the first task (by default the model's best is).
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if "wgmma" in kinds:
        raise ValueError("kinds: the wgmma attention kernel is not a tuning task (an sm_90a-only kernel whose few "
                         "configurations the model prices from its own H200 fit; scripts/bench_attention.py times "
                         "them); tune 'block' and 'row'")
    target_kind = tvm.target.Target(target).kind.name if not isinstance(target, tvm.target.Target) \
        else target.kind.name
    if ranked is None:
        ranked = rank_attention(problem, hw, cal, attention_candidates(problem, hw, kinds))
    if target_kind == "llvm" and problem.dtype not in ("float16", "bfloat16"):
        ranked = [r for r in ranked if r.candidate.kind == "row"]      # the block-wise twin is 16-bit only
    group = attention_group(problem)
    tasks: list[TuningTask] = []
    seen: set[str] = set()
    for entry in _selection_order(ranked, margin, baseline):
        kind, config = entry.candidate.kind, entry.candidate.config
        func, fixed = attention_workload(problem, kind, config, target_kind, scale)
        task = TuningTask(
            name=f"{name}_{kind}_" + "_".join(f"{k}{v if isinstance(v, str) else int(v)}"
                                              for k, v in _short(asdict(config)).items()), func=func,
            predicted_s=[entry.time_s] if entry.time_s is not None else [], fixed_args=fixed, weight=weight,
            group=group,
            meta={"kind": kind, "config": asdict(config), "predicted_s": entry.time_s,
                  "problem": {"batch": problem.batch, "heads": problem.heads, "seq_q": problem.seq_q,
                              "seq_k": problem.seq_k, "head_dim": problem.head_dim, "dtype": problem.dtype,
                              "scale": scale if scale is not None else 1.0 / math.sqrt(problem.head_dim),
                              **({"kv_heads": problem.kv_heads} if problem.kv_heads else {})},
                  **({"untuned": True} if not tasks else {})})
        if task.key in seen:
            continue
        seen.add(task.key)
        tasks.append(task)
        if len(tasks) == top_k:
            break
    if not tasks:
        raise ValueError(f"no attention kernel fits {problem.head_dim=} {problem.dtype=} on {hw.name}")
    return tasks
