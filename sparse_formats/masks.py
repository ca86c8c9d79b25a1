"""Attention masks: the named STOF masks, mask specs, and normalisation of every accepted mask form.

A mask is a boolean array where ``mask[..., i, j]`` is True when query ``i`` may attend to key ``j``. Every
kernel, format and statistic in stof-tvm works on the *normalised* form returned by :func:`normalize_mask`:
a 4-D array ``[Bm, Hm, Sq, Sk]`` with ``Bm`` in ``{1, batch}`` and ``Hm`` in ``{1, heads}``. A mask shared by
all batches (or heads) keeps a size-1 axis there, so it is stored and converted to formats once.

Rows with no kept key are legal; attention defines their output as zero.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

__all__ = ["MASK_NAMES", "MaskSpec", "parse_spec", "make_mask", "padding_mask", "normalize_mask"]


@dataclass(frozen=True)
class MaskSpec:
    """A parsed mask spec string: a mask name plus its parameters (defaults filled in)."""

    name: str
    params: Mapping[str, object]

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))


# name -> {parameter: default}. Integer parameters must be >= 0 (``block`` >= 1); ``density`` is in [0, 1].
_DEFAULTS: dict[str, dict[str, object]] = {
    "dense": {},
    "causal": {},
    "sliding": {"window": 64},
    "local": {"window": 64},
    "longformer": {"window": 32, "globals": 32},
    "bigbird": {"window": 32, "globals": 32, "block": 32, "density": 0.1, "seed": 0},
    "dilated": {"window": 64, "dilation": 2},
    "blocksparse": {"file": None, "block": 64},
}
MASK_NAMES = tuple(_DEFAULTS)


def parse_spec(spec: str) -> MaskSpec:
    """Parse ``"name"`` or ``"name:key=value,key=value"`` into a :class:`MaskSpec`, checking names and values."""
    if not isinstance(spec, str):
        raise TypeError(f"mask spec must be a string like 'sliding:window=64', got {type(spec).__name__}")
    name, colon, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in _DEFAULTS:
        raise ValueError(f"unknown mask name {name!r} in spec {spec!r}; expected one of {', '.join(MASK_NAMES)}")
    params = dict(_DEFAULTS[name])
    for item in rest.split(",") if colon else ():
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"malformed mask spec {spec!r}: expected key=value after ':', got {item.strip()!r}")
        if key not in params:
            known = ", ".join(sorted(params)) or "none"
            raise ValueError(f"mask {name!r} has no parameter {key!r} (parameters: {known})")
        params[key] = _parse_value(name, key, value)
    if name == "blocksparse" and params["file"] is None:
        raise ValueError("mask 'blocksparse' needs a tile bitmap: 'blocksparse:file=bitmap.npy,block=64' "
                         "or pass the expanded boolean array itself")
    return MaskSpec(name, params)


def _parse_value(name: str, key: str, text: str) -> object:
    if key == "file":
        return text
    if key == "density":
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"mask {name!r}: {key} must be a number in [0, 1], got {text!r}") from None
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"mask {name!r}: {key} must be in [0, 1], got {value}")
        return value
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"mask {name!r}: {key} must be an integer, got {text!r}") from None
    lowest = 1 if key in ("block", "dilation") else 0
    if value < lowest:
        raise ValueError(f"mask {name!r}: {key} must be >= {lowest}, got {value}")
    return value


def make_mask(spec: str | MaskSpec, seq_len: int, *, batch: int | None = None,
              heads: int | None = None) -> np.ndarray:
    """Build a named mask as a boolean ``[S, S]`` array.

    With ``batch`` and/or ``heads`` the result is a read-only broadcast view ``[B, H, S, S]`` (no copy): the
    named masks are the same for every batch and head. ``spec`` is ``name`` or ``name:key=value,...``; see
    :data:`MASK_NAMES` and README for the parameters.
    """
    parsed = spec if isinstance(spec, MaskSpec) else parse_spec(spec)
    seq_len = _check_positive_int("seq_len", seq_len)
    mask = _BUILDERS[parsed.name](seq_len, **parsed.params)
    if batch is None and heads is None:
        return mask
    b = _check_positive_int("batch", batch if batch is not None else 1)
    h = _check_positive_int("heads", heads if heads is not None else 1)
    return np.broadcast_to(mask, (b, h, seq_len, seq_len))


def padding_mask(lengths, seq_len: int, *, seq_q: int | None = None) -> np.ndarray:
    """Per-batch padding as a ``[B, 1, Sq, Sk]`` mask: key ``j`` is kept for batch ``b`` iff ``j < lengths[b]``."""
    seq_len = _check_positive_int("seq_len", seq_len)
    seq_q = seq_len if seq_q is None else _check_positive_int("seq_q", seq_q)
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"lengths must be a non-empty 1-D integer array, got shape {lengths.shape} "
                        f"dtype {lengths.dtype}")
    if lengths.min() < 0 or lengths.max() > seq_len:
        raise ValueError(f"lengths must lie in [0, {seq_len}], got min {lengths.min()} max {lengths.max()}")
    keys = np.arange(seq_len)[None, :] < lengths[:, None]                     # [B, Sk]
    return np.broadcast_to(keys[:, None, None, :], (lengths.size, 1, seq_q, seq_len))


def normalize_mask(mask, *, batch: int = 1, heads: int = 1, seq_q: int, seq_k: int | None = None) -> np.ndarray:
    """Turn any accepted mask form into a boolean ``[Bm, Hm, Sq, Sk]`` array (``Bm`` in {1, batch}, ...).

    Accepted forms: a spec string; a :class:`MaskSpec`; a boolean array ``[Sq, Sk]``, ``[B, Sq, Sk]`` or
    ``[B, H, Sq, Sk]`` (size-1 or broadcast batch/head axes are kept once); a callable ``f(b, h, i, j)``
    vectorised over broadcast index arrays; a 1-D integer array of per-batch valid key lengths (padding).
    """
    batch = _check_positive_int("batch", batch)
    heads = _check_positive_int("heads", heads)
    seq_q = _check_positive_int("seq_q", seq_q)
    seq_k = seq_q if seq_k is None else _check_positive_int("seq_k", seq_k)
    if isinstance(mask, (str, MaskSpec)):
        if seq_q != seq_k:
            raise ValueError(f"named masks are square; got seq_q={seq_q} and seq_k={seq_k}")
        array = make_mask(mask, seq_q)
    elif callable(mask):
        array = _evaluate_callable(mask, batch, heads, seq_q, seq_k)
    else:
        array = np.asarray(mask)
        if array.dtype == object:                        # None, a dict, ...: no array numpy could read
            raise TypeError(f"mask: {type(mask).__name__} is not a mask; give a spec ('bigbird', 'sliding', ...; "
                            f"'dense' keeps the model's own attention), a boolean array, a callable f(b, h, i, j) "
                            f"or per-batch valid lengths")
        if array.ndim == 1:
            if array.shape[0] != batch:
                raise ValueError(f"padding lengths must have one entry per batch ({batch}), got {array.shape[0]}")
            array = padding_mask(array, seq_k, seq_q=seq_q)
        elif array.dtype != np.bool_:
            raise TypeError(f"mask array must have dtype bool, got {array.dtype} (use mask != 0 to convert)")
    return _to_4d(array, batch, heads, seq_q, seq_k)


def _to_4d(array: np.ndarray, batch: int, heads: int, seq_q: int, seq_k: int) -> np.ndarray:
    if array.ndim not in (2, 3, 4):
        raise ValueError(f"mask must have rank 2 [S, S], 3 [B, S, S] or 4 [B, H, S, S], got shape {array.shape}")
    if array.shape[-2:] != (seq_q, seq_k):
        raise ValueError(f"mask's last two dimensions must be ({seq_q}, {seq_k}), got {array.shape[-2:]}")
    if array.ndim == 3:                                  # [B, Sq, Sk]: one mask per batch, shared by heads
        array = array[:, None]
    array = array.reshape((1,) * (4 - array.ndim) + array.shape)
    for axis, (name, want) in enumerate((("batch", batch), ("heads", heads))):
        if array.shape[axis] not in (1, want):
            raise ValueError(f"mask's {name} dimension must be 1 or {want}, got {array.shape[axis]} "
                             f"(mask shape {array.shape})")
        if array.shape[axis] > 1 and array.strides[axis] == 0:
            array = array[(slice(None),) * axis + (slice(0, 1),)]          # a broadcast view: keep one copy
    return array


def _evaluate_callable(fn: Callable, batch: int, heads: int, seq_q: int, seq_k: int) -> np.ndarray:
    b = np.arange(batch).reshape(-1, 1, 1, 1)
    h = np.arange(heads).reshape(1, -1, 1, 1)
    i = np.arange(seq_q).reshape(1, 1, -1, 1)
    j = np.arange(seq_k).reshape(1, 1, 1, -1)
    result = np.asarray(fn(b, h, i, j))
    if result.dtype != np.bool_:
        raise TypeError(f"mask callable must return booleans, got dtype {result.dtype}")
    if result.ndim > 4:
        raise ValueError(f"mask callable returned rank {result.ndim}; expected a broadcast of [B, H, Sq, Sk]")
    result = result.reshape((1,) * (4 - result.ndim) + result.shape)
    shape = tuple(full if got != 1 else 1 for got, full in zip(result.shape, (batch, heads, seq_q, seq_k)))
    if any(got not in (1, full) for got, full in zip(result.shape, (batch, heads, seq_q, seq_k))):
        raise ValueError(f"mask callable returned shape {result.shape}, not broadcastable to "
                         f"{(batch, heads, seq_q, seq_k)}")
    return np.ascontiguousarray(np.broadcast_to(result, shape[:2] + (seq_q, seq_k)))


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


# ----------------------------------------------------------------------------------------------------------------
# The named masks (design.md section 3). Each returns a fresh boolean [S, S] array.

def _band(seq_len: int, low: int, high: int) -> np.ndarray:
    """``low <= i - j <= high`` for every query i (rows) and key j (columns): a narrow band diagonal by diagonal,
    a wide one from boolean triangles (no [S, S] integer offsets: at S = 16384 those were 2 GiB and seconds)."""
    low, high = max(low, 1 - seq_len), min(high, seq_len - 1)
    if high - low < 1024:
        keep = np.zeros((seq_len, seq_len), dtype=bool)
        flat = keep.reshape(-1)
        for offset in range(low, high + 1):         # i - j = offset: S - |offset| cells, step S + 1
            start = offset * seq_len if offset >= 0 else -offset
            flat[start:start + (seq_len - abs(offset)) * (seq_len + 1):seq_len + 1] = True
        return keep
    keep = np.tri(seq_len, k=-low, dtype=bool)
    if high < seq_len - 1:
        keep &= ~np.tri(seq_len, k=-high - 1, dtype=bool)
    return keep


def _dense(seq_len: int) -> np.ndarray:
    return np.ones((seq_len, seq_len), dtype=bool)


def _causal(seq_len: int) -> np.ndarray:
    return _band(seq_len, 0, seq_len)


def _sliding(seq_len: int, window: int) -> np.ndarray:
    return _band(seq_len, 0, window)


def _local(seq_len: int, window: int) -> np.ndarray:
    return _band(seq_len, -window, window)


def _global_positions(seq_len: int, starts: list[int], width: int) -> np.ndarray:
    marks = np.zeros(seq_len, dtype=bool)
    for start in starts:
        marks[start:start + width] = True
    return marks


def _longformer(seq_len: int, window: int, globals: int) -> np.ndarray:
    marks = _global_positions(seq_len, [0, seq_len // 2], globals)
    mask = _local(seq_len, window)
    mask[marks, :] = True                   # global rows and columns, written in place
    mask[:, marks] = True
    return mask


def _bigbird(seq_len: int, window: int, globals: int, block: int, density: float, seed: int) -> np.ndarray:
    """Band + global rows/columns + random points.

    Random part: row blocks of ``block`` queries; row block r draws each element of one neighbouring
    ``block x block`` key block with probability ``density``. The neighbour is key block r + 1, or r - 1 for the
    last row block (the block itself when there is only one). One ``numpy.random.default_rng(seed)`` draw of
    shape [n_blocks, block, block] makes it reproducible.
    """
    marks = _global_positions(seq_len, [0], globals)
    mask = _local(seq_len, window)
    mask[marks, :] = True                   # global rows and columns, written in place
    mask[:, marks] = True
    n_blocks = -(-seq_len // block)
    draws = np.random.default_rng(seed).random((n_blocks, block, block)) < density
    neighbour = np.arange(n_blocks) + 1
    neighbour[-1] = max(n_blocks - 2, 0)
    for row_block, key_block in enumerate(neighbour):     # one small block each, no [S, S] temporary
        rows = slice(row_block * block, min((row_block + 1) * block, seq_len))
        keys = slice(key_block * block, min((key_block + 1) * block, seq_len))
        mask[rows, keys] |= draws[row_block, :rows.stop - rows.start, :keys.stop - keys.start]
    return mask


def _dilated(seq_len: int, window: int, dilation: int) -> np.ndarray:
    keep = np.zeros((seq_len, seq_len), dtype=bool)
    flat = keep.reshape(-1)
    for offset in range(0, min(window, seq_len - 1) + 1, dilation):     # the diagonal i - j = offset
        flat[offset * seq_len::seq_len + 1] = True
    return keep


def _blocksparse(seq_len: int, file: str, block: int) -> np.ndarray:
    if not os.path.exists(file):
        raise FileNotFoundError(f"blocksparse tile bitmap file not found: {file}")
    return expand_tile_bitmap(np.load(file), seq_len, block)


def expand_tile_bitmap(bitmap: np.ndarray, seq_len: int, block: int) -> np.ndarray:
    """Expand a boolean tile bitmap ``[ceil(S/block), ceil(S/block)]`` into an element mask ``[S, S]``."""
    bitmap = np.asarray(bitmap)
    n_blocks = -(-seq_len // block)
    if bitmap.dtype != np.bool_:
        raise TypeError(f"tile bitmap must have dtype bool, got {bitmap.dtype}")
    if bitmap.shape != (n_blocks, n_blocks):
        raise ValueError(f"tile bitmap for seq_len={seq_len}, block={block} must have shape "
                         f"({n_blocks}, {n_blocks}), got {bitmap.shape}")
    return np.repeat(np.repeat(bitmap, block, axis=0), block, axis=1)[:seq_len, :seq_len]


_BUILDERS: dict[str, Callable[..., np.ndarray]] = {
    "dense": _dense, "causal": _causal, "sliding": _sliding, "local": _local, "longformer": _longformer,
    "bigbird": _bigbird, "dilated": _dilated, "blocksparse": _blocksparse,
}
