"""The tuner plans exactly the template calls the compile path makes, and the compile path uses what it records.

- plan vs compile: for tiny BERT on CUDA, with mma.sync and with wgmma GEMMs, the planned calls (template, shape,
  dtype, LayerNorm eps, count) equal the compile manifest's stages, and every call has its tasks;
- llvm end to end: ``stof_tvm.tune`` on llvm (one measurement per call) writes records that a later
  ``compile(..., database=)`` applies to every template stage (source ``database``), and a second tune measures
  nothing;
- wgmma records: the per-knob-set tasks built here by the real builder, "measured" by a stand-in runner (no GPU
  here) whose times favour a knob set other than the template's default; the compile picks that knob set.
"""
from __future__ import annotations

import os
import sys

import pytest

import stof_tvm
from stof_tvm.compiler import cubins, linear_match
from stof_tvm.schedules.templates import get_template
from stof_tvm.tuning import TuningDatabase, plan, tune, tune_tasks, tuning_target
from stof_tvm.tuning.template_tasks import wgmma_group

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from stand_in_tuning import ScriptedRunner  # noqa: E402  (scripts/ is not a package)


def manifest_calls(manifest) -> dict:
    calls = {}
    for site in manifest["templates"]["sites"]:
        for stage in site["stages"]:
            key = (stage["template"], tuple(sorted(stage["shape"].items())), stage["dtype"], stage.get("eps"))
            calls[key] = calls.get(key, 0) + site["count"]
    return calls


def planned_calls(stage1) -> dict:
    return {(name, tuple(sorted(shape.items())), dtype, options.get("eps")): count
            for name, shape, dtype, options, count in stage1.calls}


