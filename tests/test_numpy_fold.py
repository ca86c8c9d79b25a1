"""The numpy constant folder (:mod:`stof_tvm.compiler.numpy_fold`) folds each op family exactly as TVM's
``FoldConstant`` does (values and dtypes: TVM's result is built and run on llvm here), and leaves alone the calls
it cannot fold exactly."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

from stof_tvm.compiler.numpy_fold import RULES, fold_numpy


def _module(make, params=()):
    """A module whose main returns ``make(*params)`` (one call, bound in a dataflow block)."""
    bb = relax.BlockBuilder()
    with bb.function("main", list(params)):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(make(*params)))
        bb.emit_func_output(out)
    return bb.get()


def _result(mod):
    """The expression main's output variable is bound to (or main's body where it returns an expression)."""
    func = mod["main"]
    body = func.body.body
    for block in func.body.blocks:
        for binding in block.bindings:
            if binding.var.same_as(body):
                body = binding.value
    while isinstance(body, relax.Var):      # the output var bound to the folded var
        body = next(b.value for blk in func.body.blocks for b in blk.bindings if b.var.same_as(body))
    return body


def _check_same_fold(make, params=()):
    mod = _module(make, params)
    ours, tvms = _result(fold_numpy(mod)), _result(relax.transform.FoldConstant()(mod))
    assert isinstance(ours, type(tvms)), (ours, tvms)
    if isinstance(tvms, relax.ShapeExpr):
        assert [int(v) for v in ours.values] == [int(v) for v in tvms.values]
        return
    assert isinstance(tvms, tvm.ir.expr.Constant)           # TVM folds it: the comparison means something
    mine, theirs = ours.value.numpy(), tvms.value.numpy()
    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
    np.testing.assert_array_equal(mine, theirs)


def _const(array):
    return relax.const(array, str(array.dtype))


INTS = st.sampled_from(["int32", "int64"])
SHAPES = st.sampled_from([((3,), (3,)), ((2, 3), (3,)), ((2, 1), (1, 3)), ((), (4,))])


def _array(draw, shape, dtype, low=-50, high=50):
    n = int(np.prod(shape)) if shape else 1
    values = draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
    return np.array(values, dtype).reshape(shape)


@st.composite
def binary_operands(draw):
    """Two broadcastable integer arrays of one dtype (the tests scale them into floats where asked)."""
    dtype = draw(INTS)
    sa, sb = draw(SHAPES)
    return _array(draw, sa, dtype), _array(draw, sb, dtype)


@pytest.mark.parametrize("op", ["add", "subtract", "multiply", "maximum", "minimum", "less", "less_equal",
                                "greater", "greater_equal", "equal", "not_equal"])
@settings(max_examples=3, deadline=None)
@given(operands=binary_operands(), floats=st.booleans())
def test_elementwise_matches_fold_constant(op, operands, floats):
    a, b = operands
    if floats:
        a, b = a.astype("float32") / np.float32(7), b.astype("float32") / np.float32(3)
    _check_same_fold(lambda: getattr(relax.op, op)(_const(a), _const(b)))


@pytest.mark.parametrize("op", ["divide", "floor_divide"])
@settings(max_examples=4, deadline=None)
@given(operands=binary_operands(), floats=st.booleans())
def test_division_matches_fold_constant(op, operands, floats):
    """Integer ``divide`` truncates (TIR's Div), ``floor_divide`` floors; negative operands included."""
    a, b = operands
    b = np.where(b == 0, np.ones_like(b), b)
    if floats:
        a, b = a.astype("float32"), b.astype("float32") * np.float32(0.3)
    _check_same_fold(lambda: getattr(relax.op, op)(_const(a), _const(b)))


@pytest.mark.parametrize("op", ["divide", "floor_divide"])
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_division_rounds_like_tvm(op, dtype):
    """Every sign combination, exact and inexact: ``divide`` truncates, ``floor_divide`` floors."""
    a = np.array([-7, 7, -7, 7, -6, 0, -1, 5], dtype)
    b = np.array([2, -2, -2, 2, 3, -3, 4, -7], dtype)
    _check_same_fold(lambda: getattr(relax.op, op)(_const(a), _const(b)))


def test_float_floor_divide_is_floor_of_the_quotient():
    """TVM floors the rounded quotient: 1 // 0.1 is 10 there (numpy's floor_divide says 9)."""
    _check_same_fold(lambda: relax.op.floor_divide(_const(np.array([1.0, 7.0], "float32")),
                                                   _const(np.array([0.1, 0.7], "float32"))))


def test_integer_division_by_zero_is_left_to_tvm():
    mod = _module(lambda: relax.op.divide(_const(np.array([4, 5], "int64")), _const(np.array([2, 0], "int64"))))
    assert isinstance(_result(fold_numpy(mod)), relax.Call)


def test_the_onnx_gather_on_a_shape_folds_like_fold_constant():
    """``take(shape_to_tensor(shape_of(x)), where(less(i, 0), add(i, n), i))``: the importer's Gather on a shape,
    folded through every rule it uses (shape_of of a non-constant tensor with a static shape)."""
    x = relax.Var("x", relax.TensorType((2, 5, 7), "float32"))
    for index in (-1, 1):
        i = _const(np.array(index, "int64"))

        def gather(x):
            shape = relax.op.shape_to_tensor(relax.op.shape_of(x))
            fixed = relax.op.where(relax.op.less(i, _const(np.array(0, "int64"))),
                                   relax.op.add(i, _const(np.array(3, "int64"))), i)
            return relax.op.take(shape, fixed, axis=0)

        bb = relax.BlockBuilder()
        with bb.function("main", [x]):
            with bb.dataflow():
                lv = bb.emit(relax.op.shape_to_tensor(bb.emit(relax.op.shape_of(x))))
                neg = bb.emit(relax.op.less(i, _const(np.array(0, "int64"))))
                fixed = bb.emit(relax.op.where(neg, bb.emit(relax.op.add(i, _const(np.array(3, "int64")))), i))
                out = bb.emit_output(bb.emit(relax.op.take(lv, fixed, axis=0)))
            bb.emit_func_output(out)
        ours = _result(fold_numpy(bb.get()))
        assert isinstance(ours, tvm.ir.expr.Constant) and ours.value.numpy() == (7 if index < 0 else 5)
        _check_same_fold(gather, [x])


def test_a_variable_bound_to_a_constant_folds_through():
    """The importer binds some constants to variables (``lv = R.const(...)``): calls reading them fold too."""
    bb = relax.BlockBuilder()
    with bb.function("main", []):
        with bb.dataflow():
            bound = bb.emit(_const(np.arange(6, dtype="int64")))
            out = bb.emit_output(bb.emit(relax.op.strided_slice(relax.op.add(bound, bound), [0], [1], [4])))
        bb.emit_func_output(out)
    folded = _result(fold_numpy(bb.get()))
    assert isinstance(folded, tvm.ir.expr.Constant)
    np.testing.assert_array_equal(folded.value.numpy(), [2, 4, 6])


def test_take_out_of_range_is_left_to_tvm():
    mod = _module(lambda: relax.op.take(_const(np.arange(3, dtype="int64")), _const(np.array([3], "int64")),
                                        axis=0))
    assert isinstance(_result(fold_numpy(mod)), relax.Call)


@pytest.mark.parametrize("dtype", ["int64", "float32", "bool"])
def test_where_take_and_casts_match_fold_constant(dtype):
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((4, 3)) * 5).astype(dtype)
    cond = rng.standard_normal((4, 1)) > 0
    _check_same_fold(lambda: relax.op.where(_const(cond), _const(data), _const(data[::-1].copy())))
    _check_same_fold(lambda: relax.op.take(_const(data), _const(np.array([2, 0, 2], "int64")), axis=1))
    _check_same_fold(lambda: relax.op.take(_const(data), _const(np.array(3, "int32")), axis=0))
    for to in ("int32", "float16", "bool", "int64"):
        _check_same_fold(lambda: relax.op.astype(_const(data), to))


