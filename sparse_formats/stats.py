"""Mask statistics used to choose a kernel and predict its cost.

All statistics come from the 8x8 sub-tile words (:mod:`.bitmaps`), so several tile shapes cost one packing pass.
``stof_rule`` is STOF's published kernel-selection rule (design.md 1A), the baseline the analytical model beats.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .bitmaps import ALL_ONES, subtile_words, tile_words

__all__ = ["TileStats", "MaskStats", "mask_stats", "tile_stats", "stof_rule", "DEFAULT_TILE_SHAPES"]

DEFAULT_TILE_SHAPES = ((16, 16), (32, 32), (64, 64), (128, 64), (128, 128))


@dataclass(frozen=True)
class TileStats:
    """Tile counts of a mask at one tile shape, summed over mask groups."""

    block_m: int
    block_n: int
    full: int
    partial: int
    empty: int

    @property
    def total(self) -> int:
        return self.full + self.partial + self.empty

    @property
    def nonempty_ratio(self) -> float:
        """Share of tiles that hold at least one kept pair (STOF's rho at 16x16)."""
        return (self.full + self.partial) / self.total

    @property
    def partial_share(self) -> float:
        """Share of the non-empty tiles that are partial (need bitmap work)."""
        nonempty = self.full + self.partial
        return self.partial / nonempty if nonempty else 0.0


@dataclass(frozen=True)
class MaskStats:
    """Density, keys per row and tile counts of a normalised ``[Bm, Hm, Sq, Sk]`` mask."""

    seq_q: int
    seq_k: int
    mask_batch: int
    mask_heads: int
    kept: int
    keys_min: int
    keys_mean: float
    keys_max: int
    empty_rows: int
    tiles: dict[tuple[int, int], TileStats] = field(default_factory=dict)

    @property
    def density(self) -> float:
        return self.kept / (self.mask_batch * self.mask_heads * self.seq_q * self.seq_k)


def tile_stats(words: np.ndarray, block_m: int, block_n: int) -> TileStats:
    """Count full, partial and empty tiles from sub-tile words ``[..., R8, C8]``."""
    tiles = tile_words(words, block_m, block_n)
    full = int((tiles == ALL_ONES).all(axis=(-2, -1)).sum())
    nonempty = int(tiles.any(axis=(-2, -1)).sum())
    total = int(np.prod(tiles.shape[:-2]))
    return TileStats(block_m, block_n, full=full, partial=nonempty - full, empty=total - nonempty)


def mask_stats(mask: np.ndarray, tile_shapes=DEFAULT_TILE_SHAPES) -> MaskStats:
    """Statistics of a normalised boolean mask ``[Bm, Hm, Sq, Sk]`` at each of ``tile_shapes``."""
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.ndim != 4:
        raise TypeError("mask_stats expects a boolean [Bm, Hm, Sq, Sk] numpy array (see normalize_mask)")
    keys = np.count_nonzero(mask, axis=-1)
    words = subtile_words(mask)
    return MaskStats(
        seq_q=mask.shape[2], seq_k=mask.shape[3], mask_batch=mask.shape[0], mask_heads=mask.shape[1],
        kept=int(keys.sum()), keys_min=int(keys.min()), keys_mean=float(keys.mean()), keys_max=int(keys.max()),
        empty_rows=int((keys == 0).sum()),
        tiles={(bm, bn): tile_stats(words, bm, bn) for bm, bn in tile_shapes})


def stof_rule(stats: MaskStats) -> str:
    """STOF's selection rule: block-wise iff the non-empty 16x16 block share rho >= 1 / log2(S/16)^2.

    For S <= 16 the logarithm is 0 and the rule picks block-wise (one block holds the whole problem).
    """
    rho = stats.tiles[(16, 16)].nonempty_ratio if (16, 16) in stats.tiles else None
    if rho is None:
        raise ValueError("stof_rule needs the 16x16 tile statistics (include (16, 16) in tile_shapes)")
    log_term = math.log2(max(stats.seq_k, 16) / 16)
    tau = 1.0 / log_term**2 if log_term > 0 else 0.0
    return "block" if rho >= tau else "row"
