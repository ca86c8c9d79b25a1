"""Masks and sparse storage formats (installed as ``stof_tvm.sparse_formats``).

mask (any form) -> :func:`normalize_mask` -> ``[Bm, Hm, Sq, Sk]`` bool -> :func:`build_tiled` (block-wise kernel)
or :func:`build_rows` (row-wise kernel); :func:`mask_stats` feeds the kernel choice.
"""
from .masks import MASK_NAMES, MaskSpec, make_mask, normalize_mask, padding_mask, parse_spec
from .rows import RowFormat, build_rows
from .stats import MaskStats, TileStats, mask_stats, stof_rule
from .tiled import TiledFormat, build_tiled

__all__ = ["MASK_NAMES", "MaskSpec", "make_mask", "normalize_mask", "padding_mask", "parse_spec", "RowFormat",
           "build_rows", "MaskStats", "TileStats", "mask_stats", "stof_rule", "TiledFormat", "build_tiled"]
