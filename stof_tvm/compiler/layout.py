"""Layout round trips the rewrites leave behind, folded away.

The attention kernels and the QKV template write in the layout their consumers read, and the rewrites wrap
their results in ``permute_dims`` back to the layout the graph expects; the graph's own transpose of that result
then forms a pair of permutes that compose to the identity (or to one permute). Folding the pair here removes
a full read and write of the tensor that TVM would otherwise fuse into a copy kernel.
"""
from __future__ import annotations

import tvm
from tvm import relax


def _permute_axes(expr) -> list[int] | None:
    """The axes of a ``permute_dims`` call (None for anything else, or a permute without explicit axes)."""
    if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.permute_dims"):
        return None
    axes = expr.attrs.axes
    return None if axes is None else [int(a) for a in axes]


def fold_permute_pairs(func: relax.Function) -> relax.Function:
    """Replace every ``y = permute_dims(x, b)`` whose ``x`` is bound to ``permute_dims(w, a)`` by ``y = w`` (when
    the two compose to the identity) or by one ``permute_dims(w, a∘b)``. Works across plain and dataflow binding
    blocks (the ONNX importer emits plain ones); the inner permute, if nothing else reads it, is left for
    dead-code elimination."""
    var2val = relax.analysis.get_var2val(func)

    @relax.expr_functor.mutator
    class Fold(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            outer = _permute_axes(binding.value)
            source = binding.value.args[0] if outer is not None else None
            inner_call = var2val.get(source) if source is not None else None
            inner = _permute_axes(inner_call)
            if inner is None:
                super().visit_var_binding_(binding)
                return
            axes = [inner[a] for a in outer]
            base = self.visit_expr(inner_call.args[0])
            value = base if axes == list(range(len(axes))) else \
                self.builder_.normalize(relax.op.permute_dims(base, axes))
            # the binding keeps its variable: it may be read after its dataflow block
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))

    return Fold().visit_expr(func)
