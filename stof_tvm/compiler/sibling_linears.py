"""Linear layers that read the same input, as one GEMM: the gate and up projections of a gated MLP (HF Llama, Qwen2,
Mistral and Gemma's SwiGLU / GeGLU: ``act(x W_gate) * (x W_up)``).

Run after the chains that fuse a linear layer with what follows it (QKV into heads, GELU / ReLU epilogues, residual
+ LayerNorm): the linears left are plain ones. Two or more of them on one input, with weights of the same ``K``
(constants, or the parameters a real-size model's weights are), become one GEMM template call on the weights
concatenated along ``N`` (a weight-only concatenation, lifted into the weight transform; the biases too, zeros for
a layer without one, where any has one); each layer's value becomes a ``strided_slice`` of its columns, which TVM
fuses into the elementwise kernel that reads it. Exact: each output column is the same dot product. One launch
fewer per layer, and a GEMM twice as wide fills more of the GPU at small row counts. With the compile option
``gated_epilogue``, a pair that is a gated unit (``silu(gate) * up``) becomes one GEMM with the product in its
epilogue instead (:mod:`.gated_units`).
"""
from __future__ import annotations

import numpy as np
import tvm_ffi
from tvm import relax

from .gated_units import emit_gated, find_gated_unit, fits
from .linear_match import (ANY_LINEAR, LINEAR_W, LINEAR_X, WGMMA_TILES, concat_weights, concatenated_linear,
                           fixed_weights, is_weight, linear_dims, users_of, wgmma_misfit, zero_bias)


class _Sibling:
    """One linear layer of a group: its bound variable, matched parts and dims (x shape, m, n, k, dtype)."""

    def __init__(self, var, matches, dims):
        self.var, self.matches, self.dims = var, matches, dims

    @property
    def n(self) -> int:
        return self.dims[2]


def _find_siblings(func: relax.Function) -> list[list[_Sibling]]:
    """Groups of two or more plain linear layers (weights: constants, or parameters as a real-size model's are,
    possibly cast) that read one input, in program order. One input: the same variable, or bindings of the same
    value (a float16 compile casts the RMSNorm's output once for each reader: HF Llama's gate and up)."""
    var2val = relax.analysis.get_var2val(func)
    weights = fixed_weights(func)
    groups: list[tuple] = []
    bound = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            bound[binding.value] = binding.var
            matches = ANY_LINEAR.extract_matched_expr(binding.value, var2val)
            if matches is None or not is_weight(matches[LINEAR_W], var2val, weights):
                continue
            dims = linear_dims(matches, str(binding.value.ty.dtype))
            if dims is None:
                continue
            x = bound.get(matches[LINEAR_X], matches[LINEAR_X])
            key = (dims[0], dims[3], dims[4])          # x shape, k, dtype
            group = next((g for g in groups if g[1] == key and _same_input(g[0], x, var2val)), None)
            if group is None:
                groups.append((x, key, []))
                group = groups[-1]
            group[2].append(_Sibling(binding.var, matches, dims))
    return [members for _, _, members in groups if len(members) >= 2]


def _gated_units(t, func: relax.Function, groups: list[list[_Sibling]]) -> dict:
    """The groups (by their first linear's variable) that become one gated GEMM (:mod:`.gated_units`): under
    ``gemm="wgmma"`` with the compile option ``gated_epilogue``, where the template fits."""
    if not (t.gated_epilogue and t.gemm == "wgmma"):
        return {}
    users = users_of(func)
    units = {}
    for group in groups:
        _, m, n, k, _ = group[0].dims
        unit = find_gated_unit(group, users)
        if unit is not None and fits(m, n, k):
            units[group[0].var] = unit
    return units


def _same_input(a, b, var2val) -> bool:
    """Whether ``a`` and ``b`` hold the same tensor: one variable, or variables bound to structurally equal values
    (calls on the same variables)."""
    if a.same_as(b):
        return True
    va, vb = var2val.get(a, a), var2val.get(b, b)
    return isinstance(va, relax.Call) and tvm_ffi.structural_equal(va, vb)


