"""The row-compressed format of the row-wise kernel: per (mask group, query row), the kept key ids (CSR).

Row id ``g * Sq + i`` for mask group g (same group rule as :mod:`.tiled`) and query i; ``indices`` holds each
row's kept keys in ascending order. The row-wise kernel touches exactly these keys and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tiled import csr_from_flags

__all__ = ["RowFormat", "build_rows"]


@dataclass(frozen=True)
class RowFormat:
    """Kept key ids per query row of a ``[Bm, Hm, Sq, Sk]`` mask."""

    seq_q: int
    seq_k: int
    mask_batch: int
    mask_heads: int
    indptr: np.ndarray    # int32 [G*Sq + 1]
    indices: np.ndarray   # int32 [nnz]

    @property
    def groups(self) -> int:
        return self.mask_batch * self.mask_heads

    @property
    def nnz(self) -> int:
        return int(self.indptr[-1])

    def to_dense(self) -> np.ndarray:
        """The boolean ``[Bm, Hm, Sq, Sk]`` mask this format encodes (for tests and debugging)."""
        dense = np.zeros((self.groups * self.seq_q, self.seq_k), dtype=bool)
        dense[np.repeat(np.arange(dense.shape[0]), np.diff(self.indptr)), self.indices] = True
        return dense.reshape(self.mask_batch, self.mask_heads, self.seq_q, self.seq_k)


def build_rows(mask: np.ndarray) -> RowFormat:
    """Build the row-compressed format of a normalised boolean mask ``[Bm, Hm, Sq, Sk]``."""
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.ndim != 4:
        raise TypeError("build_rows expects a boolean [Bm, Hm, Sq, Sk] numpy array (see normalize_mask)")
    bm_, hm_, seq_q, seq_k = mask.shape
    indptr, indices = csr_from_flags(mask.reshape(bm_ * hm_ * seq_q, seq_k))
    return RowFormat(seq_q=seq_q, seq_k=seq_k, mask_batch=bm_, mask_heads=hm_, indptr=indptr, indices=indices)
