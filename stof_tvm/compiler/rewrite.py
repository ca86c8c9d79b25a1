"""Replace the attention sites of ``main`` with the chosen kernel, adding the mask inputs as parameters.

The mask inputs (sparse-format arrays, or the dense bias/keep pair) are inserted into ``main``'s parameters
after the model's own inputs (before its weights, and counted in ``num_input``), with symbolic sizes where the
format's length depends on the mask (``nnz``, ``n_full``, ``n_part``). Each site is found again with the
dataflow pattern that located it (:data:`~stof_tvm.compiler.attention_match.ATTENTION_PATTERN`, applied with
``rewrite_call``) and becomes:

- sparse kernels: ``call_tir(kernel, [Q, K, V, *format arrays(, score bias)])`` with ``K = permute_dims(K^T)``
  (fused by TVM into the producer's layout transform); a real score bias (T5) is the graph's own expression;
  a kernel writing [B, S, H, D] (``KernelChoice.out_layout``) is followed by a permute to [B, H, S, D], which
  the front end later folds with the graph's own transpose back (:func:`~stof_tvm.compiler.layout.fold_permute_pairs`);
- dense: ``matmul(softmax(scores + stof_bias) * stof_keep, V)`` with float inputs (bias 0 / -1e30, keep 1 / 0),
  so rows with no kept key give zeros exactly like the sparse kernels.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import rewrite_call

from .attention_match import _SCORES, _SOFTMAX, _V, ATTENTION_PATTERN, AttentionSite
from .kernels import FormatInput, KernelChoice
from .mask_sources import score_bias


def _relax_param(spec: FormatInput, sizes: dict) -> relax.Var:
    dims = []
    for dim in spec.shape:
        if isinstance(dim, str):
            sizes.setdefault(dim, tvm.tirx.Var(dim, "int64"))
            dims.append(sizes[dim])
        else:
            dims.append(int(dim))
    return relax.Var(spec.name, relax.TensorType(dims, spec.dtype))


def _dense_replacement(expr: relax.Call, matches, bias: relax.Var, keep: relax.Var) -> relax.Expr:
    scores, softmax = matches[_SCORES], matches[_SOFTMAX]
    score_dtype, prob_dtype = str(scores.ty.dtype), str(softmax.ty.dtype)
    masked = relax.op.add(scores, bias if score_dtype == "float32" else relax.op.astype(bias, score_dtype))
    probs = relax.op.nn.softmax(masked, axis=int(softmax.attrs.axis))
    probs = relax.op.multiply(probs, keep if prob_dtype == "float32" else relax.op.astype(keep, prob_dtype))
    probs = relax.op.astype(probs, str(matches[_V].ty.dtype))
    return relax.op.matmul(probs, matches[_V], out_dtype=str(expr.ty.dtype))


def rewrite_attention(mod: tvm.IRModule, sites: list[AttentionSite], choice: KernelChoice, kernel,
                      bias_terms: list[int] = ()) -> tuple:
    """Rewrite ``mod["main"]``; ``kernel`` is the sparse PrimFunc (None for dense), added to the module.
    ``bias_terms``: the sites' real-bias terms, passed to a kernel that takes a bias (``choice.bias``).

    Returns ``(new module, [FormatInput])`` with the format inputs in parameter order.
    """
    func = mod["main"]
    first = sites[0]
    specs = choice.format_inputs(first.seq_q, first.seq_k)
    sizes: dict = {}
    params = [_relax_param(spec, sizes) for spec in specs]
    var2val = relax.analysis.get_var2val(func)
    site_values = [var2val[site.var] for site in sites]

    if kernel is not None:
        builder = relax.BlockBuilder(mod)
        name = "stof_attention_" + choice.kind
        # Marked scheduled so that dlight and MetaSchedule leave the hand-scheduled kernel as it is.
        kernel = kernel.with_attr("global_symbol", name).with_attr("tirx.is_scheduled", True)
        kernel_gv = builder.add_func(kernel, name)
        mod = builder.get()

    def rewriter(expr: relax.Call, matches) -> relax.Expr:
        if not any(expr.same_as(value) for value in site_values):
            return expr
        site = sites[next(i for i, value in enumerate(site_values) if expr.same_as(value))]
        if kernel is None:
            return _dense_replacement(expr, matches, params[0], params[1])
        k = relax.op.permute_dims(site.k_t, [0, 1, 3, 2])
        rows_then_heads = choice.out_layout == "bshd"
        dims = [site.batch, site.seq_q, site.heads] if rows_then_heads else [site.batch, site.heads, site.seq_q]
        out_ty = relax.TensorType(dims + [site.head_dim], site.dtype)
        bias = [score_bias(site, list(bias_terms))[0]] if choice.bias is not None else []
        out = relax.call_tir(kernel_gv, [site.q, k, site.v, *params, *bias], out_ty=out_ty)
        if rows_then_heads:         # the graph's transpose back to [B, S, H, D] folds with this one
            out = relax.op.permute_dims(out, [0, 2, 1, 3])
        if str(expr.ty.dtype) != site.dtype:
            out = relax.op.astype(out, str(expr.ty.dtype))
        return out

    num_input = int(func.attrs["num_input"])
    ordered = list(func.params[:num_input]) + params + list(func.params[num_input:])
    extended = relax.Function(ordered, func.body, func.ret_ty, func.is_pure, func.attrs)
    extended = extended.with_attr("num_input", num_input + len(params))
    rewritten = rewrite_call(ATTENTION_PATTERN, rewriter, extended)
    mod["main"] = rewritten
    return mod, specs
