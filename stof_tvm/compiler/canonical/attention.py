"""The attention forms exporters emit around ``softmax(Q K^T * scale + mask) V``, brought to one form.

Canonical attention, as :mod:`stof_tvm.compiler.attention_match` reads it: ``matmul(Q, K^T)``, then one scalar
scale on the scores, then the model's masking as ``where(keep, scores, fill)`` (a very negative, finite ``fill``)
and/or additive terms, ``softmax`` over the last axis, ``matmul`` with V. The rules:

- :class:`SplitScale`: ``matmul(Q * a, K^T * b)`` (torch's SDPA decomposed below opset 23 scales both operands by
  ``sqrt(scale)``) -> ``matmul(Q, K^T) * (a * b)``; divisions by a constant count as factors.
- :class:`SelectMask`: ``scores + where(keep, 0, fill)`` -> ``where(keep, scores, fill)`` (a boolean mask turned
  additive per layer, by SDPA's decomposition and HF's sdpa path): one boolean condition instead of a float tensor,
  and the same term in every layer.
- :class:`FiniteFill`: a ``-inf`` fill before a softmax -> the dtype's most negative finite value, so that a row
  with no kept key computes a finite softmax instead of NaN.
- :class:`NanGuard`: ``where(isnan(P), 0, P)`` after the softmax -> ``P``. SDPA adds the guard for rows with no kept
  key (``-inf`` everywhere). stof-tvm's attention kernels define such rows' output as 0 (the same as the guarded
  graph); the dense fallback path, with :class:`FiniteFill`'s finite fill, gives such a row the average of V
  instead (the only case in which the two differ: a query that may attend to no key at all).
"""
from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from ..attention_match import MASKED_FILL
from .base import Rule, const_like, op_name, resolve, rewrite_matches, scalar_constant, tensor_dtype, tensor_shape

FINITE_DTYPES = ("float16", "float32")
MIN_SCORE_RANK = 3      # [B*H, S, D] or [B, H, S, D]: products of two activations, never a linear layer's


def _peel_scale(expr, var2val) -> tuple[relax.Expr, float]:
    """``(x, factor)`` with ``expr = x * factor`` for a chain of multiplications / divisions by scalar constants."""
    factor = 1.0
    for _ in range(4):
        value = resolve(expr, var2val)
        name = op_name(value)
        if name == "relax.multiply":
            found = [(scalar_constant(value.args[i], var2val), value.args[1 - i]) for i in (1, 0)]
            hit = next(((c, x) for c, x in found if c is not None and tensor_shape(x) == tensor_shape(value)), None)
        elif name == "relax.divide":
            c = scalar_constant(value.args[1], var2val)
            hit = (1.0 / c, value.args[0]) if c not in (None, 0.0) else None
        else:
            hit = None
        if hit is None:
            break
        factor *= hit[0]
        expr = hit[1]
    return expr, factor


class SplitScale(Rule):
    """``matmul(Q * a, K^T * b)`` -> ``matmul(Q, K^T) * (a * b)`` for products of two activations."""

    name = "split_scale"
    _a, _b = wildcard(), wildcard()
    pattern = is_op("relax.matmul")(_a, _b)

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            a, b = matches[self._a], matches[self._b]
            shapes = [tensor_shape(a), tensor_shape(b)]
            if any(s is None or len(s) < MIN_SCORE_RANK for s in shapes):
                return None
            (a0, fa), (b0, fb) = _peel_scale(a, var2val), _peel_scale(b, var2val)
            if fa == 1.0 and fb == 1.0:
                return None
            product = relax.op.matmul(a0, b0, out_dtype=tensor_dtype(expr))
            return relax.op.multiply(product, const_like(fa * fb, tensor_dtype(expr)))

        return rewrite_matches(self.pattern, rewrite, func)


def _masking_fill(expr, var2val) -> float | None:
    value = scalar_constant(expr, var2val)
    return value if value is not None and value <= MASKED_FILL else None


class SelectMask(Rule):
    """``softmax(scores + where(keep, 0, fill))`` (either add order, either where branch, through a cast) ->
    ``softmax(where(keep, scores, fill))``. Only the add the softmax reads: T5 adds ``position_bias + mask`` as
    one term, whose mask must stay apart from the bias (:func:`..attention_match._summands`)."""

    name = "select_mask"
    _scores, _cond, _x, _y = wildcard(), wildcard(), is_const(), is_const()
    _where = is_op("relax.where")(_cond, _x, _y)
    _add = is_op("relax.add")(_scores, _where) | is_op("relax.add")(_where, _scores)
    pattern = is_op("relax.nn.softmax")(_add | is_op("relax.astype")(_add))

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            added = resolve(matches[self._add], var2val)
            scores, x, y = matches[self._scores], matches[self._x], matches[self._y]
            if tensor_shape(scores) != tensor_shape(added) or tensor_dtype(scores) != tensor_dtype(added):
                return None
            dtype = tensor_dtype(added)
            if scalar_constant(x) == 0.0 and _masking_fill(y, var2val) is not None:
                masked = relax.op.where(matches[self._cond], scores, const_like(scalar_constant(y), dtype))
            elif scalar_constant(y) == 0.0 and _masking_fill(x, var2val) is not None:
                masked = relax.op.where(matches[self._cond], const_like(scalar_constant(x), dtype), scores)
            else:
                return None
            inner = resolve(expr.args[0], var2val)
            if op_name(inner) == "relax.astype":
                masked = relax.op.astype(masked, str(inner.attrs.dtype))
            return relax.op.nn.softmax(masked, axis=int(expr.attrs.axis))

        return rewrite_matches(self.pattern, rewrite, func)


class FiniteFill(Rule):
    """``softmax(where(keep, s, -inf))`` (either branch, through casts) -> the dtype's most negative finite fill."""

    name = "finite_fill"
    _cond, _a, _b = wildcard(), wildcard(), wildcard()
    _where = is_op("relax.where")(_cond, _a, _b)
    pattern = is_op("relax.nn.softmax")(_where | is_op("relax.astype")(_where))

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            where = resolve(matches[self._where], var2val)
            dtype = tensor_dtype(where)
            args = list(where.args)
            changed = False
            for i in (1, 2):
                value = scalar_constant(args[i], var2val)
                if value == -np.inf and dtype in FINITE_DTYPES:
                    args[i] = const_like(float(np.finfo(dtype).min), dtype)
                    changed = True
            if not changed:
                return None
            masked = relax.op.where(*args)
            inner = resolve(expr.args[0], var2val)
            if op_name(inner) == "relax.astype":
                masked = relax.op.astype(masked, str(inner.attrs.dtype))
            return relax.op.nn.softmax(masked, axis=int(expr.attrs.axis))

        return rewrite_matches(self.pattern, rewrite, func)


class NanGuard(Rule):
    """``where(isnan(P), 0, P)`` with ``P = softmax(..)`` -> ``P`` (see the module docstring)."""

    name = "nan_guard"
    _p, _zero = wildcard(), is_const()
    pattern = is_op("relax.where")(is_op("relax.isnan")(_p), _zero, _p)

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            p = matches[self._p]
            if scalar_constant(matches[self._zero]) != 0.0 or op_name(resolve(p, var2val)) != "relax.nn.softmax":
                return None
            return p

        return rewrite_matches(self.pattern, rewrite, func)
