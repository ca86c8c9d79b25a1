"""The QKV projection onto the ``qkv_projection`` template, and its heads as the attention kernels read them.

Three head-split linears on one ``X`` (each ``reshape [B, S, H, D]`` + ``permute_dims``), or one linear whose
output is split into thirds that are each split into heads (GPT-2's ``c_attn``), become one template call writing
``[3, B, H, S, D]``. Each of Q, K and V is then a zero-copy view at its offset into it where only kernels that accept
such views read it (:func:`_takes_view`), else a copy of its own; a reshape of it to ``[B * H, S, D]`` that only such
kernels read becomes a view of its own. Any sequence length: the template's ``x`` rows are
``B*S`` zero-padded to its row multiple (ViT's 197 tokens), the padding never stored.
"""
from __future__ import annotations

import tvm
from tvm import relax

from .attention_match import static_shape
from .linear_match import (ANY_LINEAR, LINEAR_X, concatenated_linear, is_call, linear_dims, padded_rows, transposed,
                           users_of, wgmma_misfit)
from .sibling_linears import emit_one_gemm

class _QKVGroup:
    """Three linear layers on one X whose outputs are split into heads (reshape + permute_dims). ``permutes`` and
    ``axes``: per linear, the permutes of its head split (one, or several where the graph permutes the same heads
    for several readers: HF DeBERTa-v3's K for the scores and for the position-to-content product) and their axes.
    ``heads``: the query's; ``kv_heads``: the key's and value's, fewer where they are shared by groups of query heads
    (grouped-query and multi-query attention: Llama, Qwen2, Mistral), else ``heads``."""

    def __init__(self, x, linears: list, permutes: list, axes: list, heads: int, head_dim: int,
                 kv_heads: int | None = None):
        self.x, self.linears, self.permutes, self.axes = x, linears, permutes, axes
        self.heads, self.head_dim = heads, head_dim
        self.kv_heads = heads if kv_heads is None else kv_heads
        self.widths = [n * head_dim for n in (heads, self.kv_heads, self.kv_heads)]   # output features per linear
        self.shape: dict = {}

    @property
    def grouped(self) -> bool:
        return self.kv_heads != self.heads


_HEAD_PERMS = {(0, 2, 1, 3): None, (0, 2, 3, 1): [0, 1, 3, 2]}   # Q/V form, K^T form (from [B, H, S, D])


def _find_qkv(func: relax.Function, users: dict) -> list[_QKVGroup]:
    """Groups of three head-split linears (with or without bias) sharing X, in program order (their permutes
    after the third), and single linears whose [..., 3 * H * D] output is split into thirds that are each split
    into heads (GPT-2's ``c_attn``: its weight already is the concatenated one)."""
    var2val = relax.analysis.get_var2val(func)
    order, by_x, fused, bound = {}, [], [], {}
    for block in func.body.blocks:
        for binding in block.bindings:
            order[binding.var] = len(order)
            bound[binding.value] = binding.var
            matches = ANY_LINEAR.extract_matched_expr(binding.value, var2val)
            if matches is None or linear_dims(matches, str(binding.value.ty.dtype)) is None:
                continue
            # X as the variable that holds it: the matcher hands back the bound value (a float16 export's LayerNorm
            # call), which the template's input would otherwise compute a second time
            matches = {**matches, LINEAR_X: bound.get(matches[LINEAR_X], matches[LINEAR_X])}
            split = _head_split(binding.var, users)
            if split is None:
                thirds = _split_thirds(binding.var, users)
                if thirds is not None and len({(s[0], s[1]) for s in thirds}) == 1:
                    fused.append(_QKVGroup(matches[LINEAR_X], [(binding.var, matches)], [s[3] for s in thirds],
                                           [s[4] for s in thirds], thirds[0][0], thirds[0][1]))
                continue
            x = matches[LINEAR_X]
            group = next((g for g in by_x if g[0].same_as(x)), None)
            if group is None:
                by_x.append((x, []))
                group = by_x[-1]
            group[1].append((binding.var, matches, *split))
    groups = []
    for x, members in by_x:
        if len(members) != 3:
            continue
        heads = _query_and_kv_heads([(m[2], m[3]) for m in members])
        last = max(order[m[0]] for m in members)
        # the permutes are replaced by the template's heads, emitted after the last linear (the reshapes die), so
        # nothing may read them before it
        if heads is None or not all(_read_after(permute, last, order, users) for m in members for permute in m[5]):
            continue
        h, kv, d = heads
        groups.append(_QKVGroup(x, [(m[0], m[1]) for m in members], [m[5] for m in members],
                                [m[6] for m in members], h, d, kv))
    return groups + fused


