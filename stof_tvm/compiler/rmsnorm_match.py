"""RMSNorm (T5) matched in the mixed-precision graph and replaced by the ``rmsnorm`` / ``residual_rmsnorm`` templates.

After the front end (``pow(x, 2)`` already ``x * x``, mixed precision keeping the normalisation in float32) a T5
RMSNorm of a ``[..., n]`` tensor ``X`` reads, as torch.onnx exports it::

    weight * (X * (1 / sqrt(mean(X * X, axis=-1, keepdims=True) + eps)))        (or rsqrt(...) for the division)

with ``weight`` an ``[n]`` constant, multiplications in either operand order. Its readers cast the float32
result to the 16-bit dtype (the final one is the model's output). T5 normalises before each sublayer and adds
the sublayer's output to the residual stream, ``h = h + sublayer(RMSNorm(h))``, so every RMSNorm but the first
reads ``X = add(h, astype(linear))``, a sum also read by the next residual add. Each such sum and its RMSNorm
become one ``residual_rmsnorm`` call at the sum's place (both addends cast to 16-bit; it writes the 16-bit sum,
which the sum's other readers read through a cast, and the normalised rows): the residual stream becomes 16-bit,
as in a float16 PyTorch model, and the casts fold away (:func:`.downstream._simplify`). Any other input (the
embeddings, a broadcasting add) gets the plain ``rmsnorm`` of a 16-bit cast of it. Rows must be multiples of 64
wide (the templates' tiling); other RMSNorms keep TVM's default path.
"""
from __future__ import annotations

import math

from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .attention_match import resolve, scalar_value, static_shape
from .linear_match import TEMPLATE_DTYPES, is_call

_X, _EPS, _WEIGHT, _ONE = wildcard(), is_const(), is_const(), is_const()
_MEAN_SQUARE = is_op("relax.mean")(is_op("relax.multiply")(_X, _X))
_VARIANCE = is_op("relax.add")(_MEAN_SQUARE, _EPS)
_INV_RMS = is_op("relax.rsqrt")(_VARIANCE) | is_op("relax.divide")(_ONE, is_op("relax.sqrt")(_VARIANCE))
RMSNORM = is_op("relax.multiply")(_WEIGHT, is_op("relax.multiply")(_X, _INV_RMS))


def compute_dtype(func: relax.Function) -> str | None:
    """The model's 16-bit dtype: the one mixed precision casts to (None unless exactly one)."""
    found = {str(b.value.attrs.dtype) for block in func.body.blocks for b in block.bindings
             if is_call(b.value, "relax.astype") and str(b.value.attrs.dtype) in TEMPLATE_DTYPES}
    return found.pop() if len(found) == 1 else None


def _match(value, var2val) -> dict | None:
    """``{"x", "weight", "eps", "shape"}`` of an RMSNorm bound to ``value`` that the templates take, else None."""
    matches = RMSNORM.extract_matched_expr(value, var2val)
    if matches is None or (_ONE in matches and scalar_value(matches[_ONE], var2val) != 1.0):
        return None
    x, weight = matches[_X], matches[_WEIGHT]
    mean = resolve(matches[_MEAN_SQUARE], var2val)
    shape, eps = static_shape(x), scalar_value(matches[_EPS], var2val)
    if shape is None or len(shape) < 2 or eps is None or str(x.ty.dtype) not in ("float32",) + TEMPLATE_DTYPES:
        return None
    axes = [int(a) for a in mean.attrs.axis]
    if axes not in ([-1], [len(shape) - 1]) or not bool(mean.attrs.keepdims):
        return None
    if static_shape(weight) != (shape[-1],) or shape[-1] % 64:
        return None
    var = _bound_var(x, var2val)
    return {"x": x if var is None else var, "weight": weight, "eps": eps, "shape": shape}


def _bound_var(expr, var2val):
    """The variable bound to ``expr`` (the patterns hand over bound expressions as well as variables)."""
    if isinstance(expr, relax.Var):
        return expr
    return next((var for var, value in var2val.items() if value.same_as(expr)), None)


