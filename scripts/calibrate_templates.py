"""Calibrate the fusion-template part of the analytical model on the H200, and measure what stage 1 saves stage 2.

The template calls of one BERT-Base encoder layer as ``stof-tvm compile --templates`` runs them (QKV projection
into heads, attention-output GEMM, FFN up-projection with GELU, FFN down-projection, bias + residual + LayerNorm
twice), at 8 x 512 and 16 x 2048 tokens. Per call (a *task*) a broad sample of the template's knob space is
measured: the model's top ``--top`` knob sets, the top ``--variant-top`` under a few other plausible constant
sets (so that the fitted model's head is measured too), the template's own first ``--own`` choices, and one
random knob set from each of ``--strata`` equal slices of the rest of the model's ranking. The best of that
sample stands for what a budget 10x larger than stage 2's finds (see ``fit``).

Three steps (like ``calibrate_model.py`` for attention):

1. ``build`` (here, TVM compiler): schedule and compile every sampled knob set for sm_90, export each module,
   compile its CUDA source with nvcc into a cubin keyed by the source hash (registers, spills); times each
   build. Resumable: modules already in the manifest are kept. Packs the folder into ``<out>.tar.xz`` (the
   exported libraries are nearly identical, so it compresses about 30x: that is what travels to the GPU).
2. ``run`` (GPU machine: torch + TVM runtime from ``.devkit``): per task fresh random inputs, a torch float32
   reference (TF32 off), and every module run on NaN-poisoned outputs, checked (relative Frobenius error) and
   timed (CUDA events around back-to-back calls, median of 7 repeats after warm-up). JSON + a table.
3. ``fit`` (here): least squares on log(predicted / measured) of the template constants
   (:data:`FIT_CONSTANTS`; held out: fitted on one layer set, scored on the other), Spearman rank correlation and
   top-1 within 10% per task, and the tuning cost: trials (and seconds) until stage 2, measuring the model's
   survivors in its order, has a knob set within 5% of the sample's best, against a search without the
   prefilter (uniform random order over the whole knob space, expectation from the stratified sample).

    python scripts/calibrate_templates.py build --out out/calib_templates
    python3 scripts/calibrate_templates.py run --archive out/calib_templates.tar.xz --json $OUT/calib.json  # GPU
    python scripts/calibrate_templates.py fit --json calib_templates.json --write constants.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_templates import Runner, _nvcc, module_key, source_key  # noqa: E402  (shared build/run helpers)

HIDDEN, FFN, HEADS, DTYPE = 768, 3072, 12, "float16"
LAYER_SETS = {"8x512": (8, 512), "16x2048": (16, 2048)}
TOLERANCE = 5e-3
LN_EPS = 1e-5
# Other plausible constant sets whose heads are measured too (the fit moves the ranking; its head should be
# in the sample): shared memory priced, a lower main-loop efficiency, slower k steps.
SAMPLING_VARIANTS = ({"smem_ops_per_byte": 1.0}, {"smem_ops_per_byte": 4.0},
                     {"gemm_tc_eff": 0.4, "smem_ops_per_byte": 2.0}, {"gemm_iter_cycles": 800.0})
FIT_CONSTANTS = ("gemm_tc_eff", "gemm_iter_cycles", "gemm_block_cycles", "smem_ops_per_byte", "epilogue_ops")
FIT_BOUNDS = ((0.05, 1.0), (0.0, 5000.0), (0.0, 50000.0), (0.0, 20.0), (0.0, 200.0))


# -- the tasks (numpy only) ------------------------------------------------------------------------------------

def layer_tasks(layer_set: str) -> list[dict]:
    """The distinct template calls of one BERT-Base layer (``weight``: calls per layer)."""
    batch, seq = LAYER_SETS[layer_set]
    m = batch * seq
    calls = [("qkv", "qkv_projection_kn", {"batch": batch, "seq": seq, "heads": HEADS, "head_dim": HIDDEN // HEADS}, 1),
             ("attn_out", "gemm_kn", {"m": m, "n": HIDDEN, "k": HIDDEN}, 1),
             ("ffn_up", "gemm_bias_gelu_erf_kn", {"m": m, "n": FFN, "k": HIDDEN}, 1),
             ("ffn_down", "gemm_kn", {"m": m, "n": HIDDEN, "k": FFN}, 1),
             ("layernorm", "bias_residual_layernorm", {"m": m, "n": HIDDEN}, 2)]
    return [{"id": f"{layer_set}/{call}", "layer_set": layer_set, "call": call, "template": name, "shape": shape,
             "weight": weight} for call, name, shape, weight in calls]


def knob_id(knobs: dict) -> str:
    return json.dumps({k: int(v) for k, v in sorted(knobs.items())})


# -- build (here) ----------------------------------------------------------------------------------------------

def sample_space(template, shape: dict, args, seed: int) -> tuple[list[dict], list[dict]]:
    """(the knob sets to measure with why each was picked, the model's whole ranking as knob dicts)."""
    from stof_tvm.cost_model import DEFAULT_CALIBRATION
    from stof_tvm.cost_model.templates import rank_template

    own = template.knob_space(shape, DTYPE)
    ranking = [r.candidate for r in rank_template(template, shape, DTYPE, explain_top=0)]
    picked: dict[str, dict] = {}

    def pick(knobs, why):
        entry = picked.setdefault(knob_id(knobs), {"knobs": dict(knobs), "why": []})
        if why not in entry["why"]:
            entry["why"].append(why)

    for knobs in ranking[:args.top]:
        pick(knobs, "model")
    for n, variant in enumerate(SAMPLING_VARIANTS):
        for r in rank_template(template, shape, DTYPE, cal=DEFAULT_CALIBRATION.replace(**variant),
                               explain_top=0)[:args.variant_top]:
            pick(r.candidate, f"variant{n}")
    for knobs in own[:args.own]:
        pick(knobs, "own")
    rest = [knobs for knobs in ranking[args.top:] if knob_id(knobs) not in picked]
    rng = random.Random(seed)
    for chunk in np.array_split(np.arange(len(rest)), max(1, min(args.strata, len(rest)))):
        if len(chunk):
            pick(rest[int(rng.choice(list(chunk)))], f"stratum:{len(chunk)}")
    return list(picked.values()), ranking


def build(args) -> None:
    from stof_tvm.schedules.templates import get_template
    from stof_tvm.schedules.templates.build import build as build_template
    from stof_tvm.schedules.templates.build import cuda_source, cuda_target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"modules": {}}
    target = cuda_target()
    tasks = [task for layer_set in LAYER_SETS for task in layer_tasks(layer_set)]
    modules, started = {}, time.time()
    for n, task in enumerate(tasks):
        template = get_template(task["template"])
        sample, ranking = sample_space(template, task["shape"], args, seed=n)
        task["space"] = len(ranking)
        task["model_rank"] = {knob_id(k): i for i, k in enumerate(ranking)}
        own = template.knob_space(task["shape"], DTYPE)
        own_rank = {knob_id(k): i for i, k in enumerate(own)}
        task["configs"] = []
        for entry in sample:
            knobs = entry["knobs"]
            key = module_key("cal", task["template"], task["shape"], DTYPE, knobs)
            info = old["modules"].get(key)
            if info is None or not (out / info["library"]).exists():
                t0 = time.perf_counter()
                ex = build_template(template.schedule(task["shape"], DTYPE, knobs), target)
                src = cuda_source(ex)
                ex.export_library(str(out / f"{key}.so"))
                t1 = time.perf_counter()
                report = _nvcc(src, out / f"{source_key(src)}.cubin")
                info = {"template": task["template"], "shape": task["shape"], "dtype": DTYPE, "knobs": knobs,
                        "library": f"{key}.so", "source": source_key(src), "ptxas": report,
                        "arguments": [[a, list(s), d] for a, s, d in template.arguments(task["shape"], DTYPE)],
                        "tvm_build_s": t1 - t0, "nvcc_s": time.perf_counter() - t1}
            modules[key] = info
            task["configs"].append({"key": key, "knobs": knobs, "why": entry["why"],
                                    "model_rank": task["model_rank"][knob_id(knobs)],
                                    "own_rank": own_rank[knob_id(knobs)]})
        manifest = {"tasks": tasks[:n + 1], "modules": modules, "ln_eps": LN_EPS,
                    "built": time.strftime("%Y-%m-%d %H:%M"), "sampling": {k: getattr(args, k) for k in ("top", "variant_top", "own", "strata")}}
        manifest_path.write_text(json.dumps(manifest, indent=1))
        print(f"{task['id']:<22} {task['template']:<24} space {task['space']:5d}  sampled {len(sample):3d}  "
              f"modules so far {len(modules):4d} ({time.time() - started:.0f} s)", flush=True)
    spills = [k for k, v in modules.items() if v["ptxas"]["spill_stores"] or v["ptxas"]["stack_frame"]]
    build_s = [v["tvm_build_s"] + v["nvcc_s"] for v in modules.values()]
    size = sum((out / v["library"]).stat().st_size + (out / v["ptxas"]["cubin"]).stat().st_size
               for v in modules.values())
    archive = out.with_name(out.name + ".tar.xz")
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(manifest_path, arcname=f"{out.name}/manifest.json")
        for info in modules.values():
            for name in (info["library"], info["ptxas"]["cubin"]):
                tar.add(out / name, arcname=f"{out.name}/{name}")
    print(f"{len(tasks)} tasks, {len(modules)} modules in {out}: {size / 2**20:.1f} MiB, packed into {archive} "
          f"({archive.stat().st_size / 2**20:.1f} MiB); build per module (TVM + nvcc, here) median "
          f"{statistics.median(build_s):.2f} s, total {sum(build_s):.0f} s; with spills or stack: {spills or 'none'}")


