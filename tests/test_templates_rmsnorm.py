"""The RMSNorm templates (schedules/templates/rmsnorm.py) and their match in the compile path
(stof_tvm/compiler/rmsnorm_match.py):

- registry, knob space and resources shared with the LayerNorm template, ranked by the cost model;
- the definitions built for llvm against float64 numpy (NaN-poisoned outputs; both outputs of
  ``residual_rmsnorm``; a non-default epsilon);
- the scheduled CUDA source compiled by nvcc for sm_90 (16-byte accesses, both outputs stored, no spills), and
  MetaSchedule's sampled design space replayed, postprocessed and built;
- the Relax rewrite on a hand-built graph in the rsqrt form: the plain template where the input is no residual
  sum, the fused one where it is, nothing where the rows do not tile; outputs equal to the graph's on llvm.
The torch-exported tiny T5 is covered by tests/test_compile_torch_chains.py."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, s_tir

from stof_tvm.compiler import pipeline
from stof_tvm.compiler.downstream import _Templates
from stof_tvm.compiler.rmsnorm_match import rewrite_rmsnorms
from stof_tvm.cost_model.templates import rank_template
from stof_tvm.schedules.templates import TEMPLATES, get_template
from stof_tvm.schedules.templates.build import build, cuda_source, cuda_target
from stof_tvm.schedules.templates.registry import Finalize, KeepCandidates
from stof_tvm.schedules.templates.rmsnorm import rmsnorm_np
from stof_tvm.tuning.template_tasks import template_task

from attention_reference import relative_error
from hopper_checks import sm90_ptxas_report

LLVM = tvm.target.Target({"kind": "llvm"})
TOL = {"float16": 2e-3, "bfloat16": 1.5e-2}
T5_BASE = {"m": 16 * 2048, "n": 768}       # T5-Base at 16 x 2048 tokens


def np_dtype(dtype: str):
    if dtype == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(dtype)


def _run_llvm(template, shape, dtype, inputs, **options):
    """The definition built for llvm on ``inputs``; outputs (float64) from NaN-poisoned buffers."""
    args = template.arguments(shape, dtype)
    n_out = template.outputs()
    outs = [tvm.runtime.tensor(np.full(s, np.nan, dtype=np_dtype(dtype))) for _, s, _ in args[-n_out:]]
    ex = tvm.compile(template.primfunc(shape, dtype, **options), target=LLVM)
    ex["main"](*[tvm.runtime.tensor(inputs[name]) for name, _, _ in args[:-n_out]], *outs)
    return [out.numpy().astype(np.float64) for out in outs]


def _inputs(template, shape, dtype, rng, row_scale=None):
    inputs = {}
    for name, arg_shape, _ in template.arguments(shape, dtype)[:-template.outputs()]:
        value = rng.standard_normal(arg_shape)
        if name == "weight":
            value = 1.0 + 0.2 * value
        elif row_scale is not None:
            value = value * row_scale[:, None]
        inputs[name] = value.astype(np_dtype(dtype))
    return inputs


# ---- registry, knobs, cost model ---------------------------------------------------------------------------

def test_registered_with_the_layernorm_knob_space():
    layernorm = get_template("layernorm")
    for name, outputs in (("rmsnorm", 1), ("residual_rmsnorm", 2)):
        t = TEMPLATES[name]
        assert t.family == "rmsnorm" and t.outputs() == outputs and t.knob_names == layernorm.knob_names
        space = t.knob_space(T5_BASE)
        assert space == layernorm.knob_space(T5_BASE)
        assert all(t.resources(T5_BASE, "float16", k) == layernorm.resources(T5_BASE, "float16", k) for k in space)
    assert [a for a, _, _ in TEMPLATES["residual_rmsnorm"].arguments(T5_BASE)] == ["x", "residual", "weight", "sum",
                                                                                     "out"]
    with pytest.raises(ValueError, match="multiple of 64"):
        get_template("rmsnorm").primfunc({"m": 8, "n": 96})


def test_ranked_by_the_cost_model_and_planned_for_tuning():
    plain = rank_template(get_template("rmsnorm"), T5_BASE)
    fused = rank_template(get_template("residual_rmsnorm"), T5_BASE)
    assert plain and fused and all(np.isfinite(r.time_s) for r in plain + fused)
    # the fused form moves 4 rows of bytes (2 reads, 2 writes) where the plain one moves 2
    assert 1.5 < fused[0].time_s / plain[0].time_s < 2.5
    task = template_task(get_template("residual_rmsnorm"), T5_BASE, top_k=4, ranked=fused)
    assert task.candidates == [r.candidate for r in fused[:4]]
    assert task.meta["template"] == "residual_rmsnorm"


# ---- CPU numerics -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [("rmsnorm", "float16"), ("rmsnorm", "bfloat16"),
                                         ("residual_rmsnorm", "float16"), ("residual_rmsnorm", "bfloat16")])
def test_definition_matches_numpy_float64(name, dtype):
    t = get_template(name)
    shape = {"m": 16, "n": 128}
    inputs = _inputs(t, shape, dtype, np.random.default_rng(3), row_scale=np.geomspace(0.05, 20.0, shape["m"]))
    got = _run_llvm(t, shape, dtype, inputs)
    ref = t.reference(shape, inputs)
    assert len(got) == len(ref) == t.outputs()
    for out, expected in zip(got, ref):
        assert np.isfinite(out).all(), f"{name}: unwritten outputs"
        assert relative_error(out, expected) < TOL[dtype], f"{name} {dtype}: {relative_error(out, expected):.2e}"
    if name == "residual_rmsnorm":   # out normalises the rounded sum it wrote
        y = got[0]
        np.testing.assert_allclose(got[1], rmsnorm_np(y, inputs["weight"]), rtol=0, atol=4 * TOL[dtype])


def test_epsilon_option_reaches_the_definition():
    """Rows of mean square ~1e-4: eps = 1e-2 dominates, the default 1e-6 does not."""
    t = get_template("rmsnorm")
    shape = {"m": 8, "n": 128}
    inputs = _inputs(t, shape, "float16", np.random.default_rng(5), row_scale=np.full(8, 0.01))
    (got,) = _run_llvm(t, shape, "float16", inputs, eps=1e-2)
    expected = rmsnorm_np(inputs["x"], inputs["weight"], eps=1e-2)
    assert relative_error(got, expected) < TOL["float16"]
    assert relative_error(got, rmsnorm_np(inputs["x"], inputs["weight"])) > 0.5


# ---- CUDA code generation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype, knobs", [
    ("rmsnorm", "float16", None), ("residual_rmsnorm", "float16", None),
    ("residual_rmsnorm", "bfloat16", {"rows": 1, "lanes": 128, "vec": 2, "registers": 1}),
    ("residual_rmsnorm", "float16", {"rows": 4, "lanes": 32, "vec": 8, "registers": 0}),
    ("residual_rmsnorm", "float16", {"rows": 8, "lanes": 32, "vec": 8, "registers": 1})])
def test_cuda_source_compiles_to_sm90_without_spills(name, dtype, knobs, tmp_path):
    t = get_template(name)
    shape = {"m": 512, "n": 768}
    knobs = knobs or t.default_knobs(shape, dtype)
    assert knobs in t.knob_space(shape, dtype)
    src = cuda_source(build(t.schedule(shape, dtype, knobs), cuda_target()))
    assert "rsqrtf" in src and "__shfl_down_sync" in src
    outputs = ["total_ptr", "out_ptr"] if t.outputs() == 2 else ["out_ptr"]
    if knobs["vec"] == 8:          # 16-byte loads of the inputs and stores of every output
        for ptr in ["x_ptr"] + outputs:
            assert re.search(rf"uint4\*\)\({ptr} \+", src), ptr
    else:
        for ptr in outputs:
            assert re.search(rf"\({ptr} \+", src), ptr
    report = sm90_ptxas_report(src, tmp_path)
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), report
    found = re.search(r"(\d+) bytes smem", report)       # ptxas reports no line for none (rows in registers)
    smem = int(found.group(1)) if found else 0
    # the staged rows; a row spanning several warps adds the reduction's scratch (under 32 floats per row)
    assert smem <= t.resources(shape, dtype, knobs)["shared_bytes"] + knobs["rows"] * 128


def test_sampled_design_space_replays_and_builds():
    """sample_categorical knobs, KeepCandidates and Finalize (the deferred row steps with two outputs), then a
    MetaSchedule build of the candidates (no GPU run)."""
    import logging

    from tvm.s_tir import meta_schedule as ms

    from stof_tvm.schedules.templates.build import ms_builder

    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    t = get_template("residual_rmsnorm")
    shape = {"m": 256, "n": 768}
    candidates = t.knob_space(shape)[:4]
    sch = s_tir.Schedule(t.primfunc(shape))
    t.sample(sch, candidates)
    assert KeepCandidates(t.name, t.spec_of(sch), candidates).apply(sch)
    assert Finalize().apply(sch)
    assert t.decode(sch, candidates) in candidates
    func = t.primfunc(shape).with_attr("global_symbol", "main")
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=cuda_target(),
                         space_generator=t.space_generator(shape, "float16", candidates),
                         search_strategy="replay-trace", num_threads=1)
    spaces = ctx.generate_design_space()
    ctx.pre_tuning(max_trials=4, num_trials_per_iter=4, design_spaces=spaces)
    measured = ctx.search_strategy.generate_measure_candidates()
    assert measured
    results = ms_builder(timeout_sec=300, max_workers=1).build(
        [ms.builder.BuilderInput(c.sch.mod, cuda_target()) for c in measured[:2]])
    assert all(r.error_msg is None for r in results), [r.error_msg for r in results]


# ---- the compile path's match ------------------------------------------------------------------------------

def _t5_like(n: int, w1, w2, eps: float = 1e-6) -> tvm.IRModule:
    """h0 -> RMSNorm(h0) (rsqrt form, float32, cast to float16 as mixed precision leaves it); h1 = h0 + that
    output; RMSNorm(h1) is the result."""
    bb = relax.BlockBuilder()
    h0 = relax.Var("h0", relax.TensorType([2, 64, n], "float32"))

    def rmsnorm(x, w):
        mean = bb.emit(relax.op.mean(bb.emit(relax.op.multiply(x, x)), axis=[-1], keepdims=True))
        inv = bb.emit(relax.op.rsqrt(bb.emit(relax.op.add(mean, relax.const(eps, "float32")))))
        return bb.emit(relax.op.multiply(relax.const(w, "float32"), bb.emit(relax.op.multiply(x, inv))))

    with bb.function("main", [h0]):
        with bb.dataflow():
            first = bb.emit(relax.op.astype(rmsnorm(h0, w1), "float16"))
            h1 = bb.emit(relax.op.add(h0, bb.emit(relax.op.astype(first, "float32"))))
            out = bb.emit_output(rmsnorm(h1, w2))
        bb.emit_func_output(out)
    return bb.get()


def _rewrite(mod, target):
    t = _Templates(mod, target, None, "mma")
    t.mod["main"] = relax.analysis.remove_all_unused(rewrite_rmsnorms(t, mod["main"]))
    return t


def test_relax_rewrite_plain_then_fused_matches_the_graph():
    rng = np.random.default_rng(11)
    n = 128
    w1, w2 = ((1.0 + 0.2 * rng.standard_normal(n)).astype("float32") for _ in range(2))
    mod = _t5_like(n, w1, w2)
    t = _rewrite(mod, LLVM)
    assert {site["chain"]: site["count"] for site in t.sites.values()} == {"rmsnorm": 1, "residual_rmsnorm": 1}
    ops = {b.value.op.name for block in t.mod["main"].body.blocks for b in block.bindings
           if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)}
    assert not ops & {"relax.mean", "relax.rsqrt", "relax.add"}, ops
    h0 = rng.standard_normal((2, 64, n)).astype("float32")

    def run(module):
        ex = pipeline.build(pipeline.optimize(module, LLVM, None), LLVM)
        return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(h0)).numpy().astype(np.float64)

    first = rmsnorm_np(h0, w1).astype(np.float16).astype(np.float64)     # the graph casts it to float16
    expected = rmsnorm_np(h0 + first, w2)
    assert relative_error(run(mod), expected) < 1e-5                  # the graph itself, float32
    assert relative_error(run(t.mod), expected) < TOL["float16"]


def test_relax_rewrite_leaves_rows_that_do_not_tile():
    n = 96
    mod = _t5_like(n, np.ones(n, "float32"), np.ones(n, "float32"))
    t = _rewrite(mod, LLVM)
    assert not t.sites
    assert tvm_ffi.structural_equal(t.mod["main"], mod["main"])
