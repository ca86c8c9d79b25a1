"""Tuning cost and quality on the GPU: two-stage tuning of a BERT layer set vs MetaSchedule's generic rules.

Runs on a machine with a GPU and TVM's full compiler (the GPU machine after the two-call compiler kit, see
shared/device/README.md). In one run:

1. stage 1 + stage 2 (``stof_tvm.tuning``) for every distinct call of a model's layer (``--model``, default
   bert-base, at ``--batch`` x ``--seq-len`` under ``--mask``), all survivors measured: wall time of each stage,
   per task the measured time of the model's first choice, the best survivor, and their ratio;
2. the same GEMM workloads tuned by MetaSchedule's generic CUDA tensor-core rules (``PostOrderApply``,
   evolutionary search, XGBoost) with the *same number of trials* as stage 2 gave each of them: wall time and
   best time (the no-prefilter baseline).

Prints a table and writes JSON (``--json``).

    python3 scripts/bench_tuning.py --json $OUT/tuning.json --database $OUT/db
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


def _best_seconds(db, mod, target):
    from tvm.s_tir import meta_schedule as ms

    records = db.get_top_k(db.commit_workload(mod), 1)
    if not records:
        return math.nan
    secs = [float(s) for s in records[0].run_secs]
    return sum(secs) / len(secs)


def generic_baseline(task, target, trials: int, work_dir: Path) -> dict:
    """MetaSchedule's own tensor-core auto-scheduling of ``task``'s workload for ``trials`` trials."""
    import tvm.s_tir.tensor_intrin.cuda  # noqa: F401  (registers the wmma/mma intrinsics the rules use)
    from tvm.s_tir import meta_schedule as ms

    shutil.rmtree(work_dir, ignore_errors=True)
    started = time.time()
    space = ms.space_generator.PostOrderApply(sch_rules="cuda-tensorcore", postprocs="cuda-tensorcore",
                                              mutator_probs="cuda-tensorcore")
    db = ms.tune_tir(task.mod, target, work_dir=str(work_dir), max_trials_global=trials,
                     num_trials_per_iter=min(trials, 16), space=space,
                     strategy=ms.search_strategy.EvolutionarySearch(population_size=128, init_min_unmeasured=16))
    records = db.get_all_tuning_records()
    return {"wall_s": time.time() - started, "trials": len(records),
            "best_s": _best_seconds(db, task.mod, target)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--mask", default="bigbird")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--gemm", default="auto", choices=["auto", "mma", "wgmma"],
                        help="the templates' GEMM kernel, as for compile (auto: wgmma on sm_90 with nvcc)")
    parser.add_argument("--database", default="out/tuning-db")
    parser.add_argument("--baseline-tasks", type=int, default=1, help="GEMM tasks to re-tune with generic rules")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)

    import tvm

    from stof_tvm.tuning import plan, tune_tasks, tuning_target

    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    target = tuning_target({"kind": "cuda", "arch": "sm_" + tvm.cuda(0).compute_version.replace(".", "")})
    shutil.rmtree(args.database, ignore_errors=True)
    t0 = time.time()
    stage1 = plan(args.model, mask=args.mask, batch=args.batch, seq_len=args.seq_len, target=target,
                  top_k=args.top_k, gemm=args.gemm)
    target = tuning_target(stage1.target)     # what the compile builds for: sm_90a with wgmma GEMMs
    t1 = time.time()
    report = tune_tasks(stage1.tasks, target, args.database, progress_stream=sys.stderr)
    t2 = time.time()
    from stof_tvm.tuning import TuningDatabase

    db = TuningDatabase(args.database)
    rows = []
    for result in report.results:
        task = result.task
        first = None
        if task.candidates:               # the model's first choice: the record of candidate 0
            for rec in db.records(task):
                if db.candidate_index(task, rec) == 0:
                    first = sum(float(s) for s in rec.run_secs) / len(rec.run_secs)
        rows.append({"task": task.name, "weight": task.weight, "survivors": task.space_size,
                     "trials": result.trials, "best_s": result.best_s, "model_first_s": first,
                     "predicted_best_s": task.predicted_s[0] if task.predicted_s else None, "meta": task.meta})
    groups = {}
    for group, choice in report.choices.items():    # attention: the model's first kernel vs the measured best
        members = [r for r in rows if r["meta"].get("problem") and r["task"].startswith("attention")
                   and next(t for t in stage1.tasks if t.name == r["task"]).group == group]
        if members:
            groups[group] = {"choice": choice["name"], "best_s": choice["best_s"], "model_first": members[0]["task"],
                             "model_first_s": members[0]["best_s"] or math.nan, "kernels_measured": len(members)}
    summary = {"model": args.model, "batch": args.batch, "seq_len": args.seq_len, "mask": args.mask,
               "top_k": args.top_k, "stage1_s": t1 - t0, "stage1_model_s": stage1.model_seconds,
               "stage2_s": t2 - t1, "measured": report.measured, "tasks": rows, "attention_choice": groups,
               "generic_baseline": [], "device": tvm.cuda(0).device_name, "notes": stage1.notes}
    Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    print(f"\n{args.model} B={args.batch} S={args.seq_len} mask={args.mask}: stage 1 {t1 - t0:.1f} s "
          f"(model {stage1.model_seconds * 1e3:.1f} ms), stage 2 {t2 - t1:.1f} s, {report.measured} trials")
    print(f"{'task':<44} {'x':>4} {'trials':>6} {'model #1 us':>12} {'best us':>9} {'#1/best':>8}")
    for r in rows:
        first = r["model_first_s"]
        best = r["best_s"]
        ratio = first / best if first and best else math.nan
        print(f"{r['task'][:44]:<44} {r['weight']:>4g} {r['trials']:>6} "
              f"{(first or math.nan) * 1e6:>12.2f} {(best or math.nan) * 1e6:>9.2f} {ratio:>8.3f}")
    for g in groups.values():
        print(f"attention: model's first {g['model_first']} {g['model_first_s'] * 1e6:.2f} us, measured best "
              f"{g['choice']} {g['best_s'] * 1e6:.2f} us over {g['kernels_measured']} kernels", flush=True)
    # The no-prefilter baseline last (the JSON above is already written if it runs out of time).
    gemms = [r.task for r in report.results if r.task.candidates][: args.baseline_tasks]
    for task in gemms:
        trials = task.space_size
        base = generic_baseline(task, target, trials, Path(args.database).with_name("generic-" + task.name))
        ours = next(r for r in rows if r["task"] == task.name)
        summary["generic_baseline"].append({"task": task.name, "trials": trials, "generic": base,
                                            "ours_best_s": ours["best_s"]})
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
        print(f"generic MetaSchedule on {task.name}: {base['trials']} trials in {base['wall_s']:.1f} s, "
              f"best {base['best_s'] * 1e6:.2f} us vs ours {(ours['best_s'] or math.nan) * 1e6:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