# -- run (GPU machine) -----------------------------------------------------------------------------------------

def torch_reference(task: dict, t: dict, eps: float):
    """float32 output of the task's template call on the named inputs ``t`` (torch tensors)."""
    import torch.nn.functional as F

    f = {name: value.float() for name, value in t.items()}
    name, shape = task["template"], task["shape"]
    if name == "qkv_projection_kn":
        y = f["x"] @ f["W"] + f["bias"]
        b, s, h, d = shape["batch"], shape["seq"], shape["heads"], shape["head_dim"]
        return y.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4).contiguous()
    if name == "gemm_kn":
        return f["A"] @ f["W"]
    if name == "gemm_bias_gelu_erf_kn":
        return F.gelu(f["A"] @ f["W"] + f["bias"])
    if name == "bias_residual_layernorm":
        return F.layer_norm(f["x"] + f["bias"] + f["residual"], (shape["n"],), f["gamma"], f["beta"], eps=eps)
    raise ValueError(f"no torch reference for template {name!r}")


def run(args) -> None:
    import torch

    out = Path(args.out)
    if args.archive:
        with tarfile.open(args.archive) as tar:
            tar.extractall(out.parent, filter="data")
    runner = Runner(out)
    manifest = runner.manifest
    results, started = [], time.time()
    for task in manifest["tasks"]:
        if time.time() - started > args.budget_s:
            print(f"time budget spent: {task['id']} and later tasks left out")
            break
        t_task = time.time()
        first = manifest["modules"][task["configs"][0]["key"]]
        tensors = runner.inputs(first["arguments"], DTYPE, 1)
        out_name = first["arguments"][-1][0]
        with torch.no_grad():
            ref = torch_reference(task, {k: v for k, v in tensors.items() if k != out_name}, manifest["ln_eps"])
        rows = []
        for config in task["configs"]:
            t0 = time.time()
            try:
                fn, err = runner.run_tvm(config["key"], tensors, ref)
                failure = None
            except Exception as exc:  # a module that fails to load or launch is recorded, the others still run
                fn, err, failure = None, None, f"{type(exc).__name__}: {str(exc)[:300]}"
            ok = err is not None and err <= TOLERANCE
            ms = runner.timeit(fn) if ok else None
            rows.append({**config, "ms": ms, "rel_err": err, "ok": ok, "error": failure,
                         "gpu_s": time.time() - t0})
        good = [r for r in rows if r["ok"]]
        res = {**{k: v for k, v in task.items() if k not in ("configs", "model_rank")}, "configs": rows,
               "task_gpu_s": time.time() - t_task}
        results.append(res)
        best = min(good, key=lambda r: r["ms"], default=None)
        head = next((r for r in good if r["model_rank"] == 0), None)
        print(f"{task['id']:<20} {len(rows):3d} run, {len(rows) - len(good)} failed; best "
              f"{best['ms'] * 1e3 if best else math.nan:8.2f} us (model rank {best['model_rank'] if best else '-'}); "
              f"model's first {head['ms'] * 1e3 if head else math.nan:8.2f} us ({time.time() - t_task:.1f} s)",
              flush=True)
        Path(args.json).write_text(json.dumps({"tasks": results, "device": torch.cuda.get_device_name(0),
                                               "torch": torch.__version__, "cubin_hits": runner.hits,
                                               "cubin_misses": runner.misses,
                                               "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    n = sum(len(r["configs"]) for r in results)
    bad = sum(not c["ok"] for r in results for c in r["configs"])
    per_module = [c["gpu_s"] for r in results for c in r["configs"]]
    print(f"{n} modules in {time.time() - started:.0f} s (median {statistics.median(per_module):.3f} s each: load, "
          f"check, time); {bad} failed or outside tolerance {TOLERANCE}; cubins prebuilt {runner.hits}, compiled "
          f"there {runner.misses}")


# -- fit (here) ------------------------------------------------------------------------------------------------

def _spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if len(a) < 3 or ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


class Measured:
    """One task's measurements with what the model needs to price them and its whole knob space."""

    def __init__(self, task: dict):
        from stof_tvm.schedules.templates import get_template

        self.task = task
        self.template = get_template(task["template"])
        self.shape = task["shape"]
        good = [c for c in task["configs"] if c["ok"]]
        self.knobs = [c["knobs"] for c in good]
        self.ms = np.array([c["ms"] for c in good])
        self.space = self.template.knob_space(self.shape, DTYPE)
        self.index = {knob_id(k): i for i, k in enumerate(self.knobs)}

    def predict_ms(self, cal, knobs=None) -> np.ndarray:
        from stof_tvm.cost_model.templates import price_knobs

        return price_knobs(self.template, self.shape, DTYPE, self.knobs if knobs is None else knobs, cal=cal) * 1e3

    def ranking(self, cal) -> list[str]:
        """The model's order of the whole knob space (knob ids, feasible only)."""
        times = self.predict_ms(cal, self.space)
        order = [i for i in np.argsort(times, kind="stable") if np.isfinite(times[i])]
        return [knob_id(self.space[i]) for i in order]


def tuning_cost(m: Measured, cal, top_k: int, target: float) -> dict:
    """Trials until a knob set within ``target`` of the sample's best is measured: stage 2 over the model's
    ranking (in its order), and a search without the prefilter (uniform random order over the whole space)."""
    best = float(m.ms.min())
    good = m.ms <= target * best
    order = m.ranking(cal)
    unmeasured_in_head = sum(k not in m.index for k in order[:top_k])
    prefilter_trials = next((p + 1 for p, k in enumerate(order) if k in m.index and good[m.index[k]]), None)
    best_in_k = min((m.ms[m.index[k]] for k in order[:top_k] if k in m.index), default=math.inf)
    # Uniform random order over the whole space: estimate how many knob sets are good from the sample. A knob
    # set picked for the model's head, a variant's head or the template's own order counts as itself; a
    # stratum's random pick ("stratum:<size>") stands for its whole slice of the rest of the ranking.
    weights = np.ones(len(m.knobs))
    for c in m.task["configs"]:
        stratum = [why for why in c["why"] if why.startswith("stratum:")]
        if c["ok"] and stratum:
            weights[m.index[knob_id(c["knobs"])]] = int(stratum[0].split(":")[1])
    n_good = float((weights * good).sum())
    n_space = len(m.space)
    random_trials = (n_space + 1) / (n_good + 1)
    return {"best_ms": best, "prefilter_trials": prefilter_trials, "unmeasured_in_top_k": unmeasured_in_head,
            "best_in_top_k_ratio": best_in_k / best, "good_estimate": n_good, "space": n_space,
            "random_trials": random_trials}


def evaluate(measured: list[Measured], cal, top_k: int) -> dict:
    rows = []
    for m in measured:
        pred = m.predict_ms(cal)
        order = m.ranking(cal)
        first = order[0]
        first_ms = m.ms[m.index[first]] if first in m.index else None
        # the model's first choice among the measured knob sets (used when its global first was not measured)
        pick = int(np.argmin(pred))
        rows.append({"task": m.task["id"], "template": m.task["template"], "n": len(m.knobs),
                     "spearman": _spearman(pred, m.ms), "best_ms": float(m.ms.min()),
                     "first_ms": None if first_ms is None else float(first_ms),
                     "pick_ms": float(m.ms[pick]), "rms_log": float(np.sqrt(np.mean(np.log(pred / m.ms) ** 2))),
                     **tuning_cost(m, cal, top_k, 1.05)})
    within = [r["pick_ms"] <= 1.1 * r["best_ms"] for r in rows]
    return {"rows": rows, "spearman_mean": float(np.nanmean([r["spearman"] for r in rows])),
            "top1_within_10pct": sum(within) / len(rows)}


def _fit(measured: list[Measured], start, max_evals: int):
    from scipy.optimize import least_squares

    lower, upper = (np.array(b) for b in zip(*FIT_BOUNDS))

    def residuals(theta):
        cal = start.replace(**dict(zip(FIT_CONSTANTS, map(float, theta))))
        return np.concatenate([np.log(m.predict_ms(cal) / m.ms) for m in measured])

    theta0 = np.clip([getattr(start, k) for k in FIT_CONSTANTS], lower, upper)
    sol = least_squares(residuals, theta0, bounds=(lower, upper), x_scale="jac", max_nfev=max_evals)
    return start.replace(**dict(zip(FIT_CONSTANTS, map(float, sol.x))))


def fit(args) -> None:
    from stof_tvm.cost_model import DEFAULT_CALIBRATION

    data = json.loads(Path(args.json).read_text())
    measured = [Measured(t) for t in data["tasks"] if any(c["ok"] for c in t["configs"])]
    start = DEFAULT_CALIBRATION
    t0 = time.time()
    held = {}
    for layer_set in LAYER_SETS:
        train = [m for m in measured if m.task["layer_set"] != layer_set]
        test = [m for m in measured if m.task["layer_set"] == layer_set]
        if train and test:
            held[layer_set] = evaluate(test, _fit(train, start, args.max_evals), args.top_k)
    fitted = _fit(measured, start, args.max_evals)
    before, after = evaluate(measured, start, args.top_k), evaluate(measured, fitted, args.top_k)
    print(f"fit over {len(measured)} tasks, {sum(len(m.knobs) for m in measured)} timings ({time.time() - t0:.0f} s)")
    print("fitted constants:", json.dumps({k: round(getattr(fitted, k), 4) for k in FIT_CONSTANTS}))
    print(f"{'':>36} {'spearman':>9} {'top-1 <=10%':>12}")
    for name, ev in [("default constants", before), *((f"fitted without {s}, on {s}", e) for s, e in held.items()),
                     ("fitted on all", after)]:
        print(f"{name:>36} {ev['spearman_mean']:9.3f} {ev['top1_within_10pct']:12.1%}")
    trial_s = args.trial_seconds
    for name, ev in (("default constants", before), ("fitted constants", after)):
        print(f"\n{name}: per task (trials to within 5% of the sample's best; stage 2 in the model's order vs "
              f"uniform random order over the whole space; seconds at {trial_s:.2f} s per trial)")
        print(f"{'task':<20} {'rho':>5} {'rms':>5} {'n':>3} {'best us':>8} {'1st/best':>8} {'top-K/best':>10} "
              f"{'prefilter':>9} {'random':>7} {'unmeas.':>7}")
        for r in ev["rows"]:
            first = f"{r['first_ms'] / r['best_ms']:.2f}" if r["first_ms"] else "n/m"
            pre = r["prefilter_trials"] if r["prefilter_trials"] is not None else "-"
            print(f"{r['task']:<20} {r['spearman']:5.2f} {r['rms_log']:5.2f} {r['n']:3d} {r['best_ms'] * 1e3:8.2f} "
                  f"{first:>8} {r['best_in_top_k_ratio']:10.2f} {pre:>9} {r['random_trials']:7.1f} "
                  f"{r['unmeasured_in_top_k']:>7}")
        for layer_set in LAYER_SETS:
            rows = [r for r in ev["rows"] if r["task"].startswith(layer_set + "/")]
            if rows and all(r["prefilter_trials"] for r in rows):
                pre = sum(r["prefilter_trials"] for r in rows)
                rnd = sum(r["random_trials"] for r in rows)
                print(f"  layer set {layer_set}: prefilter {pre} trials ({pre * trial_s:.0f} s), random "
                      f"{rnd:.0f} trials ({rnd * trial_s:.0f} s)")
    report = {"before": before, "after": after, "held_out": held, "device": data.get("device"),
              "constants": {k: getattr(fitted, k) for k in FIT_CONSTANTS}, "trial_seconds": trial_s}
    if args.write:
        Path(args.write).write_text(json.dumps(report["constants"], indent=2))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="compile the sampled knob sets of every task (here)")
    b.add_argument("--out", default="out/calib_templates")
    b.add_argument("--top", type=int, default=32, help="the model's first knob sets, per task")
    b.add_argument("--variant-top", type=int, default=8, help="first knob sets under each sampling variant")
    b.add_argument("--own", type=int, default=8, help="the template's own first choices")
    b.add_argument("--strata", type=int, default=24, help="random picks from equal slices of the rest")
    r = sub.add_parser("run", help="check and time every module (GPU machine)")
    r.add_argument("--out", default="out/calib_templates")
    r.add_argument("--archive", help="unpack this archive from build (holding the --out folder) first")
    r.add_argument("--json", required=True)
    r.add_argument("--budget-s", type=float, default=240.0, help="no new task starts after this long")
    f = sub.add_parser("fit", help="fit the template constants, report choices and tuning cost (here)")
    f.add_argument("--json", required=True)
    f.add_argument("--write", help="write the fitted constants to this JSON file (Calibration.load reads it)")
    f.add_argument("--report", help="write the full report to this JSON file")
    f.add_argument("--top-k", type=int, default=8, help="stage 2's survivors per task")
    f.add_argument("--trial-seconds", type=float, default=97.9 / 16,
                   help="seconds per stage-2 trial (default: the H200 bench_tuning run, 97.9 s for 16 trials)")
    f.add_argument("--max-evals", type=int, default=200)
    args = parser.parse_args(argv)
    {"build": build, "run": run, "fit": fit}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
