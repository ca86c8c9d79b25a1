"""Layout detours exporters take on the way into attention, removed.

- :class:`SingleConcat`: ``concat((x,))`` -> ``x``, parts with no element dropped first. transformers 5's GPT-2
  appends K and V to an empty cache (``torch.cat([empty, k])``); the exporter drops the empty part and leaves a
  concat of one tensor between the head split and the attention product. Phi-3's rotary embedding concatenates the
  rotated part of Q and K with the rest (``q[..., rotary_dim:]``), empty when the whole head rotates; TVM's GPU
  schedules cannot take the zero-length loop that part would become.
- :class:`TransposeThrough3D`: ``reshape(permute_dims(reshape(x, [B*H, S, D]), [0, 2, 1]), [B, H, D, S])`` ->
  ``permute_dims(x, [0, 1, 3, 2])`` (the dynamo exporter's K^T of SDPA's decomposition, over 3-D batches).
- :class:`PermutePairs`: ``permute_dims(permute_dims(x, a), b)`` -> one permute (or ``x``), so that K's head split
  reads ``permute_dims(reshape(linear), [0, 2, 3, 1])``, the form the QKV projection matcher takes.
- :class:`ScaleAfterHeadSplit`: ``head split(linear(x) * c)`` -> ``head split(linear(x)) * c`` for a scalar
  constant ``c``: OPT scales Q right after its projection, which hid that projection from the QKV matcher; past the
  head split the scale reaches the score product, where :class:`..attention.SplitScale` moves it onto the scores.
- :class:`FlatLinear`: ``reshape(matmul(reshape(x, [M, K]), W) (+ b), [..., N])`` -> ``matmul(x', W) (+ b)`` with
  ``x'`` = ``x`` on the output's leading shape: HF's ``Conv1D`` (GPT-2) flattens its input to 2-D around
  ``addmm``; on the model's own shape the linear layer reads the LayerNorm (or the GELU reads the linear)
  directly, as in every other model.
- :class:`PatchEmbedding`: a vision transformer's patch embedding, ``permute_dims(reshape(conv2d(x, W) (+ b),
  [B, O, P]), [0, 2, 1])`` with a non-overlapping conv (stride = kernel, no padding or dilation, one group) ->
  ``matmul(patches(x), W') (+ b)``, ``patches`` one reshape / permute / reshape of the image into ``[B, P, C*p*q]``
  rows and ``W'`` the ``[C*p*q, O]`` weight: a linear layer the GEMM templates take. TVM schedules the conv with
  its generic GPU rules: on the H200 ViT-Base's took 102 us of the 975 us forward at 8 images (session 16).
- :class:`RepeatedKVHeads`: grouped-query attention's ``repeat_kv`` (HF Llama, Qwen2, Mistral, Gemma),
  ``reshape(broadcast_to(expand_dims(x, 2), [B, Hkv, G, S, D]), [B, Hkv * G, S, D])`` (or onto ``[B * Hkv * G, S,
  D]``, SDPA's flat batches) -> ``repeat(x, G, axis=1)`` (then the flat reshape): one operator the attention
  matcher reads the key/value heads through, so the sparse kernels take K and V as the projection wrote them.
"""
from __future__ import annotations

import math

import numpy as np
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_op, wildcard

from ..layout import fold_permute_pairs
from .base import Rule, op_name, resolve, rewrite_matches, scalar_constant, tensor_dtype, tensor_shape


class SingleConcat(Rule):
    """``concat((x,), axis)`` -> ``x``, after dropping the parts with no element along ``axis`` (a concat of the
    others where more than one is left)."""

    name = "single_concat"
    pattern = is_op("relax.concat")(wildcard())

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            parts = resolve(expr.args[0], var2val)
            if not isinstance(parts, relax.Tuple):
                return None
            axis = int(expr.attrs.axis)
            kept = [part for part in parts.fields if not _empty_along(part, axis)]
            if len(kept) == 1:
                return kept[0]
            if not kept or len(kept) == len(parts.fields):
                return None
            return relax.op.concat(kept, axis=axis)

        return rewrite_matches(self.pattern, rewrite, func)


