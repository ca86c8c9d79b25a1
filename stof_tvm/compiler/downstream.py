"""Replace the linear layers around attention with stof-tvm's GEMM fusion templates (schedules/templates).

Matched with Relax dataflow patterns on the mixed-precision graph (16-bit inputs, float32 accumulation):

- ``add(astype(matmul(X, W)), bias)`` -> template ``gemm_bias_kn`` (projections: QKV, output, FFN2);
- the same followed by erf GELU, ``multiply(multiply(y, add(erf(divide(y, sqrt2)), 1)), 0.5)``
  -> template ``gemm_bias_gelu_erf_kn`` (FFN1 with its activation fused into the epilogue).

``X`` is ``[..., K]`` (flattened to ``[M, K]``), ``W`` the ``[K, N]`` weight, ``bias`` a constant ``[N]``. A
match is rewritten only when the template supports it (16-bit dtype, M, N, K multiples of 16). On CUDA each
call gets the template's schedule: the measured-best record of a tuning database when it holds one, else the
template's default configuration. On the CPU the template's definition runs unscheduled (TVM's default
lowering), which keeps the rewrite testable without a GPU.
"""
from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from .attention_match import scalar_value, static_shape

TEMPLATE_DTYPES = ("float16", "bfloat16")

_X, _W, _BIAS = wildcard(), wildcard(), is_const()
_MATMUL = is_op("relax.matmul")(_X, _W)
LINEAR = is_op("relax.add")(is_op("relax.astype")(_MATMUL), _BIAS)
_SQRT2, _ONE, _HALF = is_const(), is_const(), is_const()
_ERF_ADD = is_op("relax.add")(is_op("relax.erf")(is_op("relax.divide")(LINEAR, _SQRT2)), _ONE)
LINEAR_GELU = is_op("relax.multiply")(is_op("relax.multiply")(LINEAR, _ERF_ADD), _HALF)


class _Templates:
    """Adds one scheduled PrimFunc per (template, shape) to the module and rewrites matches into calls."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target, database: str | None):
        self.builder = relax.BlockBuilder(mod)
        self.target = target
        self.database = database
        self.functions: dict[tuple, tvm.ir.GlobalVar] = {}
        self.used: dict[str, int] = {}

    def _function(self, name: str, shape: dict, dtype: str) -> tvm.ir.GlobalVar:
        key = (name, shape["m"], shape["n"], shape["k"], dtype)
        if key not in self.functions:
            from stof_tvm.schedules.templates import get_template

            template = get_template(name)
            func = template.primfunc(shape, dtype)
            if self.target.kind.name == "cuda":
                func = self._scheduled(template, func, shape, dtype).with_attr("tirx.is_scheduled", True)
            symbol = f"stof_{name}_m{shape['m']}_n{shape['n']}_k{shape['k']}"
            self.functions[key] = self.builder.add_func(func.with_attr("global_symbol", symbol), symbol)
        self.used[name] = self.used.get(name, 0) + 1
        return self.functions[key]

    def _scheduled(self, template, func, shape: dict, dtype: str) -> tvm.tirx.PrimFunc:
        if self.database is not None:
            from stof_tvm.tuning import TuningDatabase

            best = TuningDatabase(self.database).best_schedule(func, self.target)
            if best is not None:
                return best.mod["main"]
        return template.schedule(shape, dtype).mod["main"]

    def rewrite(self, name: str, expr: relax.Call, matches) -> relax.Expr:
        x, w, bias = matches[_X], matches[_W], matches[_BIAS]
        x_shape, w_shape = static_shape(x), static_shape(w)
        dtype = str(x.ty.dtype)
        if (x_shape is None or w_shape is None or len(w_shape) != 2 or dtype not in TEMPLATE_DTYPES
                or str(w.ty.dtype) != dtype or str(bias.ty.dtype) != dtype or str(expr.ty.dtype) != dtype):
            return expr
        k, n = w_shape
        m = int(np.prod(x_shape[:-1]))
        if x_shape[-1] != k or tuple(static_shape(bias) or ()) != (n,) or m % 16 or n % 16 or k % 16:
            return expr
        gv = self._function(name, {"m": m, "n": n, "k": k}, dtype)
        out = relax.call_tir(gv, [relax.op.reshape(x, [m, k]), w, bias], out_ty=relax.TensorType([m, n], dtype))
        return relax.op.reshape(out, list(x_shape[:-1]) + [n])


def _is(matches, pattern, value: float, var2val) -> bool:
    found = scalar_value(matches[pattern], var2val)
    return found is not None and math.isclose(found, value, rel_tol=1e-3)


def use_templates(mod: tvm.IRModule, target: tvm.target.Target, database: str | None = None
                  ) -> tuple[tvm.IRModule, dict[str, int]]:
    """Rewrite ``main``'s linear layers into template calls; returns the module and calls per template."""
    templates = _Templates(mod, target, database)
    func = mod["main"]
    var2val = relax.analysis.get_var2val(func)

    def gelu(expr, matches):
        if not (_is(matches, _SQRT2, math.sqrt(2.0), var2val) and _is(matches, _ONE, 1.0, var2val)
                and _is(matches, _HALF, 0.5, var2val)):
            return expr
        return templates.rewrite("gemm_bias_gelu_erf_kn", expr, matches)

    func = rewrite_call(LINEAR_GELU, gelu, func)
    func = rewrite_call(LINEAR, lambda expr, matches: templates.rewrite("gemm_bias_kn", expr, matches), func)
    out = templates.builder.get()
    out["main"] = func
    return out, templates.used
