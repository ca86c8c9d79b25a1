"""``stof-tvm masks``: print a mask's statistics and the kernel the selection rule would pick."""
from __future__ import annotations

import json

from stof_tvm.sparse_formats import MASK_NAMES, mask_stats, normalize_mask, stof_rule
from stof_tvm.sparse_formats.stats import DEFAULT_TILE_SHAPES

from .mask_arg import load_mask_arg

STOF_MASKS = ("causal", "sliding", "longformer", "bigbird")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "masks", help="print mask statistics (density, tiles full/partial/empty, kernel choice)",
        description="Print statistics of one or more masks: density, keys per query row, full/partial/empty "
                    "tiles at several tile shapes, and the kernel STOF's selection rule picks. With no SPEC, "
                    f"reports STOF's evaluation masks ({', '.join(STOF_MASKS)}).")
    parser.add_argument("specs", nargs="*", metavar="SPEC",
                        help=f"mask spec 'name' or 'name:key=value,...' (names: {', '.join(MASK_NAMES)}), or a "
                             f".npy boolean array")
    parser.add_argument("--seq-len", type=int, default=4096, help="sequence length S (default 4096)")
    parser.add_argument("--tile", action="append", metavar="BMxBN",
                        help="tile shape to report, e.g. 64x64 (repeatable; default "
                             + ", ".join(f"{m}x{n}" for m, n in DEFAULT_TILE_SHAPES) + ")")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _parse_tile(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--tile must look like 64x64, got {text!r}")
    return int(parts[0]), int(parts[1])


def run(args) -> int:
    shapes = [_parse_tile(t) for t in args.tile] if args.tile else list(DEFAULT_TILE_SHAPES)
    if (16, 16) not in shapes:
        shapes.append((16, 16))                       # the selection rule reads the 16x16 block share
    reports = []
    for spec in args.specs or STOF_MASKS:
        stats = mask_stats(normalize_mask(load_mask_arg(spec), seq_q=args.seq_len), shapes)
        reports.append({
            "mask": spec, "seq_len": args.seq_len, "density": stats.density, "kept_pairs": stats.kept,
            "keys_per_row": {"min": stats.keys_min, "mean": stats.keys_mean, "max": stats.keys_max},
            "empty_rows": stats.empty_rows, "kernel": stof_rule(stats),
            "tiles": [{"tile": f"{t.block_m}x{t.block_n}", "full": t.full, "partial": t.partial,
                       "empty": t.empty, "nonempty_ratio": t.nonempty_ratio, "partial_share": t.partial_share}
                      for t in stats.tiles.values()],
        })
    print(json.dumps(reports, indent=2) if args.json else "\n\n".join(map(_format, reports)))
    return 0


def _format(report: dict) -> str:
    keys = report["keys_per_row"]
    lines = [f"mask {report['mask']}  S={report['seq_len']}  density {report['density']:.4%}  "
             f"kept pairs {report['kept_pairs']}",
             f"  keys per query row: min {keys['min']}  mean {keys['mean']:.1f}  max {keys['max']}  "
             f"(rows with none: {report['empty_rows']})",
             f"  kernel (STOF rule): {report['kernel']}-wise",
             f"  {'tile':>8} {'full':>9} {'partial':>9} {'empty':>9} {'non-empty':>10} {'partial share':>14}"]
    for t in report["tiles"]:
        lines.append(f"  {t['tile']:>8} {t['full']:>9} {t['partial']:>9} {t['empty']:>9} "
                     f"{t['nonempty_ratio']:>10.2%} {t['partial_share']:>14.2%}")
    return "\n".join(lines)
