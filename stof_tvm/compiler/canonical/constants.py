"""Constants folded to full size, brought back to the size their values need.

- :class:`RepeatedConstant`: a large constant operand of a broadcasting elementwise operator whose values repeat along
  some axes -> the constant with those axes of length 1 (exact: broadcasting gives every element the same value).
  Constant folding materialises what the model broadcasts: a BERT export without a ``token_type_ids`` input gathers
  its token-type embedding with constant zeros, and TVM folds that into a ``[B, S, hidden]`` float32 tensor, 12.6 MB
  at 8 x 512 tokens and 100 MB at 16 x 2048, stored in the module and read by every forward pass; its one row is
  3 KB.
"""
from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.ir.expr import Constant

from .base import Rule, op_name, tensor_shape

BROADCASTING = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum")
MIN_ELEMENTS = 1 << 14      # smaller constants are not worth the check (tiny BERT at 2 x 64 tokens: 16384)


def repeated_axes_removed(value: np.ndarray) -> np.ndarray:
    """``value`` with every axis along which all its slices are equal cut to length 1."""
    for axis in range(value.ndim):
        if value.shape[axis] > 1:
            first = np.take(value, [0], axis=axis)
            # two slices first: an axis that varies (most do) costs two slices, not a pass over the whole constant
            if (np.array_equal(first, np.take(value, [1], axis=axis))
                    and np.array_equal(value, np.broadcast_to(first, value.shape))):
                value = first
    return value


class RepeatedConstant(Rule):
    """``op(x, C)`` / ``op(C, x)`` with ``C`` a large constant that repeats along some axes -> ``C`` cut to one slice
    along them, where broadcasting still gives the output its shape."""

    name = "repeated_constant"

    def apply(self, func):
        changed = []

        @relax.expr_functor.mutator
        class Shrink(relax.PyExprMutator):
            def visit_call_(self, call):
                call = super().visit_call_(call)
                if op_name(call) not in BROADCASTING:
                    return call
                args = list(call.args)
                for i, arg in enumerate(args):
                    small = _shrunk(arg, args[1 - i], tensor_shape(call))
                    if small is not None:
                        args[i] = small
                if all(a.same_as(b) for a, b in zip(args, call.args)):
                    return call
                changed.append(call)
                return relax.Call(call.op, args, call.attrs)

        out = Shrink().visit_expr(func)
        return out if changed else None


def _shrunk(arg, other, out_shape) -> Constant | None:
    """``arg`` cut to its repeating slices, where it is a large constant and the result keeps ``out_shape``."""
    if not isinstance(arg, Constant) or out_shape is None:
        return None
    value = arg.value.numpy()
    if value.size < MIN_ELEMENTS:
        return None
    small = repeated_axes_removed(value)
    other_shape = tensor_shape(other)
    if small.shape == value.shape or other_shape is None:
        return None
    if tuple(np.broadcast_shapes(small.shape, other_shape)) != tuple(out_shape):
        return None
    return relax.const(np.ascontiguousarray(small), str(arg.ty.dtype))


__all__ = ["RepeatedConstant", "repeated_axes_removed"]