def _empty_along(expr, axis: int) -> bool:
    """Whether ``expr``'s static shape has no element along ``axis``."""
    shape = tensor_shape(expr)
    return shape is not None and shape[axis] == 0


def _axes(call) -> list[int] | None:
    axes = call.attrs.axes
    return None if axes is None else [int(a) for a in axes]


class TransposeThrough3D(Rule):
    """A last-two-axes transpose of a [B, H, S, D] tensor written over its [B*H, S, D] view -> one 4-D permute."""

    name = "transpose_through_3d"
    _x = wildcard()
    _inner = is_op("relax.reshape")(_x, wildcard())
    pattern = is_op("relax.reshape")(is_op("relax.permute_dims")(_inner), wildcard())

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            x = matches[self._x]
            permute = resolve(expr.args[0], var2val)
            shape, flat, out = tensor_shape(x), tensor_shape(matches[self._inner]), tensor_shape(expr)
            if shape is None or flat is None or out is None or len(shape) != 4 or _axes(permute) != [0, 2, 1]:
                return None
            b, h, s, d = shape
            if flat != (b * h, s, d) or out != (b, h, d, s):
                return None
            return relax.op.permute_dims(x, [0, 1, 3, 2])

        return rewrite_matches(self.pattern, rewrite, func)


def _heads_view(expr, var2val, batch: int, heads: int) -> relax.Expr | None:
    """The [B, H, m, n] tensor that ``expr`` views as [B*H, m, n] (a ``reshape``, or a last-two-axes transpose of
    one, then given as the 4-D transpose), else None."""
    value = resolve(expr, var2val)
    transposed = op_name(value) == "relax.permute_dims" and _axes(value) == [0, 2, 1]
    if transposed:
        value = resolve(value.args[0], var2val)
    if op_name(value) != "relax.reshape":
        return None
    source, flat = value.args[0], tensor_shape(value)
    shape = tensor_shape(source)
    if shape is None or flat is None or len(shape) != 4 or shape[:2] != (batch, heads) or flat != (
            batch * heads, *shape[2:]):
        return None
    return relax.op.permute_dims(source, [0, 1, 3, 2]) if transposed else source


def _heads_product(expr, var2val, batch: int, heads: int) -> relax.Expr | None:
    """``matmul(a, b)`` of two [B*H, ...] views of [B, H, ...] tensors, as the 4-D product; else None."""
    value = resolve(expr, var2val)
    if op_name(value) != "relax.matmul":
        return None
    a, b = (_heads_view(arg, var2val, batch, heads) for arg in value.args)
    if a is None or b is None:
        return None
    return relax.op.matmul(a, b, out_dtype=value.attrs.out_dtype)


def _on_heads(arg, out: tuple[int, ...]) -> relax.Expr | None:
    """Operand ``arg`` of a step on [B*H, m, n] flat scores, given for the [B, H, m, n] scores ``out``: a [B*H or 1,
    m or 1, n or 1] tensor (BLOOM's ALiBi term is [B*H, 1, Sk]) reshaped onto the heads, a lower-rank one (a
    scalar, a [m, n] table) as it is (it broadcasts over the leading axes alike); None for any other shape."""
    shape = tensor_shape(arg)
    if shape is None or len(shape) > 3:
        return None
    if len(shape) < 3:
        return arg
    rows, cols = shape[1:]
    if rows not in (1, out[2]) or cols not in (1, out[3]):
        return None
    if shape[0] == out[0] * out[1]:
        return relax.op.reshape(arg, [out[0], out[1], rows, cols])
    return relax.op.reshape(arg, [1, 1, rows, cols]) if shape[0] == 1 else None


