"""Find multi-head attention subgraphs in an imported Relax function.

An attention site is anchored with a Relax dataflow pattern (``tvm.relax.dpl``):
``matmul(softmax(scores, axis=-1) [-> astype], V)`` with 4-D ``[B, H, S, D]`` operands. From the softmax
input we walk back through the forms exporters emit until the ``matmul(Q, K^T)`` that made the scores:

- scaling: ``divide(s, c)`` or ``multiply(s, c)`` by a scalar constant (the scale may also sit on Q or K
  upstream; it is then part of Q/K and the kernel scale is 1),
- masking: ``add(s, bias)`` (Hugging Face's additive mask, a causal constant, or a position bias) and
  ``where(cond, s, fill)`` / ``where(cond, fill, s)`` with a very negative scalar ``fill``,
- ``astype`` casts (mixed precision puts the softmax in float32).

The result lists, for each site, Q, K^T and V, the scale, and every mask term found on the way. What each
term means (a mask or a real bias) is decided later by :mod:`stof_tvm.compiler.mask_sources`. Where K and V are
key/value heads repeated for groups of query heads (grouped-query attention, canonically ``repeat(x, G, axis=1)``),
the site also holds them unrepeated (:attr:`AttentionSite.grouped_kv`).
"""
from __future__ import annotations

import dataclasses

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

# A fill value at or below this marks a masked score (HF uses -10000 or finfo.min; fp16 may make it -inf).
MASKED_FILL = -1.0e4

_Q, _KT, _V, _SCORES = wildcard(), wildcard(), wildcard(), wildcard()
_SOFTMAX = is_op("relax.nn.softmax")(_SCORES)
ATTENTION_PATTERN = is_op("relax.matmul")(_SOFTMAX | is_op("relax.astype")(_SOFTMAX), _V)
QK_PATTERN = is_op("relax.matmul")(_Q, _KT)


@dataclasses.dataclass
class MaskTerm:
    """One masking step on the scores: ``kind`` is "add" (``expr`` is the added tensor) or "where"
    (``expr`` is the boolean condition; ``keep_if_true`` says which branch holds the scores)."""

    kind: str
    expr: relax.Expr
    keep_if_true: bool = True


@dataclasses.dataclass
class AttentionSite:
    """One attention subgraph: ``var`` is bound to the weighted sum ``softmax(scores) @ V``."""

    var: relax.Var
    q: relax.Expr
    k_t: relax.Expr
    v: relax.Expr
    scale: float
    terms: list[MaskTerm]
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str
    grouped_kv: tuple | None = None     # (K [B, Hkv, Sk, D], V [B, Hkv, Sk, D], Hkv) before their repeat to H heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads the kernel can read K and V from: fewer than ``heads`` under grouped-query attention."""
        return self.heads if self.grouped_kv is None else self.grouped_kv[2]

    @property
    def shape_key(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seq_q, self.seq_k)


def static_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    """The static shape of a tensor-typed expression, or None if it is unknown or symbolic."""
    values = getattr(getattr(expr.ty, "shape", None), "values", None)
    if values is None or not all(isinstance(v, tvm.tirx.IntImm) for v in values):
        return None
    return tuple(int(v) for v in values)


