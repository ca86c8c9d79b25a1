"""``gather_elements`` by an index that is one small tensor broadcast over the leading axis, as a ``take``.

HF DeBERTa-v3 gathers its relative-position scores with ``gather(c2p, -1, index.expand([B*H, S, S]))``: one
[1, S, S] table of positions, broadcast to every head of every batch row. TVM's importer spells it as
``gather_elements(x, where(less(i, 0), add(i, n), i))`` with ``i = broadcast_to(table, [B*H, S, S])``, and constant
folding then materialises every broadcast index (int64, B*H*S*S elements: 200 MB at 8 x 512 per gather, 24 gathers
in a base model, a peak of 16.7 GB). :func:`narrow_gather_indices`, run before folding, computes the index's
elementwise arithmetic on the table itself and gathers with ``take`` over the flattened last two axes:
``out[n, i, j] = x[n, i, t[i, j]] = x.reshape(N, S * K)[n, i * K + t[i, j]]``, whose index is one [S, S'] table
(int32 where it fits: the gathering kernel reads it once per element of every head). Exact: the same elements are
read.

DeBERTa transposes one of the two gathers (position-to-content: ``gather(p2c, -1, t).transpose(-1, -2)``). That
gather stays a ``take`` in the layout it reads, followed by the transpose: ``FuseOps`` puts both in the bias kernel,
whose schedule (:mod:`stof_tvm.schedules.staged_transpose`) computes the take in its own order, coalesced along the
rows of ``p2c`` and of the table, into shared memory and reads it back transposed. Taken in the output's order, or
from the transposed product, consecutive threads would read addresses a row apart wherever the relative position is
exact.

An index already folded into a constant (TorchScript exports at a fixed shape) is one table where every slice along
the leading axis is the same.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .canonical.base import op_name, resolve, tensor_shape

_ELEMENTWISE = {"relax.where": relax.op.where, "relax.add": relax.op.add, "relax.subtract": relax.op.subtract,
                "relax.less": relax.op.less, "relax.multiply": relax.op.multiply}


def _on_table(expr, var2val, big: tuple[int, ...]):
    """``expr`` (an index of shape ``big``) recomputed on the table its one ``broadcast_to`` spreads over the
    leading axis: ``(table expression, source)``, or None where it is not of that form. ``source`` is what every
    table operand of ``expr`` must be read from, the broadcast's operand or the folded index constant."""
    value = resolve(expr, var2val)
    shape = tensor_shape(value)
    if shape == () or shape == (1,):
        return value, None                      # a scalar operand stays as it is
    if shape != big:
        return None
    if isinstance(value, tvm.ir.expr.Constant):        # already folded: one table if every slice is the first
        array = value.value.numpy()
        if not (array == array[:1]).all():
            return None
        return relax.const(array[:1], str(array.dtype)), value
    name = op_name(value)
    if name == "relax.broadcast_to":
        table = value.args[0]
        small = tensor_shape(table)
        if small is None or len(small) != len(big) or small[0] != 1 or tuple(small[1:]) != big[1:]:
            return None
        return table, table
    if name not in _ELEMENTWISE:
        return None
    parts = [_on_table(arg, var2val, big) for arg in value.args]
    if any(part is None for part in parts):
        return None
    tables = [t for _, t in parts if t is not None]
    if not tables or not all(t.same_as(tables[0]) for t in tables):
        return None
    return _ELEMENTWISE[name](*[e for e, _ in parts]), tables[0]


def _table_gather(call, var2val):
    """``(x, table expression)`` of a ``gather_elements`` on the last axis of a 3-D ``x`` by an index that is one
    [1, S, S'] table broadcast over the leading axis; None for any other call."""
    if op_name(call) != "relax.gather_elements":
        return None
    x, index = call.args
    shape, big = tensor_shape(x), tensor_shape(index)
    if shape is None or big is None or len(shape) != 3 or int(call.attrs.axis) not in (-1, 2) or big[:2] != shape[:2]:
        return None
    found = _on_table(index, var2val, big)
    if found is None or found[1] is None:
        return None
    return x, relax.op.reshape(found[0], big[1:])


def _flat_index(table, offsets: np.ndarray, size: int):
    """``table + offsets`` in the narrowest integer type that indexes ``size`` elements: int32 below 2^31, so the
    gathering kernel reads 4 bytes of index per element instead of 8 (the table is read once per element of every
    head and batch row)."""
    dtype = "int32" if size < 2 ** 31 else "int64"
    return relax.op.add(relax.op.astype(table, dtype), relax.const(offsets.astype(dtype), dtype))


def narrow_gather_indices(mod: tvm.IRModule) -> tvm.IRModule:
    """``main`` with each ``gather_elements`` on the last axis of a 3-D tensor by a broadcast table rewritten as a
    ``take`` by one flattened table (module docstring); other gathers are left as they are."""
    func = mod["main"]
    var2val = relax.analysis.get_var2val(func)

    @relax.expr_functor.mutator
    class Narrow(relax.PyExprMutator):
        def visit_call_(self, original):
            call = super().visit_call_(original)
            found = _table_gather(call, var2val)
            if found is None:
                return call
            x, table = found
            n, rows, width = tensor_shape(x)
            index = _flat_index(table, (np.arange(rows) * width)[:, None], rows * width)
            return relax.op.take(relax.op.reshape(x, (n, rows * width)), index, axis=1)

    out = mod.clone()
    out["main"] = relax.analysis.remove_all_unused(Narrow().visit_expr(func))
    return out


__all__ = ["narrow_gather_indices"]