_BINARY = {"relax.add": relax.op.add, "relax.multiply": relax.op.multiply, "relax.divide": relax.op.divide}
_SCORE_STEPS = (*_BINARY, "relax.astype")


def _reaches_product(expr, var2val, batch: int, heads: int, depth: int = 6) -> bool:
    """Whether ``expr`` is such a product, through additions, scalings and casts."""
    value = resolve(expr, var2val)
    if _heads_product(value, var2val, batch, heads) is not None:
        return True
    if depth == 0 or op_name(value) not in _SCORE_STEPS:
        return False
    return any(_reaches_product(arg, var2val, batch, heads, depth - 1) for arg in value.args
               if isinstance(arg, relax.Expr) and len(tensor_shape(arg) or ()) == 3)


class FlatHeads(Rule):
    """Attention computed on [B*H, S, ...] views of its [B, H, S, ...] heads, then reshaped back -> on the heads.

    HF DeBERTa-v2/v3 multiplies flattened heads (``bmm``) and adds its relative-position terms to the flat scores
    before reshaping them to [B, H, S, Sk] for the mask and the softmax: ``reshape(matmul(reshape(Q),
    transpose(reshape(K))) * c + bias, [B, H, S, Sk])``, and ``reshape(matmul(reshape(P), reshape(V)), [B, H, S,
    D])``. The reshape back moves down one operator per application (through additions, scalar scalings and casts
    that lead to the product) until it meets the product, which then takes the 4-D heads; a flat term added to the
    scores keeps a reshape of its own, onto [B, H, 1, Sk] where it broadcasts over the queries (HF BLOOM's ALiBi
    term, ``baddbmm`` of a [B*H, 1, Sk] tensor). Exact: reshapes move no data."""

    name = "flat_heads"
    _x = wildcard()
    pattern = is_op("relax.reshape")(_x, wildcard())

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            out, flat = tensor_shape(expr), tensor_shape(matches[self._x])
            if out is None or flat is None or len(out) != 4 or flat != (out[0] * out[1], *out[2:]):
                return None
            batch, heads = out[:2]
            value = resolve(matches[self._x], var2val)
            product = _heads_product(value, var2val, batch, heads)
            if product is not None:
                return product
            if op_name(value) not in _SCORE_STEPS or not _reaches_product(value, var2val, batch, heads):
                return None
            if op_name(value) == "relax.astype":
                return relax.op.astype(relax.op.reshape(value.args[0], out), value.attrs.dtype)
            args = [_on_heads(arg, out) for arg in value.args]
            if any(arg is None for arg in args):
                return None         # an operand that is not a view of the heads: left as it is
            return _BINARY[op_name(value)](*args)

        return rewrite_matches(self.pattern, rewrite, func)


class RepeatedKVHeads(Rule):
    """``reshape(broadcast_to(expand_dims(x, 2), [B, Hkv, G, S, D]), [B, Hkv * G, S, D])`` -> ``repeat(x, G,
    axis=1)``: each key/value head repeated for the G query heads that share it, consecutively (query head ``h``
    reads key/value head ``h // G``); a reshape onto ``[B * Hkv * G, S, D]`` keeps a reshape of the repeat. Exact:
    the same elements in the same order."""

    name = "repeated_kv_heads"
    _x = wildcard()
    _spread = is_op("relax.broadcast_to")(is_op("relax.expand_dims")(_x), wildcard())
    pattern = is_op("relax.reshape")(_spread, wildcard())

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            x, out = matches[self._x], tensor_shape(expr)
            x_shape, spread = tensor_shape(x), tensor_shape(matches[self._spread])
            expand = resolve(resolve(matches[self._spread], var2val).args[0], var2val)
            axes = [int(a) for a in expand.attrs.axis]
            if None in (x_shape, spread, out) or len(x_shape) != 4 or axes not in ([2], [-3]):
                return None
            b, kv, s, d = x_shape
            group = spread[2]
            if spread != (b, kv, group, s, d) or group < 2:
                return None
            repeated = relax.op.repeat(x, group, axis=1)
            if out == (b, kv * group, s, d):
                return repeated
            if out == (b * kv * group, s, d):
                return relax.op.reshape(repeated, out)
            return None

        return rewrite_matches(self.pattern, rewrite, func)


