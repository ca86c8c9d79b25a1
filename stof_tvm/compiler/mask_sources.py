"""Decide what each masking term found on the attention scores means, and where its values come from.

A term is either a *mask* (every added value is 0 or at most ``MASKED_FILL``; a ``where`` with a very negative
fill) or a real *bias* (a T5-style position bias: any other values). Masks are folded into the sparse mask:

- a term that depends on no model input (a causal constant, a sliced causal buffer) is evaluated now and
  stored in the artifact as a boolean "keep" array;
- a term computed from model inputs is extracted into its own Relax function of those inputs and probed on the
  CPU. When it is *key padding* of one ``[B, S]`` input (Hugging Face's ``attention_mask``: for every probe the
  term keeps exactly ``C[i, j] and input[b, j] != 0`` at the query rows the input keeps, C a constant such as a
  causal mask), the sparse kernels apply it on the device from that input (:mod:`stof_tvm.schedules.key_padding`;
  C joins the constant masks). Any other term is evaluated by the runtime on every call, checked to be a mask
  and ANDed into the user's mask before the sparse format is built on the host (exact, slower; see
  :mod:`stof_tvm.runtime`).

A real bias cannot be expressed as a mask: its terms stay expressions of the graph, which the sparse kernels
add to each kept score (an input after the format arrays; "dense" also keeps them).

Masks differing between layers (ModernBERT's global and sliding-window layers): where every site's own term at a
place is key padding of the same input with a constant part, and one site's constant keeps every key the others
keep, that site's masking is the shared mask and each stricter site adds its own term to its scores as a bias
(0 where it keeps, :data:`SITE_MASK_FILL` elsewhere; :attr:`MaskPlan.site_bias`). Exact for every query row that
keeps a key (a row all of whose keys only the bias masks would average them instead of giving 0).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from .attention_match import MASKED_FILL, AttentionSite, MaskTerm, resolve, static_shape

# What a site's stricter mask adds to the scores it masks: exp() of it is 0 in float32 and float16, and it stays
# finite in float16 (-65504 is the lowest) when added to a score
SITE_MASK_FILL = 3 * MASKED_FILL


@dataclasses.dataclass
class RuntimeSource:
    """A mask term computed from model inputs: Relax function ``name`` maps ``inputs`` to the term."""

    name: str
    inputs: list[str]
    kind: str
    keep_if_true: bool
    function: relax.Function

    def to_json(self) -> dict:
        return {"function": self.name, "inputs": self.inputs, "kind": self.kind, "keep_if_true": self.keep_if_true}


@dataclasses.dataclass
class MaskPlan:
    """The model's own masking, common to every attention site.

    ``const_keep``: boolean array broadcastable to ``[B, H, Sq, Sk]`` (4-D) or None; ``runtime``: sources
    evaluated at run time on the host path; ``bias_terms``: positions in each site's ``terms`` of the terms that
    are a real bias (added to the scores); ``dense_only``: a term no sparse kernel can apply (a ``where`` computed
    from weights); ``padding``: the model input whose key padding the kernels apply on the device (None: none);
    ``padding_terms``: the sources that padding replaces (what a dense kernel, which keeps the graph's own
    masking, would still need); ``site_bias``: where sites mask differently, per site the extra additive term of
    its scores (None: it masks as the shared mask does), else None.
    """

    const_keep: np.ndarray | None
    runtime: list[RuntimeSource]
    bias_terms: list[int] = dataclasses.field(default_factory=list)
    dense_only: bool = False
    padding: str | None = None
    padding_terms: list[RuntimeSource] = dataclasses.field(default_factory=list)
    site_bias: list[relax.Expr | None] | None = None


def _upstream_vars(expr: relax.Expr, var2val) -> set:
    """Every variable ``expr`` reads, directly or through bindings (bound variables and parameters)."""
    found, stack = set(), [expr]
    while stack:
        node = stack.pop()
        for var in [node] if isinstance(node, relax.Var) else relax.analysis.free_vars(node):
            if var not in found:
                found.add(var)
                if var in var2val:
                    stack.append(var2val[var])
    return found


def _constant_value(expr: relax.Expr, var2val) -> np.ndarray | None:
    value = resolve(expr, var2val)
    if isinstance(value, tvm.ir.expr.Constant):
        return value.value.numpy()
    return None


def _as_4d(array: np.ndarray) -> np.ndarray:
    if array.ndim > 4:
        raise ValueError(f"attention mask term has rank {array.ndim}; expected at most 4")
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


def additive_keep(values: np.ndarray) -> np.ndarray | None:
    """Keep-mask of an additive term whose values are all 0 or <= MASKED_FILL; None if it is a real bias."""
    kept, masked = values == 0, values <= MASKED_FILL
    if not np.all(kept | masked):
        return None
    return kept


def _extract_function(func: relax.Function, expr: relax.Expr, upstream: set, name: str) -> relax.Function:
    """A new Relax function computing ``expr`` (reading the variables ``upstream``) from ``func``'s parameters."""
    bindings = [b for block in func.body.blocks for b in block.bindings if b.var in upstream]
    out = relax.Var(name + "_out", expr.ty)
    bindings.append(relax.VarBinding(out, expr))
    params = [p for p in func.params if p in upstream]
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], out)
    extracted = relax.Function(params, body, expr.ty, is_pure=True)
    extracted = relax.utils.copy_with_new_vars(extracted).with_attr("global_symbol", name)
    return extracted.with_attr("num_input", len(params))     # all runtime inputs: nothing to lift


