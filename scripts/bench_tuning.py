"""Tuning cost and quality of the default path: a model's layer set tuned with the default top K, against what
a 10x budget finds, and the trials in the model's order needed to come within 5% of that.

Runs where stage 2 can measure: a GPU machine with TVM's full compiler (shared/device/README.md), or, as a dry
run of the whole flow, ``--target llvm``. Phases, each written to ``--json`` as it ends:

1. stage 1 (:func:`stof_tvm.tuning.plan`: the compile's own front end, then the analytical model) with top K;
2. stage 2 over its tasks (:func:`stof_tvm.tuning.tune_tasks`, builds in parallel on this machine's CPUs): the
   default path's tuning cost;
3. the 10x budget: stage 1 with top ``factor x K`` (on the wgmma path: every knob set of each GEMM call, the
   whole LayerNorm space, the top attention kernels); the candidates beyond the top K are measured into a
   second database;
4. per job (one template call, or the attention problem): the best of the top K against the best of the 10x
   budget, and the trials in the model's order (:func:`trials_to_reach`) needed to come within 5% of it;
5. a fresh run measuring exactly those trials per job: the wall time to reach within 5%, stage 1 included;
6. with ``--generic-trials N``: MetaSchedule's generic CUDA tensor-core rules (no prefilter) on the FFN GEMM's
   definition for N trials, against the template call's best of the top K.

Phases 3, 5 and 6 respect ``--deadline`` (seconds from the start): tuning stops cleanly and what was measured
is reported (a skipped phase 5 is estimated from phase 2's rate and marked so). Prints a table.

    python3 scripts/bench_tuning.py --batch 8 --seq-len 512 --json $OUT/tuning_8x512.json --work /tmp/tb
    python scripts/bench_tuning.py --target llvm --model tiny-bert --batch 1 --seq-len 64 --templates \\
        --top-k 2 --json out/tuning_dry.json --work /tmp/tb            # CPU dry run
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

TOLERANCE = 0.05        # "within 5% of the best a 10x budget finds"


def trials_to_reach(times, best: float, tolerance: float = TOLERANCE) -> int | None:
    """Measurements in the given order (None: failed or not measured) until one is within ``tolerance`` of
    ``best``; None when none is."""
    for n, seconds in enumerate(times, 1):
        if seconds is not None and seconds <= (1 + tolerance) * best:
            return n
    return None


def summarise_job(times, k: int, tolerance: float = TOLERANCE) -> dict:
    """One job's figures from its measured times in the model's order (the first ``k`` are the default top K)."""
    measured = [t for t in times if t is not None]
    top = [t for t in times[:k] if t is not None]
    best = min(measured) if measured else None
    return {"candidates": len(times), "measured": len(measured), "best_s": best,
            "top_k_best_s": min(top) if top else None,
            "top_k_over_best": min(top) / best if top and best else None,
            "model_first_s": times[0] if times else None,
            "trials_to_reach": trials_to_reach(times, best, tolerance) if best else None}


def layer_summary(jobs: dict) -> dict:
    """Layer-set figures: weighted time with the top-K choices against the 10x-budget choices, and the trials
    to bring every job within the tolerance."""
    ok = [j for j in jobs.values() if j["best_s"] and j["top_k_best_s"]]
    top = sum(j["weight"] * j["top_k_best_s"] for j in ok)
    best = sum(j["weight"] * j["best_s"] for j in ok)
    reach = [j["trials_to_reach"] for j in jobs.values()]
    return {"weighted_top_k_s": top, "weighted_best_s": best, "top_k_over_best": top / best if best else None,
            "trials_to_reach": sum(reach) if all(r is not None for r in reach) else None,
            "default_trials": sum(min(j["k"], j["candidates"]) for j in jobs.values())}


# -- jobs and their measured times ------------------------------------------------------------------------------

def jobs_of(tasks) -> dict:
    """``{job: [(task, candidate index or None), ...]}`` in the model's order. A job is a task with candidates
    (its knob sets), or a group of pre-built tasks (a wgmma call's knob sets; the attention kernels)."""
    jobs: dict = {}
    for task in tasks:
        if task.candidates:
            jobs[task.name] = [(task, i) for i in range(len(task.candidates))]
        else:
            jobs.setdefault(task.group or task.name, []).append((task, None))
    return jobs


def job_label(entries) -> str:
    task = entries[0][0]
    meta = task.meta
    if "template" in meta:
        return f"{meta['template']} {'x'.join(str(v) for v in meta['shape'].values())}"
    problem = meta.get("problem", {})
    return f"attention B{problem.get('batch')} S{problem.get('seq_q')}" if problem else task.name


def _knob_key(task, index) -> str:
    return task.key if index is None else f"{task.key}:{json.dumps(task.candidates[index], sort_keys=True, default=str)}"


def measured_seconds(work_dir: str, tasks) -> dict:
    """``{knob key: mean seconds}`` of every successful record of ``tasks`` in ``work_dir``."""
    from stof_tvm.tuning import TuningDatabase

    db, out = TuningDatabase(work_dir), {}
    for task in tasks:
        for record in db.records(task):
            secs = [float(s) for s in record.run_secs]
            mean = sum(secs) / len(secs)
            if mean >= 1e9:             # MetaSchedule's mark of a failed candidate
                continue
            index = db.candidate_index(task, record) if task.candidates else None
            if task.candidates and index is None:
                continue
            key = _knob_key(task, index)
            out[key] = min(out.get(key, math.inf), mean)
    return out


def rest_tasks(big_tasks, default_keys: set, k: int):
    """The 10x budget's tasks beyond the default top K: pre-built tasks not planned by default, and each task
    with candidates restricted to its candidates after the first ``k`` (a separate database holds them)."""
    from stof_tvm.tuning import TuningTask

    out = []
    for task in big_tasks:
        if not task.candidates:
            if task.key not in default_keys:
                out.append(task)
        elif len(task.candidates) > k:
            out.append(TuningTask(task.name, task.func, task.candidates[k:], task.apply,
                                  predicted_s=task.predicted_s[k:] if task.predicted_s else (),
                                  weight=task.weight, group=task.group, meta=task.meta))
    return out


def first_n_tasks(jobs: dict, counts: dict):
    """Tasks measuring the first ``counts[job]`` entries of each job in the model's order."""
    from stof_tvm.tuning import TuningTask

    out = []
    for job, entries in jobs.items():
        n = counts[job]
        task = entries[0][0]
        if entries[0][1] is None:
            out += [t for t, _ in entries[:n]]
        else:
            out.append(TuningTask(task.name, task.func, task.candidates[:n], task.apply,
                                  predicted_s=task.predicted_s[:n] if task.predicted_s else (),
                                  weight=task.weight, group=task.group, meta=task.meta))
    return out


# -- the no-prefilter baseline ----------------------------------------------------------------------------------

def generic_baseline(func, target, trials: int, work_dir: Path) -> dict:
    """MetaSchedule's own tensor-core auto-scheduling of ``func`` (a definition) for ``trials`` trials."""
    import tvm.s_tir.tensor_intrin.cuda  # noqa: F401  (registers the wmma/mma intrinsics the rules use)
    from tvm.s_tir import meta_schedule as ms

    from stof_tvm.tuning import normalize_workload

    shutil.rmtree(work_dir, ignore_errors=True)
    mod = normalize_workload(func)
    started = time.monotonic()
    space = ms.space_generator.PostOrderApply(sch_rules="cuda-tensorcore", postprocs="cuda-tensorcore",
                                              mutator_probs="cuda-tensorcore")
    db = ms.tune_tir(mod, target, work_dir=str(work_dir), max_trials_global=trials,
                     num_trials_per_iter=min(trials, 16), space=space,
                     strategy=ms.search_strategy.EvolutionarySearch(population_size=128, init_min_unmeasured=16))
    secs = [sum(float(s) for s in r.run_secs) / len(r.run_secs) for r in db.get_all_tuning_records()]
    good = [s for s in secs if s < 1e9]
    return {"wall_s": time.monotonic() - started, "trials": len(secs), "best_s": min(good) if good else None}


# -- the run ----------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--mask", default="bigbird")
    parser.add_argument("--target", choices=["cuda", "llvm"], default="cuda")
    parser.add_argument("--top-k", type=int, default=8, help="stage-1 survivors per job (default 8, the CLI's)")
    parser.add_argument("--factor", type=int, default=10, help="the larger budget, x top-K (default 10)")
    parser.add_argument("--gemm", default="auto", choices=["auto", "mma", "wgmma"])
    parser.add_argument("--templates", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--build-workers", type=int, help="parallel builds (default: all cores)")
    parser.add_argument("--deadline", type=float, default=math.inf, help="seconds from the start for all phases")
    parser.add_argument("--generic-trials", type=int, default=0, help="no-prefilter baseline trials (0: skip)")
    parser.add_argument("--work", default="out/tuning-bench", help="work directory (databases; emptied first)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)

    import tvm

    from stof_tvm.tuning import plan, tune_tasks, tuning_target

    started = time.monotonic()
    left = lambda: args.deadline - (time.monotonic() - started)    # noqa: E731
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    if args.target == "cuda":
        from stof_tvm.cuda_runtime import ensure_cuda_runtime

        ensure_cuda_runtime()
        target = tuning_target({"kind": "cuda", "arch": "sm_" + tvm.cuda(0).compute_version.replace(".", "")})
        device = tvm.cuda(0).device_name
    else:
        target, device = tuning_target("llvm"), "cpu"
    common = dict(mask=args.mask, batch=args.batch, seq_len=args.seq_len, gemm=args.gemm, templates=args.templates)
    out = {"model": args.model, "batch": args.batch, "seq_len": args.seq_len, "mask": args.mask, "k": args.top_k,
           "factor": args.factor, "tolerance": TOLERANCE, "device": device, "command": " ".join(sys.argv)}

    def save():
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))

    # 1-2. the default path
    t0 = time.monotonic()
    stage1 = plan(args.model, target=target, top_k=args.top_k, **common)
    target = tuning_target(stage1.target)
    t1 = time.monotonic()
    default = tune_tasks(stage1.tasks, target, str(work / "default"), build_workers=args.build_workers)
    t2 = time.monotonic()
    out.update(target=str(target), stage1_s=t1 - t0, stage1_model_s=stage1.model_seconds, stage2_s=t2 - t1,
               stage2_trials=default.measured, notes=stage1.notes, default_report=default.to_json())
    save()
    print(f"stage 1 {t1 - t0:.1f} s (model {stage1.model_seconds * 1e3:.1f} ms); stage 2 {t2 - t1:.1f} s for "
          f"{default.measured} trials", flush=True)

    # 3. the 10x budget: only what the default run did not measure
    big = plan(args.model, target=target, top_k=args.factor * args.top_k, **common)
    rest = rest_tasks(big.tasks, {t.key for t in stage1.tasks}, args.top_k)
    t3 = time.monotonic()
    rest_report = tune_tasks(rest, target, str(work / "rest"), build_workers=args.build_workers,
                             time_budget_s=max(1.0, left() - 60)) if rest and left() > 60 else None
    out.update(rest_s=time.monotonic() - t3, rest_trials=rest_report.measured if rest_report else 0,
               rest_planned=sum(t.space_size for t in rest), rest_stopped=rest_report.stopped if rest_report else
               ("skipped" if rest else ""))

    # 4. per job: top K vs the 10x budget, trials to reach within 5% in the model's order
    seconds = {**measured_seconds(str(work / "default"), stage1.tasks), **measured_seconds(str(work / "rest"), rest)}
    jobs, table = jobs_of(big.tasks), {}
    for job, entries in jobs.items():
        times = [seconds.get(_knob_key(t, i)) for t, i in entries]     # keys name the workload and the knobs
        table[job] = {"label": job_label(entries), "weight": entries[0][0].weight, "k": args.top_k,
                      "times_s": times, **summarise_job(times, args.top_k)}
    out.update(jobs=table, layer=layer_summary(table))
    save()

    # 5. wall time to reach within 5%: a fresh run of exactly those trials
    counts = {job: row["trials_to_reach"] or min(args.top_k, row["candidates"]) for job, row in table.items()}
    reach_trials = sum(counts.values())
    rate = (t2 - t1) / max(1, default.measured)
    if left() > 1.5 * rate * reach_trials + 10:
        t4 = time.monotonic()
        reach = tune_tasks(first_n_tasks(jobs, counts), target, str(work / "reach"),
                           build_workers=args.build_workers, time_budget_s=max(1.0, left() - 10))
        out["reach"] = {"trials": reach.measured, "stage2_s": time.monotonic() - t4, "stopped": reach.stopped,
                        "with_stage1_s": time.monotonic() - t4 + (t1 - t0), "measured": True}
    else:
        out["reach"] = {"trials": reach_trials, "stage2_s": rate * reach_trials,
                        "with_stage1_s": rate * reach_trials + (t1 - t0), "measured": False}
    save()

    # 6. the no-prefilter baseline on the FFN GEMM's definition
    if args.generic_trials and args.target == "cuda" and left() > 90:    # it has no time limit of its own
        from stof_tvm.schedules.templates import get_template

        ffn = next((c for c in stage1.calls if c[0].startswith("gemm_bias_gelu")), None)
        if ffn is not None:
            name, shape, dtype, _, _ = ffn
            base = generic_baseline(get_template(name).primfunc(shape, dtype), target, args.generic_trials,
                                    work / "generic")
            ours = next((row for row in table.values() if row["label"].startswith(name)), None)
            out["generic_baseline"] = {"call": f"{name} {shape}", **base,
                                       "ours_top_k_best_s": ours and ours["top_k_best_s"]}
            save()

    print_table(out)
    return 0


def _us(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.2f}"


def print_table(out: dict) -> None:
    layer, reach = out["layer"], out["reach"]
    print(f"\n{out['model']} B={out['batch']} S={out['seq_len']} {out['mask']} on {out['device']} ({out['target']})")
    print(f"stage 1 {out['stage1_s']:.1f} s (model {out['stage1_model_s'] * 1e3:.1f} ms); stage 2 with top-K "
          f"{out['k']}: {out['stage2_s']:.1f} s for {out['stage2_trials']} trials; 10x budget: "
          f"{out['rest_trials']}/{out['rest_planned']} more trials in {out['rest_s']:.1f} s"
          + (f" ({out['rest_stopped']})" if out["rest_stopped"] else ""))
    print(f"{'job':<42} {'x':>3} {'space':>5} {'top-K us':>9} {'10x us':>9} {'K/10x':>6} {'#1 us':>9} {'to 5%':>5}")
    for row in out["jobs"].values():
        ratio = "-" if row["top_k_over_best"] is None else f"{row['top_k_over_best']:.3f}"
        print(f"{row['label'][:42]:<42} {row['weight']:>3g} {row['candidates']:>5} {_us(row['top_k_best_s']):>9} "
              f"{_us(row['best_s']):>9} {ratio:>6} {_us(row['model_first_s']):>9} "
              f"{row['trials_to_reach'] if row['trials_to_reach'] is not None else '-':>5}")
    ratio = "-" if layer["top_k_over_best"] is None else f"{layer['top_k_over_best']:.3f}"
    print(f"layer set: weighted time top-K / 10x = {ratio}; trials to within 5% per job: "
          f"{layer['trials_to_reach']} (default {layer['default_trials']}); wall to reach "
          f"{reach['with_stage1_s']:.1f} s with stage 1 ({'measured' if reach['measured'] else 'estimated'}, "
          f"{reach['trials']} trials)")
    base = out.get("generic_baseline")
    if base:
        print(f"generic MetaSchedule rules on {base['call']}: {base['trials']} trials in {base['wall_s']:.1f} s, "
              f"best {_us(base['best_s'])} us vs the template's top-K best {_us(base['ours_top_k_best_s'])} us")


if __name__ == "__main__":
    sys.exit(main())
