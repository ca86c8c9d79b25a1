"""The tuning flow a user runs: tune exactly the calls a compile makes, then compile with the records.

:func:`compile` is what ``stof_tvm.compile`` and ``stof-tvm compile`` call. Without ``tune_trials`` it is
:func:`stof_tvm.compiler.compile`. With ``tune_trials=N`` and a ``database`` directory it first runs both tuning
stages on the compile's own calls (:func:`stof_tvm.tuning.plan` runs the compiler's front end with the same
arguments, so every call gets its tasks and no task is for a call the compile does not make), then compiles
with the records and reports how many it applied. A database that already holds complete tasks is not measured
again, so the same command re-run (or after a killed run) only measures what is missing.

After stage 2, stage 3 (:mod:`stof_tvm.tuning_check`) times the whole forward pass compiled with and without the
records on the local device and vetoes them where they made it slower.

Records can change a decision the front end takes from them (an attention kernel of the other kind measured
faster), and with it the template calls that follow; when that happens the calls are planned once more with the
records and what is new is tuned before the compile. Another configuration of the same kind changes no call, so
it needs no second planning.

This module sits above :mod:`stof_tvm.tuning` and :mod:`stof_tvm.compiler`; they share records only through
:mod:`stof_tvm.records`, and the compiler imports neither this module nor the tuner.
"""
from __future__ import annotations

import sys
import time

__all__ = ["compile", "tune_for_compile"]

# Plannings of one compile's calls: the first, and one more when records changed a front-end decision.
_ROUNDS = 2


def _check_trials(tune_trials) -> int:
    if isinstance(tune_trials, bool) or not isinstance(tune_trials, int) or tune_trials < 0:
        raise ValueError(f"tune_trials: expected an integer >= 0, got {tune_trials!r}")
    return tune_trials


def _attention_kind_moved(report) -> bool:
    """Whether an attention problem's measured choice is a kernel of another kind (block-wise vs row-wise) than
    its untuned kernel (the group's first task). Only the kind shapes the graph after attention (the block-wise
    kernel reads the QKV projection's [3, B, H, S, D] output as views and writes [B, S, H, D], the row-wise one
    [B, H, S, D]), so only then can the template calls differ; another configuration of the same kind leaves
    every call as planned, and planning again (a second front end and stage 1: ~30 s for a base model) is
    skipped."""
    kinds = {r.task.key: r.task.meta.get("kind") for r in report.results}
    untuned = {r.task.group: r.task.meta.get("kind") for r in report.results
               if r.task.group.startswith("attention:") and r.task.meta.get("untuned")}
    return any(group in untuned and kinds.get(choice["task"], untuned[group]) != untuned[group]
               for group, choice in report.choices.items())


def tune_for_compile(model, *, mask, batch: int, seq_len: int, database: str, trials: int, target="cuda",
                     dtype: str = "float16", kernel: str = "auto", templates: bool | None = None, gemm: str = "auto",
                     top_k: int = 8, time_budget_s: float | None = None, rpc_tracker: str | None = None,
                     rpc_key: str | None = None, report=None, progress_stream=sys.stderr,
                     whole_model_check: bool = True, cuda_graph: bool = False,
                     gated_epilogue: bool = False) -> dict:
    """Stages 1 and 2 for the calls :func:`stof_tvm.compiler.compile` makes with these arguments, then stage 3;
    returns what the manifest records of it: ``{"trials", "top_k", "seconds", "stage1_s", "stage2_s", "measured",
    "tasks", "rounds", "stopped"}`` (``stage1_s``/``stage2_s``: seconds in each stage, over all rounds) and, where
    stage 3 ran, ``"whole_model"`` (:func:`stof_tvm.tuning_check.whole_model_check`'s verdict).

    ``report``: called with each stage line; ``progress_stream``: where stage 2's progress bar goes (None: off).
    ``whole_model_check``: run stage 3 where the target's device is this machine's (not over RPC), compiling as
    the compile will (``cuda_graph``).
    """
    from stof_tvm.tuning import plan, tune_tasks, tuning_target
    from stof_tvm.tuning.build_pool import BuildPool
    from stof_tvm.tuning.plan import NothingToTune

    say = report if report is not None else (lambda line: None)
    started = time.monotonic()
    summary = {"trials": trials, "top_k": top_k, "measured": 0, "tasks": 0, "rounds": 0, "stopped": "",
               "stage1_s": 0.0, "stage2_s": 0.0}
    builder = BuildPool()
    builder.warm_up()          # the build workers start (import TVM) while stage 1 runs here
    stage1 = None
    try:
        for _ in range(_ROUNDS):
            say("stage 1: planning the calls this compile makes (front end, then the analytical model's ranking)")
            planning = time.monotonic()
            try:
                stage1 = plan(model, mask=mask, batch=batch, seq_len=seq_len, dtype=dtype, target=tuning_target(target),
                              top_k=top_k, kernel=kernel, templates=templates, gemm=gemm, database=database,
                              gated_epilogue=gated_epilogue)
            except NothingToTune as err:
                say(f"stage 1: {err}; compiling without tuning")
                summary["stopped"] = str(err)
                break
            target_of_calls = tuning_target(stage1.target)
            summary["stage1_s"] += time.monotonic() - planning
            say(f"stage 1: {len(stage1.tasks)} tasks, {sum(t.space_size for t in stage1.tasks)} candidates in "
                f"{time.monotonic() - planning:.1f} s (model {stage1.model_seconds:.2f} s); "
                + ("; ".join(stage1.notes) or "every call planned"))
            budget = None if time_budget_s is None else time_budget_s - (time.monotonic() - started)
            if budget is not None and budget <= 0:
                summary["stopped"] = f"time budget of {time_budget_s:g} s spent"
                break
            say(f"stage 2: measuring at most {trials} candidates per task on {target_of_calls.kind.name} "
                f"{target_of_calls.attrs.get('arch', '')}".rstrip())
            result = tune_tasks(stage1.tasks, target_of_calls, database, trials=trials, time_budget_s=budget,
                                rpc_tracker=rpc_tracker, rpc_key=rpc_key, builder=builder,
                                progress_stream=progress_stream)
            summary["stage2_s"] += result.elapsed_s
            cached = sum(r.status == "cached" for r in result.results)
            say(f"stage 2: {result.measured} trials measured in {result.elapsed_s:.1f} s, {cached} of "
                f"{len(result.results)} tasks already complete in {result.work_dir}"
                + (f"; stopped: {result.stopped}" if result.stopped else ""))
            summary["measured"] += result.measured
            summary["tasks"] = len(result.results)
            summary["rounds"] += 1
            summary["stopped"] = result.stopped
            if result.stopped or result.measured == 0 or not _attention_kind_moved(result):
                break
            say("stage 1 again: the records chose an attention kernel of the other kind, which changes the calls "
                "after it")
    finally:
        builder.close()
    if whole_model_check and stage1 is not None and stage1.tasks and rpc_tracker is None:
        from stof_tvm.tuning_check import stage3

        verdict = stage3(model, database=database, tasks=stage1.tasks, report=say, compile_options={
            "mask": mask, "batch": batch, "seq_len": seq_len, "target": target, "dtype": dtype, "kernel": kernel,
            "templates": templates, "gemm": gemm, "cuda_graph": cuda_graph, "gated_epilogue": gated_epilogue})
        if verdict is not None:
            summary["whole_model"] = verdict
    summary["seconds"] = time.monotonic() - started
    return summary