_EVALUATORS: dict[int, list[tuple[relax.Function, object]]] = {}    # structural hash -> (function, evaluate)
_EVALUATOR_CACHE_SIZE = 64


def _cpu_evaluator(function: relax.Function):
    """``evaluate(*numpy arrays) -> numpy array`` of a term's function, compiled for the CPU (~0.3 s), once per
    process for structurally equal functions: recompiling a model (another mask, dtype or target) reuses it."""
    key = tvm_ffi.structural_hash(function)
    for seen, evaluate in _EVALUATORS.get(key, []):
        if tvm_ffi.structural_equal(seen, function):
            return evaluate
    if sum(len(v) for v in _EVALUATORS.values()) >= _EVALUATOR_CACHE_SIZE:
        _EVALUATORS.clear()
    evaluate = _build_cpu_evaluator(function)
    _EVALUATORS.setdefault(key, []).append((function, evaluate))
    return evaluate


def _build_cpu_evaluator(function: relax.Function):
    executable = tvm.compile(tvm.IRModule({"main": function.with_attr("global_symbol", "main")}), target="llvm")
    entry = relax.VirtualMachine(executable, tvm.cpu())["main"]
    dtypes = [str(param.ty.dtype) for param in function.params]
    return lambda *arrays: entry(*[tvm.runtime.tensor(np.ascontiguousarray(a, dtype=t))
                                   for a, t in zip(arrays, dtypes)]).numpy()


def _param_shapes(function: relax.Function) -> list[tuple]:
    return [tuple(int(d) for d in param.ty.shape.values) for param in function.params]


def _is_mask_when_nothing_is_padded(evaluate, function: relax.Function) -> bool:
    """Evaluate an additive term (on the CPU) for all-ones inputs, i.e. no padding: a mask term then adds only
    0 (or masks with very negative values); anything else means the term carries a real bias."""
    return additive_keep(evaluate(*[np.ones(shape) for shape in _param_shapes(function)])) is not None


def _term_keep(values: np.ndarray, kind: str, keep_if_true: bool) -> np.ndarray | None:
    """The keep-mask of a term's values (None: an additive term whose values are not a mask)."""
    if kind == "where":
        return values.astype(bool) == keep_if_true
    return additive_keep(values)