class PermutePairs(Rule):
    """``permute_dims`` of a ``permute_dims`` -> one permute, or its input when they cancel."""

    name = "permute_pairs"

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)
        pairs = [value for value in var2val.values()
                 if op_name(value) == "relax.permute_dims" and _axes(value) is not None
                 and op_name(resolve(value.args[0], var2val)) == "relax.permute_dims"
                 and _axes(resolve(value.args[0], var2val)) is not None]
        if not pairs:
            return None
        return relax.analysis.remove_all_unused(fold_permute_pairs(func))


class ScaleAfterHeadSplit(Rule):
    """``reshape(linear * c)`` or ``permute_dims(linear * c)`` -> the same layout operator on the linear layer's
    output, then ``* c`` (``c`` a scalar constant; a linear layer: a ``matmul``, or a ``matmul`` plus a bias). Exact:
    a scalar multiply commutes with any layout operator. It moves OPT's ``q_proj(h) * scaling`` past both the
    reshape and the permute of Q's head split (one pass: the rewrite matches its own result again)."""

    name = "scale_after_head_split"
    _x, _c = wildcard(), is_const()
    _scaled = is_op("relax.multiply")(_x, _c) | is_op("relax.multiply")(_c, _x)
    pattern = is_op("relax.reshape")(_scaled, wildcard()) | is_op("relax.permute_dims")(_scaled)

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            x, c = matches[self._x], matches[self._c]
            scaled = resolve(expr.args[0], var2val)
            if (scalar_constant(c) is None or tensor_dtype(x) != tensor_dtype(scaled)
                    or tensor_shape(x) != tensor_shape(scaled) or not _is_linear(x, var2val)):
                return None
            if op_name(expr) == "relax.reshape":
                moved = relax.op.reshape(x, expr.args[1])
            else:
                moved = relax.op.permute_dims(x, _axes(expr))
            return relax.op.multiply(moved, c)

        return rewrite_matches(self.pattern, rewrite, func)


def _is_linear(expr, var2val) -> bool:
    """Whether ``expr`` is a ``matmul``, a ``matmul`` plus a bias, or a layout operator of one (through bindings)."""
    value = resolve(expr, var2val)
    while op_name(value) in ("relax.reshape", "relax.permute_dims"):
        value = resolve(value.args[0], var2val)
    if op_name(value) == "relax.add":
        value = next((resolve(a, var2val) for a in value.args if op_name(resolve(a, var2val)) == "relax.matmul"),
                     None)
    return op_name(value) == "relax.matmul"


class FlatLinear(Rule):
    """A linear layer written on a 2-D view of its input and reshaped back -> the linear on the input's shape."""

    name = "flat_linear"
    _x, _w, _b = wildcard(), wildcard(), is_const()
    _matmul = is_op("relax.matmul")(is_op("relax.reshape")(_x, wildcard()), _w)
    _linear = is_op("relax.add")(_matmul, _b) | is_op("relax.add")(_b, _matmul) | _matmul
    pattern = is_op("relax.reshape")(_linear, wildcard())

    def apply(self, func):
        var2val = relax.analysis.get_var2val(func)

        def rewrite(expr, matches):
            x, w = matches[self._x], matches[self._w]
            x_shape, w_shape, out = tensor_shape(x), tensor_shape(w), tensor_shape(expr)
            flat = tensor_shape(resolve(matches[self._matmul], var2val).args[0])
            if None in (x_shape, w_shape, out, flat) or len(w_shape) != 2 or len(out) < 3 or len(flat) != 2:
                return None
            k, n = w_shape
            if out[-1] != n or flat[1] != k or math.prod(out[:-1]) != flat[0] or math.prod(x_shape) != flat[0] * k:
                return None
            if x_shape != out[:-1] + (k,):       # the flattening also merged heads (attention's output projection)
                x = relax.op.reshape(x, list(out[:-1]) + [k])
            matmul = matches[self._matmul]
            y = relax.op.matmul(x, w, out_dtype=str(matmul.ty.dtype))
            if self._b in matches:
                bias = matches[self._b]
                if tensor_shape(bias) not in ((n,), (), (1,)):
                    return None
                added = resolve(matches[self._linear], var2val)
                y = relax.op.add(y, bias) if added.args[1].same_as(bias) else relax.op.add(bias, y)
            return y

        return rewrite_matches(self.pattern, rewrite, func)


