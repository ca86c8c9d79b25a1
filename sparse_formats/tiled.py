"""The tiled format of the block-wise kernel: BSR lists of full and partial tiles plus 8x8 bitmaps (STOF's
two-level BSR + bitmap).

For a tile shape (BM, BN), each (mask group g, tile row tr) has a flat row id ``r = g * TR + tr`` and two CSR
lists of column-tile ids: *full* tiles (every element kept, so the kernel does no mask work) and *partial*
tiles, each with its exact element mask as ``BM/8 x BN/8`` uint64 words (layout in :mod:`.bitmaps`). Empty
tiles appear in neither list and are never loaded. The mask group of batch b, head h is
``(b if mask_batch > 1 else 0) * mask_heads + (h if mask_heads > 1 else 0)``: a mask shared by all batches or
heads is stored once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bitmaps import ALL_ONES, subtile_words, tile_words, words_to_mask

__all__ = ["TiledFormat", "build_tiled", "csr_from_flags"]


@dataclass(frozen=True)
class TiledFormat:
    """Full/partial tile lists of a ``[Bm, Hm, Sq, Sk]`` mask at tile shape (block_m, block_n)."""

    seq_q: int
    seq_k: int
    block_m: int
    block_n: int
    mask_batch: int
    mask_heads: int
    full_indptr: np.ndarray    # int32 [G*TR + 1]
    full_indices: np.ndarray   # int32 [n_full], ascending within a row
    part_indptr: np.ndarray    # int32 [G*TR + 1]
    part_indices: np.ndarray   # int32 [n_part], ascending within a row
    part_bitmaps: np.ndarray   # uint64 [n_part, BM/8, BN/8]

    @property
    def groups(self) -> int:
        return self.mask_batch * self.mask_heads

    @property
    def n_tile_rows(self) -> int:
        return -(-self.seq_q // self.block_m)

    @property
    def n_tile_cols(self) -> int:
        return -(-self.seq_k // self.block_n)

    def group(self, batch_index: int, head_index: int) -> int:
        """The mask group that batch ``batch_index``, head ``head_index`` reads."""
        return (batch_index if self.mask_batch > 1 else 0) * self.mask_heads + (
            head_index if self.mask_heads > 1 else 0)

    def to_dense(self) -> np.ndarray:
        """The boolean ``[Bm, Hm, Sq, Sk]`` mask this format encodes (for tests and debugging)."""
        tr, tc, a, b = self.n_tile_rows, self.n_tile_cols, self.block_m // 8, self.block_n // 8
        tiles = np.zeros((self.groups * tr, tc, a, b), dtype=np.uint64)
        rows = np.repeat(np.arange(self.groups * tr), np.diff(self.full_indptr))
        tiles[rows, self.full_indices] = ALL_ONES
        rows = np.repeat(np.arange(self.groups * tr), np.diff(self.part_indptr))
        tiles[rows, self.part_indices] = self.part_bitmaps
        words = tiles.reshape(self.groups, tr, tc, a, b).swapaxes(2, 3).reshape(self.groups, tr * a, tc * b)
        dense = words_to_mask(words, self.seq_q, self.seq_k)
        return dense.reshape(self.mask_batch, self.mask_heads, self.seq_q, self.seq_k)


def csr_from_flags(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR (indptr, column ids) of the True entries of a 2-D ``[rows, cols]`` boolean array, as int32."""
    rows, cols = np.nonzero(flags)
    counts = np.bincount(rows, minlength=flags.shape[0])
    indptr = np.zeros(flags.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    if indptr[-1] >= 2**31:
        raise ValueError(f"mask has {indptr[-1]} entries, more than int32 indices can address")
    return indptr.astype(np.int32), cols.astype(np.int32)


def build_tiled(mask: np.ndarray, block_m: int, block_n: int) -> TiledFormat:
    """Build the tiled format of a normalised boolean mask ``[Bm, Hm, Sq, Sk]``.

    Use :func:`stof_tvm.sparse_formats.masks.normalize_mask` first for any other mask form.
    """
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.ndim != 4:
        raise TypeError("build_tiled expects a boolean [Bm, Hm, Sq, Sk] numpy array (see normalize_mask)")
    bm_, hm_, seq_q, seq_k = mask.shape
    tiles = tile_words(subtile_words(mask), block_m, block_n)               # [Bm, Hm, TR, TC, a, b]
    tr, tc = tiles.shape[2:4]
    tiles = tiles.reshape(bm_ * hm_ * tr, tc, *tiles.shape[4:])
    full = (tiles == ALL_ONES).all(axis=(2, 3))
    nonempty = tiles.any(axis=(2, 3))
    partial = nonempty & ~full
    full_indptr, full_indices = csr_from_flags(full)
    part_indptr, part_indices = csr_from_flags(partial)
    return TiledFormat(seq_q=seq_q, seq_k=seq_k, block_m=block_m, block_n=block_n, mask_batch=bm_,
                       mask_heads=hm_, full_indptr=full_indptr, full_indices=full_indices,
                       part_indptr=part_indptr, part_indices=part_indices,
                       part_bitmaps=np.ascontiguousarray(tiles[partial]))