def _padding_probes(batch: int, seq: int) -> list[np.ndarray]:
    """0/1 ``[batch, seq]`` inputs covering right padding of many lengths, left padding, a fully padded row and
    random gaps."""
    positions = np.arange(seq)
    lengths = 1 + (np.arange(batch) * 7919 + seq // 3) % seq
    rng = np.random.default_rng(0)
    probes = [positions[None, :] < lengths[:, None], positions[None, :] >= seq - lengths[:, None],
              np.zeros((batch, seq), bool), rng.random((batch, seq)) < 0.5]
    probes.append(np.concatenate([np.zeros((1, seq), bool), rng.random((batch - 1, seq)) < 0.7])
                  if batch > 1 else positions[None, :] % 3 != 1)
    return [probe.astype(np.int64) for probe in probes]


def key_padding_constant(source: RuntimeSource, evaluate, batch: int, seq: int) -> np.ndarray | None:
    """If term ``source`` is key padding by its one ``[batch, seq]`` input, its constant part C (a 4-D keep
    broadcastable to [B, H, Sq, Sk] with batch dim 1): for every probe, the term keeps ``C & (input[b, j] != 0)``
    at every query row the input keeps (padded query rows are free: the kernels write them as 0). Else None."""
    shapes = _param_shapes(source.function)
    if len(shapes) != 1 or shapes[0] != (batch, seq):
        return None
    full = _term_keep(evaluate(np.ones((batch, seq))), source.kind, source.keep_if_true)
    if full is None:
        return None
    full = _as_4d(full)
    if full.shape[2] not in (1, seq) or full.shape[3] not in (1, seq) or not (full == full[:1]).all():
        return None
    constant = full[:1]
    for probe in _padding_probes(batch, seq):
        got = _term_keep(evaluate(probe), source.kind, source.keep_if_true)
        if got is None:
            return None
        kept = probe != 0
        want = constant & kept[:, None, None, :]
        got = _as_4d(got)
        rows = kept[:, None, :, None] if max(got.shape[2], want.shape[2]) > 1 else kept.any(1)[:, None, None, None]
        if ((got != want) & rows).any():
            return None
    return constant


def _same_terms(a: list[MaskTerm], b: list[MaskTerm], var2val, weights) -> bool:
    """True when two sites mask their scores identically (the same variables, or equal constants). Additive terms
    computed from weights are each layer's own bias (DeBERTa's relative-position terms: from the layer's Q and K),
    which the kernels take per site: they need only stand at the same place."""
    def same(x: MaskTerm, y: MaskTerm) -> bool:
        if x.kind != y.kind or x.keep_if_true != y.keep_if_true:
            return False
        if x.expr.same_as(y.expr) or tvm_ffi.structural_equal(resolve(x.expr, var2val), resolve(y.expr, var2val)):
            return True
        return x.kind == "add" and all(_upstream_vars(t.expr, var2val) & weights for t in (x, y))

    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def _differing_sites(sites: list[AttentionSite], var2val, weights) -> str | None:
    """Why ``sites`` do not share one masking (None: they do)."""
    first = sites[0]
    for index, site in enumerate(sites[1:], 1):
        if site.shape_key != first.shape_key:
            return f"site {index} of {len(sites)} has shape [B, H, Sq, Sk] = {list(site.shape_key)}, site 0 " \
                   f"{list(first.shape_key)}"
        if not _same_terms(site.terms, first.terms, var2val, weights):
            return f"site {index} of {len(sites)} masks its scores unlike site 0"
    return None


def _site_mask_bias(term: MaskTerm) -> relax.Expr:
    """A mask term of one site as an additive [.., Sq, Sk] float32 term: 0 where it keeps, SITE_MASK_FILL else."""
    zero, fill = relax.const(0.0, "float32"), relax.const(SITE_MASK_FILL, "float32")
    if term.kind == "where":
        expr = relax.op.where(term.expr, zero, fill) if term.keep_if_true else relax.op.where(term.expr, fill, zero)
    else:
        expr = relax.op.maximum(relax.op.astype(term.expr, "float32"), fill)
    return relax.BlockBuilder().normalize(expr)


def _per_site_masks(func, sites, var2val, weights, model_inputs, why: str) -> tuple[int, list]:
    """Sites whose masks differ only in key-padding terms with constant parts (sliding windows) of one input:
    ``(representative, site_bias)``, the site whose mask keeps what every other keeps and each site's extra
    term (None where it masks as the representative does). Raises the reason otherwise."""
    def refuse(detail: str):
        raise ValueError(f"model: attention sites differ in shape or in their own masking ({why}: {detail}); "
                         "stof-tvm supports one mask shared by every attention layer, or layers whose masks "
                         "differ only by a constant part of the key padding (a sliding window)")

    first = sites[0]
    if any(site.shape_key != first.shape_key for site in sites):
        refuse("attention shapes differ")
    if any([(t.kind, t.keep_if_true) for t in site.terms] != [(t.kind, t.keep_if_true) for t in first.terms]
           for site in sites):
        refuse("their masking steps differ")
    places = [i for i in range(len(first.terms))
              if not all(_same_terms([site.terms[i]], [first.terms[i]], var2val, weights) for site in sites)]
    keeps: dict[tuple[int, int], np.ndarray] = {}            # (site, place) -> constant part of its key padding
    padding_inputs = set()
    for place in places:
        for index, site in enumerate(sites):
            term = site.terms[place]
            upstream = _upstream_vars(term.expr, var2val)
            inputs = [p.name for p in model_inputs if p in upstream]
            if upstream & weights or len(inputs) != 1:
                refuse(f"a differing term of site {index} is not a mask of one model input")
            function = _extract_function(func, term.expr, upstream, f"stof_site{index}_term{place}")
            source = RuntimeSource(function.attrs["global_symbol"], inputs, term.kind, term.keep_if_true, function)
            constant = key_padding_constant(source, _cpu_evaluator(function), site.batch, site.seq_k) \
                if site.seq_q == site.seq_k else None
            if constant is None:
                refuse(f"a differing term of site {index} is not key padding with a constant part")
            keeps[index, place] = constant
            padding_inputs.add(inputs[0])
    if len(padding_inputs) > 1:
        refuse(f"their key padding comes from several inputs {sorted(padding_inputs)}")

    def holds(i: int, j: int, place: int) -> bool:     # site i's constant keeps every key site j's keeps
        return not (keeps[j, place] & ~keeps[i, place]).any()

    widest = next((i for i in range(len(sites)) if all(holds(i, j, p) for p in places for j in range(len(sites)))),
                  None)
    if widest is None:
        refuse("no site's mask keeps every key the others keep")
    site_bias: list = []
    for index, site in enumerate(sites):
        extra = [_site_mask_bias(site.terms[p]) for p in places
                 if not np.array_equal(*np.broadcast_arrays(keeps[index, p], keeps[widest, p]))]
        total = None
        for term in extra:
            total = term if total is None else relax.BlockBuilder().normalize(relax.op.add(total, term))
        site_bias.append(total)
    return widest, site_bias


def plan_masks(func: relax.Function, sites: list[AttentionSite]) -> MaskPlan:
    """Classify the masking terms of ``sites`` into a :class:`MaskPlan`: the masking they share, or, where they
    differ only by constant parts of the key padding (sliding windows), the widest site's with each stricter
    site's own mask as its bias (:attr:`MaskPlan.site_bias`)."""
    var2val = relax.analysis.get_var2val(func)
    model_inputs = list(func.params[:int(func.attrs["num_input"])])
    weights = set(func.params[len(model_inputs):])
    why = _differing_sites(sites, var2val, weights)
    if why is None:
        return _shared_plan(func, sites[0], var2val, model_inputs, weights)
    widest, site_bias = _per_site_masks(func, sites, var2val, weights, model_inputs, why)
    plan = _shared_plan(func, sites[widest], var2val, model_inputs, weights)
    if plan.runtime or plan.dense_only:
        raise ValueError(f"model: attention sites differ in shape or in their own masking ({why}), and their "
                         "shared mask is not one the sparse kernels apply on the device")
    plan.site_bias = site_bias if any(b is not None for b in site_bias) else None
    return plan


def _shared_plan(func, first: AttentionSite, var2val, model_inputs, weights) -> MaskPlan:
    """The :class:`MaskPlan` of site ``first``'s masking terms."""
    const_keep, runtime, bias_terms, dense_only, padding, padding_terms = None, [], [], False, None, []
    for index, term in enumerate(first.terms):
        upstream = _upstream_vars(term.expr, var2val)
        if upstream & weights:
            if term.kind == "add":
                bias_terms.append(index)    # computed from weights (a learned bias)
            else:
                dense_only = True           # a condition computed from weights: left to the dense graph
            continue
        inputs = [p.name for p in model_inputs if p in upstream]
        if inputs:
            name = f"stof_mask_term{index}"
            function = _extract_function(func, term.expr, upstream, name)
            evaluate = _cpu_evaluator(function)
            if term.kind == "add" and not _is_mask_when_nothing_is_padded(evaluate, function):
                bias_terms.append(index)    # an input-dependent term that is not a mask (summands are split)
                continue
            source = RuntimeSource(name, inputs, term.kind, term.keep_if_true, function)
            constant = key_padding_constant(source, evaluate, first.batch, first.seq_k) \
                if first.seq_q == first.seq_k and padding in (None, inputs[0]) else None
            if constant is None:
                runtime.append(source)      # evaluated per call by the runtime: the host path
                continue
            padding = inputs[0]
            padding_terms.append(source)
            if not constant.all():
                const_keep = constant if const_keep is None else const_keep & constant
            continue
        values = _constant_value(term.expr, var2val)
        if values is None:
            raise ValueError(f"model: the attention mask term {term.expr} depends on no input but did not fold to "
                             "a constant")
        if term.kind == "where":
            keep = values.astype(bool) if term.keep_if_true else ~values.astype(bool)
        else:
            keep = additive_keep(values)
            if keep is None:
                bias_terms.append(index)
                continue
        keep = _as_4d(keep)
        const_keep = keep if const_keep is None else const_keep & keep
    return MaskPlan(const_keep, runtime, bias_terms, dense_only, padding, padding_terms)


def score_bias(site: AttentionSite, bias_terms: list[int], plan: MaskPlan | None = None,
               index: int = 0, dtype: str | None = None) -> tuple[relax.Expr, tuple[int, int, str]] | None:
    """The real-bias terms of ``site`` summed into one ``[Bb, Hb, Sq, Sk]`` expression of the graph (Bb 1 or B,
    Hb 1 or H, broadcast over the query and key axes), with ``(Bb, Hb, dtype)``; None when it has none. With a
    ``plan`` whose sites mask differently, site ``index``'s own mask term is added (every site then takes a bias,
    of the groups the sites' extra terms need). ``dtype``: the sum cast to it (default: the terms' own)."""
    extra = plan.site_bias if plan is not None and plan.site_bias is not None else None
    if not bias_terms and extra is None:
        return None
    exprs = [site.terms[i].expr for i in bias_terms]
    if extra is not None:
        # a site masking as the shared mask does adds zeros of the broadest extra term's shape (the kernel takes
        # one bias layout at every site)
        shapes = [(1,) * (4 - len(shape)) + shape for shape in (static_shape(e) for e in extra if e is not None)]
        widest = tuple(max(dims) for dims in zip(*shapes))
        own = extra[index] if extra[index] is not None else relax.op.zeros(widest, "float32")
        exprs.append(relax.BlockBuilder().normalize(own))
    shapes = [static_shape(e) for e in exprs]
    if any(shape is None or len(shape) > 4 for shape in shapes):
        raise ValueError("model: the attention bias must have a static shape of rank <= 4")
    padded = [(1,) * (4 - len(shape)) + tuple(shape) for shape in shapes]
    groups = (site.batch if any(p[0] == site.batch for p in padded) and site.batch > 1 else 1,
              site.heads if any(p[1] == site.heads for p in padded) and site.heads > 1 else 1)
    own_dtype = str(exprs[0].ty.dtype)
    total = None
    for expr, shape in zip(exprs, shapes):
        cast = str(expr.ty.dtype) != own_dtype         # read before the reshape: a new call has no type yet
        expr = relax.op.reshape(expr, (1,) * (4 - len(shape)) + tuple(shape)) if len(shape) < 4 else expr
        expr = relax.op.astype(expr, own_dtype) if cast else expr
        total = expr if total is None else relax.op.add(total, expr)
    if dtype is not None and dtype != own_dtype:
        total = relax.op.astype(total, dtype)
    full = relax.op.broadcast_to(total, (groups[0], groups[1], site.seq_q, site.seq_k))
    return full, (groups[0], groups[1], dtype or own_dtype)