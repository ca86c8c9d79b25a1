"""Whether a score bias computed in float32 may reach the sparse kernel in the model's 16-bit dtype.

A sparse kernel's score bias is a ``[Bb, Hb, Sq, Sk]`` tensor the graph writes on every forward and the kernel reads
at each kept key: at DeBERTa-v3-base's 8 x 512 tokens 100 MB of float32 a layer, more than the layer's weights and
activations together. Its two relative-position terms are gathers of products that the graph has already rounded to
float16 (``astype`` to float32 after a float16 matmul), divided by a constant and summed: rounding that sum to 16
bits once more adds an error of the same size as the roundings already in it, and halves the bytes the bias kernel
writes and the attention kernel reads.

:func:`narrows_exactly_enough` accepts a bias only when every value it is made of went through a 16-bit tensor and
what follows is arithmetic a 16-bit graph does itself: the walk from the bias back through the function's bindings
passes only value-preserving operators (layout changes, gathers, broadcasts, casts), sums and differences, products
of such operands (a matmul's float32 accumulation, which every 16-bit GEMM rounds), division by a scalar constant of
magnitude at least 1, multiplication by one of magnitude at most 1 and finite scalar constants (rounded with the sum
they join), and stops at 16-bit tensors. Anything else (a float32 weight or input, a constant tensor of float32
values, an exponential) keeps the bias in float32, as ModernBERT's per-site masks (float32 fills) stay. T5's
position bias is float16 in the graph already.
"""
from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax

NARROW_DTYPES = ("float16", "bfloat16")
# Operators whose output holds only values of their tensor inputs (or their sums): the walk goes on through them
_VALUE_PRESERVING = frozenset({"relax.reshape", "relax.permute_dims", "relax.broadcast_to", "relax.take",
                               "relax.astype", "relax.expand_dims", "relax.squeeze", "relax.strided_slice",
                               "relax.concat", "relax.add", "relax.subtract", "relax.matmul"})


def _dtype(expr) -> str | None:
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def _scalar_constant(expr) -> float | None:
    """The value of a finite one-element float constant, else None."""
    if not isinstance(expr, tvm.ir.expr.Constant):
        return None
    values = expr.value.numpy()
    if values.size != 1 or not np.issubdtype(values.dtype, np.floating):
        return None
    value = float(values.reshape(()))
    return value if math.isfinite(value) else None


def narrows_exactly_enough(expr, var2val: dict) -> bool:
    """Whether the float32 bias ``expr`` is made only of values that went through 16-bit tensors (see the module
    docstring); ``var2val``: the bindings of the function it lives in."""
    seen: set = set()

    def walk(node) -> bool:
        dtype = _dtype(node)
        if dtype in NARROW_DTYPES:
            return True
        if dtype is not None and not dtype.startswith("float"):
            return True                     # index tables, integer inputs
        if isinstance(node, relax.Var):
            if node in seen:
                return True
            seen.add(node)
            bound = var2val.get(node)
            return bound is not None and walk(bound)
        if isinstance(node, tvm.ir.expr.Constant):
            return _scalar_constant(node) is not None   # rounded with the sum it joins
        if isinstance(node, relax.Tuple):
            return all(walk(field) for field in node.fields)
        if not isinstance(node, relax.Call) or not isinstance(node.op, tvm.ir.Op):
            return False
        name = node.op.name
        tensors = [arg for arg in node.args
                   if isinstance(arg, (relax.Var, relax.Call, tvm.ir.expr.Constant, relax.Tuple))]
        if name in ("relax.divide", "relax.multiply") and len(tensors) == 2:
            # x / c with |c| >= 1, x * c or c * x with |c| <= 1: no value grows
            scalar_at = 1 if name == "relax.divide" or _scalar_constant(tensors[0]) is None else 0
            scalar = _scalar_constant(tensors[scalar_at])
            shrinks = scalar is not None and (abs(scalar) >= 1.0 if name == "relax.divide" else abs(scalar) <= 1.0)
            return shrinks and walk(tensors[1 - scalar_at])
        if name not in _VALUE_PRESERVING:
            return False
        return all(walk(arg) for arg in tensors)

    return walk(expr)