def _residual_sum(x, shape, var2val):
    """``(var, (a, b))`` when the RMSNorm's input ``x`` is a variable bound to ``add(a, b)`` of two tensors of its
    own shape."""
    value = var2val.get(x) if isinstance(x, relax.Var) else None
    if not is_call(value, "relax.add") or any(static_shape(arg) != shape for arg in value.args):
        return None
    return x, tuple(value.args)


def rewrite_rmsnorms(t, func: relax.Function) -> relax.Function:
    """Replace every RMSNorm of ``func`` that the templates take (see the module docstring); ``t`` is the
    rewrite's :class:`.downstream._Templates` (functions, manifest sites)."""
    from stof_tvm.schedules.templates.rmsnorm import RMS_EPS

    dtype = compute_dtype(func)
    if dtype is None:
        return func
    var2val = relax.analysis.get_var2val(func)
    norms, sums = {}, {}         # norm var -> site; residual sum var -> norm var
    for block in func.body.blocks:
        for binding in block.bindings:
            if not isinstance(binding.value, relax.Call):       # an alias (``gv = lv``) is no second RMSNorm
                continue
            site = _match(binding.value, var2val)
            if site is None:
                continue
            norms[binding.var] = site
            found = _residual_sum(site["x"], site["shape"], var2val)
            if found is not None and found[0] not in sums:     # a sum normalised twice: the first one fuses
                sums[found[0]] = binding.var
                site["addends"] = found[1]

    @relax.expr_functor.mutator
    class Rewrite(relax.PyExprMutator):
        def __init__(self):
            super().__init__()
            self.normed = {}     # norm var -> its normalised rows (16-bit, the norm's shape), made at its sum
            self.narrowed = {}   # input -> its [m, n] 16-bit variable, in the current block

        def visit_dataflow_block_(self, block):
            self.narrowed = {}
            return super().visit_dataflow_block_(block)

        def visit_binding_block_(self, block):
            self.narrowed = {}
            return super().visit_binding_block_(block)

        def narrow(self, expr, m: int, n: int):
            """A visited input as [m, n] in the 16-bit dtype (emitted once per input and block: the first
            RMSNorm and the first residual sum both read the embeddings)."""
            if expr not in self.narrowed:
                value = self.visit_expr(expr)
                if str(value.ty.dtype) != dtype:
                    value = relax.op.astype(value, dtype)
                self.narrowed[expr] = self.builder_.emit(relax.op.reshape(value, [m, n]))
            return self.narrowed[expr]

        def visit_var_binding_(self, binding):
            var = binding.var
            if var not in sums and var not in norms:
                super().visit_var_binding_(binding)
                return
            site = norms[sums[var]] if var in sums else norms[var]
            shape = list(site["shape"])
            n = shape[-1]
            m = math.prod(shape) // n
            eps = None if math.isclose(site["eps"], RMS_EPS, rel_tol=1e-6) else site["eps"]
            weight = relax.const(site["weight"].value.numpy().astype(dtype), dtype)
            if var in sums:
                a, b = (self.narrow(arg, m, n) for arg in site["addends"])
                call, stage = t.call("residual_rmsnorm", {"m": m, "n": n}, dtype, [a, b, weight],
                                     [(m, n), (m, n)], eps)
                pair = self.builder_.emit(call)
                total = relax.op.reshape(self.builder_.emit(relax.TupleGetItem(pair, 0)), shape)
                self.normed[sums[var]] = relax.op.reshape(self.builder_.emit(relax.TupleGetItem(pair, 1)), shape)
                self.rebind(var, relax.op.astype(total, str(var.ty.dtype)))
                t.record("residual_rmsnorm", [stage])
                return
            out = self.normed.get(var)
            if out is None:
                call, stage = t.call("rmsnorm", {"m": m, "n": n}, dtype, [self.narrow(site["x"], m, n), weight],
                                     (m, n), eps)
                out = relax.op.reshape(call, shape)
                t.record("rmsnorm", [stage])
            self.rebind(var, relax.op.astype(out, str(var.ty.dtype)))

        def rebind(self, var, value):
            """Bind ``var`` itself (a dataflow variable, or the block's output) to ``value``."""
            self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(value)))

    return Rewrite().visit_expr(func)
