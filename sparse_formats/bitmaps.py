"""The 8x8 sub-tile bitmap view of a mask, and tile classification built on it.

Packing the mask into one 64-bit word per 8x8 sub-tile is the shared first step of the tiled format and of the
mask statistics: a BM x BN tile is *empty* when all its words are zero, *full* when all are all-ones, *partial*
otherwise. Working on words (S*S/64 of them) instead of booleans keeps every builder vectorised and fast.

Bit layout: bit ``r * 8 + c`` of word ``[g..., a, b]`` is the mask at query ``a * 8 + r``, key ``b * 8 + c``.
Positions beyond the mask's edge are 0, so a tile overhanging the edge is never full.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ALL_ONES", "subtile_words", "tile_words", "check_tile_shape", "words_to_mask"]

ALL_ONES = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


def subtile_words(mask: np.ndarray) -> np.ndarray:
    """Pack a boolean ``[..., Sq, Sk]`` mask into uint64 words ``[..., ceil(Sq/8), ceil(Sk/8)]``."""
    *lead, seq_q, seq_k = mask.shape
    packed = np.packbits(mask, axis=-1, bitorder="little")                    # [..., Sq, ceil(Sk/8)] bytes
    rows8 = -(-seq_q // 8)
    if rows8 * 8 != seq_q:
        pad = [(0, 0)] * len(lead) + [(0, rows8 * 8 - seq_q), (0, 0)]
        packed = np.pad(packed, pad)
    cols8 = packed.shape[-1]
    # byte r of a sub-tile's word holds its row r: move the 8 rows of each sub-tile next to each other.
    grouped = packed.reshape(*lead, rows8, 8, cols8).swapaxes(-1, -2)           # [..., rows8, cols8, 8]
    return np.ascontiguousarray(grouped).view("<u8")[..., 0]


def check_tile_shape(block_m: int, block_n: int) -> None:
    """Tiles are whole 8x8 sub-tiles: both sides positive multiples of 8."""
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
        if value < 8 or value % 8:
            raise ValueError(f"{name} must be a positive multiple of 8, got {value}")


def tile_words(words: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """Group sub-tile words by tile: ``[..., R8, C8]`` -> ``[..., TR, TC, BM/8, BN/8]`` (zero-padded at the edge)."""
    check_tile_shape(block_m, block_n)
    a, b = block_m // 8, block_n // 8
    *lead, rows8, cols8 = words.shape
    tile_rows, tile_cols = -(-rows8 // a), -(-cols8 // b)
    if (tile_rows * a, tile_cols * b) != (rows8, cols8):
        pad = [(0, 0)] * len(lead) + [(0, tile_rows * a - rows8), (0, tile_cols * b - cols8)]
        words = np.pad(words, pad)
    return words.reshape(*lead, tile_rows, a, tile_cols, b).swapaxes(-3, -2)


def words_to_mask(words: np.ndarray, seq_q: int, seq_k: int) -> np.ndarray:
    """Inverse of :func:`subtile_words`: words ``[..., R8, C8]`` -> boolean ``[..., Sq, Sk]``."""
    *lead, rows8, cols8 = words.shape
    as_bytes = np.ascontiguousarray(words, dtype="<u8")[..., None].view(np.uint8)   # [..., R8, C8, 8]
    rows = as_bytes.swapaxes(-1, -2).reshape(*lead, rows8 * 8, cols8)
    bits = np.unpackbits(rows, axis=-1, bitorder="little")
    return bits[..., :seq_q, :seq_k].astype(bool)
