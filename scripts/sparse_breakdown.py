"""Where the sparse masks' time goes (issue 16, B16 H12 S4096 D64 fp16), from the mask alone, on the CPU.

For each mask: its kept pairs by class (:func:`stof_tvm.sparse_formats.row_classes.pair_classes`: the dense query
rows, the dense key columns outside them, the rest), the block-wise kernel's tiles at 32x32 (full / partial, in
the dense rows' tile rows and in the others) and the wgmma kernel's tiles at 192x128 (three consumers) for the
dense rows alone, then what each part costs at rates measured on the H200:

- the block-wise kernel: ``t = t0 + c * tiles_per_head``, fitted by least squares to its measured times at
  32x32 (``MEASURED_BLOCK``: 32x32x2x2 heavy-first, min_blocks 10, session 9 call 9; the fit's residuals are
  printed);
- the wgmma kernel on dense tiles: 1.580 ms for dense B16 H12 S4096 D64 (session 9 call 14), 522 TFLOP/s;
- mma.sync at its best (causal 128x64 tiles, 1.315 ms: 313 TFLOP/s) and the memory floor (Q, K, V, O once at
  4.3 TB/s: 0.094 ms).

The last table prices the dense-row split in two launches: the sparse rows on the block-wise kernel (the fit at
their tiles) plus the dense rows on wgmma, *packed* (their pairs at the dense rate: the bound with the rows gathered
into full tiles) or *in place* (the 192-row tile rows that hold them, every tile at the dense rate). Either way the
dense launch reads every head's K and V again (201 MB: 0.047 ms at 4.3 TB/s; L2 holds 60 MB, so the second launch
finds none of them there), where the single block-wise launch runs a head's global rows beside its other rows
(heavy-first) and reads K and V once; ``split packed`` takes the larger of the dense rows' compute and that re-read.
The H200 measured more still (``measured``: the packed dense rows alone took 0.09-0.10 ms, one busy 64-row consumer
per (batch, head)), as the analytical model priced them.

A last table sets 32x16 tiles beside 32x32 (measured, one warp, heavy-first): twice the tiles over the same area
cost within 2% of each other, so the kernel's time follows the pairs it computes, not its tile count, and wider
key tiles for the heavy rows would not buy much either.

    python scripts/sparse_breakdown.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sparse_formats.masks import normalize_mask  # noqa: E402
from sparse_formats.row_classes import dense_query_rows, pack_dense_rows, pair_classes, split_dense_rows  # noqa: E402
from sparse_formats.tiled import build_tiled  # noqa: E402

BATCH, HEADS, SEQ, HEAD_DIM = 16, 12, 4096, 64
MASKS = ("sliding", "longformer", "bigbird")
# ms on the H200, block-wise 32x32x2x2 heavy-first min_blocks 10 (s9sparse, session 9 call 9, 'vote' build)
MEASURED_BLOCK = {"sliding": 0.1397, "longformer": 0.2623, "bigbird": 0.1961}
BEST_MEASURED = {"sliding": 0.1349, "longformer": 0.2506, "bigbird": 0.1961}
WGMMA_DENSE_TFLOPS = 4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM / 1.580e-3 / 1e12
MMA_SYNC_TFLOPS = 4 * BATCH * HEADS * SEQ * (SEQ + 1) / 2 * HEAD_DIM / 1.315e-3 / 1e12
FLOOR_MS = 4 * BATCH * HEADS * SEQ * HEAD_DIM * 2 / 4.3e12 * 1e3
KV_REREAD_MS = FLOOR_MS / 2                   # K and V of every head read again by a second launch
# ms, 32x16x1x2 and 32x32x1x2 heavy-first (s9sparse 'vote' build): half-width tiles, twice as many, same area
MEASURED_WIDTH = {("sliding", 16): 0.1521, ("sliding", 32): 0.1540, ("longformer", 16): 0.2740,
                  ("longformer", 32): 0.2702, ("bigbird", 16): 0.2453, ("bigbird", 32): 0.2404}
# ms on the H200 (s10sparse, session 10 call 4): the best split (32x32x1x2 + wgmma two consumers, one block per
# item) and its packed dense part alone (gather and scatter included)
MEASURED_SPLIT = {"longformer": (0.2733, 0.1002), "bigbird": (0.2465, 0.0940)}
GOAL_MS = 0.133
BLOCK_TILE = (32, 32)
WGMMA_TILE = (192, 128)


def tile_counts(mask4: np.ndarray, block_m: int, block_n: int) -> dict[str, int]:
    """Full and partial tiles of a mask at one tile shape (one mask group: the named masks are shared)."""
    fmt = build_tiled(mask4, block_m, block_n)
    return {"full": int(fmt.full_indptr[-1]), "partial": int(fmt.part_indptr[-1])}


def wgmma_tile_rows(mask4: np.ndarray, block_m: int) -> int:
    """Tile rows of ``block_m`` queries that hold at least one dense query row."""
    rows = dense_query_rows(mask4)[0, 0]
    padded = np.zeros(-(-rows.size // block_m) * block_m, bool)
    padded[:rows.size] = rows
    return int(padded.reshape(-1, block_m).any(axis=1).sum())


def ms_of_flops(flops: float, tflops: float) -> float:
    return flops / (tflops * 1e12) * 1e3


def breakdown(name: str) -> dict:
    """Pairs, tiles and part costs of one named mask at the benchmark shape."""
    mask = normalize_mask(name, batch=BATCH, heads=HEADS, seq_q=SEQ)
    heads = BATCH * HEADS
    pairs = pair_classes(mask)
    dense, sparse = split_dense_rows(mask)
    tiles = {"all": tile_counts(mask, *BLOCK_TILE), "dense_rows": tile_counts(dense, *BLOCK_TILE),
             "sparse_rows": tile_counts(sparse, *BLOCK_TILE)}
    per_pair = 4 * HEAD_DIM * heads                           # flops of one kept pair over all (batch, head)
    tile_flops = 4 * BLOCK_TILE[0] * BLOCK_TILE[1] * HEAD_DIM * heads
    n_wgmma_rows = wgmma_tile_rows(mask, WGMMA_TILE[0])
    wgmma_tiles = n_wgmma_rows * -(-SEQ // WGMMA_TILE[1])
    return {
        "mask": name, "pairs": pairs, "tiles_32x32": tiles,
        "kept_ms_mma_sync": ms_of_flops(pairs["total"] * per_pair, MMA_SYNC_TFLOPS),
        "kept_ms_wgmma": ms_of_flops(pairs["total"] * per_pair, WGMMA_DENSE_TFLOPS),
        "part_ms_mma_sync": {k: ms_of_flops(pairs[k] * per_pair, MMA_SYNC_TFLOPS)
                             for k in ("dense_rows", "dense_columns", "other")},
        "tile_ms_mma_sync": {k: ms_of_flops((v["full"] + v["partial"]) * tile_flops, MMA_SYNC_TFLOPS)
                             for k, v in tiles.items()},
        "dense_packed_ms_wgmma": ms_of_flops(pairs["dense_rows"] * per_pair, WGMMA_DENSE_TFLOPS),
        "wgmma_tile_rows": n_wgmma_rows,
        "dense_in_place_ms_wgmma": ms_of_flops(wgmma_tiles * 4 * WGMMA_TILE[0] * WGMMA_TILE[1] * HEAD_DIM * heads,
                                               WGMMA_DENSE_TFLOPS),
    }


def model_split_ms(name: str) -> dict:
    """The analytical model's own prices (:mod:`stof_tvm.cost_model`, H200 constants): its best block-wise
    configuration on the whole mask, on the sparse rows alone, and its best kernel (block-wise or wgmma) on the
    packed dense rows (G queries, every key: it reads all of K and V)."""
    from stof_tvm.cost_model import AttentionProblem, MaskProfile
    from stof_tvm.cost_model.attention import attention_candidates, rank_attention

    mask = normalize_mask(name, batch=BATCH, heads=HEADS, seq_q=SEQ)
    _, sparse = split_dense_rows(mask)
    row_ids, packed = pack_dense_rows(mask)

    def best(part, kinds):
        problem = AttentionProblem(batch=BATCH, heads=HEADS, head_dim=HEAD_DIM, dtype="float16",
                                   mask=MaskProfile(part))
        top = rank_attention(problem, candidates=attention_candidates(problem, kinds=kinds))[0]
        return top.time_s * 1e3, str(top.candidate)

    whole, sparse_rows = best(mask, ("block",)), best(sparse, ("block",))
    dense = best(packed, ("block", "wgmma")) if (row_ids >= 0).any() else (0.0, "-")
    return {"whole": whole, "sparse_rows": sparse_rows, "dense_rows": dense,
            "split_ms": sparse_rows[0] + dense[0]}


def fit_block(rows: list[dict]) -> tuple[float, float]:
    """(t0 ms, ms per 32x32 tile per head) of the block-wise kernel, least squares over MEASURED_BLOCK."""
    x = np.array([r["tiles_32x32"]["all"]["full"] + r["tiles_32x32"]["all"]["partial"] for r in rows], float)
    y = np.array([MEASURED_BLOCK[r["mask"]] for r in rows])
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def table(header: list[str], body: list[list]) -> str:
    cells = [header] + [[f"{c:.4f}" if isinstance(c, float) else str(c) for c in row] for row in body]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the breakdown here")
    args = parser.parse_args(argv)
    rows = [breakdown(name) for name in MASKS]
    t0, per_tile = fit_block(rows)
    for r in rows:
        t = r["tiles_32x32"]
        r["block_fit_ms"] = {k: t0 + per_tile * (v["full"] + v["partial"]) for k, v in t.items()}
        r["block_measured_ms"] = MEASURED_BLOCK[r["mask"]]
        sparse_ms = r["block_fit_ms"]["sparse_rows"] if r["pairs"]["dense_rows"] else r["block_fit_ms"]["all"]
        dense = r["pairs"]["dense_rows"] > 0
        r["split_packed_ms"] = sparse_ms + dense * max(r["dense_packed_ms_wgmma"], KV_REREAD_MS)
        r["split_packed_no_reread_ms"] = sparse_ms + r["dense_packed_ms_wgmma"]
        r["split_in_place_ms"] = sparse_ms + dense * max(r["dense_in_place_ms_wgmma"], KV_REREAD_MS)
    print(f"rates: wgmma dense {WGMMA_DENSE_TFLOPS:.0f} TFLOP/s, mma.sync best {MMA_SYNC_TFLOPS:.0f} TFLOP/s, "
          f"memory floor {FLOOR_MS:.3f} ms (K and V alone {KV_REREAD_MS:.3f}), goal {GOAL_MS} ms")
    print(f"block-wise fit (32x32x2x2 hf mb10): t = {t0:.4f} ms + {per_tile * 1e3:.3f} us x tiles per head")
    print("\nkept pairs (millions, all heads) and 32x32 tiles per head (full + partial):")
    print(table(["mask", "dense rows", "dense cols", "other", "total", "tiles all", "in dense rows",
                 "in sparse rows"],
                [[r["mask"]] + [f"{r['pairs'][k] * BATCH * HEADS / 1e6:.1f}" for k in
                                ("dense_rows", "dense_columns", "other", "total")]
                 + [f"{v['full']}+{v['partial']}" for v in r["tiles_32x32"].values()] for r in rows]))
    print("\nms per part: kept pairs at the mma.sync best rate, 32x32 tiles at that rate, the fit:")
    print(table(["mask", "kept mma.sync", "dense rows", "dense cols", "other", "kept wgmma", "tiles mma.sync",
                 "fit all", "measured", "fit sparse rows"],
                [[r["mask"], r["kept_ms_mma_sync"], *r["part_ms_mma_sync"].values(), r["kept_ms_wgmma"],
                  r["tile_ms_mma_sync"]["all"], r["block_fit_ms"]["all"], r["block_measured_ms"],
                  r["block_fit_ms"]["sparse_rows"]] for r in rows]))
    print("\nthe dense-row split in two launches (sparse rows on the block-wise fit + dense rows on wgmma, which "
          "reads K and V again), ms:")
    print(table(["mask", "now (best)", "dense packed", "dense in place", "tile rows", "split packed",
                 "(no re-read)", "split in place", "measured split", "measured dense", "goal"],
                [[r["mask"], BEST_MEASURED[r["mask"]], r["dense_packed_ms_wgmma"], r["dense_in_place_ms_wgmma"],
                  r["wgmma_tile_rows"], r["split_packed_ms"], r["split_packed_no_reread_ms"], r["split_in_place_ms"],
                  *(MEASURED_SPLIT.get(r["mask"], ("-", "-"))), GOAL_MS] for r in rows]))
    print("\ntile width: 32x16 vs 32x32 (one warp, heavy-first): twice the tiles over the same area, ms and ms per "
          "million computed pairs a head")
    for name in MASKS:
        mask = normalize_mask(name, batch=BATCH, heads=HEADS, seq_q=SEQ)
        cells = []
        for width in (16, 32):
            counts = tile_counts(mask, 32, width)
            area = (counts["full"] + counts["partial"]) * 32 * width
            ms = MEASURED_WIDTH[(name, width)]
            cells.append(f"32x{width}: {counts['full'] + counts['partial']} tiles, {ms:.4f} ms, "
                         f"{ms / (area / 1e6):.3f} ms/M")
        print(f"  {name:<10} " + "; ".join(cells))
    print("\nthe analytical model's prices (ms; its best configuration of each part):")
    for r in rows:
        m = r["model"] = model_split_ms(r["mask"])
        print(f"  {r['mask']:<10} whole {m['whole'][0]:.4f}  split {m['split_ms']:.4f} = sparse rows "
              f"{m['sparse_rows'][0]:.4f} ({m['sparse_rows'][1]}) + dense rows {m['dense_rows'][0]:.4f} "
              f"({m['dense_rows'][1]})")
    need = (GOAL_MS - t0) / per_tile
    print(f"\nthe goal at today's tile cost: <= {need:.0f} tiles of 32x32 a head ("
          + ", ".join(f"{r['mask']} {sum(r['tiles_32x32']['all'].values())}" for r in rows) + ")")
    if args.json:
        Path(args.json).write_text(json.dumps({"fit": {"t0_ms": t0, "ms_per_tile_per_head": per_tile},
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