def _dtype(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def scalar_value(expr: relax.Expr, var2val) -> float | None:
    """The value of a scalar (or all-size-1) constant, looking through bindings and casts; None if not one."""
    expr = resolve(expr, var2val)
    while _op_name(expr) == "relax.astype":
        expr = resolve(expr.args[0], var2val)
    if isinstance(expr, tvm.ir.expr.Constant):
        data = expr.value.numpy()
        if data.size == 1:
            return float(data.reshape(()))
    return None


def resolve(expr: relax.Expr, var2val) -> relax.Expr:
    while isinstance(expr, relax.Var) and expr in var2val:
        expr = var2val[expr]
    return expr


def _op_name(expr: relax.Expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


@dataclasses.dataclass
class _Chain:
    qk: relax.Call
    scale: float
    terms: list[MaskTerm]


def _walk_scores(expr: relax.Expr, var2val, depth: int = 0, stops: list | None = None) -> _Chain | None:
    """Walk from the softmax input back to ``matmul(Q, K^T)``; None if the chain has another form. ``stops``
    (optional) collects the operators the walk stopped at whose result has the scores' full shape (an operator on
    the scores themselves, not on a broadcast mask term): why a softmax is not an attention site."""
    if depth > 32:
        return None
    call = resolve(expr, var2val)
    name = _op_name(call)
    if name is None:
        return None
    walk = lambda e: _walk_scores(e, var2val, depth + 1, stops)    # noqa: E731
    if name == "relax.matmul":
        shape = static_shape(call)
        return _Chain(call, 1.0, []) if shape is not None and len(shape) == 4 else None
    if name == "relax.astype":
        return walk(call.args[0])
    if name in ("relax.divide", "relax.multiply"):
        for score_side, other in ((0, 1), (1, 0)) if name == "relax.multiply" else ((0, 1),):
            factor = scalar_value(call.args[other], var2val)
            if factor is None or factor == 0.0:
                continue
            chain = walk(call.args[score_side])
            if chain is not None:
                chain.scale *= factor if name == "relax.multiply" else 1.0 / factor
                return chain
        return None
    if name == "relax.add":
        for score_side, other in ((0, 1), (1, 0)):
            chain = walk(call.args[score_side])
            if chain is not None:
                chain.terms.extend(MaskTerm("add", leaf) for leaf in _summands(call.args[other], var2val))
                return chain
        return None
    if name == "relax.where":
        cond, on_true, on_false = call.args
        for score_side, fill, keep_if_true in ((on_true, on_false, True), (on_false, on_true, False)):
            fill_value = scalar_value(fill, var2val)
            if fill_value is None or fill_value > MASKED_FILL:
                continue
            chain = walk(score_side)
            if chain is not None:
                chain.terms.append(MaskTerm("where", cond, keep_if_true))
                return chain
        return None
    if stops is not None and len(static_shape(call) or ()) == 4 and name not in stops:
        stops.append(name)
    return None


def _summands(expr: relax.Expr, var2val, depth: int = 0) -> list[relax.Expr]:
    """The terms of a sum added to the scores, each classified on its own: T5 adds ``position_bias + padding``
    as one tensor, and apart the padding is a mask the sparse format takes while the position bias (weights only)
    stays a [1, H, S, S] bias, instead of one [B, H, S, S] float32 bias the graph writes on every forward."""
    call = resolve(expr, var2val)
    if depth > 8 or _op_name(call) != "relax.add":
        return [expr]
    return [leaf for arg in call.args for leaf in _summands(arg, var2val, depth + 1)]


def _softmax_is_last_axis(call: relax.Call) -> bool:
    axis = int(call.attrs.axis)
    return axis in (-1, 3)


def unmatched_score_ops(func: relax.Function) -> list[str]:
    """The operators (without the ``relax.`` prefix) applied to the scores of softmax-weighted sums that are not
    attention sites, where the walk back to ``matmul(Q, K^T)`` stopped: ``tanh`` for Gemma 2's logit
    soft-capping (``tanh(scores / c) * c``), which no attention kernel of stof-tvm computes."""
    var2val = relax.analysis.get_var2val(func)
    found: list[str] = []
    for block in func.body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            matched = ATTENTION_PATTERN.extract_matched_expr(binding.value, var2val)
            if matched is None or not _softmax_is_last_axis(resolve(matched[_SOFTMAX], var2val)):
                continue
            stops: list[str] = []
            if _walk_scores(matched[_SCORES], var2val, stops=stops) is None:
                found += [name.removeprefix("relax.") for name in stops if name.removeprefix("relax.") not in found]
    return found


def find_attention_sites(func: relax.Function) -> list[AttentionSite]:
    """All attention sites of ``func`` (bindings in program order)."""
    var2val = relax.analysis.get_var2val(func)
    sites = []
    for block in func.body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            matched = ATTENTION_PATTERN.extract_matched_expr(binding.value, var2val)
            if matched is None:
                continue
            probs = resolve(matched[_SOFTMAX], var2val)
            if not _softmax_is_last_axis(probs):
                continue
            chain = _walk_scores(matched[_SCORES], var2val)
            if chain is None:
                continue
            qk = QK_PATTERN.extract_matched_expr(chain.qk, var2val)
            q, k_t, v = qk[_Q], qk[_KT], matched[_V]
            shapes = [static_shape(e) for e in (q, k_t, v)]
            if any(s is None or len(s) != 4 for s in shapes):
                continue
            (b, h, sq, d), (_, _, dk, sk), (_, _, sv, dv) = shapes
            if dk != d or sv != sk or dv != d or shapes[1][:2] != (b, h) or shapes[2][:2] != (b, h):
                continue
            sites.append(AttentionSite(binding.var, q, k_t, v, chain.scale, chain.terms, b, h, sq, sk, d,
                                       _dtype(q), _grouped_kv(k_t, v, var2val)))
    return sites


def shared_kv_heads(sites: list[AttentionSite]) -> int:
    """The key/value heads a kernel serving every site reads K and V from: the sites' grouped key/value heads where
    they all have the same, else their query heads (K and V repeated, as the graph computes them)."""
    kinds = {(site.grouped_kv is None, site.kv_heads) for site in sites}
    return sites[0].kv_heads if len(kinds) == 1 else sites[0].heads


def _unrepeated(expr, var2val) -> tuple[relax.Expr, int] | None:
    """(x, G) where ``expr`` is ``repeat(x, G, axis=1)`` of [B, Hkv, S, D] heads (through bindings; a cast of the
    repeat becomes the same cast of ``x``); else None."""
    value = resolve(expr, var2val)
    if _op_name(value) == "relax.astype":
        inner = _unrepeated(value.args[0], var2val)
        return None if inner is None else (relax.op.astype(inner[0], value.attrs.dtype), inner[1])
    if _op_name(value) != "relax.repeat" or value.attrs.axis is None or int(value.attrs.axis) not in (1, -3):
        return None
    shape = static_shape(value.args[0])
    return (value.args[0], int(value.attrs.repeats)) if shape is not None and len(shape) == 4 else None


def _grouped_kv(k_t, v, var2val) -> tuple | None:
    """(K, V, Hkv) unrepeated where K^T is ``permute_dims(repeat(K, G, 1), [0, 1, 3, 2])`` and V is ``repeat(V', G, 1)``
    with the same G (each query head reads the key/value head its group shares), casts kept; else None."""
    permute, cast = resolve(k_t, var2val), None
    if _op_name(permute) == "relax.astype":
        permute, cast = resolve(permute.args[0], var2val), permute.attrs.dtype
    if _op_name(permute) != "relax.permute_dims" or [int(a) for a in permute.attrs.axes or []] != [0, 1, 3, 2]:
        return None
    k, v = _unrepeated(permute.args[0], var2val), _unrepeated(v, var2val)
    if k is None or v is None or k[1] != v[1]:
        return None
    k_heads = k[0] if cast is None else relax.op.astype(k[0], cast)
    return k_heads, v[0], static_shape(permute)[1] // k[1]
