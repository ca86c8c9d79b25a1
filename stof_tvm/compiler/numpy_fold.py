"""Constant folding in numpy for the high-level Relax calls ONNX imports produce on constants.

TVM's ``FoldConstant`` folds a call whose arguments are all constants by legalizing it, building an LLVM kernel
and running it: ~0.1 s of compile time per call. The ONNX importer spells every ``Gather`` on a shape as
``take(shape_to_tensor(shape_of(x)), where(less(i, 0), add(i, n), i))``, so an HF BigBird block_sparse export
folds 253 such calls (20-70 s per compile) and a tiny RoBERTa 18 (0.5-0.8 s). Here each op family is one small
rule (like TVM's dlight): ``apply(call, args)`` returns the folded value (a numpy array whose dtype is the call's,
or a static ``ShapeExpr``) or None where it does not fold the call exactly as TVM would (out-of-range indices,
integer division by zero, dtypes it does not know); :func:`fold_numpy` applies the rules in one pass over each
function, in binding order, so a folded value feeds the next call (a fixed point in one pass). Whatever no rule
folds is left to ``FoldConstant``, which runs after it.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

def _out_dtype(call) -> str:
    return str(call.ty.dtype)


class Rule:
    """One op family: ``ops`` are the Relax op names it folds; ``apply(call, args)`` -> value or None."""
    ops: tuple[str, ...] = ()

    def apply(self, call, args: list):
        raise NotImplementedError


class ShapeOf(Rule):
    """``shape_of(x)`` where ``x``'s shape is static: that shape (its argument need not be constant)."""
    ops = ("relax.shape_of",)

    def apply(self, call, args):
        shape = getattr(call.args[0].ty, "shape", None)
        if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
            return None
        return tuple(int(d) for d in shape.values)


class ShapeToTensor(Rule):
    """``shape_to_tensor(shape)``: the shape as a 1-D int64 tensor."""
    ops = ("relax.shape_to_tensor",)

    def apply(self, call, args):
        return np.array(args[0], "int64") if isinstance(args[0], tuple) else None


class Elementwise(Rule):
    """Broadcasting binary arithmetic and comparisons with numpy's semantics where they equal TVM's: wrap-around
    integer add/subtract/multiply, IEEE float ops computed in the operands' own dtype."""
    ARITH = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
             "relax.maximum": np.maximum, "relax.minimum": np.minimum}
    COMPARE = {"relax.less": np.less, "relax.less_equal": np.less_equal, "relax.greater": np.greater,
               "relax.greater_equal": np.greater_equal, "relax.equal": np.equal, "relax.not_equal": np.not_equal}
    LOGIC = {"relax.logical_and": np.logical_and, "relax.logical_or": np.logical_or}
    ops = tuple(ARITH) + tuple(COMPARE) + tuple(LOGIC)

    def apply(self, call, args):
        a, b = args
        if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray) or a.dtype != b.dtype:
            return None
        name = call.op.name
        fn = self.ARITH.get(name) or self.COMPARE.get(name) or self.LOGIC[name]
        with np.errstate(over="ignore"):
            return np.asarray(fn(a, b)).astype(_out_dtype(call))


class Divide(Rule):
    """``divide`` (float: IEEE; integer: truncated, as TIR's ``Div``) and ``floor_divide`` (floored); an integer
    division by zero is left to TVM."""
    ops = ("relax.divide", "relax.floor_divide")

    def apply(self, call, args):
        a, b = args
        if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray) or a.dtype != b.dtype:
            return None
        if a.dtype.kind == "f":
            out = np.divide(a, b)           # TIR's float floordiv is floor(a / b), not numpy's fmod-based one
            out = np.floor(out) if call.op.name == "relax.floor_divide" else out
            return np.asarray(out).astype(_out_dtype(call))
        if a.dtype.kind not in "iu" or (b == 0).any():
            return None
        floor = np.floor_divide(a, b)
        if call.op.name == "relax.divide":          # truncation: the floored quotient, one up where inexact < 0
            floor = floor + ((floor < 0) & (floor * b != a)).astype(a.dtype)
        return np.asarray(floor).astype(_out_dtype(call))


class Where(Rule):
    """``where(cond, x, y)`` with broadcasting."""
    ops = ("relax.where",)

    def apply(self, call, args):
        if not all(isinstance(a, np.ndarray) for a in args) or args[0].dtype != np.bool_:
            return None
        return np.asarray(np.where(*args)).astype(_out_dtype(call))


class Take(Rule):
    """``take(data, indices, axis)`` where every index is in range (then every ``mode`` agrees)."""
    ops = ("relax.take",)

    def apply(self, call, args):
        data, indices = args
        if not isinstance(data, np.ndarray) or not isinstance(indices, np.ndarray) or indices.dtype.kind not in "iu":
            return None
        axis = call.attrs.axis
        axis = 0 if axis is None else int(axis)
        if data.ndim == 0 or ((indices < 0) | (indices >= data.shape[axis])).any():
            return None
        return np.take(data, indices, axis=axis).astype(_out_dtype(call))


class StridedSlice(Rule):
    """``strided_slice(x, axes, begin, end[, strides])`` with constant bounds: Python slicing, as TVM clamps."""
    ops = ("relax.strided_slice",)

    def apply(self, call, args):
        data = args[0]
        if not isinstance(data, np.ndarray):
            return None
        try:
            axes, begin, end, *strides = (_ints(a) for a in call.args[1:])
        except TypeError:
            return None
        strides = strides[0] if strides else [1] * len(axes)
        index = [slice(None)] * data.ndim
        for axis, lo, hi, step in zip(axes, begin, end, strides):
            index[axis] = slice(lo, hi, step)
        out = data[tuple(index)]
        return out.astype(_out_dtype(call)) if out.shape == _static_shape(call) else None


