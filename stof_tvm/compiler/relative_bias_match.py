"""Relative-position score biases made of two gathered products, computed by one kernel that never writes them.

HF DeBERTa-v3's score bias, after :mod:`.gather_index` and the float16 conversion, is per layer::

    c2p = astype(matmul(Q, Wk, out_dtype=float32), float16)         # Q [N, S, D], Wk [N, D, K]
    t1  = take(astype(reshape(c2p, [N, S * K]), float32), T1, axis=1)     # T1[i, j] = i * K + position
    p2c = astype(matmul(Kc, Wq, out_dtype=float32), float16)
    t2  = permute_dims(take(astype(reshape(p2c, [N, S * K]), float32), T2, axis=1), [0, 2, 1])
    bias = astype(reshape(add(divide(t1, c1), divide(t2, c2)), [B, H, S, S]), float16)

(TorchScript exports add a ``+ 0.0`` to the first term.) ``Wk`` and ``Wq`` are each layer's position projections:
constants where the export folded them (small models), else graph values, ``permute_dims`` of each head's projection
repeated over the batch. :func:`fuse_relative_biases` replaces each such ``bias`` with one call of
:mod:`stof_tvm.schedules.relative_bias` (the plain loop nest off CUDA), whose inputs are Q and Kc as they are, the
two projections as [G, K, D] (G the period of their repetition over N: each head's, read once), and, built here from
the constant gather tables, each 64 x 64 tile's window start (``bases``) and every output's two offsets into the
windows (``offsets``, one byte each). The kernel computes the same products, rounds them as the graph does and sums
the same terms, so the bias equals the graph's up to the order of each product's float32 sum. It is used only where
every part matches: a 16-bit product cast from float32, a gather that stays in the product's row (the
non-transposed term's row ``i``, the transposed term's row ``j``), tile windows that fit the kernel, scalar
divisors, a 16-bit result; anything else stays as it was. On CUDA, where the bias is read only by the tiled
attention kernels, one map of the 64 x 64 tiles their runtime mask visits (built from the attention's own format
inputs) lets every layer's kernel skip the tiles no attention tile reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from stof_tvm.schedules.relative_bias import (STRIP, TILE, WARPS, fits, relative_bias_primfunc,
                                              relative_bias_reference, visited_tiles_primfunc, window_size)

from .canonical.base import op_name, resolve, scalar_constant, tensor_dtype, tensor_shape
from .linear_match import users_of
from .op_patterns import OPAQUE

__all__ = ["TiledAttention", "fuse_relative_biases"]

# main's inputs carrying the tiled attention format (stof_tvm.compiler.kernels.KernelChoice.format_inputs)
FORMAT_LISTS = ("stof_full_indptr", "stof_full_indices", "stof_part_indptr", "stof_part_indices")


@dataclass(frozen=True)
class TiledAttention:
    """What the bias kernel needs to skip tiles that the attention never visits: the tiled format's tile and mask
    groups (its lists are ``main``'s :data:`FORMAT_LISTS` inputs)."""

    block_m: int
    block_n: int
    mask_batch: int
    mask_heads: int

SIXTEEN_BIT = ("float16", "bfloat16")


@dataclass(frozen=True)
class _Term:
    """One gathered, scaled product: ``take(product rows, table) [permuted] / scale``."""

    lhs: relax.Expr                 # [N, S, D], the product's left operand (a graph value)
    positions: relax.Expr           # [groups, K, D]: the right operand transposed (a graph value or constant)
    groups: int                     # the right operand's row n is positions[n % groups]
    table: np.ndarray               # [S, S] positions, indexed as the take's output (before any permute)
    transposed: bool
    scale: float


def _strip(expr, var2val, accept):
    """Follow bindings through the calls ``accept(call)`` admits (one operand each), to the first other value."""
    expr = resolve(expr, var2val)
    while op_name(expr) is not None and accept(expr):
        expr = resolve(expr.args[0], var2val)
    return expr


def _product(expr, var2val):
    """``(lhs, rhs)`` of ``astype(matmul(lhs, rhs, out_dtype=float32), lhs dtype)`` reached through reshapes and
    casts to float32 (the flat view the gather reads), or None."""
    flat = _strip(expr, var2val, lambda e: op_name(e) == "relax.reshape"
                  or (op_name(e) == "relax.astype" and str(e.attrs.dtype) == "float32"))
    if op_name(flat) != "relax.astype":
        return None
    matmul = resolve(flat.args[0], var2val)
    if op_name(matmul) != "relax.matmul" or str(matmul.attrs.out_dtype) != "float32":
        return None
    lhs, rhs = matmul.args
    if tensor_dtype(lhs) not in SIXTEEN_BIT or str(flat.attrs.dtype) != tensor_dtype(lhs) \
            or tensor_dtype(rhs) != tensor_dtype(lhs):
        return None
    return lhs, rhs


def _repeated_rows(x, var2val):
    """``(y, g)`` with ``x[n] == y[n % g]`` for a [N, K, D] value ``x`` that is ``y`` [g, K, D] repeated over the
    batch (``reshape(broadcast_to(reshape(y)))`` expanding only axes ahead of ``y``'s, as HF DeBERTa's
    ``repeat`` exports), else ``(x, N)``."""
    shape = tensor_shape(x)
    reshaped = resolve(x, var2val)
    spread = resolve(reshaped.args[0], var2val) if op_name(reshaped) == "relax.reshape" else None
    if op_name(spread) != "relax.broadcast_to":
        return x, shape[0]
    source = spread.args[0]
    before, after = tensor_shape(source), tensor_shape(spread)
    inner = resolve(source, var2val)
    rows = inner.args[0] if op_name(inner) == "relax.reshape" else source
    row_shape = tensor_shape(rows)
    if before is None or after is None or row_shape is None or len(row_shape) != 3 \
            or tuple(row_shape[1:]) != tuple(shape[1:]) or shape[0] % row_shape[0]:
        return x, shape[0]
    first = next((i for i, d in enumerate(before) if d != 1), len(before))
    if [d for d in before if d != 1] != [d for d in row_shape if d != 1] \
            or any(b != a for b, a in zip(before[first:], after[first:])):
        return x, shape[0]
    return rows, row_shape[0]


def _positions(rhs, var2val, batch: int, depth: int):
    """The right operand [N or 1, D, K] as ``(positions [G, K, D], G, K)``: a constant transposed here, its
    period over the batch removed; a graph value through its own transpose (``permute_dims(x, [0, 2, 1])``, the
    form the exports take) and its repetition over the batch (:func:`_repeated_rows`), else transposed in the
    graph. None where the shape is not one of these."""
    value = resolve(rhs, var2val)
    shape = tensor_shape(rhs)
    if shape is None or len(shape) != 3 or shape[0] not in (1, batch) or shape[1] != depth:
        return None
    if isinstance(value, Constant):
        table = np.ascontiguousarray(value.value.numpy().transpose(0, 2, 1))
        groups = _period(table)
        return relax.const(np.ascontiguousarray(table[:groups]), str(value.value.dtype)), groups, shape[2]
    if op_name(value) == "relax.permute_dims" and value.attrs.axes is not None \
            and [int(a) for a in value.attrs.axes] == [0, 2, 1]:
        rows, groups = _repeated_rows(value.args[0], var2val)
        return rows, groups, shape[2]
    return relax.op.permute_dims(rhs, [0, 2, 1]), shape[0], shape[2]


def _term(expr, var2val) -> _Term | None:
    """The :class:`_Term` ``expr`` computes (a ``+ 0.0`` allowed around it), or None."""
    expr = _strip(expr, var2val, lambda e: op_name(e) == "relax.add" and scalar_constant(e.args[1], var2val) == 0.0)
    if op_name(expr) != "relax.divide":
        return None
    scale = scalar_constant(expr.args[1], var2val)
    if scale is None or not math.isfinite(scale) or scale == 0.0 or tensor_dtype(expr) != "float32":
        return None
    gathered = resolve(expr.args[0], var2val)
    transposed = op_name(gathered) == "relax.permute_dims"
    if transposed:
        axes = [int(a) for a in gathered.attrs.axes] if gathered.attrs.axes is not None else None
        if axes != [0, 2, 1]:
            return None
        gathered = resolve(gathered.args[0], var2val)
    if op_name(gathered) != "relax.take" or int(gathered.attrs.axis) != 1:
        return None
    table = resolve(gathered.args[1], var2val)
    product = _product(gathered.args[0], var2val)
    if product is None or not isinstance(table, Constant):
        return None
    lhs, rhs = product
    lhs_shape, out_shape = tensor_shape(lhs), tensor_shape(gathered)
    if lhs_shape is None or out_shape is None or len(lhs_shape) != 3:
        return None
    batch, seq, depth = lhs_shape
    operand = _positions(rhs, var2val, batch, depth)
    if operand is None or out_shape != (batch, seq, seq):
        return None
    positions_expr, groups, positions = operand
    flat = table.value.numpy().astype(np.int64)
    if flat.shape != (seq, seq) or flat.min() < 0 or flat.max() >= seq * positions:
        return None
    if not (flat // positions == np.arange(seq)[:, None]).all():      # each gather stays in its product row
        return None
    return _Term(lhs, positions_expr, groups, flat % positions, transposed, scale)


def _period(array: np.ndarray) -> int:
    """The smallest ``g`` dividing ``len(array)`` with ``array[n] == array[n % g]`` for every ``n``."""
    count = array.shape[0]
    for g in range(1, count + 1):
        if count % g == 0 and (array.reshape(count // g, g, *array.shape[1:]) == array[:g]).all():
            return g
    return count


def _strip_extremes(positions: np.ndarray, strip_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The least and greatest position ``[tiles, tiles, WARPS]`` of each :data:`STRIP` rows (``strip_axis`` 0) or
    columns (1) of every TILE x TILE tile."""
    tiles = positions.shape[0] // TILE
    if strip_axis == 0:
        strips = positions.reshape(tiles, WARPS, STRIP, tiles, TILE).transpose(0, 3, 1, 2, 4)
    else:
        strips = positions.reshape(tiles, TILE, tiles, WARPS, STRIP).transpose(0, 2, 3, 1, 4)
    return strips.min(axis=(3, 4)), strips.max(axis=(3, 4))


def strip_window(positions: np.ndarray, strip_axis: int) -> int:
    """Product columns a warp computes for a term: the most positions that the outputs of one :data:`STRIP` rows
    (``strip_axis`` 0) or columns (1) of a TILE x TILE tile read, rounded up to whole n16 steps."""
    low, high = _strip_extremes(positions, strip_axis)
    return int(-(-(high - low + 1).max() // 16) * 16)


def _windows(positions: np.ndarray, total: int, strip_columns: int,
             strip_axis: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Each TILE x TILE tile's window start in ``[0, total - window]`` and its strips' starts within the window
    (``[tiles, tiles, 1 + WARPS]``), and every output's offset from its strip's start; None where a tile's positions
    span more than the window or a strip's more than ``strip_columns``. Strips are :data:`STRIP` rows
    (``strip_axis`` 0: the first term, whose product rows are the output's rows) or columns (1: the second)."""
    window = window_size(total)
    tiles = positions.shape[0] // TILE
    blocks = positions.reshape(tiles, TILE, tiles, TILE)
    low, high = blocks.min(axis=(1, 3)), blocks.max(axis=(1, 3))
    strip_low, strip_high = _strip_extremes(positions, strip_axis)
    if (high - low >= window).any() or (strip_high - strip_low >= strip_columns).any():
        return None
    bases = np.minimum(low, total - window)
    starts = np.minimum(strip_low, bases[:, :, None] + window - strip_columns)      # [tiles, tiles, WARPS]
    index = np.arange(positions.shape[0])
    tile, strip = index // TILE, index % TILE // STRIP
    if strip_axis == 0:
        per_output = starts[tile[:, None], tile[None, :], strip[:, None]]
    else:
        per_output = starts[tile[:, None], tile[None, :], strip[None, :]]
    table = np.concatenate([bases[:, :, None], starts - bases[:, :, None]], axis=2)
    return table, positions - per_output


def offset_words(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The kernel's ``offsets`` [S, S / 2] uint32: word ``[i, 32 * tj + lane]`` holds the first term's offsets of
    outputs ``j = 64 tj + lane`` and ``j + 32`` in its low bytes, the second term's in its high bytes."""
    seq = first.shape[0]
    halves = [a.astype(np.uint32).reshape(seq, seq // TILE, 2, 32) for a in (first, second)]
    words = halves[0][:, :, 0] | halves[0][:, :, 1] << 8 | halves[1][:, :, 0] << 16 | halves[1][:, :, 1] << 24
    return np.ascontiguousarray(words.reshape(seq, seq // 2))


def _fused_call(expr, var2val, add_kernel, visit_map):
    """``(kernel, arguments, output type)`` of the fused call replacing ``expr`` (a 16-bit cast of a two-term
    relative bias), or None where it is not one; ``add_kernel(shape)`` adds the kernel of that shape to the module,
    ``visit_map(seq, heads)`` gives the ``visited`` argument and the kernel's ``visits`` (None: every tile)."""
    if op_name(expr) != "relax.astype" or str(expr.attrs.dtype) not in SIXTEEN_BIT:
        return None
    total = _strip(expr.args[0], var2val, lambda e: op_name(e) == "relax.reshape")
    if op_name(total) != "relax.add":
        return None
    terms = [_term(arg, var2val) for arg in total.args]
    if any(t is None for t in terms) or sorted(t.transposed for t in terms) != [False, True]:
        return None
    first, second = sorted(terms, key=lambda t: t.transposed)
    batch, seq, depth = tensor_shape(first.lhs)
    total_positions = tensor_shape(first.positions)[1]
    if (tensor_shape(second.lhs) != (batch, seq, depth) or first.groups != second.groups
            or tensor_shape(second.positions) != tensor_shape(first.positions)
            or tensor_dtype(first.lhs) != tensor_dtype(second.lhs) or not fits(seq, total_positions, depth)
            or math.prod(tensor_shape(expr)) != batch * seq * seq):
        return None
    tables = (first.table, second.table.T)
    strip_columns = max(strip_window(table, axis) for axis, table in enumerate(tables))
    if not fits(seq, total_positions, depth, strip_columns):
        return None
    windows = [_windows(table, total_positions, strip_columns, axis) for axis, table in enumerate(tables)]
    if any(w is None for w in windows):
        return None
    bases = np.stack([windows[0][0], windows[1][0]], axis=2).astype(np.int32)        # [tiles, tiles, 2, 1 + WARPS]
    out_shape = tensor_shape(expr)
    visited, visits = visit_map(seq, out_shape[1] if len(out_shape) == 4 else None)
    shape = dict(batch=batch, seq=seq, positions=total_positions, head_dim=depth, groups=first.groups,
                 strip_window=strip_columns, scales=(first.scale, second.scale), dtype=tensor_dtype(first.lhs),
                 out_dtype=str(expr.attrs.dtype), visits=visits)
    args = [first.lhs, first.positions, second.lhs, second.positions,
            relax.const(offset_words(windows[0][1], windows[1][1])), relax.const(np.ascontiguousarray(bases)),
            visited]
    return add_kernel(shape), args, relax.TensorType([batch, seq, seq], shape["out_dtype"])


def _read_only_by_attention(var, users) -> bool:
    """Whether every reader of ``var`` (through reshapes and same-shape broadcasts) is a stof-tvm attention kernel:
    the only kernels that read the bias, and only at the tiles their format lists."""
    uses = users.get(var, [])
    for use in uses:
        if use is None:
            return False
        value = use.value
        same_elements = op_name(value) == "relax.reshape" or (
            op_name(value) == "relax.broadcast_to" and tensor_shape(value) == tensor_shape(value.args[0]))
        if same_elements:
            if not _read_only_by_attention(use.var, users):
                return False
        elif not (op_name(value) == "relax.call_tir" and isinstance(value.args[0], tvm.ir.GlobalVar)
                  and value.args[0].name_hint.startswith("stof_attention_")):
            return False
    return bool(uses)


def fuse_relative_biases(mod: tvm.IRModule, target_kind: str,
                         attention: TiledAttention | None = None) -> tuple[tvm.IRModule, int]:
    """``mod`` with every relative-position bias of ``main`` (module docstring) computed by the fused kernel, and
    how many were. With ``attention`` (CUDA, the tiled attention kernels), a bias that only those kernels read is
    computed only at the 64 x 64 tiles the runtime mask's format visits (one small kernel a forward maps them)."""
    func = mod["main"]
    var2val = relax.analysis.get_var2val(func)
    users = users_of(func)
    builder = relax.BlockBuilder(mod)
    names: dict = {}
    lists = {p.name: p for p in func.params if p.name in FORMAT_LISTS}
    skipping = attention is not None and target_kind == "cuda" and len(lists) == len(FORMAT_LISTS)
    visit_calls: dict = {}          # seq -> the map's call, emitted before the first bias that reads it

    def add_kernel(shape: dict):
        key = tuple(sorted(shape.items()))
        if key not in names:
            make = relative_bias_primfunc if target_kind == "cuda" else relative_bias_reference
            name = f"stof_relative_bias_{len(names)}"
            kernel = make(**shape).with_attr("global_symbol", name).with_attr("op_pattern", OPAQUE)
            if target_kind == "cuda":       # hand-scheduled: dlight and MetaSchedule leave it as it is
                kernel = kernel.with_attr("tirx.is_scheduled", True)
            names[key] = builder.add_func(kernel, name)
        return names[key]

    def visit_map(binding_var):
        def of(seq: int, heads: int | None):
            tiles = seq // TILE
            if not (skipping and heads and _read_only_by_attention(binding_var, users)):
                return relax.const(np.ones((1, tiles, tiles), "int32")), None
            groups = attention.mask_batch * attention.mask_heads
            if seq not in visit_calls:
                kernel = visited_tiles_primfunc(mask_groups=groups, seq=seq, block_m=attention.block_m,
                                                block_n=attention.block_n)
                name = f"stof_visited_tiles_{len(visit_calls)}"
                gv = builder.add_func(kernel.with_attr("global_symbol", name).with_attr("op_pattern", OPAQUE)
                                      .with_attr("tirx.is_scheduled", True), name)
                visit_calls[seq] = relax.call_tir(gv, [lists[n] for n in FORMAT_LISTS],
                                                  out_ty=relax.TensorType([groups, tiles, tiles], "int32"))
            return visit_calls[seq], (heads, attention.mask_batch, attention.mask_heads)
        return of

    replacements = {}
    for binding_var, value in var2val.items():
        fused = _fused_call(value, var2val, add_kernel, visit_map(binding_var))
        if fused is not None:
            replacements[binding_var] = fused
    if not replacements:
        return mod, 0
    emitted: dict = {}              # seq -> the visit map's variable

    @relax.expr_functor.mutator
    class Replace(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var not in replacements:
                super().visit_var_binding_(binding)
                return
            gv, args, out_ty = replacements[binding.var]
            operands = []
            for arg in args:
                seq = next((key for key, call in visit_calls.items() if arg.same_as(call)), None)
                if seq is not None:         # the visit map: emitted once, at the first bias that reads it
                    if seq not in emitted:
                        emitted[seq] = self.builder_.emit(arg)
                    operands.append(emitted[seq])
                    continue
                arg = self.visit_expr(arg)
                operands.append(self.builder_.emit(arg) if isinstance(arg, relax.Call) else arg)
            bias = self.builder_.emit(relax.call_tir(gv, operands, out_ty=out_ty))
            shaped = self.builder_.normalize(relax.op.reshape(bias, list(binding.var.ty.shape)))
            self.builder_.emit_normalized(relax.VarBinding(binding.var, shaped))

    mod = builder.get()
    mod["main"] = relax.analysis.remove_all_unused(Replace().visit_expr(mod["main"]))
    return mod, len(replacements)
