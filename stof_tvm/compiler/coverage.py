"""How much of a model runs on stof-tvm's kernels and templates, per operator kind, and why the rest does not.

Counted on the canonical graph (:mod:`.canonical`), where each kind has one form: an attention site is a
``softmax`` over the last axis of a 4-D score tensor; a ``linear`` a ``matmul`` of an activation by a 2-D weight
(a parameter or constant); ``layernorm`` ``nn.layer_norm``; ``rmsnorm`` the RMSNorm pattern of
:mod:`.rmsnorm_match`; ``gelu`` ``nn.gelu`` and ``nn.gelu_tanh``; ``relu`` ``nn.relu``; ``qkv`` counts the
attention sites whose Q, K and V come from one ``qkv_projection`` template writing the heads. An operator is
*accelerated* when the rewrites replaced it (a sparse attention kernel; a fusion template, an activation or a
LayerNorm in a GEMM's epilogue counting as on the template); what is left in the final graph *fell back* to TVM's
default pipeline, each with the reason this module finds for it. :func:`coverage` returns the manifest's
``coverage`` entry; :func:`coverage_lines` the lines ``stof-tvm compile`` prints.
"""
from __future__ import annotations

import tvm
from tvm import relax

from .attention_match import resolve, static_shape
from .linear_match import TEMPLATE_DTYPES, fixed_weights, is_weight
from .rmsnorm_match import RMSNORM

KINDS = ("attention", "qkv", "linear", "layernorm", "rmsnorm", "gelu", "relu")
_OPS = {"relax.nn.layer_norm": "layernorm", "relax.nn.gelu": "gelu", "relax.nn.gelu_tanh": "gelu",
        "relax.nn.relu": "relu"}


def _op(value) -> str | None:
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


def _linear_reason(value, var2val) -> str:
    """Why a linear layer (``matmul(x, W)``) is not on a template."""
    x, w = value.args
    dtype = str(x.ty.dtype)
    w_shape = static_shape(resolve(w, var2val)) or static_shape(w)
    if dtype not in TEMPLATE_DTYPES:
        return f"{dtype} (the templates are 16-bit)"
    if w_shape is None or len(w_shape) != 2:
        return "weight shape not static 2-D"
    k, n = w_shape
    if k % 16 or n % 16:
        return f"K={k}, N={n}: the templates need multiples of 16"
    return "no template chain matched its form"


def _layernorm_reason(value) -> str:
    shape = static_shape(value.args[0])
    if str(value.args[0].ty.dtype) not in ("float32",) + TEMPLATE_DTYPES:
        return f"{value.args[0].ty.dtype} input"
    if shape is None:
        return "symbolic shape"
    if shape[-1] % 64:
        return f"rows of {shape[-1]}: the LayerNorm templates need multiples of 64"
    return "gamma/beta not constants, or normalised over other axes"


def census(func: relax.Function) -> dict[str, list]:
    """``{kind: [bound value, ...]}`` of every operator of ``func`` that :data:`KINDS` counts."""
    var2val = relax.analysis.get_var2val(func)
    weights = fixed_weights(func)
    found: dict[str, list] = {kind: [] for kind in KINDS}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            name = _op(value)
            if name in _OPS:
                found[_OPS[name]].append(value)
            elif name == "relax.nn.softmax":
                shape = static_shape(value)
                if shape is not None and len(shape) == 4 and int(value.attrs.axis) in (-1, 3):
                    found["attention"].append(value)
            elif name == "relax.matmul" and is_weight(value.args[1], var2val, weights) \
                    and not is_weight(value.args[0], var2val, weights):
                found["linear"].append(value)
            elif name == "relax.multiply" and RMSNORM.extract_matched_expr(value, var2val) is not None:
                found["rmsnorm"].append(value)
    return found


def _qkv_entry(attention_sites: int, template_entry: dict, templates: str | None) -> dict:
    """How many attention sites read Q, K and V from one QKV projection into heads (the ``qkv`` chain)."""
    reasons: dict[str, int] = {}
    fused = 0
    for site in template_entry.get("sites", []):
        if site["chain"] == "qkv":
            fused += site["count"]
        elif site["chain"] == "qkv_gemm":
            reasons[site.get("note", "one GEMM")] = reasons.get(site.get("note", "one GEMM"), 0) + site["count"]
    rest = attention_sites - fused - sum(reasons.values())
    if rest > 0:
        reasons[templates or "Q, K and V are not three linear layers of one input (or one split in thirds)"] = rest
    return {"total": attention_sites, "accelerated": fused,
            "fallback": [{"reason": r, "count": c} for r, c in sorted(reasons.items())]}


def coverage(canonical: relax.Function, final: relax.Function, *, attention_kernel: str | None,
             attention_sites: int, attention_reason: str | None, templates: str | None,
             template_entry: dict | None = None) -> dict:
    """The manifest's ``coverage`` entry: per kind ``{"total", "accelerated", "fallback": [{"reason", "count"}]}``.

    ``canonical``: ``main`` before any stof-tvm rewrite; ``final``: after them. ``attention_kernel``: the sparse
    kernel the sites run on (None or "dense": TVM's dense path, ``attention_reason`` says why);
    ``attention_sites``: how many sites were matched. ``templates``: None when the fusion templates ran, else why
    they did not (every other kind then falls back for that reason); ``template_entry``: the manifest's
    ``templates`` entry (its ``qkv`` sites)."""
    before, after = census(canonical), census(final)
    var2val = relax.analysis.get_var2val(final)
    entry = {}
    for kind in KINDS:
        total = len(before.get(kind, []))
        if kind == "qkv":
            entry[kind] = _qkv_entry(attention_sites, template_entry or {}, templates)
            continue
        if kind == "attention":
            on_kernel = attention_kernel not in (None, "dense")
            accelerated = attention_sites if on_kernel else 0
            reasons = {}
            if total - accelerated:
                unmatched = total - attention_sites
                if unmatched:
                    reasons["not standard multi-head attention (no matmul -> softmax -> matmul site)"] = unmatched
                if attention_sites and not on_kernel:
                    reasons[attention_reason or "dense kernel"] = attention_sites
        else:
            left = after[kind]
            accelerated = max(total - len(left), 0)
            reasons = {}
            for value in left:
                if templates is not None:
                    why = templates
                elif kind == "linear":
                    why = _linear_reason(value, var2val)
                elif kind == "layernorm":
                    why = _layernorm_reason(value)
                elif kind in ("gelu", "relu"):
                    why = "its input is not a linear layer on a template"
                else:
                    why = "rows not a multiple of 64, or not 16-bit"
                reasons[why] = reasons.get(why, 0) + 1
        entry[kind] = {"total": total, "accelerated": accelerated,
                       "fallback": [{"reason": r, "count": c} for r, c in sorted(reasons.items())]}
        if kind == "attention" and attention_kernel is not None:
            entry[kind]["kernel"] = attention_kernel
    return entry


def coverage_lines(entry: dict) -> list[str]:
    """Human-readable lines of a ``coverage`` entry: one summary line, then one line per fallback reason."""
    parts, lines = [], []
    for kind, counts in entry.items():
        if counts["total"] == 0:
            continue
        kernel = f" ({counts['kernel']})" if counts.get("kernel") else ""
        parts.append(f"{kind} {counts['accelerated']}/{counts['total']}{kernel}")
        lines += [f"  {kind}: {f['count']} fell back: {f['reason']}" for f in counts["fallback"]]
    return ["coverage (on stof-tvm kernels / templates): " + ", ".join(parts)] + lines
