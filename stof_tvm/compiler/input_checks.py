"""Make ``main`` safe for any input values, and let it report the ones outside their valid range.

- :func:`clip_gathers`: every ``take`` whose indices come from the inputs (embedding lookups of token ids)
  clamps them into the table (``mode="clip"``) instead of trusting them (``"fast"``): an out-of-range token id
  can no longer read outside the table (a segfault on the CPU; on a GPU a fault that can end the process's CUDA
  context).
- :func:`add_value_checks`: ``main`` also returns ``stof_value_errors``, an int64 vector with, per checked input,
  how many of its values are outside ``[low, high)`` (token ids: the embedding rows; an attention mask: 0 / 1),
  computed on the device with the forward pass. The runtime reads these few bytes after the call and raises a
  clear error when one is not 0, so no input is ever copied to the host to be checked.
"""
from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import relax, s_tir, te, tirx

from .attention_match import static_shape
from .op_patterns import OPAQUE

VALUE_ERRORS = "stof_value_errors"
COUNT_SYMBOL = "stof_count_outside"
MAX_THREADS = 1024


@dataclasses.dataclass(frozen=True)
class ValueCheck:
    """Values of input ``name`` must lie in ``[low, high)``."""

    name: str
    low: int
    high: int

    def to_json(self) -> dict:
        return {"name": self.name, "low": self.low, "high": self.high}


@relax.expr_functor.mutator
class _ClipGathers(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.take" and call.attrs.mode == "fast"
                and not isinstance(call.args[1], tvm.ir.expr.Constant)):
            return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
        return call


def clip_gathers(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every input-indexed ``take`` of ``main`` clamping its indices."""
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod["main"] = _ClipGathers().visit_expr(mod["main"])
    return mod


def _outside(value: relax.Expr, check: ValueCheck) -> relax.Expr:
    """Whether each value lies outside ``[low, high)`` (bool, ``value``'s shape)."""
    dtype = str(value.ty.dtype)
    return relax.op.logical_or(relax.op.less(value, relax.const(check.low, dtype)),
                               relax.op.greater_equal(value, relax.const(check.high, dtype)))


def _out_of_range_count(value: relax.Expr, check: ValueCheck) -> relax.Expr:
    return relax.op.sum(relax.op.astype(_outside(value, check), "int64"))


def _same_shape(values: list[relax.Expr]) -> bool:
    shapes = {static_shape(v) for v in values}
    return len(shapes) == 1 and bool(next(iter(shapes)))


def count_outside_primfunc(checks: list[ValueCheck], dtypes: list[str], size: int, target_kind: str = "cuda",
                           name: str = COUNT_SYMBOL) -> tirx.PrimFunc:
    """``(x_0[size], ..., x_n-1[size], counts[n])``: ``counts[i]`` = how many values of ``x_i`` lie outside
    ``checks[i]``'s range. On CUDA one thread block per input, its threads striding over the values and their
    counts summed across the block (TVM's cross-thread reduction): a thread counting all of an input's values
    alone would take 0.35 ms at 8 x 512 tokens. On the CPU the plain loop nest."""
    if target_kind not in ("cuda", "llvm"):
        raise ValueError(f"target_kind must be 'cuda' or 'llvm', got {target_kind!r}")
    xs = [te.placeholder((size,), dtype, name=f"x{i}") for i, dtype in enumerate(dtypes)]
    k = te.reduce_axis((0, size), name="k")

    def test(n, k):
        value, check = xs[n][k], checks[n]
        return tirx.Or(value < tirx.const(check.low, dtypes[n]), value >= tirx.const(check.high, dtypes[n]))

    def outside(i, k):      # input i's test: if_then_else(i == 0, test 0, if_then_else(i == 1, ..., test n-1))
        flag = test(len(checks) - 1, k)
        for n in reversed(range(len(checks) - 1)):
            flag = tirx.if_then_else(i == n, test(n, k), flag)
        return flag

    counts = te.compute((len(checks),), lambda i: te.sum(outside(i, k).astype("int64"), axis=k), name="counts")
    func = te.create_prim_func(xs + [counts]).with_attrs({"global_symbol": name, "tirx.noalias": True,
                                                                "op_pattern": OPAQUE})
    if target_kind == "llvm":
        return func
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("counts")
    per_input, values = sch.get_loops(block)
    _, lanes = sch.split(values, [None, min(MAX_THREADS, max(32, 1 << (size - 1).bit_length()))])
    sch.bind(per_input, "blockIdx.x")
    sch.bind(lanes, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def add_value_checks(mod: tvm.IRModule, checks: list[ValueCheck],
                     target_kind: str = "cuda") -> tuple[tvm.IRModule, int | None]:
    """``main`` returning its outputs and then ``stof_value_errors`` (``[len(checks)]`` int64); returns the module
    and the position of that output (None when there is nothing to check: ``main`` is unchanged)."""
    if not checks:
        return mod, None
    func = mod["main"]
    params = {p.name: p for p in func.params}
    errors = relax.Var(VALUE_ERRORS, relax.TensorType([len(checks)], "int64"))
    if isinstance(func.ret_ty, relax.TupleType):
        types = list(func.ret_ty.fields)
        fields = [relax.TupleGetItem(func.body.body, i) for i in range(len(types))]
    else:
        types, fields = [func.ret_ty], [func.body.body]
    values = [params[c.name] for c in checks]
    if _same_shape(values):
        # inputs of one static shape (token ids, token types, the attention mask: [B, S]): counted by one kernel
        # (count_outside_primfunc) writing the output at the end of main's last dataflow block
        size = math.prod(static_shape(values[0]))
        dtypes = [str(v.ty.dtype) for v in values]
        builder = relax.BlockBuilder(mod)
        counter = builder.add_func(count_outside_primfunc(checks, dtypes, size, target_kind), COUNT_SYMBOL)
        mod = builder.get()
        flat = [relax.op.reshape(v, [size]) for v in values]
        firsts, last = [], relax.VarBinding(errors, relax.call_tir(counter, flat, errors.ty))
    else:
        # one fused reduction per input at the start of main's first dataflow block (they read only the inputs:
        # there they join the static region of the forward pass that CUDA graphs capture, :mod:`.graph_inputs`),
        # stacked into the output at the end of its last one (writing an output ends a captured region)
        counts = [relax.Var(f"stof_out_of_range_{i}", relax.TensorType([], "int64")) for i in range(len(checks))]
        firsts = [relax.VarBinding(var, _out_of_range_count(v, c)) for var, c, v in zip(counts, checks, values)]
        last = relax.VarBinding(errors, relax.op.stack(counts, axis=0))
    blocks = list(func.body.blocks)
    dataflow = [i for i, block in enumerate(blocks) if isinstance(block, relax.DataflowBlock)]
    if dataflow:
        blocks[dataflow[0]] = relax.DataflowBlock(firsts + list(blocks[dataflow[0]].bindings))
        blocks[dataflow[-1]] = relax.DataflowBlock(list(blocks[dataflow[-1]].bindings) + [last])
    else:
        blocks.append(relax.DataflowBlock(firsts + [last]))
    body = relax.SeqExpr(blocks, relax.Tuple(fields + [errors]))
    checked = relax.Function(func.params, body, relax.TupleType(types + [errors.ty]), func.is_pure, func.attrs)
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod["main"] = checked
    mod = relax.transform.Normalize()(mod)
    return mod, len(fields)
