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

With key padding on the device (``padding``: the model input holding it, e.g. ``attention_mask``), ``main`` first
computes the padding summary once (``call_tir`` of :mod:`stof_tvm.schedules.key_padding`), and every sparse
kernel call reads it after the format arrays.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import rewrite_call

from stof_tvm.schedules.key_padding import KEY_PADDING_SYMBOL, bit_words, key_padding_primfunc

from .attention_match import _SCORES, _SOFTMAX, _V, ATTENTION_PATTERN, AttentionSite
from .kernels import FormatInput, KernelChoice
from .mask_sources import score_bias
from .op_patterns import OPAQUE


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


def _with_padding_summary(func: relax.Function, summary_gv, padding: str) -> tuple:
    """``func`` with ``stof_pad = call_tir(key_padding, [padding input])`` bound first; returns the new function
    and the (pad_range, pad_bits) expressions the kernel calls read."""
    source = next(p for p in func.params if p.name == padding)
    batch, seq = (int(d) for d in source.ty.shape.values)
    out_ty = [relax.TensorType([batch, 3], "int32"), relax.TensorType([batch, bit_words(seq)], "uint32")]
    summary = relax.Var("stof_pad", relax.TupleType(out_ty))
    binding = relax.VarBinding(summary, relax.call_tir(summary_gv, [source], out_ty=out_ty))
    # A block of its own outside dataflow: RewriteDataflowReshape would inspect this one-input call_tir as a
    # possible reshape, which TVM 0.27 cannot do for a thread-level PrimFunc (it expects an s_tir body).
    body = relax.SeqExpr([relax.BindingBlock([binding])] + list(func.body.blocks), func.body.body)
    func = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
    return func, [relax.TupleGetItem(summary, 0), relax.TupleGetItem(summary, 1)]


def padding_summary_primfunc(mod: tvm.IRModule, padding: str, target_kind: str):
    """The key padding PrimFunc for ``main``'s input ``padding``, marked scheduled and opaque to FuseOps."""
    source = next(p for p in mod["main"].params if p.name == padding)
    batch, seq = (int(d) for d in source.ty.shape.values)
    func = key_padding_primfunc(batch=batch, seq_k=seq, dtype=str(source.ty.dtype), target_kind=target_kind)
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", OPAQUE)


def rewrite_attention(mod: tvm.IRModule, sites: list[AttentionSite], choice: KernelChoice, kernel,
                      bias_terms: list[int] = (), padding: str | None = None, target_kind: str = "cuda",
                      plan=None, grouped_kv: bool = False) -> tuple:
    """Rewrite ``mod["main"]``; ``kernel`` is the sparse PrimFunc (None for dense), added to the module.
    ``bias_terms``: the sites' real-bias terms, passed to a kernel that takes a bias (``choice.bias``), with each
    site's own mask term where the sites of ``plan`` (a :class:`~.mask_sources.MaskPlan`) mask differently.
    ``padding``: the input whose key padding the sparse kernel applies (``choice.padding``), summarised once by
    the key padding kernel for ``target_kind``. ``grouped_kv``: the kernel reads K and V as the sites'
    :attr:`~.attention_match.AttentionSite.grouped_kv` (key/value heads before their repeat to every query head).

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
        if choice.padding:
            summary_gv = builder.add_func(padding_summary_primfunc(mod, padding, target_kind), KEY_PADDING_SYMBOL)
        mod = builder.get()

    def rewriter(expr: relax.Call, matches) -> relax.Expr:
        if not any(expr.same_as(value) for value in site_values):
            return expr
        index = next(i for i, value in enumerate(site_values) if expr.same_as(value))
        site = sites[index]
        if kernel is None:
            return _dense_replacement(expr, matches, params[0], params[1])
        k, v = site.grouped_kv[:2] if grouped_kv else (relax.op.permute_dims(site.k_t, [0, 1, 3, 2]), site.v)
        rows_then_heads = choice.out_layout == "bshd"
        dims = [site.batch, site.seq_q, site.heads] if rows_then_heads else [site.batch, site.heads, site.seq_q]
        out_ty = relax.TensorType(dims + [site.head_dim], site.dtype)
        bias = ([score_bias(site, list(bias_terms), plan, index, choice.bias[2])[0]] if choice.bias is not None
                else [])
        out = relax.call_tir(kernel_gv, [site.q, k, v, *params, *pad_inputs, *bias], out_ty=out_ty)
        if rows_then_heads:         # the graph's transpose back to [B, S, H, D] folds with this one
            out = relax.op.permute_dims(out, [0, 2, 1, 3])
        if str(expr.ty.dtype) != site.dtype:
            out = relax.op.astype(out, str(expr.ty.dtype))
        return out

    num_input = int(func.attrs["num_input"])
    ordered = list(func.params[:num_input]) + params + list(func.params[num_input:])
    extended = relax.Function(ordered, func.body, func.ret_ty, func.is_pure, func.attrs)
    extended = extended.with_attr("num_input", num_input + len(params))
    pad_inputs = []
    if kernel is not None and choice.padding:
        extended, pad_inputs = _with_padding_summary(extended, summary_gv, padding)
    rewritten = rewrite_call(ATTENTION_PATTERN, rewriter, extended)
    mod["main"] = rewritten
    return mod, specs
