"""What every canonical-form rule shares: the :class:`Rule` interface and small helpers over Relax expressions.

A rule is one rewrite for one exporter form. ``apply(func)`` returns the rewritten function, or None when the
rule found nothing to rewrite, so that :func:`stof_tvm.compiler.canonical.canonicalize` can run the rules to a
fixed point (the shape of ``tvm.s_tir.dlight``'s schedule rules: one small rule per family, composed in a list).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import rewrite_call


class Rule:
    """One rewrite toward the canonical form; subclasses set ``name`` and implement :meth:`apply`."""

    name = "rule"

    def apply(self, func: relax.Function) -> relax.Function | None:    # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<canonical rule {self.name}>"


def rewrite_matches(pattern, callback, func: relax.Function) -> relax.Function | None:
    """``rewrite_call(pattern, ...)`` where ``callback(expr, matches)`` returns a replacement or None (keep);
    None when no match was replaced, so the rules' fixed point can be detected without comparing functions."""
    replaced = []

    def wrapped(expr, matches):
        out = callback(expr, matches)
        if out is None or out.same_as(expr):
            return expr
        replaced.append(expr)
        return out

    rewritten = rewrite_call(pattern, wrapped, func)
    return relax.analysis.remove_all_unused(rewritten) if replaced else None


def resolve(expr: relax.Expr, var2val) -> relax.Expr:
    """``expr`` with variable bindings followed to the bound value."""
    while isinstance(expr, relax.Var) and expr in var2val:
        expr = var2val[expr]
    return expr


def op_name(expr) -> str | None:
    """The Relax operator a call applies (None for anything else)."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def scalar_constant(expr, var2val=None) -> float | None:
    """The value of a constant with a single element (through bindings when ``var2val`` is given), else None."""
    expr = resolve(expr, var2val) if var2val is not None else expr
    if isinstance(expr, Constant):
        data = expr.value.numpy()
        if data.size == 1:
            return float(data.reshape(()))
    return None


def tensor_dtype(expr) -> str | None:
    """The dtype of a tensor-typed expression (None when it is not a tensor)."""
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def tensor_shape(expr) -> tuple[int, ...] | None:
    """The static shape of a tensor-typed expression, or None if unknown or symbolic."""
    values = getattr(getattr(getattr(expr, "ty", None), "shape", None), "values", None)
    if values is None or not all(isinstance(v, tvm.tirx.IntImm) for v in values):
        return None
    return tuple(int(v) for v in values)


def const_like(value: float, dtype: str) -> relax.Constant:
    """A scalar constant of ``dtype``."""
    return relax.const(np.array(value, dtype=dtype), dtype)
