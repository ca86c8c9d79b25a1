"""The user's tuning flow end to end: records written by one process apply in another that never tuned.

- fresh process: a database holding each kind of task a model compile reads (mma.sync template knob sets
  searched by MetaSchedule, wgmma knob sets, attention configurations), written by the real stage 1 and stage 2
  code for tiny BERT on CUDA, is compiled with in a subprocess in which no stof-tvm intrinsic is registered when
  it starts (the state that crashed with ``TensorIntrin 'stof_ldmatrix_a_f16' is not registered``). There is no
  GPU here, so the builder only records what it is given and a scripted runner "measures" every candidate
  faster than the one before: the times are made up, the records (workloads, traces, knob sets, group choices)
  are the ones stage 2 writes. The test proves the records load and decide every call's kernel (each choice is
  the recorded winner, never the untuned one), not that the winners are fast;
- CLI on an ONNX file (llvm, really measured): ``stof-tvm tune`` then ``stof-tvm compile --tune-trials 1`` with
  the same arguments: the second measures nothing (the same tasks), and applies a record for every call, with
  no call missing one and no measured job unused;
- untuned first: a searched task given one trial measures its first candidate, the compile's untuned choice; a
  group gets no choice until its untuned member is measured;
- killed jobs: a tuning process killed with SIGKILL in the middle of stage 2 (and a record line cut short),
  then re-run: every record written before the kill is kept, the rest is measured once, nothing twice.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import onnx
import pytest

from stof_tvm.compiler import cubins, linear_match
from stof_tvm.cost_model import AttentionProblem, attention_candidates
from stof_tvm.records import TuningDatabase, record_usage
from stof_tvm.records.database import CHOICE_MARGIN
from stof_tvm.records.store import _drop_torn_tail
from stof_tvm.schedules.templates import get_template
from stof_tvm.tuning import TuningTask, plan, tune_tasks, tuning_target
from stof_tvm.tuning.attention_tasks import attention_tasks
from stof_tvm.tuning.template_tasks import template_task

from test_tuning import TILES, apply_tiles, matmul

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from stand_in_tuning import RecordingBuilder, ScriptedRunner  # noqa: E402  (scripts/ is not a package)

# tiny BERT at 1x128 with 3 wgmma tiles as the threshold: the QKV projection (3 tiles) and the FFN's first GEMM
# (4 tiles) go to wgmma, the two 128-wide GEMMs stay on mma.sync templates (1 tile each).
WGMMA_MIN_TILES = 3
ARGS = ["--mask", "bigbird", "--batch", "1", "--seq-len", "128"]


def cli(args, **kwargs) -> subprocess.CompletedProcess:
    """``stof-tvm ARGS`` in a fresh Python process (``prelude``: code run before it)."""
    prelude = kwargs.pop("prelude", "")
    code = f"{prelude}\nfrom stof_tvm.cli import main\nraise SystemExit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, **kwargs)


def onnx_file(model, tmp_path) -> str:
    path = str(tmp_path / "tiny.onnx")
    onnx.save(model, path)
    return path


@pytest.mark.slow
@pytest.mark.skipif(cubins.find_nvcc() is None, reason="nvcc not found (the wgmma cubins are prebuilt with it)")
def test_records_of_every_task_kind_apply_in_a_fresh_process(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(linear_match, "WGMMA_MIN_TILES", WGMMA_MIN_TILES)
    work, model = str(tmp_path / "db"), onnx_file(tiny, tmp_path)
    stage1 = plan(model, mask="bigbird", batch=1, seq_len=128, target="cuda", gemm="wgmma", top_k=2)
    kinds = {"mma.sync": [t for t in stage1.tasks if t.candidates],
             "wgmma": [t for t in stage1.tasks if t.group.startswith("template:")],
             "attention": [t for t in stage1.tasks if t.group.startswith("attention:")]}
    assert all(kinds.values()), {kind: len(tasks) for kind, tasks in kinds.items()}
    assert any(t.meta["template"] == "gemm_kn" for t in kinds["mma.sync"])      # tensorizes with stof's ldmatrix
    assert any(len(t.candidates) == 2 for t in kinds["mma.sync"])      # one searched past the untuned candidate
    (tmp_path / "artifacts").mkdir()
    report = tune_tasks(stage1.tasks, tuning_target(stage1.target), work,
                        builder=RecordingBuilder(tmp_path / "artifacts"), runner=ScriptedRunner(), progress_stream=None)
    assert {r.status for r in report.results} == {"tuned"}
    jobs = TuningDatabase(work).jobs()
    assert len(jobs) == len(kinds["mma.sync"]) + len({t.group for t in stage1.tasks if t.group})

    out = str(tmp_path / "art")
    prelude = textwrap.dedent(f"""
        from tvm.s_tir import TensorIntrin
        from stof_tvm.compiler import linear_match
        assert TensorIntrin.get("stof_ldmatrix_a_f16", allow_missing=True) is None, "not a fresh process"
        linear_match.WGMMA_MIN_TILES = {WGMMA_MIN_TILES}
    """)
    done = cli(["compile", model, *ARGS, "--target", "cuda", "--gemm", "wgmma", "--database", work, "-o", out],
               prelude=prelude)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"tuning records: {len(jobs)} applied from {os.path.abspath(work)}" in done.stdout
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["tuning"] == {"database": os.path.abspath(work), "applied": len(jobs), "missing": [],
                                  "unused": []}
    db = TuningDatabase(work)
    stages = [stage for site in manifest["templates"]["sites"] for stage in site["stages"]]
    assert {s["template"] for s in stages} >= {"gemm_kn", "qkv_projection_wgmma", "gemm_bias_gelu_erf_wgmma"}
    for stage in stages:
        assert stage["source"] == "database", stage
        task = next(t for t in stage1.tasks if t.meta["template"] == stage["template"]
                    and t.meta["shape"] == stage["shape"])
        if task.candidates:       # the scripted runner made the last-measured candidate the fastest
            best = db.task_status(task)["best_candidate"]
            assert best == len(task.candidates) - 1 and stage["knobs"] == task.candidates[best], (stage, task.name)
        else:
            choice = db.group_choice(task.group)
            assert stage["knobs"] == choice["meta"]["knobs"] and not choice["meta"].get("untuned")
    kernel = manifest["attention"]["kernel"]
    choice = db.group_choice(kinds["attention"][0].group)
    assert kernel["reason"].startswith(f"tuned: {choice['name']}") and not choice["meta"].get("untuned")
    assert (kernel["kind"], kernel["config"]) == (choice["meta"]["kind"], choice["meta"]["config"])


@pytest.mark.slow
def test_cli_tune_then_compile_with_tuning_uses_every_record(tiny, tmp_path):
    model, work = onnx_file(tiny, tmp_path), str(tmp_path / "db")
    same = [*ARGS[:-1], "64", "--target", "llvm", "--dtype", "float16", "--templates", "--top-k", "1"]
    tuned = cli(["tune", "--model", model, *same, "--trials", "1", "--build-workers", "1", "--database", work])
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "stage 1: planning the calls" in tuned.stderr and "stage 2: measuring on llvm" in tuned.stderr
    assert "stage 3 (the whole forward with and without the records): not run, it times CUDA modules only" \
        in tuned.stderr
    jobs = TuningDatabase(work).jobs()
    assert len(jobs) >= 5                     # the template calls and the attention problem
    out = str(tmp_path / "art")
    done = cli(["compile", model, *same, "--tune-trials", "1", "--database", work, "-o", out])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stage 2: 0 trials measured" in done.stderr        # the same tasks: all complete already
    assert f"tuning records: {len(jobs)} applied from {os.path.abspath(work)}; tuned here: 0 trials" in done.stdout
    tuning = json.load(open(os.path.join(out, "manifest.json")))["tuning"]
    assert (tuning["applied"], tuning["missing"], tuning["unused"]) == (len(jobs), [], [])
    assert tuning["tuned"]["trials"] == 1 and tuning["tuned"]["measured"] == 0


def test_a_searched_task_measures_its_untuned_candidate_first(tmp_path):
    task = TuningTask("tiles", matmul, TILES, apply_tiles)
    report = tune_tasks([task], "llvm", str(tmp_path / "db"), trials=1, build_workers=1, progress_stream=None)
    (result,) = report.results
    assert result.status == "tuned" and result.trials == 1 and result.best_candidate == TILES[0]


def test_group_choice_waits_for_the_untuned_member(tmp_path):
    problem = AttentionProblem.build("sliding:window=8", batch=1, heads=2, seq_len=32, head_dim=64)
    tasks = attention_tasks(problem, "llvm", top_k=2)
    assert tasks[0].meta.get("untuned") and not tasks[1].meta.get("untuned")
    db = TuningDatabase(str(tmp_path / "db"))
    for task, best in zip(tasks, (None, 1e-6)):
        db.status["tasks"][task.key] = {"trials": 1, "group": task.group, "best_s": best}
    assert db.update_group(tasks[0].group, tasks) is None and db.group_choice(tasks[0].group) is None
    db.status["tasks"][tasks[0].key]["best_s"] = 2e-6
    assert db.update_group(tasks[0].group, tasks)["task"] == tasks[1].key


def test_the_untuned_member_stays_unless_another_is_clearly_faster(tmp_path):
    """Within CHOICE_MARGIN of the untuned member a faster measurement is not taken (it did not carry over to
    whole models); beyond it, it is."""
    problem = AttentionProblem.build("sliding:window=8", batch=1, heads=2, seq_len=32, head_dim=64)
    tasks = attention_tasks(problem, "llvm", top_k=2)
    db = TuningDatabase(str(tmp_path / "db"))
    untuned = 10e-6
    for faster, chosen in ((0.5 * CHOICE_MARGIN, 0), (2 * CHOICE_MARGIN, 1), (-0.1, 0)):
        for task, best in zip(tasks, (untuned, untuned * (1 - faster))):
            db.status["tasks"][task.key] = {"trials": 1, "group": task.group, "best_s": best}
        choice = db.update_group(tasks[0].group, tasks)
        assert choice["task"] == tasks[chosen].key and db.group_choice(tasks[0].group) == choice
        assert choice["best_s"] == db.status["tasks"][tasks[chosen].key]["best_s"]


def test_untuned_choices_lead_the_candidates():
    template, shape = get_template("gemm_kn"), {"m": 128, "n": 256, "k": 128}
    ranked = template_task(template, shape, top_k=4).candidates
    task = template_task(template, shape, top_k=3, baseline=ranked[3])
    assert task.candidates == [ranked[3], ranked[0], ranked[1]]
    problem = AttentionProblem.build("sliding:window=8", batch=1, heads=2, seq_len=32, head_dim=64)
    baseline = attention_candidates(problem, kinds=("row",))[-1]          # whatever the model ranks it
    tasks = attention_tasks(problem, "cuda", top_k=2, baseline=baseline)
    assert len(tasks) == 2 and tasks[0].meta["untuned"] and not tasks[1].meta.get("untuned")
    assert (tasks[0].meta["kind"], tasks[0].meta["config"]) == ("row", dataclasses.asdict(baseline.config))


def _killable_tuning(work) -> str:
    """A tuning script: a searched task (three tilings) and two attention kernels, one candidate per batch, each
    build slowed down so that the job is still in stage 2 when it is killed."""
    return textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        from tvm.ir.utils import derived_object
        from tvm.s_tir import meta_schedule as ms
        from stof_tvm.cost_model import AttentionProblem
        from stof_tvm.tuning import TuningTask, make_builder, tune_tasks
        from stof_tvm.tuning.attention_tasks import attention_tasks
        from test_tuning import TILES, apply_tiles, matmul

        @derived_object
        class SlowBuilder(ms.builder.PyBuilder):
            def __init__(self):
                super().__init__()
                self.inner = make_builder(1)

            def build(self, build_inputs):
                time.sleep(1.0)
                return self.inner.build(build_inputs)

        problem = AttentionProblem.build("sliding:window=8", batch=1, heads=2, seq_len=32, head_dim=64)
        tasks = [TuningTask("tiles", matmul, TILES, apply_tiles)] + attention_tasks(problem, "llvm", top_k=2)
        report = tune_tasks(tasks, "llvm", {work!r}, num_trials_per_iter=1, builder=SlowBuilder(),
                            progress_stream=None)
        print("measured", report.measured, "statuses", sorted(r.status for r in report.results))
    """)


