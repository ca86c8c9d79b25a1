"""Elementwise forms exporters emit for one function, brought to one Relax operator each.

- :class:`IntegerPowers`: ``power(x, n)`` for n in 1..4 -> products. TVM builds CUDA with fast math, where
  ``powf`` becomes ``exp2(y * log2(x))``, NaN for every negative ``x``: a T5 RMSNorm (``pow(x, 2)``) and HF GPT-2's
  ``gelu_new`` (``pow(x, 3)``) gave NaN outputs on the H200 while exact on the CPU. Products are exact and cheaper.
- :class:`GeluErf` / :class:`GeluTanh`: the exact GELU and its tanh approximation in any elementwise spelling
  (TorchScript's ``x * (erf(x / sqrt2) + 1) * 0.5``, the dynamo exporter's ``x * (0.5 * (erf(..) + 1))``,
  ``gelu_new``'s ``0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3))))``, ...) -> ``nn.gelu`` / ``nn.gelu_tanh``,
  the operators the importer makes of ONNX's ``Gelu`` (opset 20+). The two stay distinct: they differ by up to
  4.7e-4, which a wrong substitution would hide at 1e-3, so each rule needs its own special operator (erf / tanh).

A GELU is recognised by what it computes, not by its operand order: the elementwise expression tree under a
``multiply`` (through single-tensor ``add``/``subtract``/``multiply``/``divide``/``power``/``sqrt``/``erf``/
``tanh`` with scalar constants) that reads one tensor ``x`` is evaluated in float64 on sample points and compared
with the reference function. Any algebraically equal spelling is found, and nothing else is.
"""
from __future__ import annotations

import math

import numpy as np
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_op, wildcard

from .base import Rule, op_name, resolve, rewrite_matches, scalar_constant, tensor_shape

MAX_POWER = 4


def _product(x: relax.Expr, n: int) -> relax.Expr:
    out = x
    for _ in range(n - 1):
        out = relax.op.multiply(out, x)
    return out


class IntegerPowers(Rule):
    """``power(x, n)``, ``n`` an integer constant 1..4 -> ``x * x * ...`` (see the module docstring)."""

    name = "integer_powers"
    _base, _exponent = wildcard(), is_const()
    pattern = is_op("relax.power")(_base, _exponent)

    def apply(self, func):
        def rewrite(expr, matches):
            n = scalar_constant(matches[self._exponent])
            if n is None or n != int(n) or not 1 <= n <= MAX_POWER:
                return None
            return _product(matches[self._base], int(n))

        return rewrite_matches(self.pattern, rewrite, func)


def _erf(values: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(values)


_UNARY = {"relax.erf": _erf, "relax.tanh": np.tanh, "relax.sqrt": np.sqrt, "relax.negative": np.negative}
_BINARY = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
           "relax.divide": np.divide, "relax.power": np.power}
MAX_NODES = 24
SAMPLES = np.concatenate([np.linspace(-8.0, 8.0, 65), [-0.3, -0.01, 0.01, 0.3, 1.7]])
# how far a spelling may compute from the reference: its constants rounded to float32 put it within 1e-7, to 16 bits
# (a model exported in float16 or bfloat16; widened from bfloat16, they are float32 values still rounded so) up to
# 3.3e-4 (the tanh form's sqrt(2/pi) and 0.044715 in bfloat16). The exact and the tanh GELU, 4.7e-4 apart on
# SAMPLES, are told apart by their special operator (erf / tanh), not by this bound.
TOLERANCE = 1e-3


