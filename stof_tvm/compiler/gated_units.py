"""A gated MLP's gate and up projections and the SiLU product that joins them, as one GEMM whose epilogue writes
``silu(gate) * up`` (the ``gemm_silu_mul_wgmma`` template): HF Llama, Qwen2 and Mistral's SwiGLU,
``down(silu(x W_gate) * (x W_up))``, exported as ``sigmoid(g) * g * u`` (or ``silu(g) * u``).

Found among :mod:`.sibling_linears`' groups (two bias-free linears on one input) where the gate's value is read only
by its SiLU, the SiLU only by the product and the up projection only by the product. The two weights become one
``[2N, K]`` weight with their rows interleaved (:func:`...schedules.templates.gated_gemm.interleaved_rows`; a
weight-only expression for parameters, lifted into the weight transform), so that each pair of GEMM columns is
one gate/up pair; the product's value becomes the template's output and the gate, up, sigmoid and SiLU bindings
go. Against the one GEMM of :mod:`.sibling_linears` plus the elementwise kernel, the gate and up activations are
never written nor read back. Offered under ``gemm="wgmma"`` with the compile option ``gated_epilogue``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import relax
from tvm.ir.expr import Constant

from ..schedules.templates.gated_gemm import interleaved_rows
from .linear_match import LINEAR_BIAS, LINEAR_W, fills_gpu, is_call, wgmma_misfit

TEMPLATE = "gemm_silu_mul_wgmma"


@dataclass
class GatedUnit:
    """The bindings of one gated unit: the gate's and up projection's matches, the product (whose value the
    template's output becomes) and every binding that goes with it (gate, up, sigmoid, SiLU)."""

    gate: dict
    up: dict
    product: relax.Var
    dropped: tuple


def _only_reader(var, users) -> relax.VarBinding | None:
    readers = users.get(var, [])
    return readers[0] if len(readers) == 1 and readers[0] is not None else None


def _reads_exactly(binding, *variables) -> bool:
    """Whether ``binding``'s call takes exactly ``variables`` as its arguments, in either order."""
    args = list(binding.value.args)
    return len(args) == len(variables) and all(any(a.same_as(v) for a in args) for v in variables)


def _silu_of(gate, users) -> tuple[relax.Var, tuple] | None:
    """The binding holding ``silu(gate)`` when it is the gate's only use (``nn.silu``, or ``sigmoid`` then the product
    with the gate), with the bindings it takes; else None."""
    readers = users.get(gate, [])
    if any(r is None for r in readers):
        return None
    if len(readers) == 1 and is_call(readers[0].value, "relax.nn.silu"):
        return readers[0].var, ()
    sigmoid = next((r for r in readers if is_call(r.value, "relax.sigmoid")), None)
    if len(readers) != 2 or sigmoid is None:
        return None
    silu = _only_reader(sigmoid.var, users)
    if silu is None or not is_call(silu.value, "relax.multiply") or not _reads_exactly(silu, gate, sigmoid.var):
        return None
    return silu.var, (sigmoid.var,)


def find_gated_unit(members, users) -> GatedUnit | None:
    """The :class:`GatedUnit` of a sibling group (``members``: its two linears, ``.var``, ``.matches`` and ``.n``), or
    None: bias-free, of one width, one of them read only through its SiLU, the other only by the product of that SiLU
    with it."""
    if (len(members) != 2 or any(LINEAR_BIAS in member.matches for member in members)
            or members[0].n != members[1].n):
        return None
    for gate, up in (members, members[::-1]):
        silu = _silu_of(gate.var, users)
        if silu is None:
            continue
        silu_var, extra = silu
        product = _only_reader(silu_var, users)
        up_reader = _only_reader(up.var, users)
        if (product is None or up_reader is None or not up_reader.var.same_as(product.var)
                or not is_call(product.value, "relax.multiply") or not _reads_exactly(product, silu_var, up.var)):
            continue
        return GatedUnit(gate.matches, up.matches, product.var, (gate.var, up.var, silu_var, *extra))
    return None


def fits(m: int, n: int, k: int) -> bool:
    """Whether the template takes an [m, k] input and two [k, n] weights: the 2n-column GEMM tiles on wgmma, and its
    128-row tiles fill the GPU without split-K (which the gated epilogue does not take)."""
    return wgmma_misfit(m, 2 * n, k) is None and fills_gpu(m, 2 * n)


def interleaved_weight(unit: GatedUnit, visit) -> relax.Expr:
    """The template's ``[2N, K]`` weight from the two ``[K, N]`` ones: folded here for constants, else weight-only
    ops (``visit``: the mutator's remapping)."""
    gate, up = visit(unit.gate[LINEAR_W]), visit(unit.up[LINEAR_W])
    if isinstance(gate, Constant) and isinstance(up, Constant):
        value = interleaved_rows(gate.value.numpy().T, up.value.numpy().T)
        return relax.const(np.ascontiguousarray(value), str(gate.ty.dtype))
    k, n = (int(d) for d in gate.ty.shape.values)
    rows = [relax.op.expand_dims(relax.op.permute_dims(w, [1, 0]), 1) for w in (gate, up)]
    return relax.op.reshape(relax.op.concat(rows, axis=1), [2 * n, k])


def emit_gated(t, builder, unit: GatedUnit, x, x_shape, dtype: str, visit) -> relax.Var:
    """The template call on ``x`` (``x_shape``: [..., K]) and the unit's interleaved weight, recorded as the chain
    ``linear_silu_mul``; returns the [..., N] value that replaces the product."""
    k = x_shape[-1]
    n = int(unit.gate[LINEAR_W].ty.shape.values[1])
    m = int(np.prod(x_shape[:-1]))
    call, stage = t.call(TEMPLATE, {"m": m, "n": n, "k": k}, dtype,
                         [relax.op.reshape(x, [m, k]), interleaved_weight(unit, visit)], (m, n))
    t.record("linear_silu_mul", [stage], "gate and up as one GEMM, silu(gate) * up in its epilogue")
    return builder.emit(relax.op.reshape(call, list(x_shape[:-1]) + [n]))

