"""Layout detours exporters take on the way into attention, removed.

- :class:`SingleConcat`: ``concat((x,))`` -> ``x``. transformers 5's GPT-2 appends K and V to an empty cache
  (``torch.cat([empty, k])``); the exporter drops the empty part and leaves a concat of one tensor between the
  head split and the attention product.
- :class:`TransposeThrough3D`: ``reshape(permute_dims(reshape(x, [B*H, S, D]), [0, 2, 1]), [B, H, D, S])`` ->
  ``permute_dims(x, [0, 1, 3, 2])`` (the dynamo exporter's K^T of SDPA's decomposition, over 3-D batches).
- :class:`PermutePairs`: ``permute_dims(permute_dims(x, a), b)`` -> one permute (or ``x``), so that K's head split
  reads ``permute_dims(reshape(linear), [0, 2, 3, 1])``, the form the QKV projection matcher takes.
"""
from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from ..layout import fold_permute_pairs
from .base import Rule, op_name, resolve, rewrite_matches, tensor_shape


class SingleConcat(Rule):
    """``concat((x,), axis)`` -> ``x``."""

    name = "single_concat"
    pattern = is_op("relax.concat")(wildcard())

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            parts = resolve(expr.args[0], var2val)
            if not isinstance(parts, relax.Tuple) or len(parts.fields) != 1:
                return None
            return parts.fields[0]

        return rewrite_matches(self.pattern, rewrite, func)


def _axes(call) -> list[int] | None:
    axes = call.attrs.axes
    return None if axes is None else [int(a) for a in axes]


class TransposeThrough3D(Rule):
    """A last-two-axes transpose of a [B, H, S, D] tensor written over its [B*H, S, D] view -> one 4-D permute."""

    name = "transpose_through_3d"
    _x = wildcard()
    _inner = is_op("relax.reshape")(_x, wildcard())
    pattern = is_op("relax.reshape")(is_op("relax.permute_dims")(_inner), wildcard())

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            x = matches[self._x]
            permute = resolve(expr.args[0], var2val)
            shape, flat, out = tensor_shape(x), tensor_shape(matches[self._inner]), tensor_shape(expr)
            if shape is None or flat is None or out is None or len(shape) != 4 or _axes(permute) != [0, 2, 1]:
                return None
            b, h, s, d = shape
            if flat != (b * h, s, d) or out != (b, h, d, s):
                return None
            return relax.op.permute_dims(x, [0, 1, 3, 2])

        return rewrite_matches(self.pattern, rewrite, func)


class PermutePairs(Rule):
    """``permute_dims`` of a ``permute_dims`` -> one permute, or its input when they cancel."""

    name = "permute_pairs"

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)
        pairs = [value for value in var2val.values()
                 if op_name(value) == "relax.permute_dims" and _axes(value) is not None
                 and op_name(resolve(value.args[0], var2val)) == "relax.permute_dims"
                 and _axes(resolve(value.args[0], var2val)) is not None]
        if not pairs:
            return None
        return relax.analysis.remove_all_unused(fold_permute_pairs(func))
