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

import tvm
from tvm import relax

from .attention_match import static_shape

VALUE_ERRORS = "stof_value_errors"


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


def add_value_checks(mod: tvm.IRModule, checks: list[ValueCheck]) -> tuple[tvm.IRModule, int | None]:
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
        # inputs of one static shape (token ids, token types, the attention mask: [B, S]): their out-of-range flags
        # stacked and counted per input by one reduction (one kernel, which TVM fuses from the comparisons on),
        # written straight into the output at the end of main's last dataflow block
        rank = len(values[0].ty.shape.values)
        flags = relax.op.astype(relax.op.stack([_outside(v, c) for v, c in zip(values, checks)], axis=0), "int64")
        firsts, last = [], relax.VarBinding(errors, relax.op.sum(flags, axis=list(range(1, rank + 1))))
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