@pytest.mark.parametrize("make", [
    lambda c: relax.op.reshape(c, (3, 8)),
    lambda c: relax.op.expand_dims(c, [0, 3]),
    lambda c: relax.op.squeeze(relax.op.expand_dims(c, [1]), [1]),
    lambda c: relax.op.broadcast_to(c, (2, 2, 3, 4)),
    lambda c: relax.op.permute_dims(c, [2, 0, 1]),
    lambda c: relax.op.permute_dims(c),
    lambda c: relax.op.concat([c, c], axis=1),
    lambda c: relax.op.strided_slice(c, [0, 2], [1, 3], [2, 0], [1, -1]),
    lambda c: relax.op.strided_slice(c, [1], [0], [100], [2]),
    lambda c: relax.op.strided_slice(c, [2], [1], [3]),
], ids=["reshape", "expand_dims", "squeeze", "broadcast_to", "permute_dims", "transpose", "concat",
        "strided_slice_negative_step", "strided_slice_clamped",
        "strided_slice_no_strides"])
def test_layout_ops_match_fold_constant(make):
    data = np.arange(24, dtype="float32").reshape(2, 3, 4)
    _check_same_fold(lambda: make(_const(data)))


def test_every_rule_has_ops_and_the_ops_are_disjoint():
    ops = [op for rule in RULES for op in rule.ops]
    assert ops and len(ops) == len(set(ops))
