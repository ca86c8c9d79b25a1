"""Stage 3 of tuning: the whole forward pass with the new records against without them.

Stage 2 times each kernel alone, back to back. A choice that wins there can lose in the forward pass, where the
kernels overlap under dependent launches and read their weights from DRAM: on an H100, ViT-Base 8x197's attention
on 32 x 32 tiles with two warps ran 9.4 against 13.4 us alone and made the tuned forward 3.7% slower (BENCHMARKS.md,
session 24). So after stage 2 the flow compiles the model twice, with the database and without it, times both
forward passes interleaved on the device (:func:`interleaved_ms`), and where the tuned one is more than
:data:`CHECK_MARGIN` slower it vetoes the records of every job the compile planned
(:meth:`stof_tvm.records.TuningDatabase.veto`): the compile then runs the untuned choices, so tuning never leaves a
model slower than not tuning. Each check first lifts the veto of those jobs, so tuning again judges them again.
"""
from __future__ import annotations

import numpy as np

__all__ = ["stage3", "whole_model_check", "interleaved_ms", "unavailable", "CHECK_MARGIN"]

# The tuned forward may be this much slower than the untuned one before its records are vetoed: the spread of an
# interleaved comparison of two identical modules (bench_e2e's `same` control: 0.997-1.010 in session 24)
CHECK_MARGIN = 0.01
ROUNDS = 15          # interleaved rounds, one sample of each module per round
CALLS = 10           # forward passes per sample


def stage3(model, *, database: str, tasks, compile_options: dict, report) -> dict | None:
    """The tuning flow's stage 3 after stage 2 measured ``tasks`` (their groups and keys are the jobs judged):
    :func:`whole_model_check`'s verdict, or None where it cannot run here (``report`` says why)."""
    why_not = unavailable(compile_options["target"])
    if why_not:
        report(f"stage 3 (the whole forward with and without the records): not run, {why_not}")
        return None
    return whole_model_check(model, database=database, jobs=[task.group or task.key for task in tasks],
                             compile_options=compile_options, report=report)


def unavailable(target) -> str | None:
    """Why the check does not run for ``target`` here, or None: it times CUDA modules (on a CPU the spread between
    two timings of one module is larger than :data:`CHECK_MARGIN`), on this machine's GPU."""
    import tvm

    from stof_tvm.compiler import target_dict

    if target_dict(target)["kind"] != "cuda":
        return "it times CUDA modules only"
    if not tvm.cuda(0).exist:
        return "no CUDA device on this machine"
    return None


def interleaved_ms(models, rounds: int = ROUNDS, calls: int = CALLS) -> list[float]:
    """Median ms per forward pass of each loaded model (:class:`stof_tvm.runtime.Model`), on the same random valid
    inputs, sampled round by round (one sample of ``calls`` passes of each model per round) after a warm-up call."""
    prepared = [model.prepare(model.random_inputs(0)) for model in models]
    for model, args in zip(models, prepared):
        model.run(args)
    timers = [model.vm.time_evaluator("main", model.device, number=calls, repeat=1, min_repeat_ms=0)
              for model in models]
    samples: list[list[float]] = [[] for _ in models]
    for _ in range(rounds):
        for sample, timer, model, args in zip(samples, timers, models, prepared):
            sample.append(timer(*args, *model.params).mean * 1e3)
    return [float(np.median(sample)) for sample in samples]


def whole_model_check(model, *, database: str, jobs, compile_options: dict, report=None) -> dict:
    """Compile ``model`` (an ONNX path or proto, or a built-in model's name) without and with ``database``
    (``compile_options``: the rest of :func:`stof_tvm.compiler.compile`'s arguments), time both, and veto ``jobs``
    (the tuned calls' group names and task keys) where the tuned forward is slower than the untuned one by more than
    :data:`CHECK_MARGIN`.

    A slower tuned forward is judged again without its attention records (the kind whose kernel-alone ranking the
    forward pass has overturned, session 24): if the other records alone are not slower, only the attention jobs are
    vetoed, so the gains of the rest are kept. Returns ``{"untuned_ms", "tuned_ms", "vetoed"}``, the last the sorted
    list of vetoed jobs (empty where the records were kept), and ``"kept_ms"`` where a partial veto was timed."""
    from stof_tvm.compiler import compile as compile_model
    from stof_tvm.records import TuningDatabase, is_attention_group

    from stof_tvm.models import BUILTIN, builtin_model

    say = report if report is not None else (lambda line: None)
    if isinstance(model, str) and model in BUILTIN:      # a built-in's name, as the planner takes it
        model = builtin_model(model)
    jobs = sorted(set(jobs))
    records = TuningDatabase(database)
    records.unveto(jobs)
    say("stage 3: compiling the model without and with the records, then timing both forward passes")
    untuned = compile_model(model, database=None, **compile_options).load()
    tuned = compile_model(model, database=database, **compile_options).load()
    untuned_ms, tuned_ms = interleaved_ms([untuned, tuned])
    verdict = {"untuned_ms": untuned_ms, "tuned_ms": tuned_ms, "vetoed": []}
    if not _slower(tuned_ms, untuned_ms):
        say(f"stage 3: the forward pass {tuned_ms:.3f} ms tuned, {untuned_ms:.3f} ms untuned: the records kept")
        return verdict
    evidence = {"untuned_ms": untuned_ms, "tuned_ms": tuned_ms}
    attention = [job for job in jobs if is_attention_group(job)]
    if attention and len(attention) < len(jobs):
        records.veto(attention, evidence)
        say(f"stage 3: the forward pass {tuned_ms:.3f} ms tuned, {untuned_ms:.3f} ms untuned: timing it again "
            "without the attention records")
        kept = compile_model(model, database=database, **compile_options).load()
        untuned_ms, kept_ms = interleaved_ms([untuned, kept])
        verdict["kept_ms"] = kept_ms
        if not _slower(kept_ms, untuned_ms):
            verdict["vetoed"] = attention
            say(f"stage 3: without them {kept_ms:.3f} ms, {untuned_ms:.3f} ms untuned: the {len(attention)} "
                f"attention jobs vetoed, the other {len(jobs) - len(attention)} kept")
            return verdict
    records.veto(jobs, evidence)
    verdict["vetoed"] = jobs
    say(f"stage 3: the forward pass {tuned_ms:.3f} ms tuned, {untuned_ms:.3f} ms untuned: the {len(jobs)} tuned "
        "jobs vetoed (the compile runs the untuned choices)")
    return verdict


def _slower(tuned_ms: float, untuned_ms: float) -> bool:
    """Whether a tuned forward lost to the untuned one by more than the margin."""
    return tuned_ms > untuned_ms * (1 + CHECK_MARGIN)