def _record_lines(work) -> list[str]:
    path = os.path.join(work, "database_tuning_record.json")
    return open(path).read().splitlines() if os.path.exists(path) else []


@pytest.mark.slow
def test_a_killed_tuning_job_loses_nothing_and_resumes(tmp_path):
    work = str(tmp_path / "db")
    script = _killable_tuning(work)
    job = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    try:
        while len(_record_lines(work)) < 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job.poll() is None, f"the job ended before it could be killed: {job.communicate()}"
        os.killpg(job.pid, signal.SIGKILL)              # the job and its builder/runner workers
    finally:
        job.wait()
    kept = _record_lines(work)
    assert 2 <= len(kept) < 5 and not os.path.exists(os.path.join(work, "stof_tuning.json"))
    with open(os.path.join(work, "database_tuning_record.json"), "a") as handle:
        handle.write(kept[-1][: len(kept[-1]) // 2])    # a record line cut short, as a kill mid-write leaves it
    again = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"measured {5 - len(kept)} " in again.stdout and "'stopped'" not in again.stdout
    lines = _record_lines(work)
    assert lines[:len(kept)] == kept and len(lines) == 5          # all kept, the rest measured, none twice
    records = [json.loads(line) for line in lines]
    tilings = [json.dumps(r[1][0]) for r in records if r[1][0][0]]   # the records with instructions in the trace
    assert len(tilings) == len(set(tilings)) == 3                 # the three tilings, each measured once
    status = json.load(open(os.path.join(work, "stof_tuning.json")))
    assert all(task["complete"] for task in status["tasks"].values()) and len(status["groups"]) == 1


def test_torn_tail_is_dropped_and_whole_lines_kept(tmp_path):
    path = tmp_path / "records.json"
    path.write_bytes(b'[0, 1]\n[1, 2]\n[2, 3')
    assert _drop_torn_tail(str(path)) == 5 and path.read_bytes() == b'[0, 1]\n[1, 2]\n'
    assert _drop_torn_tail(str(path)) == 0
    path.write_bytes(b'[0, ')
    assert _drop_torn_tail(str(path)) == 4 and path.read_bytes() == b''


def test_usage_ledger_counts_applied_missing_and_unused(tmp_path):
    db = TuningDatabase(str(tmp_path / "db"))
    db.status["groups"] = {"attention:x": {"task": "a", "name": "attention_x", "best_s": 1e-6, "meta": {}},
                           "template:y": {"task": "b", "name": "y", "best_s": 1e-6, "meta": {}}}
    db.status["tasks"]["k1"] = {"name": "gemm_kn_1", "group": "", "best_s": 1e-6}
    with record_usage() as usage:
        assert db.choice("attention:x") is not None and db.choice("template:z") is None
    calls = [("attention", True), ("gemm a", True), ("gemm a", False), ("gemm b", False)]
    assert usage.summary(calls, db) == {"applied": 2, "missing": ["gemm b"], "unused": ["gemm_kn_1", "template:y"]}
    db.choice("template:y")                                     # no ledger active: nothing noted
    assert usage.summary([], db)["unused"] == ["gemm_kn_1", "template:y"]


def test_clear_errors(tiny, tmp_path):
    import stof_tvm

    with pytest.raises(FileNotFoundError, match="no tuning work directory at .*nowhere.*stof-tvm tune"):
        stof_tvm.compile(tiny, mask="bigbird", batch=1, seq_len=64, target="llvm", dtype="float32",
                         database=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no CUDA device is visible here"):
        tune_tasks([TuningTask("tiles", matmul, TILES, apply_tiles)], "cuda", str(tmp_path / "db"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "database_workload.json").write_text("not json\n")
    (tmp_path / "bad" / "database_tuning_record.json").write_text("")
    with pytest.raises(ValueError, match="database .*bad: MetaSchedule cannot read its records"):
        TuningDatabase(str(tmp_path / "bad"))
