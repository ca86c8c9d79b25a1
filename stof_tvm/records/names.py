"""The names records are filed under: a workload's normalised module and hash, and the groups of alternatives.

The tuner writes records under these names and the compiler looks them up under the same ones, so both import
them from here (neither imports the other for them).

- :func:`normalize_workload` / :func:`workload_key`: the module MetaSchedule tunes and stores for a PrimFunc,
  and the hex structural hash that keys it;
- :func:`attention_group`: the alternatives (kernel kind and configuration) of one attention problem;
- :func:`wgmma_group`: the knob sets of one wgmma template call.
"""
from __future__ import annotations

import json
from typing import Mapping

import tvm
import tvm_ffi

__all__ = ["normalize_workload", "workload_key", "attention_group", "is_attention_group", "wgmma_group"]

_ATTENTION = "attention:"        # how every attention group's name starts


def normalize_workload(func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    """The IRModule MetaSchedule tunes and stores for ``func``: ``{"main": func}`` with ``global_symbol="main"``
    and ``tirx.noalias`` (what ``tune_tir`` does, made explicit so database look-ups match)."""
    if not isinstance(func, tvm.tirx.PrimFunc):
        raise TypeError(f"a tuning workload must be a tvm.tirx.PrimFunc, got {type(func).__name__}")
    func = func.with_attr("global_symbol", "main").with_attr("tirx.noalias", True)
    return tvm.IRModule({"main": func})


def workload_key(func: tvm.tirx.PrimFunc) -> str:
    """Hex structural hash of the normalised workload (the key the JSON database uses for it)."""
    return f"{tvm_ffi.structural_hash(normalize_workload(func)) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def attention_group(problem) -> str:
    """The group of an attention problem's alternatives (a :class:`stof_tvm.cost_model.AttentionProblem`):
    shapes (grouped-query key/value heads where fewer), dtype and the mask's content hash."""
    kv = f"xHkv{problem.kv_heads}" if problem.kv_heads else ""
    return (f"{_ATTENTION}B{problem.batch}xH{problem.heads}{kv}xSq{problem.seq_q}xSk{problem.seq_k}"
            f"xD{problem.head_dim}:{problem.dtype}:mask{problem.mask.digest()}")


def is_attention_group(job: str) -> bool:
    """Whether a job (a group name or a task key) is an attention problem's group."""
    return job.startswith(_ATTENTION)


def wgmma_group(template, shape: Mapping[str, int], dtype: str) -> str:
    """The group of one wgmma template call: its members are that call's knob sets."""
    return f"template:{template.name}:{json.dumps(dict(shape), sort_keys=True)}:{dtype}"