def _query_and_kv_heads(splits: list) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head_dim) of three head splits ((heads, head_dim) each, in program order):
    all alike (multi-head attention), or one split with more heads than the other two, alike, that divide it
    (grouped-query attention, whose K and V are narrower); else None. Q is the first of them in HF's exports; the
    widths are taken in program order either way."""
    if len({d for _, d in splits}) != 1:
        return None
    d = splits[0][1]
    counts = sorted(h for h, _ in splits)
    if counts[0] == counts[2]:
        return counts[0], counts[0], d
    if counts[0] == counts[1] < counts[2] and counts[2] % counts[0] == 0 and splits[0][0] == counts[2]:
        return counts[2], counts[0], d
    return None


def _read_after(var, position: int, order: dict, users: dict) -> bool:
    """Whether every binding that reads ``var`` comes after ``position`` in program order (the result comes last)."""
    return all(use is None or order[use.var] > position for use in users.get(var, []))


def _split_thirds(var, users):
    """The :func:`_head_split` of each third when ``var`` ([..., N]) is only split into three equal parts along
    its last axis (Q, K, V in this order), each part used once, by its head split; else None."""
    first = users.get(var, [])
    shape = static_shape(var)
    if len(first) != 1 or first[0] is None or not is_call(first[0].value, "relax.split") or shape is None:
        return None
    split = first[0]
    n, attrs = shape[-1], split.value.attrs
    sections = attrs.indices_or_sections
    cuts = [int(sections)] if isinstance(sections, (int, tvm.tirx.IntImm)) else [int(i) for i in sections]
    if int(attrs.axis) not in (-1, len(shape) - 1) or n % 3 or cuts not in ([3], [n // 3, 2 * n // 3]):
        return None
    parts = {}
    for use in users.get(split.var, []):
        value = None if use is None else use.value
        if not isinstance(value, relax.TupleGetItem) or value.index in parts:
            return None
        parts[value.index] = _head_split(use.var, users)
    if sorted(parts) != [0, 1, 2] or any(part is None for part in parts.values()):
        return None
    return [parts[i] for i in range(3)]


def _head_split(var, users):
    """(heads, head_dim, reshape var, permute vars, their axes) when ``var`` is only reshaped to [B, S, H, D] and
    that is only permuted into heads (by one permute or several, each of a :data:`_HEAD_PERMS` form)."""
    first = users.get(var, [])
    if len(first) != 1 or first[0] is None or not is_call(first[0].value, "relax.reshape"):
        return None
    reshape = first[0]
    shape = static_shape(reshape.var)
    second = users.get(reshape.var, [])
    if shape is None or len(shape) != 4 or not second:
        return None
    permutes, axes = [], []
    for permute in second:
        if permute is None or not is_call(permute.value, "relax.permute_dims") or permute.value.attrs.axes is None:
            return None
        form = tuple(int(a) for a in permute.value.attrs.axes)
        if form not in _HEAD_PERMS:
            return None
        permutes.append(permute.var)
        axes.append(form)
    return shape[2], shape[3], reshape.var, permutes, axes


def rewrite_qkv(t, func: relax.Function) -> relax.Function:
    """Replace every :class:`_QKVGroup` the QKV template fits by one template call and its heads (views or a
    split); ``t`` is the template adder of :func:`.downstream.use_templates` (its ``call``, ``record``,
    ``gemm_stage``, ``gemm``, ``mod``). Three linears whose heads the template does not take become one GEMM on
    the concatenated weights, sliced into their parts before the graph's own head splits: a head_dim not a multiple of
    16, heads narrower than X (Gemma), or K and V narrower than Q (grouped-query attention; the graph's own repeat of
    the key/value heads stays)."""
    groups, gemms = [], []
    users = users_of(func)
    for group in _find_qkv(func, users):
        x_shape = static_shape(group.x)
        if x_shape is None or len(x_shape) != 3:
            continue
        group.shape = {"batch": x_shape[0], "seq": x_shape[1], "heads": group.heads, "head_dim": group.head_dim}
        square = x_shape[2] == group.heads * group.head_dim
        if square and not group.grouped and _qkv_fits(group.shape, str(group.x.ty.dtype)):
            groups.append(group)
        elif len(group.linears) == 3 and (square or group.grouped):
            gemms.append(group)
    if not groups and not gemms:
        return func
    emit_at = {group.linears[-1][0]: group for group in groups}
    moved = {permute for group in groups for permutes in group.permutes for permute in permutes}
    gemm_at = {group.linears[0][0]: group for group in gemms}
    replace: dict = {}

    @relax.expr_functor.mutator
    class QKV(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var in gemm_at:
                self._emit_gemm(gemm_at[binding.var])
            if binding.var in replace:
                self.set_var_remap(binding.var, replace[binding.var])
                return
            if binding.var in moved:        # remapped to its group's heads, emitted after the group's last linear
                return
            super().visit_var_binding_(binding)
            if binding.var in emit_at:
                self._emit_group(emit_at[binding.var])

        def _emit_gemm(self, group: _QKVGroup):
            """The three linears as one GEMM at the first one's place; each linear's value becomes its part."""
            dtype = str(group.x.ty.dtype)
            x_shape = static_shape(group.x)
            k = x_shape[2]
            matches = [m for _, m in group.linears]
            w, bias = concatenated_linear(matches, dtype, self.visit_expr, bias_needed=False)
            if group.grouped:
                why = (f"{group.heads} query heads share {group.kv_heads} key/value heads: one GEMM, the graph's head "
                       "splits and key/value repeat")
            elif k != group.heads * group.head_dim:
                why = (f"{group.heads} heads of {group.head_dim} project from {k} features: one GEMM, the graph's "
                       "head split")
            else:
                why = f"no QKV heads template fits head_dim {group.head_dim}: one GEMM, the graph's head split"
            # each part a strided slice, fused into the head split (and rotary embedding) that reads it
            parts = emit_one_gemm(t, self.builder_, self.visit_expr(group.x), x_shape, w, bias, group.widths, dtype,
                                  "qkv_gemm", why)
            for (var, _), part in zip(group.linears, parts):
                replace[var] = part

        def _emit_group(self, group: _QKVGroup):
            dtype = str(group.x.ty.dtype)
            b, s, h, d = (group.shape[key] for key in ("batch", "seq", "heads", "head_dim"))
            w, bias = concatenated_linear([m for _, m in group.linears], dtype, self.visit_expr)
            x2d = relax.op.reshape(self.visit_expr(group.x), [b * s, h * d])
            name, note = _qkv_template(b * s, h * d, t.gemm)
            rows = _template_rows(name, group.shape)
            if rows != b * s:
                x2d = relax.op.nn.pad(x2d, [0, rows - b * s, 0, 0])
                note = f"rows padded {b * s} -> {rows}" + (f"; {note}" if note else "")
            weight = transposed(w) if name == "qkv_projection_wgmma" else w
            call, stage = t.call(name, group.shape, dtype, [x2d, weight, bias], (3, b, h, s, d))
            t.record("qkv", [stage], note)
            qkv = self.builder_.emit(call)
            part_bytes = b * h * s * d * tvm.runtime.DataType(dtype).bits // 8
            for i, (permutes, forms) in enumerate(zip(group.permutes, group.axes)):
                offset = relax.prim_value(tvm.tirx.IntImm("int64", i * part_bytes))
                # [B * H, S, D] reshapes read only as views (the fused relative-position bias's Q and K): views of
                # their own, at the same offset
                flat = [r for permute in permutes for r in _flat_view_reshapes(permute, users, t.mod, (b * h, s, d))]
                for reshape in flat:
                    replace[reshape] = self.builder_.emit(relax.op.memory.view(qkv, [b * h, s, d], dtype, offset))
                if all(_reads_views(permute, users, t.mod, skip=flat) for permute in permutes):
                    # zero copy: a view at its offset into the [3, B, H, S, D] output
                    heads = relax.op.memory.view(qkv, [b, h, s, d], dtype, offset)
                else:
                    # a copy of its own, for readers that need offset 0: one kernel a part, vectorised, where a
                    # split's one kernel of three outputs ran one thread per element (~1.1 TB/s on an H100)
                    heads = relax.op.reshape(relax.op.strided_slice(qkv, axes=[0], begin=[i], end=[i + 1]),
                                             [b, h, s, d])
                heads = self.builder_.emit(heads)
                for permute, axes in zip(permutes, forms):
                    back = _HEAD_PERMS[axes]
                    self.set_var_remap(permute, heads if back is None
                                       else self.builder_.emit(relax.op.permute_dims(heads, back)))

    return QKV(t.mod).visit_expr(func)


def _takes_view(mod: tvm.IRModule, binding, var) -> bool:
    """Whether ``binding`` calls a kernel (``call_tir`` of a PrimFunc in ``mod``) whose every buffer that ``var``
    is passed as may start at an element offset (its ``elem_offset`` a variable, as ``match_buffer(...,
    offset_factor=...)`` makes it: the block-wise and wgmma attention kernels' Q, K and V, the wgmma kernel's TMA
    maps encoded from the view's first element (checked on the H200 by bench_attention.py plan s9attn); the fused
    relative-position bias's Q and K on CUDA). TVM's own kernels assume offset 0. Every part's offset is a multiple
    of ``B * H * S * D`` elements, so of the 8 that such buffers ask."""
    value = None if binding is None else binding.value
    if not (is_call(value, "relax.call_tir") and isinstance(value.args[0], tvm.ir.GlobalVar)):
        return False
    callee = mod.functions.get(value.args[0])
    if not isinstance(callee, tvm.tirx.PrimFunc):
        return False
    places = [i for i, arg in enumerate(value.args[1].fields) if arg.same_as(var)]
    return bool(places) and all(not isinstance(callee.params[i].elem_offset, tvm.tirx.IntImm)
                                for i in places)


def _reads_views(var, users, mod: tvm.IRModule, skip=()) -> bool:
    """Whether every use of the head-split ``var`` but the bindings of ``skip`` (directly, or through one
    ``permute_dims``, the K^T form) is a kernel call that takes it as a view (:func:`_takes_view`)."""
    for use in users.get(var, []):
        if use is not None and use.var in skip or _takes_view(mod, use, var):
            continue
        if use is None or not is_call(use.value, "relax.permute_dims"):
            return False
        further = users.get(use.var, [])
        if not further or not all(_takes_view(mod, u, use.var) for u in further):
            return False
    return True


def _flat_view_reshapes(var, users, mod: tvm.IRModule, flat_shape: tuple) -> list:
    """The variables of ``var``'s reshapes to ``flat_shape`` ([B * H, S, D]) that only kernels taking views read."""
    found = []
    for use in users.get(var, []):
        if use is None or not is_call(use.value, "relax.reshape") or static_shape(use.var) != flat_shape:
            continue
        readers = users.get(use.var, [])
        if readers and all(_takes_view(mod, u, use.var) for u in readers):
            found.append(use.var)
    return found


def _qkv_template(m: int, hidden: int, gemm: str) -> tuple[str, str | None]:
    """(template, note) of a QKV projection of ``m`` tokens: ``qkv_projection_wgmma`` where ``gemm="wgmma"`` puts its
    GEMM ([m, hidden] x [hidden, 3 * hidden], rows padded as :func:`.linear_match.padded_rows` pads them) on wgmma,
    else ``qkv_projection_kn`` (mma.sync) with the reason it is not on wgmma (None under ``gemm="mma"``)."""
    if gemm != "wgmma":
        return "qkv_projection_kn", None
    note = wgmma_misfit(padded_rows(m, 3 * hidden, hidden, gemm), 3 * hidden, hidden)
    return ("qkv_projection_wgmma", None) if note is None else ("qkv_projection_kn", note)


def _template_rows(name: str, shape: dict) -> int:
    from stof_tvm.schedules.templates import get_template

    return get_template(name).rows(shape)


def _qkv_fits(shape: dict, dtype: str) -> bool:
    from stof_tvm.schedules.templates import get_template

    try:
        return bool(get_template("qkv_projection_kn").knob_space(shape, dtype))
    except ValueError:
        return False