@pytest.mark.parametrize("gemm", ["mma", "wgmma"])
def test_planned_calls_equal_the_compile_manifest(tiny, gemm, monkeypatch):
    monkeypatch.setattr(cubins, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")    # gemm checks only
    monkeypatch.setattr(linear_match, "WGMMA_MIN_TILES", 1)     # tiny-bert's GEMMs are too small for wgmma otherwise
    stage1 = plan(tiny, mask="bigbird", batch=1, seq_len=128, target="cuda", gemm=gemm, top_k=3)
    front = stof_tvm.compiler.front_end(tiny, mask="bigbird", batch=1, seq_len=128, target="cuda", gemm=gemm)
    compiled = manifest_calls({"templates": front.template_entry})
    assert planned_calls(stage1) == compiled
    # the embeddings' LayerNorm is on the layernorm template too
    assert {name for name, *_ in compiled} == ({"qkv_projection_kn", "gemm_kn", "gemm_bias_gelu_erf_kn",
                                                 "bias_residual_layernorm", "layernorm"} if gemm == "mma" else
                                                {"qkv_projection_wgmma", "gemm_wgmma", "gemm_bias_gelu_erf_wgmma",
                                                 "bias_residual_layernorm", "layernorm"})
    # every call has its tasks, on the target the compile builds for
    assert stage1.target["arch"] == ("sm_90a" if gemm == "wgmma" else "sm_90")
    for name, shape, dtype, options, count in stage1.calls:
        mine = [t for t in stage1.tasks if t.meta.get("template") == name and t.meta["shape"] == shape]
        assert mine and all(t.weight == count for t in mine)
        if name.endswith("_wgmma"):      # one pre-built task per knob set, the default first
            assert len(mine) == 3 and len({t.key for t in mine}) == 3
            assert mine[0].meta["knobs"] == get_template(name).default_knobs(shape, dtype)
            assert {t.group for t in mine} == {wgmma_group(get_template(name), shape, dtype)}
        else:
            assert len(mine) == 1 and 1 <= mine[0].space_size <= 3
    assert any(t.group.startswith("attention:") for t in stage1.tasks)


def test_full_compile_manifest_matches_the_plan(tiny):
    """The front end the test above compares with is the one compile() builds from."""
    art = stof_tvm.compile(tiny, mask="bigbird", batch=1, seq_len=128, target="cuda", gemm="mma")
    stage1 = plan(tiny, mask="bigbird", batch=1, seq_len=128, target="cuda", gemm="mma", top_k=1)
    assert planned_calls(stage1) == manifest_calls(art.manifest)


def test_llvm_tuning_records_are_used_by_the_compile(tiny, tmp_path):
    work = str(tmp_path / "db")
    args = dict(mask="bigbird", batch=1, seq_len=64)
    first = tune(tiny, **args, target="llvm", templates=True, database=work, top_k=1, trials=1,
                 build_workers=1, progress=False)
    templates = [r for r in first.results if r.task.meta.get("template")]
    assert len(templates) == len(first.plan.calls) == 6      # with the embeddings' LayerNorm
    assert all(r.status == "tuned" and r.best_s > 0 for r in first.results)
    again = tune(tiny, **args, target="llvm", templates=True, database=work, top_k=1, trials=1,
                 build_workers=1, progress=False)
    assert again.measured == 0 and {r.status for r in again.results} == {"cached"}
    art = stof_tvm.compile(tiny, **args, target="llvm", dtype="float16", templates=True, database=work)
    stages = [stage for site in art.manifest["templates"]["sites"] for stage in site["stages"]]
    assert stages and all(stage["source"] == "database" and stage["seconds"] > 0 for stage in stages)
    by_template = {r.task.meta["template"]: r.best_s for r in templates}
    for stage in stages:
        assert any(stage["seconds"] == r.best_s for r in templates if r.task.meta["template"] == stage["template"])
    assert set(by_template) == {stage["template"] for stage in stages}


@pytest.mark.skipif(cubins.find_nvcc() is None, reason="nvcc not found")
def test_wgmma_records_choose_the_compiled_knobs(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(linear_match, "WGMMA_MIN_TILES", 1)     # tiny-bert's GEMMs are too small for wgmma otherwise
    work = str(tmp_path / "db")
    args = dict(mask="bigbird", batch=1, seq_len=128, target="cuda", gemm="wgmma")
    stage1 = plan(tiny, **args, top_k=2)
    wgmma = [t for t in stage1.tasks if t.group.startswith("template:")]
    report = tune_tasks(wgmma, tuning_target(stage1.target), work, runner=ScriptedRunner(), build_workers=1,
                        progress_stream=None)
    assert all(r.status == "tuned" for r in report.results)
    art = stof_tvm.compile(tiny, **args, database=work)
    assert planned_calls(stage1) == manifest_calls(art.manifest)
    db = TuningDatabase(work)
    checked = 0
    for site in art.manifest["templates"]["sites"]:
        for stage in site["stages"]:
            if not stage["template"].endswith("_wgmma"):
                continue
            best = db.group_choice(wgmma_group(get_template(stage["template"]), stage["shape"], stage["dtype"]))
            assert stage["source"] == "database" and stage["knobs"] == best["meta"]["knobs"]
            assert stage["seconds"] == best["best_s"]
            checked += 1
    assert checked == 4
    # the scripted times favour the last-measured knob set of each call, never the default (measured first)
    assert any(stage["knobs"] != get_template(stage["template"]).default_knobs(stage["shape"], stage["dtype"])
               for site in art.manifest["templates"]["sites"] for stage in site["stages"]
               if stage["template"].endswith("_wgmma"))


def test_grouped_query_attention_is_tuned_on_its_key_value_heads(hf_export):
    """A grouped-query export (the tiny Llama: 4 query heads on 2 key/value heads): the attention tasks build the
    kernel the compile runs, K and V of 2 heads, under a group name of their own (records of the same shapes on
    repeated K and V are not taken for it)."""
    path = hf_export("llama", "eager", "dynamo", 18, False, 2, 64)
    stage1 = plan(path, mask="bigbird", batch=2, seq_len=64, target="cuda", kernel="block", top_k=2)
    attention = [t for t in stage1.tasks if t.group.startswith("attention:")]
    assert attention and all("xH4xHkv2xSq64" in t.group for t in attention)
    for task in attention:
        assert [int(x) for x in task.func.params[1].shape] == [2, 2, 64, 32]
        assert task.meta["problem"]["kv_heads"] == 2
