"""Inclusive prefix sums along the last axis as one small CUDA kernel that a CUDA graph can capture.

RoBERTa-family exports compute position ids with ``cumsum(input_ids != pad, axis=1)``. TVM dispatches a GPU
``cumsum`` to its generic ``gpu_2d_continuous_cumsum`` (several kernels over symbolic extents), which
``RewriteCUDAGraph`` leaves outside the graphs, splitting the forward pass in two. At the sizes models use the scan
is tiny (a few thousand elements per row), so :func:`scan_rows_primfunc` does it with one warp per row: each lane
sums its contiguous chunk, the 32 chunk sums go through shared memory, each lane adds the sums of the lanes before
it and writes its chunk's running sums. :func:`rewrite_row_scans` puts it in place of every inclusive ``cumsum``
of ``main`` along the last axis of a static shape.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax, tirx

from .attention_match import resolve, scalar_value, static_shape
from .linear_match import is_call
from .op_patterns import OPAQUE

SCAN_SYMBOL = "stof_scan_rows"
LANES = 32
MAX_ROW = 1 << 16   # longer rows keep TVM's own scan (one lane would sum more than 2048 elements)


def scan_rows_primfunc(rows: int, length: int, dtype: str, name: str = SCAN_SYMBOL,
                       target_kind: str = "cuda", unequal_to: tuple[int, str] | None = None) -> tirx.PrimFunc:
    """``(x[rows, length], out[rows, length])``: ``out[r, j] = sum(x[r, :j + 1])``, one warp per row on CUDA, a
    running sum per row on the CPU (where the tests check the rewrite through a whole model); ``name``: its global
    symbol. ``unequal_to = (value, x_dtype)``: x holds ``x_dtype`` values and the scan counts those unequal to
    ``value`` (``out[r, j] = sum(x[r, :j + 1] != value)``: RoBERTa's position ids read the token ids themselves)."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    if rows < 1 or length < 1:
        raise ValueError(f"rows and length must be positive, got {rows} x {length}")
    if target_kind not in ("cuda", "llvm"):
        raise ValueError(f"target_kind must be 'cuda' or 'llvm', got {target_kind!r}")
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE})
            x = T.arg("x", T.Buffer((rows, length), dtype if unequal_to is None else unequal_to[1]))
            out = T.arg("out", T.Buffer((rows, length), dtype))
            if unequal_to is None:
                def term(row, j):
                    return x[row, j]
            else:
                def term(row, j):
                    return tirx.Cast(dtype, x[row, j] != tirx.const(unequal_to[0], unequal_to[1]))
            with T.sblock("root"):      # an opaque root block, as TVMScript's own kernels have (Relax's
                # RewriteDataflowReshape inspects one-input PrimFuncs' bodies and expects one)
                if target_kind == "cuda":
                    _warp_per_row(T, term, out, rows, length, dtype)
                else:
                    acc = T.alloc_buffer((1,), dtype)
                    with T.serial(rows) as row:
                        T.buffer_store(acc, tirx.const(0, dtype), [0])
                        with T.serial(length) as j:
                            T.buffer_store(acc, acc[0] + term(row, j), [0])
                            T.buffer_store(out, acc[0], [row, j])
    return builder.get()


