"""Query rows by class: *dense* rows keep every key (Longformer's and BigBird's global queries), the others are
*sparse*. A dense row is plain dense attention (no mask work), so it can go to a kernel that runs dense tiles
fast (the Hopper wgmma kernel) while the sparse rows stay on the block-wise kernel with their bitmaps; both give
each row the same softmax, so the two classes' outputs are disjoint rows of one exact result.

Also *dense columns*, the keys every query keeps (the global keys), which :func:`pair_classes` uses to split a
mask's kept pairs into dense rows, dense columns outside them, and the rest (band, random).
"""
from __future__ import annotations

import numpy as np

__all__ = ["dense_query_rows", "dense_key_columns", "split_dense_rows", "pack_dense_rows", "pair_classes"]


def _check(mask: np.ndarray) -> None:
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.ndim != 4:
        raise TypeError("expected a boolean [Bm, Hm, Sq, Sk] numpy array (see normalize_mask)")


def dense_query_rows(mask: np.ndarray) -> np.ndarray:
    """``[Bm, Hm, Sq]`` bool: the query rows of a normalised mask that keep every key (none when Sk is 0)."""
    _check(mask)
    return mask.all(axis=3) & (mask.shape[3] > 0)


def dense_key_columns(mask: np.ndarray) -> np.ndarray:
    """``[Bm, Hm, Sk]`` bool: the keys every query row of a normalised mask keeps (none when Sq is 0)."""
    _check(mask)
    return mask.all(axis=2) & (mask.shape[2] > 0)


def split_dense_rows(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(dense, sparse)``: the mask restricted to its dense query rows, and the mask with those rows emptied.

    Exact partition: ``dense | sparse == mask``, no row holds pairs of both, and every row of ``dense`` that
    holds any pair holds all of them."""
    rows = dense_query_rows(mask)[..., None]
    return mask & rows, mask & ~rows


def pack_dense_rows(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row_ids, packed)``: the dense query rows of each mask group gathered, for a dense kernel that runs them
    as a problem of ``G`` queries (``G``: the most dense rows of any group, at least 1).

    ``row_ids`` int32 ``[Bm, Hm, G]``: the query rows, ascending, then -1 in the slots of a group with fewer;
    ``packed`` bool ``[Bm, Hm, G, Sk]``: slot ``i`` keeps every key where it holds a row, nothing at a -1 slot
    (a row with no kept key gives 0, which the scatter of the slot's output must skip)."""
    rows = dense_query_rows(mask)
    count = max(int(rows.sum(axis=2).max(initial=0)), 1)
    row_ids = np.full(rows.shape[:2] + (count,), -1, dtype=np.int32)
    for g in np.ndindex(*rows.shape[:2]):
        ids = np.flatnonzero(rows[g])
        row_ids[g][:ids.size] = ids
    packed = np.broadcast_to((row_ids >= 0)[..., None], row_ids.shape + (mask.shape[3],))
    return row_ids, np.ascontiguousarray(packed)


def pair_classes(mask: np.ndarray) -> dict[str, int]:
    """Kept pairs of a normalised mask by class: ``dense_rows`` (pairs of the dense query rows),
    ``dense_columns`` (pairs at dense keys in the other rows), ``other`` (the rest: band, random points) and
    ``total``, summed over the mask groups."""
    rows = dense_query_rows(mask)
    cols = dense_key_columns(mask)
    in_rows = int(mask.sum(axis=3)[rows].sum())
    sparse_rows = (~rows).sum(axis=2)                                   # [Bm, Hm]
    in_cols = int((sparse_rows * cols.sum(axis=2)).sum())
    total = int(mask.sum())
    return {"dense_rows": in_rows, "dense_columns": in_cols, "other": total - in_rows - in_cols, "total": total}
