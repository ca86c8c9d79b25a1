"""Stage 3 of tuning (:mod:`stof_tvm.tuning_check`): the whole forward with the records against without them, and
the database's veto that a slower tuned forward leaves.

There is no GPU here: the check's decisions are tested with scripted timings on llvm modules (the compile, the
veto and what a compile then applies are real), the timing itself on two llvm modules, and the flow's refusal to
time where it would not be meaningful (CPU targets, no CUDA device)."""
from __future__ import annotations

import pytest

import stof_tvm
import stof_tvm.tuning_check as tuning_check
from stof_tvm.cost_model import AttentionProblem
from stof_tvm.records import TuningDatabase, open_database
from stof_tvm.tuning import tune_tasks
from stof_tvm.tuning.attention_tasks import attention_tasks

ARGS = dict(mask="bigbird", batch=1, seq_len=64, target="llvm", dtype="float32")


def _measured_group(work: str):
    """A database whose attention group for tiny BERT's problem has a choice (both members measured)."""
    problem = AttentionProblem.build("bigbird", batch=1, heads=2, seq_len=64, head_dim=64, dtype="float32")
    tasks = attention_tasks(problem, "llvm", top_k=2)
    tune_tasks(tasks, "llvm", work, trials=1, build_workers=1, progress_stream=None)
    return tasks


def test_a_vetoed_job_is_not_applied_until_the_veto_is_lifted(tmp_path):
    work = str(tmp_path / "db")
    tasks = _measured_group(work)
    group = tasks[0].group
    db = TuningDatabase(work)
    assert db.choice(group) is not None and group in db.jobs()
    db.veto([group], {"untuned_ms": 1.0, "tuned_ms": 1.1})
    again = open_database(work)
    assert again.choice(group) is None and group not in again.jobs()
    assert again.vetoed() == {group: {"untuned_ms": 1.0, "tuned_ms": 1.1}}
    again.unveto([group])
    assert open_database(work).choice(group) is not None and open_database(work).vetoed() == {}


@pytest.mark.parametrize("tuned_ms, vetoed", [(1.10, True), (1.005, False), (0.90, False)])
def test_the_check_vetoes_records_that_made_the_forward_slower(tiny, tmp_path, monkeypatch, tuned_ms, vetoed):
    """Scripted timings (untuned 1.0 ms): more than CHECK_MARGIN slower vetoes the jobs, and a compile with the
    database then applies none of them; within the margin or faster keeps them."""
    work = str(tmp_path / "db")
    tasks = _measured_group(work)
    compiled = []
    monkeypatch.setattr(tuning_check, "interleaved_ms",
                        lambda models: compiled.extend(models) or [1.0, tuned_ms])
    lines = []
    verdict = tuning_check.whole_model_check(tiny, database=work, jobs=[t.group or t.key for t in tasks],
                                             compile_options=ARGS, report=lines.append)
    jobs = [t.group or t.key for t in tasks]
    assert len(compiled) == 2
    assert verdict == {"untuned_ms": 1.0, "tuned_ms": tuned_ms, "vetoed": sorted(set(jobs)) if vetoed else []}
    assert ("vetoed" in lines[-1]) == vetoed and ("kept" in lines[-1]) == (not vetoed)
    art = stof_tvm.compile(tiny, **ARGS, database=work)
    assert art.manifest["tuning"]["applied"] == (0 if vetoed else 1)
    assert art.manifest["attention"]["kernel"]["reason"].startswith("tuned") == (not vetoed)


@pytest.mark.parametrize("kept_ms, vetoed_all", [(1.005, False), (1.05, True)])
def test_a_slower_forward_is_judged_again_without_its_attention_records(tiny, tmp_path, monkeypatch, kept_ms,
                                                                         vetoed_all):
    """Scripted timings: the tuned forward 10% slower, then without the attention records ``kept_ms``. Within the
    margin, only the attention group is vetoed and the other job is kept; else every job is vetoed."""
    work = str(tmp_path / "db")
    group = _measured_group(work)[0].group
    other = "template:gemm_wgmma:{}:float32"
    timings = iter([[1.0, 1.10], [1.0, kept_ms]])
    monkeypatch.setattr(tuning_check, "interleaved_ms", lambda models: next(timings))
    lines = []
    verdict = tuning_check.whole_model_check(tiny, database=work, jobs=[other, group], compile_options=ARGS,
                                             report=lines.append)
    assert verdict["kept_ms"] == kept_ms
    assert verdict["vetoed"] == (sorted([group, other]) if vetoed_all else [group])
    assert set(open_database(work).vetoed()) == set(verdict["vetoed"])
    assert ("attention jobs vetoed" in lines[-1]) == (not vetoed_all)
    assert stof_tvm.compile(tiny, **ARGS, database=work).manifest["tuning"]["applied"] == 0


def test_interleaved_timing_of_two_modules(tiny):
    """Both modules timed on the same random valid inputs: a positive median each."""
    models = [stof_tvm.compile(tiny, **ARGS).load() for _ in range(2)]
    times = tuning_check.interleaved_ms(models, rounds=2, calls=1)
    assert len(times) == 2 and all(t > 0 for t in times)


def test_the_check_runs_on_a_gpu_only(tiny):
    """stage3 says why it does not run for a CPU target and compiles nothing."""
    assert "CUDA modules only" in tuning_check.unavailable("llvm")
    assert tuning_check.unavailable("cuda") in (None, "no CUDA device on this machine")
    lines = []
    assert tuning_check.stage3(tiny, database="unused", tasks=[], compile_options=ARGS, report=lines.append) is None
    assert lines == ["stage 3 (the whole forward with and without the records): not run, it times CUDA modules only"]