def _warp_per_row(T, term, out, rows: int, length: int, dtype: str) -> None:
    """The CUDA body: lane ``l`` of row ``r``'s warp owns elements ``[l * chunk, (l + 1) * chunk)``; ``term(row,
    j)``: the value summed at (row, j)."""
    chunk = -(-length // LANES)
    zero = tirx.const(0, dtype)
    with T.thread_binding(rows, thread="blockIdx.x") as row:
        with T.thread_binding(LANES, thread="threadIdx.x") as lane:
            sums = T.alloc_buffer((LANES,), dtype, scope="shared")
            acc = T.alloc_buffer((1,), dtype, scope="local")
            T.buffer_store(acc, zero, [0])
            with T.serial(chunk) as e:                  # the lane's chunk sum
                with T.If(lane * chunk + e < length):
                    with T.Then():
                        T.buffer_store(acc, acc[0] + term(row, lane * chunk + e), [0])
            T.buffer_store(sums, acc[0], [lane])
            T.evaluate(T.tvm_storage_sync("shared"))
            T.buffer_store(acc, zero, [0])
            with T.serial(LANES) as before:             # the sums of the lanes before it
                with T.If(before < lane):
                    with T.Then():
                        T.buffer_store(acc, acc[0] + sums[before], [0])
            with T.serial(chunk) as e:                  # the chunk's running sums
                with T.If(lane * chunk + e < length):
                    with T.Then():
                        T.buffer_store(acc, acc[0] + term(row, lane * chunk + e), [0])
                        T.buffer_store(out, acc[0], [row, lane * chunk + e])


def _scannable(call: relax.Call) -> tuple[int, int, str] | None:
    """(rows, length, dtype) of an inclusive last-axis cumsum of a static shape, else None."""
    attrs, x = call.attrs, call.args[0]
    ty = x.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or attrs.exclusive:
        return None
    try:
        shape = [int(d) for d in ty.shape.values]
    except TypeError:           # a symbolic extent
        return None
    dtype = str(call.ty.dtype)
    if not shape or dtype != str(ty.dtype) or dtype not in ("int32", "int64", "float32"):
        return None
    axis = len(shape) - 1 if attrs.axis is None and len(shape) == 1 else attrs.axis
    if axis is None or int(axis) not in (-1, len(shape) - 1) or shape[-1] > MAX_ROW:
        return None
    return math.prod(shape[:-1]), shape[-1], dtype


def unequal_source(x: relax.Expr, var2val: dict) -> tuple[relax.Expr, int] | None:
    """``(ids, value)`` where ``x`` is ``astype(ids != value)`` (spelled ``not_equal``, or ``logical_not`` of
    ``equal`` as the TorchScript export of RoBERTa's ``input_ids.ne(padding_idx)`` comes), ``ids`` an integer tensor of
    ``x``'s shape and ``value`` an integer constant; else None."""
    cast = resolve(x, var2val)
    if not is_call(cast, "relax.astype"):
        return None
    test = resolve(cast.args[0], var2val)
    if is_call(test, "relax.logical_not") and is_call(resolve(test.args[0], var2val), "relax.equal"):
        test = resolve(test.args[0], var2val)
    elif not is_call(test, "relax.not_equal"):
        return None
    for ids, other in (test.args, test.args[::-1]):
        value = scalar_value(other, var2val)
        if (value is not None and float(value).is_integer() and isinstance(ids.ty, relax.TensorType)
                and "int" in str(ids.ty.dtype) and static_shape(ids) == static_shape(x) is not None):
            return ids, int(value)
    return None


def rewrite_row_scans(mod: tvm.IRModule, target_kind: str = "cuda") -> tvm.IRModule:
    """``main`` with each inclusive last-axis ``cumsum`` of a static shape computed by :func:`scan_rows_primfunc`
    for ``target_kind``. Where the summed tensor is ``astype(ids != value)`` (:func:`unequal_source`) the scan reads
    ``ids`` and counts in place, so the comparison's own kernel goes (its other users, RoBERTa's ``* mask``, fuse it
    into theirs). A mutator of the calls alone: a pattern rewrite would also merge equal subexpressions of ``main``
    and so change how its other operators fuse."""
    builder_mod = {"mod": mod}
    functions: dict[tuple, tvm.ir.GlobalVar] = {}
    var2val = relax.analysis.get_var2val(mod["main"])

    def scan_function(spec, unequal_to) -> tvm.ir.GlobalVar:
        key = (spec, unequal_to)
        if key not in functions:
            rows, length, dtype = spec
            name = f"{SCAN_SYMBOL}_{rows}x{length}_{dtype}" + ("" if unequal_to is None else "_unequal")
            builder = relax.BlockBuilder(builder_mod["mod"])
            functions[key] = builder.add_func(scan_rows_primfunc(rows, length, dtype, name, target_kind, unequal_to),
                                              name)
            builder_mod["mod"] = builder.get()
        return functions[key]

    @relax.expr_functor.mutator
    class Scans(relax.PyExprMutator):
        def visit_call_(self, call: relax.Call) -> relax.Expr:
            call = super().visit_call_(call)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.cumsum"):
                return call
            spec = _scannable(call)
            if spec is None:
                return call
            rows, length, dtype = spec
            x = call.args[0]
            source = unequal_source(x, var2val)
            summed, unequal_to = (x, None) if source is None else (source[0], (source[1], str(source[0].ty.dtype)))
            flat = self.builder_.emit(relax.op.reshape(summed, [rows, length]))
            scanned = self.builder_.emit(relax.call_tir(scan_function(spec, unequal_to), [flat],
                                                        relax.TensorType([rows, length], dtype)))
            return relax.op.reshape(scanned, list(x.ty.shape.values))

    main = Scans().visit_expr(mod["main"])
    out = builder_mod["mod"]
    out["main"] = main
    return out