def gelu_erf_reference(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def gelu_tanh_reference(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class _Elementwise:
    """The elementwise tree of one tensor under a root expression, evaluable in numpy (see module docstring).

    A node is part of the tree when it is one of the elementwise operators above, has the root's shape and reads
    only scalar constants and tensors of that shape; anything else (a linear layer's bias add, a broadcast) is a
    leaf. ``ok`` says whether the tree reads exactly one leaf tensor and stays within ``MAX_NODES``."""

    def __init__(self, root: relax.Expr, var2val):
        self.var2val = var2val
        self.shape = tensor_shape(root)
        self.leaf = None
        self.nodes = 0
        self.special = set()
        self.ok = self.shape is not None and self._scan(root) and self.leaf is not None

    def _inner(self, value) -> bool:
        name = op_name(value)
        return ((name in _UNARY or name in _BINARY) and tensor_shape(value) == self.shape
                and all(scalar_constant(arg, self.var2val) is not None
                        or (tensor_shape(arg) == self.shape and not isinstance(resolve(arg, self.var2val), Constant))
                        for arg in value.args))

    def _is_leaf(self, value) -> bool:
        return self.leaf is not None and resolve(self.leaf, self.var2val).same_as(value)

    def _scan(self, expr) -> bool:
        value = resolve(expr, self.var2val)
        if scalar_constant(value) is not None or self._is_leaf(value):
            return True
        self.nodes += 1
        if self.nodes > MAX_NODES:
            return False
        if self._inner(value):
            if op_name(value) in ("relax.erf", "relax.tanh"):
                self.special.add(op_name(value))
            return all(self._scan(arg) for arg in value.args)
        if self.leaf is not None or tensor_shape(expr) != self.shape:
            return False
        self.leaf = expr
        return True

    def evaluate(self, expr, x: np.ndarray) -> np.ndarray:
        value = resolve(expr, self.var2val)
        constant = scalar_constant(value)
        if constant is not None:
            return np.float64(constant)
        if self._is_leaf(value):
            return x
        name = op_name(value)
        if name in _UNARY:
            return _UNARY[name](self.evaluate(value.args[0], x))
        return _BINARY[name](self.evaluate(value.args[0], x), self.evaluate(value.args[1], x))


def _computes(root, var2val, reference, special: str):
    """The tensor ``x`` when ``root`` computes ``reference(x)`` elementwise through ``special`` (erf / tanh)."""
    tree = _Elementwise(root, var2val)
    if not tree.ok or special not in tree.special:
        return None
    with np.errstate(all="ignore"):
        got = tree.evaluate(root, SAMPLES)
    want = reference(SAMPLES)
    if not np.all(np.isfinite(got)) or np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want))) > TOLERANCE:
        return None
    return tree.leaf


class _GeluRule(Rule):
    reference = staticmethod(gelu_erf_reference)
    special = "relax.erf"
    op = staticmethod(relax.op.nn.gelu)
    pattern = is_op("relax.multiply")(wildcard(), wildcard())

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            x = _computes(expr, var2val, self.reference, self.special)
            return None if x is None else self.op(x)

        return rewrite_matches(self.pattern, rewrite, func)


class GeluErf(_GeluRule):
    """Any elementwise spelling of ``0.5 * x * (1 + erf(x / sqrt(2)))`` -> ``nn.gelu(x)``."""

    name = "gelu_erf"


class GeluTanh(_GeluRule):
    """Any elementwise spelling of ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` -> ``nn.gelu_tanh``."""

    name = "gelu_tanh"
    reference = staticmethod(gelu_tanh_reference)
    special = "relax.tanh"
    op = staticmethod(relax.op.nn.gelu_tanh)


class NoOpCasts(Rule):
    """``astype(x, d)`` where ``x`` already is ``d`` -> ``x``: TorchScript's ``Cast`` to float after ViT's Softmax,
    and the float32 -> float32 casts mixed precision leaves where a float16 model's graph cast to float."""

    name = "no_op_casts"
    _x = wildcard()
    pattern = is_op("relax.astype")(_x)

    def apply(self, func):
        def rewrite(expr, matches):
            x = matches[self._x]
            ty = getattr(x, "ty", None)
            if not isinstance(ty, relax.TensorType) or str(ty.dtype) != str(expr.attrs.dtype):
                return None
            return x

        return rewrite_matches(self.pattern, rewrite, func)


# dtype -> the dtypes that hold each of its values exactly (a cast there and back is the identity)
EXACT_WIDENINGS = {"float16": ("float32", "float64"), "bfloat16": ("float32", "float64"), "float32": ("float64",),
                   "int8": ("int16", "int32", "int64"), "int16": ("int32", "int64"), "int32": ("int64",)}


class RoundTripCasts(Rule):
    """``astype(astype(x, wide), d)`` where ``x`` is ``d`` and ``wide`` holds every value of ``d`` exactly -> ``x``:
    a model exported after ``model.half()`` whose attention asks for its softmax in float32 (HF ViT's, Mistral's
    and Llama-style eager attention) comes out of TorchScript as ``Softmax`` (float16) -> ``Cast`` to float ->
    ``Cast`` back to float16 before the P V product."""

    name = "round_trip_casts"
    _x = wildcard()
    _widened = is_op("relax.astype")(_x)
    pattern = is_op("relax.astype")(_widened)

    def apply(self, func):
        def rewrite(expr, matches):
            x = matches[self._x]
            ty = getattr(x, "ty", None)
            wide = str(matches[self._widened].attrs.dtype)
            if not isinstance(ty, relax.TensorType) or str(ty.dtype) != str(expr.attrs.dtype):
                return None
            return x if wide in EXACT_WIDENINGS.get(str(ty.dtype), ()) else None

        return rewrite_matches(self.pattern, rewrite, func)


__all__ = ["IntegerPowers", "GeluErf", "GeluTanh", "NoOpCasts", "RoundTripCasts", "EXACT_WIDENINGS",
           "gelu_erf_reference", "gelu_tanh_reference"]