def merge_sibling_linears(t, func: relax.Function) -> relax.Function:
    """``func`` with each group of :func:`_find_siblings` as one GEMM (``t``: the template adder of
    :func:`.downstream.use_templates`, its ``gemm_stage`` and ``record``), emitted at the group's first layer."""
    groups = _find_siblings(func)
    if not groups:
        return func
    first = {group[0].var: group for group in groups}
    units = _gated_units(t, func, groups)
    dropped = {var for unit in units.values() for var in unit.dropped}
    replace: dict = {}

    @relax.expr_functor.mutator
    class Merge(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var in first:
                self._emit(first[binding.var])
            if binding.var in replace:
                self.set_var_remap(binding.var, replace[binding.var])
                return
            if binding.var not in dropped:
                super().visit_var_binding_(binding)

        def _emit(self, group: list[_Sibling]):
            x_shape, _, _, _, dtype = group[0].dims
            unit = units.get(group[0].var)
            if unit is not None:
                x = self.visit_expr(group[0].matches[LINEAR_X])
                replace[unit.product] = emit_gated(t, self.builder_, unit, x, x_shape, dtype, self.visit_expr)
                return
            weight, bias = concatenated_linear([member.matches for member in group], dtype, self.visit_expr,
                                               bias_needed=False)
            parts = emit_one_gemm(t, self.builder_, self.visit_expr(group[0].matches[LINEAR_X]), x_shape, weight,
                                  bias, [member.n for member in group], dtype, "linear",
                                  f"{len(group)} linear layers on one input as one GEMM")
            for member, part in zip(group, parts):
                replace[member.var] = part

    return Merge(t.mod).visit_expr(func)


# Most zero columns, as a share of the real ones, that the one GEMM of concatenated weights takes on to reach a
# width the wgmma kernel tiles (SmolLM2-360M's Q, K and V: 1600 columns -> 1664, 4% more work, instead of mma.sync)
PAD_SHARE = 0.125


def wgmma_columns(gemm: str, m: int, n: int, k: int) -> int:
    """The columns the one GEMM of an [m, k] x [k, n] concatenation computes: ``n``, or ``n`` rounded up to whole
    128-column tiles where only that puts it on wgmma (``gemm="wgmma"``) at :data:`PAD_SHARE` more work or less; the
    zero columns' outputs lie past every part's slice."""
    if gemm != "wgmma" or wgmma_misfit(m, n, k) is None:
        return n
    columns = -(-n // WGMMA_TILES["n"]) * WGMMA_TILES["n"]
    if columns - n > PAD_SHARE * n or wgmma_misfit(m, columns, k) is not None:
        return n
    return columns


def emit_one_gemm(t, builder, x, x_shape, weight, bias, widths: list[int], dtype: str, chain: str, why: str) -> list:
    """Emit one GEMM template call of ``x`` ([..., K], ``x_shape``) with the concatenated ``weight`` and ``bias``
    (``t.gemm_stage``, recorded as ``chain`` with the note ``why``) and return one ``strided_slice`` of its output
    per part of ``widths`` columns: TVM fuses a slice into the operator that reads it (a split would be a kernel of
    its own); where :func:`wgmma_columns` says so, the weight (and bias) gain zero columns past the last part."""
    m, k, n = int(np.prod(x_shape[:-1])), x_shape[-1], sum(widths)
    columns = wgmma_columns(t.gemm, m, n, k)
    if columns != n:
        weight = concat_weights([weight, relax.const(np.zeros((k, columns - n), dtype), dtype)], 1)
        bias = None if bias is None else concat_weights([bias, zero_bias(columns - n, dtype)], 0)
        why += f"; {columns - n} zero columns let it run on wgmma"
    call, stage, note = t.gemm_stage("none", relax.op.reshape(x, [m, k]), weight, bias, m, columns, k, dtype)
    t.record(chain, [stage], why + (f"; {note}" if note else ""))
    out = builder.emit(relax.op.reshape(call, list(x_shape[:-1]) + [columns]))
    parts, start = [], 0
    for width in widths:
        parts.append(builder.emit(relax.op.strided_slice(out, axes=[len(x_shape) - 1], begin=[start],
                                                         end=[start + width])))
        start += width
    return parts
