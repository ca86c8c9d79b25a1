"""Time the vectorised format builders (tiled BSR + bitmaps, row-compressed) on STOF's masks.

Prints a table (median of repeated builds, milliseconds) and writes JSON. Issue 2's bar: the tiled format
for S = 4096 in under 10 ms on a 2-core CPU (STOF's builder took 0.07-1.8 s).

    python scripts/bench_formats.py --seq-lens 1024 4096 16384 --json out/bench_formats.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from stof_tvm.sparse_formats import build_rows, build_tiled, normalize_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)


def median_ms(fn, repeats: int) -> float:
    """Median wall-clock ms of ``repeats`` calls after one warm-up (page faults, caches)."""
    return bl.time_ms(fn, device="cpu", warmup=1, samples=repeats, number=1).median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--masks", nargs="+", default=["causal", "sliding", "longformer", "bigbird"])
    parser.add_argument("--tile", type=int, nargs=2, default=[64, 64], metavar=("BM", "BN"))
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--json", default="out/bench_formats.json")
    args = parser.parse_args()

    rows = []
    for seq_len in args.seq_lens:
        for spec in args.masks:
            mask = normalize_mask(spec, seq_q=seq_len)
            repeats = max(3, args.repeats if seq_len <= 4096 else args.repeats // 3)
            tiled = median_ms(lambda: build_tiled(mask, *args.tile), repeats)
            row = median_ms(lambda: build_rows(mask), max(3, repeats // 2))
            rows.append({"mask": spec, "seq_len": seq_len, "tile": args.tile, "tiled_ms": tiled, "rows_ms": row})
            print(f"{spec:>11} S={seq_len:>6}  tiled {tiled:8.2f} ms   rows {row:8.2f} ms", flush=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                   "results": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
