"""The dtype each weight is stored in: float16 for a float16 module, so that the artifact holds half the bytes.

The ONNX file holds float32 weights; TVM's mixed-precision pass leaves them float32 parameters of ``main`` and
casts each one where it is read (``astype(W, "float16")`` before a matmul). :func:`store_weights_float16`
makes every such float32 parameter a float16 one instead:

- a read that was ``astype(W, "float16")`` reads the float16 parameter itself: the same values, since the cast
  is exactly the rounding the artifact now stores;
- any other read (an embedding ``take``, which mixed precision runs in float32) reads ``astype(W16, "float32")``,
  which ``LiftTransformParams`` moves into ``main_transform_params`` with the other weight-only work: that read
  sees the weight rounded to float16, as in a float16 PyTorch model;
- a weight with any value beyond float16's range (``|x| > 65504``, or not finite) stays float32: rounding would
  make it infinite.

The weights' specs (the manifest's ``weights`` entry) carry the new dtypes; :func:`stored_values` casts the
ONNX values to them.
"""
from __future__ import annotations

import numpy as np
from onnx import numpy_helper
from tvm import relax

from .linear_match import is_call, users_of
from .onnx_import import TensorSpec

FLOAT16_MAX = float(np.finfo(np.float16).max)


def fits_float16(value: np.ndarray) -> bool:
    """Whether every value of ``value`` is finite and within float16's range (NaN fails the comparisons)."""
    return value.size == 0 or bool(-FLOAT16_MAX <= value.min() and value.max() <= FLOAT16_MAX)


def _is_float16_cast(binding, var) -> bool:
    return binding is not None and is_call(binding.value, "relax.astype") and binding.value.args[0].same_as(var) \
        and str(binding.value.attrs.dtype) == "float16"


def store_weights_float16(mod, weights: list[TensorSpec], onnx_model):
    """``mod`` with ``main``'s float32 weight parameters (its last ``len(weights)``) made float16 where their
    values fit (see the module docstring); returns ``(mod, weight specs with the stored dtypes)``."""
    func = mod["main"]
    first = len(func.params) - len(weights)
    values = {t.name: t for t in onnx_model.graph.initializer}
    users = users_of(func)
    fresh, specs = {}, []
    for var, spec in zip(func.params[first:], weights):
        if spec.dtype == "float32" and fits_float16(numpy_helper.to_array(values[spec.name])):
            fresh[var] = relax.Var(var.name, relax.TensorType(list(spec.shape), "float16"))
            spec = TensorSpec(spec.name, spec.shape, "float16")
        specs.append(spec)
    if not fresh:
        return mod, specs
    # a converted parameter's old variable is now bound to its float32 view, so other reads stay as they are; in
    # a dataflow block of its own, which LiftTransformParams lifts (it lifts nothing from plain blocks)
    widened = [relax.VarBinding(var, relax.op.astype(half, "float32")) for var, half in fresh.items()
               if not all(_is_float16_cast(b, var) for b in users.get(var, []))]
    blocks = [relax.DataflowBlock(widened)] if widened else []
    for block in func.body.blocks:
        bindings = []
        for binding in block.bindings:
            source = binding.value.args[0] if is_call(binding.value, "relax.astype") else None
            if source is not None and source in fresh and _is_float16_cast(binding, source):
                binding = relax.VarBinding(binding.var, fresh[source])
            bindings.append(binding)
        block_type = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        blocks.append(block_type(bindings))
    params = [fresh.get(var, var) for var in func.params]
    new = relax.Function(params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure, func.attrs)
    mod["main"] = new.without_attr("params")        # the importer's float32 copies of the weights: unused
    return mod, specs


def stored_values(onnx_model, weights: list[TensorSpec]) -> dict[str, np.ndarray]:
    """The weights' values by name, from the ONNX initializers, in the dtypes ``weights`` records."""
    dtypes = {w.name: w.dtype for w in weights}
    return {t.name: numpy_helper.to_array(t).astype(dtypes[t.name], copy=False)
            for t in onnx_model.graph.initializer if t.name in dtypes}
