"""Calibrate the analytical attention model on the H200 and measure how well it chooses.

Three steps:

1. ``build`` (here, TVM compiler): every (kernel kind, configuration) of the calibration set for every
   (batch, sequence) of the grid is compiled for sm_90 and exported; nvcc turns each CUDA source into a cubin
   (the GPU side loads them instead of compiling, matched by a source hash) and reports registers and spills.
2. ``run`` (GPU machine: torch + triton + TVM runtime from ``.devkit``): for every grid point the mask and its
   formats are rebuilt with numpy, fresh random inputs drawn, the output poisoned, and every configuration run,
   checked against a float32 reference and timed (``triton.testing.do_bench``, median after warm-up).
   Writes JSON (rewritten as it goes).
3. ``fit`` (here): the model's constants are fitted to the measured times (least squares on log time ratios,
   scipy), then the report: Spearman rank correlation of predicted vs measured times per point, how often the
   model's top choice is within 10% of the measured best, and how often the chosen kernel *kind* is within 10%
   of the faster kind, for the model (default and fitted constants) and for STOF's rule. ``--write FILE`` saves
   the fitted constants (``Calibration.load`` reads them).
4. ``fit-wgmma`` (here): the Hopper wgmma kernel's own constants (``wgmma_*``) from ``scripts/bench_attention.py``
   JSON (its ``time`` rows of family ``wgmma``, current tree only: no ``variant`` builds, no key-padded builds),
   the other constants as they are; ``--constants`` fits a subset, ``--loads`` and ``--persistent`` take some
   timings only (``--constants wgmma_tma_tile_cycles --loads tma --persistent no``: the TMA producer's per-tile
   latency; ``--constants wgmma_persistent_item_cycles --persistent yes``: a persistent block's cost per item).

Grid: STOF's masks (causal, sliding, longformer, bigbird) x B {1, 8, 16} x S {128 .. 4096}, H=12, D=64, fp16,
plus masks where gathering rows should win (random 1% and 0.1%, dilated) at B=8, S {1024, 4096}.

    python scripts/calibrate_model.py build --out out/calib
    python3 scripts/calibrate_model.py run --out out/calib --json $OUT/calib.json       # on the GPU machine
    python scripts/calibrate_model.py fit --json calib.json --write out/calib/constants.json
    python scripts/calibrate_model.py fit-wgmma --json s8wgmma.json     # session 9's H200 run of the s8wgmma plan
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (the scripts' shared timing, checking and CUDA tool-chain helpers)
from benchlib import source_key  # noqa: E402

import numpy as np

HEADS, HEAD_DIM, DTYPE = 12, 64, "float16"
NAMED = ("causal", "sliding", "longformer", "bigbird")
BATCHES = (1, 8, 16)
SEQS = (128, 256, 512, 1024, 2048, 4096)
EXTRA = ("random:0.01", "random:0.001", "dilated")
EXTRA_BATCH, EXTRA_SEQS = 8, (1024, 4096)
# (block_m, block_n, num_warps, stages, heavy_first) and (key_groups, keys_per_step, rows_per_block).
BLOCK_CONFIGS = [(128, 64, 4, 2, False), (64, 64, 4, 2, False), (64, 64, 2, 2, False), (64, 32, 4, 2, False),
                 (32, 64, 2, 2, False), (32, 32, 2, 2, False), (64, 128, 4, 3, False)]
HEAVY_CONFIGS = [(64, 32, 4, 2, True), (32, 64, 2, 2, True)]
HEAVY_MASKS = ("longformer", "bigbird")
ROW_CONFIGS = [(4, 2, 4), (8, 2, 2)]
CUDA_TARGET = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "max_shared_memory_per_block": 232448}
TOLERANCE = 2e-3


# -- the grid (numpy only: used on both machines) -------------------------------------------------------------

def grid_points() -> list[dict]:
    points = [{"mask": m, "batch": b, "seq": s} for m in NAMED for b in BATCHES for s in SEQS]
    points += [{"mask": m, "batch": EXTRA_BATCH, "seq": s} for m in EXTRA for s in EXTRA_SEQS]
    return points


def candidates(point: dict) -> list[tuple[str, tuple]]:
    out = [("block", c) for c in BLOCK_CONFIGS]
    if point["mask"] in HEAVY_MASKS:
        out += [("block", c) for c in HEAVY_CONFIGS]
    return out + [("row", c) for c in ROW_CONFIGS]


def point_mask(point: dict) -> np.ndarray:
    """The shared [1, 1, S, S] mask of a grid point (random masks seeded by S)."""
    from stof_tvm.sparse_formats import normalize_mask

    spec, seq = point["mask"], point["seq"]
    if spec.startswith("random:"):
        rng = np.random.default_rng(seq)
        return normalize_mask(rng.random((seq, seq)) < float(spec.split(":")[1]), seq_q=seq)
    return normalize_mask(spec, seq_q=seq)


def module_key(kind: str, config: tuple, batch: int, seq: int) -> str:
    return f"{kind}_b{batch}s{seq}_" + "x".join(str(int(v)) for v in config)


# -- build (here) --------------------------------------------------------------------------------------------

def _primfunc(kind: str, config: tuple, batch: int, seq: int):
    common = dict(batch=batch, heads=HEADS, seq_q=seq, seq_k=seq, head_dim=HEAD_DIM, dtype=DTYPE, mask_batch=1,
                  mask_heads=1, target_kind="cuda")
    if kind == "block":
        from stof_tvm.schedules.attention_blockwise import BlockConfig, blockwise_attention_primfunc

        return blockwise_attention_primfunc(config=BlockConfig(*config), **common)
    from stof_tvm.schedules.attention_rowwise import RowConfig, rowwise_attention_primfunc

    return rowwise_attention_primfunc(config=RowConfig(*config), **common)


def _nvcc(src: str, path: Path) -> dict:
    """cubin of ``src`` with TVM's nvcc flags, plus ptxas' register and spill report."""
    report = bl.nvcc_cubin(src, path, "sm_90", fast_math=True)
    return {"registers": report["registers"], "spill_bytes": report["spill_stores"] or 0}


def build(args) -> None:
    import tvm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = tvm.target.Target(CUDA_TARGET, host={"kind": "llvm"})
    started = time.time()
    wanted = {}
    for point in grid_points():
        for kind, config in candidates(point):
            wanted[module_key(kind, config, point["batch"], point["seq"])] = (kind, config, point["batch"],
                                                                              point["seq"])
    manifest = {"modules": {}, "points": grid_points()}
    sources = {}
    for key, (kind, config, batch, seq) in sorted(wanted.items()):
        library = out / f"{key}.so"
        ex = tvm.compile(_primfunc(kind, config, batch, seq), target=target)
        cuda = [m for m in ex.mod.imports if m.kind == "cuda"]
        if not cuda:
            raise RuntimeError(f"{key}: no CUDA module was produced")
        src = cuda[0].inspect_source()
        ex.export_library(str(library))
        skey = source_key(src)
        sources[skey] = src
        manifest["modules"][key] = {"library": library.name, "source": skey,
                                    "symbol": "blockwise_attention" if kind == "block" else "rowwise_attention"}
    todo = [(k, s) for k, s in sources.items() if not (out / f"{k}.cubin").exists()]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        reports = dict(zip([k for k, _ in todo], pool.map(lambda kv: _nvcc(kv[1], out / f"{kv[0]}.cubin"), todo)))
    manifest_path = out / "manifest.json"
    old = json.loads(manifest_path.read_text()).get("ptxas", {}) if manifest_path.exists() else {}
    manifest["ptxas"] = {**old, **reports}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(wanted)} modules, {len(todo)} new cubins in {out} ({time.time() - started:.0f} s)")


# -- run (GPU machine) ---------------------------------------------------------------------------------------

def _install_cubins(out: Path) -> None:
    """Load TVM's CUDA module loader, and answer its compile callback with the prebuilt cubin of the same source
    when there is one."""

    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    if not ensure_cuda_runtime():
        raise RuntimeError("TVM's CUDA runtime library could not be loaded")
    bl.PrebuiltCubins(out)


def _formats(kind: str, config: tuple, mask4: np.ndarray) -> list[np.ndarray]:
    from stof_tvm.sparse_formats import build_rows, build_tiled

    if kind == "block":
        fmt = build_tiled(mask4, config[0], config[1])
        arrays = [fmt.full_indptr, fmt.full_indices, fmt.part_indptr, fmt.part_indices, fmt.part_bitmaps]
    else:
        fmt = build_rows(mask4)
        arrays = [fmt.indptr, fmt.indices]
    return [np.ascontiguousarray(a if a.shape[0] else np.zeros((1,) + a.shape[1:], a.dtype)) for a in arrays]


def run(args) -> None:
    import torch
    import triton.testing
    import tvm

    out = Path(args.out)
    manifest = json.loads((out / "manifest.json").read_text())
    _install_cubins(out)
    json_path = Path(args.json)
    results, started = [], time.time()
    loaded = {}
    for n, point in enumerate(manifest["points"]):
        if time.time() - started > args.budget_s:
            print(f"time budget spent: {len(manifest['points']) - n} points left out")
            break
        B, S = point["batch"], point["seq"]
        mask4 = point_mask(point)
        mask_t = torch.from_numpy(np.ascontiguousarray(mask4[0, 0])).cuda()
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn((B, HEADS, S, HEAD_DIM), generator=gen, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        ref = torch.empty(q.shape, dtype=torch.float32, device="cuda")
        for b in range(B):                       # float32 reference, rows with nothing kept -> 0
            s = torch.matmul(q[b].float(), k[b].float().transpose(-1, -2)) / math.sqrt(HEAD_DIM)
            p = torch.softmax(s.masked_fill(~mask_t, float("-inf")), dim=-1).nan_to_num(0.0)
            ref[b] = torch.matmul(p, v[b].float())
        formats = {}
        for kind, config in candidates(point):
            key = module_key(kind, tuple(config), B, S)
            info = manifest["modules"][key]
            if key not in loaded:
                loaded[key] = tvm.runtime.load_module(str(out / info["library"]))[info["symbol"]]
            fn = loaded[key]
            fkey = (kind, tuple(config[:2])) if kind == "block" else (kind,)
            if fkey not in formats:
                formats[fkey] = [tvm.runtime.tensor(a, tvm.cuda(0)) for a in _formats(kind, config, mask4)]
            res = torch.full_like(q, float("nan"))
            call_args = [tvm.runtime.from_dlpack(t) for t in (q, k, v)] + formats[fkey] + [
                tvm.runtime.from_dlpack(res)]
            fn(*call_args)
            torch.cuda.synchronize()
            err = float((res.float() - ref).norm() / ref.norm()) if bool(res.isfinite().all()) else math.inf
            ms = float(triton.testing.do_bench(lambda: fn(*call_args), warmup=3, rep=12, return_mode="median"))
            results.append({**point, "kind": kind, "config": list(config), "ms": ms, "rel_err": err,
                            "ok": err <= TOLERANCE})
            print(f"{point['mask']:>13} B={B:<2} S={S:<5} {kind:>5} {'x'.join(map(str, config)):<18} "
                  f"{ms:8.4f} ms  err {err:.1e}", flush=True)
        del q, k, v, ref
        json_path.write_text(json.dumps({"results": results, "device": torch.cuda.get_device_name(),
                                         "ptxas": manifest.get("ptxas", {}),
                                         "modules": manifest["modules"]}, indent=1))
    bad = [r for r in results if not r["ok"]]
    print(f"{len(results)} measurements in {time.time() - started:.0f} s; {len(bad)} outside tolerance")


# -- fit (here) ----------------------------------------------------------------------------------------------

FIT_CONSTANTS = ("tc_eff", "cc_eff", "warps_to_saturate", "l2_eff", "dram_eff", "launch_s", "tail", "softmax_ops",
                 "mask_ops", "tile_cycles", "block_cycles", "pair_ops_per_dim", "step_cycles", "row_cycles",
                 "stage_gain")
_SCALE = {"launch_s": 1e-6}


def _problem(point: dict):
    from stof_tvm.cost_model import AttentionProblem, MaskProfile

    return AttentionProblem(batch=point["batch"], heads=HEADS, head_dim=HEAD_DIM, dtype=DTYPE,
                            mask=MaskProfile(point_mask(point)))


def _candidate(kind: str, config):
    from stof_tvm.cost_model import AttentionCandidate
    from stof_tvm.schedules.attention_blockwise import BlockConfig
    from stof_tvm.schedules.attention_rowwise import RowConfig

    return AttentionCandidate(kind, BlockConfig(*config) if kind == "block" else RowConfig(*config))


def _spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if len(a) < 3 or ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def evaluate(groups, predict_fn) -> dict:
    """Choice quality over measured points: ``groups`` = [(point, problem, [(candidate, ms)])]."""
    from stof_tvm.sparse_formats import mask_stats, stof_rule

    rho, top_ok, kind_ok, stof_ok, rows = [], 0, 0, 0, []
    for point, problem, measured in groups:
        pred = np.array([predict_fn(problem, c) for c, _ in measured])
        meas = np.array([ms for _, ms in measured])
        rho.append(_spearman(pred, meas))
        best = meas.min()
        pick = int(np.argmin(pred))
        top_ok += meas[pick] <= 1.1 * best
        best_kind = {kind: min(ms for c, ms in measured if c.kind == kind) for kind in ("block", "row")}
        faster = min(best_kind.values())
        model_kind = measured[pick][0].kind
        rule_kind = stof_rule(mask_stats(problem.mask.mask, ((16, 16),)))
        kind_ok += best_kind[model_kind] <= 1.1 * faster
        stof_ok += best_kind[rule_kind] <= 1.1 * faster
        rows.append({"point": point, "spearman": rho[-1], "model_pick": str(measured[pick][0]),
                     "pick_ms": float(meas[pick]), "best_ms": float(best), "best_block_ms": best_kind["block"],
                     "best_row_ms": best_kind["row"], "model_kind": model_kind, "stof_kind": rule_kind})
    n = len(groups)
    return {"points": n, "spearman_mean": float(np.nanmean(rho)), "spearman_median": float(np.nanmedian(rho)),
            "top1_within_10pct": top_ok / n, "kind_within_10pct": kind_ok / n, "stof_kind_within_10pct": stof_ok / n,
            "rows": rows}


def fit(args) -> None:
    from scipy.optimize import least_squares

    from stof_tvm.cost_model import DEFAULT_CALIBRATION, attention_work, predict
    from stof_tvm.hardware import H200

    data = json.loads(Path(args.json).read_text())
    by_point: dict[tuple, list] = {}
    for r in data["results"]:
        if r["ok"]:
            by_point.setdefault((r["mask"], r["batch"], r["seq"]), []).append(r)
    groups = []
    for (mask, batch, seq), rows in sorted(by_point.items()):
        point = {"mask": mask, "batch": batch, "seq": seq}
        if {r["kind"] for r in rows} != {"block", "row"}:
            continue
        problem = _problem(point)
        groups.append((point, problem, [(_candidate(r["kind"], r["config"]), r["ms"]) for r in rows]))

    def predictor(cal):
        return lambda problem, cand: predict(attention_work(problem, cand, cal), H200, cal).time_s * 1e3

    def calibration(theta):
        return DEFAULT_CALIBRATION.replace(**{k: float(v) * _SCALE.get(k, 1.0) for k, v in zip(FIT_CONSTANTS, theta)})

    def residuals(theta, subset):
        pred = predictor(calibration(theta))
        return np.array([math.log(pred(p, c) / ms) for _, p, ms_list in subset for c, ms in ms_list])

    start = np.array([getattr(DEFAULT_CALIBRATION, k) / _SCALE.get(k, 1.0) for k in FIT_CONSTANTS])
    lower = np.array([0.05, 0.05, 1.0, 0.05, 0.3, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0])
    upper = np.array([1.0, 1.0, 64.0, 1.5, 1.0, 30.0, 1.0, 60.0, 60.0, 5000.0, 50000.0, 60.0, 20000.0, 50000.0, 2.0])
    t0 = time.time()
    # Held-out check: fit on every other point (sorted by mask, B, S), evaluate on the rest, then fit on all.
    train, test = groups[0::2], groups[1::2]
    half = least_squares(lambda th: residuals(th, train), np.clip(start, lower, upper), bounds=(lower, upper),
                         x_scale="jac", max_nfev=args.max_evals)
    held_out = evaluate(test, predictor(calibration(half.x)))
    solution = least_squares(lambda th: residuals(th, groups), np.clip(start, lower, upper), bounds=(lower, upper),
                             x_scale="jac", max_nfev=args.max_evals)
    fitted = calibration(solution.x)
    before = evaluate(groups, predictor(DEFAULT_CALIBRATION))
    after = evaluate(groups, predictor(fitted))
    rms_before = float(np.sqrt(np.mean(residuals(start, groups) ** 2)))
    rms_after = float(np.sqrt(np.mean(solution.fun ** 2)))
    print(f"fit over {len(groups)} points, {sum(len(m) for _, _, m in groups)} measurements "
          f"({time.time() - t0:.0f} s): rms log error {rms_before:.3f} -> {rms_after:.3f}")
    print(f"{'':>34} {'spearman':>9} {'top-1 <=10%':>12} {'kind <=10%':>11} {'STOF rule kind':>15}")
    for name, ev in (("default constants, all points", before), ("fitted on half, other half", held_out),
                     ("fitted on all, all points", after)):
        print(f"{name:>34} {ev['spearman_mean']:9.3f} {ev['top1_within_10pct']:12.1%} "
              f"{ev['kind_within_10pct']:11.1%} {ev['stof_kind_within_10pct']:15.1%}")
    print("fitted constants:", json.dumps({k: getattr(fitted, k) for k in FIT_CONSTANTS}))
    for row in after["rows"]:
        p = row["point"]
        print(f"  {p['mask']:>13} B={p['batch']:<2} S={p['seq']:<5} rho {row['spearman']:5.2f}  pick "
              f"{row['model_pick']:<40} {row['pick_ms']:.4f} ms (best {row['best_ms']:.4f}; block "
              f"{row['best_block_ms']:.4f} row {row['best_row_ms']:.4f}; STOF {row['stof_kind']})")
    report = {"before": before, "after": after, "held_out": held_out, "rms_log_before": rms_before,
              "rms_log_after": rms_after, "constants": json.loads(fitted.to_json()), "device": data.get("device")}
    if args.write:
        Path(args.write).write_text(json.dumps(report["constants"], indent=2))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))


WGMMA_CONSTANTS = ("wgmma_attn_tc_eff", "wgmma_softmax_ops", "wgmma_mask_ops", "wgmma_tile_cycles",
                   "wgmma_item_cycles", "wgmma_stage_gain", "wgmma_tma_tile_cycles", "wgmma_persistent_item_cycles")
WGMMA_BOUNDS = ((0.8, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), (1.5, 20.0, 60.0, 5000.0, 50000.0, 0.5, 5000.0, 50000.0))


def wgmma_timings(paths) -> list[tuple[dict, float]]:
    """``[(row, ms)]``: the checked wgmma timings of bench_attention JSON files built from the current tree
    (rows of ``variant`` builds and key-padded builds left out: the model does not price the padding predicate),
    repeated measurements of one case averaged. Configurations without a consumers field ran two, without a
    loads field cp.async."""
    cases: dict[tuple, list] = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            variant = r.get("variant") or "x" not in r["module"].rsplit("_", 1)[-1]   # e.g. ..._order80670e1
            if r["kind"] != "time" or r["family"] != "wgmma" or not r["ok"] or variant or r.get("padding"):
                continue
            config = tuple(r["config"]) + ((2,) if len(r["config"]) == 4 else ()) + (
                ("cp.async",) if len(r["config"]) < 6 else ())
            key = (r["mask"], r["batch"], r["heads"], r["seq"], r["head_dim"], r["dtype"], config)
            cases.setdefault(key, []).append(r)
    return [(rows[0], float(np.mean([r["ms"] for r in rows]))) for _, rows in sorted(cases.items())]


def _wgmma_case(row: dict):
    from stof_tvm.cost_model import AttentionCandidate, AttentionProblem
    from bench_attention import build_mask
    from stof_tvm.schedules.attention_wgmma import WgmmaAttentionConfig

    config = WgmmaAttentionConfig(*row["config"])
    mask = build_mask(row["mask"], row["batch"], row["heads"], row["seq"], row["seed"])    # as the bench built it
    problem = AttentionProblem.build(mask, batch=row["batch"], heads=row["heads"], seq_len=row["seq"],
                                     head_dim=row["head_dim"], dtype=row["dtype"])
    return problem, AttentionCandidate("wgmma", config)


def fit_wgmma(args) -> None:
    """Least squares on log(predicted / measured) over the wgmma timings; prints each case and the constants."""
    from scipy.optimize import least_squares

    from stof_tvm.cost_model import DEFAULT_CALIBRATION, attention_work, predict
    from stof_tvm.hardware import H200

    names = args.constants.split(",") if args.constants else list(WGMMA_CONSTANTS)
    unknown = set(names) - set(WGMMA_CONSTANTS)
    if unknown:
        raise SystemExit(f"--constants: unknown {sorted(unknown)}; choose among {WGMMA_CONSTANTS}")
    timings = wgmma_timings(args.json)
    if args.loads:
        timings = [(row, ms) for row, ms in timings
                   if (row["config"][5] if len(row["config"]) > 5 else "cp.async") == args.loads]
    if args.persistent is not None:
        timings = [(row, ms) for row, ms in timings if row["config"][3] == (args.persistent == "yes")]
    cases = [(_wgmma_case(row), ms) for row, ms in timings]
    masks = [row["mask"] for row, _ in timings]
    picked = [WGMMA_CONSTANTS.index(k) for k in names]

    def calibration(theta):
        return DEFAULT_CALIBRATION.replace(**{k: float(v) for k, v in zip(names, theta)})

    def predicted_ms(cal):
        return np.array([predict(attention_work(p, c, cal), H200, cal).time_s * 1e3 for (p, c), _ in cases])

    measured = np.array([ms for _, ms in cases])
    start = np.array([getattr(DEFAULT_CALIBRATION, k) for k in names])
    lower, upper = (np.array(b)[picked] for b in WGMMA_BOUNDS)
    solution = least_squares(lambda th: np.log(predicted_ms(calibration(th)) / measured),
                             np.clip(start, lower, upper), bounds=(lower, upper), x_scale="jac",
                             max_nfev=args.max_evals)
    fitted = calibration(solution.x)
    before, after = predicted_ms(DEFAULT_CALIBRATION), predicted_ms(fitted)
    rms = [float(np.sqrt(np.mean(np.log(p / measured) ** 2))) for p in (before, after)]
    print(f"wgmma fit over {len(cases)} cases: rms log error {rms[0]:.3f} -> {rms[1]:.3f}")
    for ((problem, cand), ms), p0, p1, mask in zip(cases, before, after, masks):
        print(f"  {mask:>8} B={problem.batch:<2} H={problem.heads:<2} S={problem.seq_q:<5} "
              f"D={problem.head_dim:<3} {str(cand):<36} measured {ms:.3f} ms  predicted {p0:.3f} -> {p1:.3f}")
    constants = {k: round(float(getattr(fitted, k)), 4) for k in names}
    print("fitted constants:", json.dumps(constants))
    if args.write:
        Path(args.write).write_text(json.dumps(constants, indent=2))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="compile every kernel of the calibration grid (here)")
    b.add_argument("--out", default="out/calib")
    b.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes")
    r = sub.add_parser("run", help="time every kernel on the GPU (GPU machine)")
    r.add_argument("--out", default="out/calib")
    r.add_argument("--json", required=True)
    r.add_argument("--budget-s", type=float, default=420.0, help="stop starting new points after this long")
    f = sub.add_parser("fit", help="fit the model's constants and report its choices (here)")
    f.add_argument("--json", required=True)
    f.add_argument("--write", help="write the fitted constants to this JSON file")
    f.add_argument("--report", help="write the full report (per point) to this JSON file")
    f.add_argument("--max-evals", type=int, default=60)
    w = sub.add_parser("fit-wgmma", help="fit the wgmma attention kernel's constants (here)")
    w.add_argument("--json", nargs="+", required=True, help="bench_attention.py JSON files")
    w.add_argument("--write", help="write the fitted constants to this JSON file")
    w.add_argument("--max-evals", type=int, default=200)
    w.add_argument("--constants", help="comma-separated wgmma_* constants to fit (default all; the others stay)")
    w.add_argument("--loads", choices=("cp.async", "tma"), help="only the timings of these loads")
    w.add_argument("--persistent", choices=("yes", "no"), help="only the persistent (or one-block-per-item) grids")
    args = parser.parse_args(argv)
    {"build": build, "run": run, "fit": fit, "fit-wgmma": fit_wgmma}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