def compile(model, *, mask, batch: int, seq_len: int, target="cuda", dtype: str = "float16", kernel: str = "auto",
            templates: bool | None = None, gemm: str = "auto", cuda_graph: bool = False,
            dependent_launch: bool | None = None, tune_trials: int = 0, database: str | None = None, top_k: int = 8,
            time_budget_s: float | None = None, rpc_tracker: str | None = None, rpc_key: str | None = None,
            progress=None, lean_padding: bool = True, gemm_knobs: dict | None = None, norm_fusion: bool = False,
            attention_knobs: dict | None = None, narrow_bias: bool = True, fuse_relative_bias: bool = True,
            gated_epilogue: bool = False):
    """:func:`stof_tvm.compiler.compile` (same arguments, see there), tuning first when ``tune_trials`` > 0.

    ``tune_trials``: at most this many measurements per task, for every call the compile makes (stage 1 keeps
    ``top_k`` candidates per job; ``time_budget_s`` bounds the whole tuning; ``rpc_tracker``/``rpc_key`` measure
    on remote devices). Records go to ``database`` (created if missing), which the compile then reads; the
    manifest's ``tuning`` entry adds what tuning did to the records applied. ``progress``: called with each
    stage line (stage 2's progress bar goes to stderr)."""
    from stof_tvm.compiler import compile as compile_with_records

    tune_trials = _check_trials(tune_trials)
    if tune_trials and database is None:
        raise ValueError("database: tuning (tune_trials > 0) needs a work directory to write its records to")
    tuned = None
    if tune_trials:
        tuned = tune_for_compile(model, mask=mask, batch=batch, seq_len=seq_len, database=database,
                                 trials=tune_trials, target=target, dtype=dtype, kernel=kernel, templates=templates,
                                 gemm=gemm, top_k=top_k, time_budget_s=time_budget_s, rpc_tracker=rpc_tracker,
                                 rpc_key=rpc_key, report=progress, cuda_graph=cuda_graph,
                                 gated_epilogue=gated_epilogue)
    artifact = compile_with_records(model, mask=mask, batch=batch, seq_len=seq_len, target=target, dtype=dtype,
                                    kernel=kernel, templates=templates, gemm=gemm, cuda_graph=cuda_graph,
                                    dependent_launch=dependent_launch, database=database, progress=progress,
                                    lean_padding=lean_padding, gemm_knobs=gemm_knobs, norm_fusion=norm_fusion,
                                    attention_knobs=attention_knobs, narrow_bias=narrow_bias,
                                    fuse_relative_bias=fuse_relative_bias, gated_epilogue=gated_epilogue)
    if tuned is not None:
        artifact.manifest["tuning"]["tuned"] = tuned
    return artifact
