"""What the cost model needs to know about a mask: per-row and per-tile-row work, at any tile shape.

:class:`MaskProfile` is built once per mask (one packing pass into 8x8 sub-tile words, shared with the formats)
and answers, lazily and cached:

- ``tile_counts(BM, BN)``: full and partial tiles of every (mask group, tile row): the work of each block-wise
  thread block;
- ``keys_per_row``: kept keys of every (mask group, query row): the work of the row-wise kernel's rows;
- ``block_union(rows)``: distinct keys that ``rows`` consecutive query rows read together (what a row-wise
  thread block really loads through L2, its rows sharing keys in L1).

Totals (density, kept pairs, the 16x16 non-empty share of STOF's rule) come with it. It holds numpy arrays
only; nothing here depends on TVM.
"""
from __future__ import annotations

import numpy as np

from ..sparse_formats.bitmaps import ALL_ONES, check_tile_shape, subtile_words

__all__ = ["MaskProfile"]

# block_union() looks at this many mask groups at most: the ratio of union to summed keys is a property of
# the pattern, and per-head masks of a large batch would otherwise cost seconds.
_UNION_SAMPLE_GROUPS = 4
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


class MaskProfile:
    """Work statistics of a normalised boolean mask ``[Bm, Hm, Sq, Sk]`` (see the module docstring)."""

    def __init__(self, mask: np.ndarray):
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.ndim != 4:
            raise TypeError("MaskProfile expects a boolean [Bm, Hm, Sq, Sk] numpy array (see normalize_mask)")
        self.mask_batch, self.mask_heads, self.seq_q, self.seq_k = (int(n) for n in mask.shape)
        self._mask = mask
        self._words = None
        self._tables = None
        self._tiles: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._unions: dict[int, np.ndarray] = {}
        self._memo: dict = {}
        self.keys_per_row = np.count_nonzero(mask, axis=-1).reshape(self.groups, self.seq_q).astype(np.int64)
        self.kept = int(self.keys_per_row.sum())

    @classmethod
    def from_spec(cls, spec, *, seq_q: int, seq_k: int | None = None, batch: int = 1,
                  heads: int = 1) -> "MaskProfile":
        """Profile of any mask form :func:`stof_tvm.normalize_mask` accepts."""
        from ..sparse_formats import normalize_mask

        return cls(normalize_mask(spec, batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k))

    @property
    def mask(self) -> np.ndarray:
        """The normalised boolean mask ``[Bm, Hm, Sq, Sk]`` this profile describes."""
        return self._mask

    def digest(self) -> str:
        """A short content hash of the mask (shape included): names a problem's tuning group."""
        import hashlib

        packed = np.packbits(self._mask, axis=-1)
        return hashlib.sha1(repr(self._mask.shape).encode() + packed.tobytes()).hexdigest()[:12]

    @property
    def groups(self) -> int:
        return self.mask_batch * self.mask_heads

    @property
    def density(self) -> float:
        return self.kept / (self.groups * self.seq_q * self.seq_k)

    def memo(self, key, compute):
        """``compute()`` once per ``key`` for this mask (derived arrays the model reuses across candidates)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def words(self) -> np.ndarray:
        """The 8x8 sub-tile words ``[G, ceil(Sq/8), ceil(Sk/8)]`` (computed once)."""
        if self._words is None:
            self._words = subtile_words(self._mask).reshape(self.groups, -(-self.seq_q // 8), -(-self.seq_k // 8))
        return self._words

    def _summed_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Summed-area tables ``[G, R8+1, C8+1]`` of full and of non-empty 8x8 sub-tiles: any tile shape's
        counts are then four look-ups per tile."""
        if self._tables is None:
            words = self.words()
            tables = []
            for flags in (words == ALL_ONES, words != 0):
                table = np.zeros((words.shape[0], words.shape[1] + 1, words.shape[2] + 1), dtype=np.int32)
                table[:, 1:, 1:] = flags.cumsum(axis=1, dtype=np.int32).cumsum(axis=2, dtype=np.int32)
                tables.append(table)
            self._tables = tuple(tables)
        return self._tables

    def tile_counts(self, block_m: int, block_n: int) -> tuple[np.ndarray, np.ndarray]:
        """(full, partial) tile counts, int64 arrays ``[G, ceil(Sq/BM)]``, at tile shape ``BM x BN``.

        A tile is full when all its ``BM/8 x BN/8`` sub-tiles are (an edge tile never is: its overhang counts
        as empty sub-tiles), non-empty when any is.
        """
        key = (int(block_m), int(block_n))
        if key not in self._tiles:
            check_tile_shape(*key)
            a, b = key[0] // 8, key[1] // 8
            full_t, any_t = self._summed_tables()
            rows8, cols8 = full_t.shape[1] - 1, full_t.shape[2] - 1
            r = np.minimum(np.arange(0, rows8 + a, a)[: -(-rows8 // a) + 1], rows8)
            c = np.minimum(np.arange(0, cols8 + b, b)[: -(-cols8 // b) + 1], cols8)

            def per_tile(table):
                return (table[:, r[1:]][:, :, c[1:]] - table[:, r[:-1]][:, :, c[1:]]
                        - table[:, r[1:]][:, :, c[:-1]] + table[:, r[:-1]][:, :, c[:-1]])

            full = (per_tile(full_t) == a * b).sum(axis=-1)
            nonempty = (per_tile(any_t) > 0).sum(axis=-1)
            self._tiles[key] = (full.astype(np.int64), (nonempty - full).astype(np.int64))
        return self._tiles[key]

    def nonempty_ratio(self, block_m: int = 16, block_n: int = 16) -> float:
        """Share of ``BM x BN`` tiles holding a kept pair (STOF's rho at 16x16)."""
        full, partial = self.tile_counts(block_m, block_n)
        total_tiles = self.groups * (-(-self.seq_q // block_m)) * (-(-self.seq_k // block_n))
        return float(full.sum() + partial.sum()) / total_tiles

    def block_union(self, rows: int) -> np.ndarray:
        """Distinct kept keys of each run of ``rows`` consecutive query rows, float64 ``[G, ceil(Sq/rows)]``.

        Computed exactly for up to four mask groups; for more, the remaining groups take the sampled groups'
        ratio of union to summed keys (the pattern's property).
        """
        rows = int(rows)
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if rows not in self._unions:
            summed = self._row_runs(self.keys_per_row.astype(np.float64), rows)
            if rows == 1:
                self._unions[rows] = summed
            else:
                sample = min(self.groups, _UNION_SAMPLE_GROUPS)
                packed = np.packbits(self._mask.reshape(self.groups, self.seq_q, self.seq_k)[:sample], axis=-1)
                n_runs = summed.shape[1]
                pad = n_runs * rows - self.seq_q
                if pad:
                    packed = np.pad(packed, ((0, 0), (0, pad), (0, 0)))
                merged = np.bitwise_or.reduce(packed.reshape(sample, n_runs, rows, -1), axis=2)
                union = _POPCOUNT[merged].sum(axis=-1, dtype=np.int64).astype(np.float64)
                ratio = union.sum() / max(summed[:sample].sum(), 1.0)
                union_all = summed * ratio
                union_all[:sample] = union
                self._unions[rows] = union_all
        return self._unions[rows]

    def _row_runs(self, per_row: np.ndarray, rows: int) -> np.ndarray:
        n_runs = -(-self.seq_q // rows)
        pad = n_runs * rows - self.seq_q
        if pad:
            per_row = np.pad(per_row, ((0, 0), (0, pad)))
        return per_row.reshape(self.groups, n_runs, rows).sum(axis=-1)