class Astype(Rule):
    """``astype(x, dtype)`` (numpy's cast; float -> int truncates, as TVM's does)."""
    ops = ("relax.astype",)

    def apply(self, call, args):
        x = args[0]
        if not isinstance(x, np.ndarray) or (x.dtype.kind == "f" and not np.isfinite(x).all()
                                             and _out_dtype(call)[0] in "iub"):
            return None
        return x.astype(_out_dtype(call))


class Layout(Rule):
    """Data movement: ``reshape`` / ``expand_dims`` / ``squeeze`` / ``broadcast_to`` (to the call's static
    shape), ``permute_dims``, ``concat``."""
    ops = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.broadcast_to", "relax.permute_dims",
           "relax.concat")

    def apply(self, call, args):
        name, shape = call.op.name, _static_shape(call)
        if shape is None:
            return None
        if name == "relax.concat":
            parts = args[0]
            if not isinstance(parts, list) or not all(isinstance(p, np.ndarray) for p in parts):
                return None
            out = np.concatenate(parts, axis=int(call.attrs.axis))
        elif not isinstance(args[0], np.ndarray):
            return None
        elif name == "relax.permute_dims":
            axes = call.attrs.axes
            out = np.transpose(args[0], None if axes is None else [int(a) for a in axes])
        elif name == "relax.broadcast_to":
            out = np.broadcast_to(args[0], shape)
        else:
            out = args[0].reshape(shape)
        return np.ascontiguousarray(out).astype(_out_dtype(call)) if out.shape == shape else None


RULES: list[Rule] = [ShapeOf(), ShapeToTensor(), Elementwise(), Divide(), Where(), Take(), StridedSlice(),
                     Astype(), Layout()]
_BY_OP = {op: rule for rule in RULES for op in rule.ops}


def _static_shape(call) -> tuple[int, ...] | None:
    shape = getattr(call.ty, "shape", None)
    if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        return None
    return tuple(int(d) for d in shape.values)


def _ints(expr) -> list[int]:
    """The integers of a static ShapeExpr / tuple of PrimValues / constant (TypeError where not static)."""
    if isinstance(expr, tvm.ir.expr.Constant):
        return [int(v) for v in expr.value.numpy().reshape(-1)]
    values = expr.values if isinstance(expr, relax.ShapeExpr) else getattr(expr, "fields", ())
    values = [getattr(v, "value", v) if not isinstance(v, tvm.tirx.IntImm) else v for v in values]
    if not all(isinstance(v, tvm.tirx.IntImm) for v in values):
        raise TypeError("not static")
    return [int(v) for v in values]


def _to_expr(value, call):
    if isinstance(value, tuple):
        return relax.ShapeExpr(list(value))
    return relax.const(value, _out_dtype(call))


def fold_call(call, values: dict):
    """The folded expression of ``call`` (a Constant or a static ShapeExpr), or None. ``values`` maps the
    variables already folded to their values."""
    rule = _BY_OP.get(call.op.name) if isinstance(call.op, tvm.ir.Op) else None
    if rule is None:
        return None
    args = [_value(a, values) for a in call.args]
    if not isinstance(rule, ShapeOf) and any(a is None for a in args):
        return None
    value = rule.apply(call, args)
    return None if value is None else _to_expr(value, call)


def _value(expr, values: dict):
    if isinstance(expr, tvm.tirx.IntImm):
        return int(expr)
    if isinstance(expr, relax.Var):
        return values.get(expr)
    if isinstance(expr, tvm.ir.expr.Constant):
        return expr.value.numpy()
    if isinstance(expr, relax.ShapeExpr):
        if all(isinstance(v, tvm.tirx.IntImm) for v in expr.values):
            return tuple(int(v) for v in expr.values)
        return None
    if isinstance(expr, relax.Tuple):
        fields = [_value(f, values) for f in expr.fields]
        return None if any(f is None for f in fields) else fields
    return None


def fold_numpy(mod: tvm.IRModule) -> tvm.IRModule:
    """Every Relax function of ``mod`` with the calls the rules fold replaced by their constants (a variable bound
    to a folded call is bound to its constant and read as it, as ``FoldConstant`` leaves them)."""

    @relax.expr_functor.mutator
    class Fold(relax.PyExprMutator):
        def __init__(self):
            super().__init__()
            self.values, self.constants = {}, {}

        def visit_var_binding_(self, binding):
            value = self.visit_expr(binding.value)
            folded = fold_call(value, self.values) if isinstance(value, relax.Call) else None
            if folded is None and isinstance(value, tvm.ir.expr.Constant):      # a constant the import bound
                folded = value
            if folded is None:
                super().visit_var_binding_(binding)
                return
            self.values[binding.var] = _value(folded, {})
            if isinstance(folded, tvm.ir.expr.Constant):
                self.constants[binding.var] = folded
            self.builder_.emit_normalized(relax.VarBinding(binding.var, folded))

        def visit_var_(self, var):
            return self.constants.get(var) or super().visit_var_(var)

    folded = mod.clone()
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            folded[gv] = Fold().visit_expr(func)
    return folded