class PatchEmbedding(Rule):
    """A non-overlapping conv flattened into patch rows -> a linear layer on the image's patches (exact: the same
    products and sums, in another order of the reduction)."""

    name = "patch_embedding"
    _x, _w, _b = wildcard(), wildcard(), is_const()
    _conv = is_op("relax.nn.conv2d")(_x, _w)
    _biased = is_op("relax.add")(_conv, _b) | _conv
    pattern = is_op("relax.permute_dims")(is_op("relax.reshape")(_biased, wildcard()))

    def apply(self, func):
        def rewrite(expr, matches):
            x, w, conv = matches[self._x], matches[self._w], matches[self._conv]
            dims = self._patch_dims(conv, tensor_shape(x), tensor_shape(w))
            if dims is None or [int(a) for a in expr.attrs.axes] != [0, 2, 1]:
                return None
            batch, channels, rows, cols, out, p, q = dims
            if tensor_shape(expr) != (batch, rows * cols, out):
                return None
            bias = None
            if self._b in matches:
                bias = matches[self._b]
                if tensor_shape(bias) != (1, out, 1, 1):
                    return None
                bias = relax.const(bias.value.numpy().reshape(out), str(bias.ty.dtype))
            tiles = relax.op.reshape(x, [batch, channels, rows, p, cols, q])
            patches = relax.op.reshape(relax.op.permute_dims(tiles, [0, 2, 4, 1, 3, 5]),
                                       [batch, rows * cols, channels * p * q])
            y = relax.op.matmul(patches, self._weight(w, out), out_dtype=str(conv.ty.dtype))
            return y if bias is None else relax.op.add(y, bias)

        return rewrite_matches(self.pattern, rewrite, func)

    @staticmethod
    def _patch_dims(conv, x_shape, w_shape):
        """(B, C, rows, cols, O, p, q) of a patch conv (stride = kernel, no padding, dilation 1, one group, NCHW
        / OIHW, an image of whole patches), else None."""
        attrs = conv.attrs
        if x_shape is None or w_shape is None or len(x_shape) != 4 or len(w_shape) != 4:
            return None
        layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
        if layouts != ("NCHW", "OIHW", "NCHW") or int(attrs.groups) != 1:
            return None
        (batch, channels, height, width), (out, in_channels, p, q) = x_shape, w_shape
        if ([int(v) for v in attrs.strides] != [p, q] or any(int(v) for v in attrs.padding)
                or [int(v) for v in attrs.dilation] != [1, 1] or in_channels != channels
                or height % p or width % q):
            return None
        return batch, channels, height // p, width // q, out, p, q

    @staticmethod
    def _weight(w, out: int) -> relax.Expr:
        """The ``[C*p*q, O]`` weight: folded here for a constant, else weight-only ops (lifted into the weight
        transform at build)."""
        if isinstance(w, Constant):
            value = w.value.numpy()
            return relax.const(np.ascontiguousarray(value.reshape(out, -1).T), str(w.ty.dtype))
        return relax.op.permute_dims(relax.op.reshape(w, [out, -1]), [1, 0])
