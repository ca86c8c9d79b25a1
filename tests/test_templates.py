"""Fusion templates (schedules/templates): registry and knob spaces, CPU (llvm) numerics of every template
against float64 numpy, CUDA code generation compiled to sm_90 cubin with nvcc (tensor-core instructions
present, no spills), and the MetaSchedule design space (sampled knobs flow into the schedule)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import s_tir

from stof_tvm.schedules.templates import CHAINS, H200, TEMPLATES, chain_stages, get_template
from stof_tvm.schedules.templates.build import BUILD_CONFIG, build, cuda_source, cuda_target
from stof_tvm.schedules.templates.deferred import COOP_KEY, ROWS_KEY, STAGES_KEY
from stof_tvm.schedules.templates.gemm import GemmTemplate
from stof_tvm.schedules.templates.registry import Finalize, KeepCandidates

from attention_reference import relative_error
from hopper_checks import sm90_ptxas_report

LLVM = tvm.target.Target({"kind": "llvm"})
TOL = {"float16": 2e-3, "bfloat16": 1.5e-2}

SMALL = {  # small shapes for the llvm checks
    "gemm": {"m": 32, "n": 48, "k": 64},
    "gemm_layernorm": {"m": 16, "n": 128, "k": 32},
    "layernorm": {"m": 8, "n": 128},
    "qkv": {"batch": 2, "seq": 16, "heads": 2, "head_dim": 16},
    "qkv_flat": {"batch": 2, "seq": 13, "heads": 2, "head_dim": 16},     # 26 rows padded to 32; tiles span sequences
}
BERT = {  # BERT-Base layer shapes at 4096 tokens
    "gemm": {"m": 4096, "n": 3072, "k": 768},
    "gemm_layernorm": {"m": 4096, "n": 768, "k": 3072},
    "layernorm": {"m": 4096, "n": 768},
    "qkv": {"batch": 8, "seq": 512, "heads": 12, "head_dim": 64},
}


def np_dtype(dtype: str):
    if dtype == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(dtype)


def random_inputs(template, shape, dtype, rng):
    """Named inputs (as numpy arrays of ``dtype``) for every argument but the output."""
    inputs = {}
    for name, arg_shape, _ in template.arguments(shape, dtype)[:-template.outputs()]:
        scale = 0.2 if name.startswith("W") else 1.0
        inputs[name] = (rng.standard_normal(arg_shape) * scale).astype(np_dtype(dtype))
    return inputs


# ---- registry ---------------------------------------------------------------------------------------------

def test_registry_lists_every_family_and_layout():
    expected = {"gemm", "gemm_bias", "gemm_bias_relu", "gemm_bias_gelu_erf", "gemm_bias_gelu_tanh",
                "gemm_bias_residual_layernorm", "bias_residual_layernorm", "layernorm", "qkv_projection",
                "split_heads"}
    assert expected <= set(TEMPLATES)
    for name in ("gemm", "gemm_bias_gelu_erf", "gemm_bias_residual_layernorm", "qkv_projection"):
        assert f"{name}_kn" in TEMPLATES
    for name, t in TEMPLATES.items():
        assert t.name == name and t.family and t.shape_keys and t.knob_names


@pytest.mark.parametrize("call, error", [
    (lambda: get_template("no_such_template"), ValueError),
    (lambda: get_template("gemm").primfunc({"m": 64, "n": 64}), ValueError),
    (lambda: get_template("gemm").primfunc({"m": 64, "n": 64, "k": 64, "x": 1}), ValueError),
    (lambda: get_template("gemm").primfunc([64, 64, 64]), TypeError),
    (lambda: get_template("gemm").primfunc({"m": 64, "n": -64, "k": 64}), ValueError),
    (lambda: get_template("gemm").primfunc({"m": 64, "n": 64, "k": 64}, "float32"), ValueError),
    (lambda: get_template("gemm").primfunc({"m": 60, "n": 64, "k": 64}), ValueError),
    (lambda: get_template("layernorm").primfunc({"m": 8, "n": 100}), ValueError),
    (lambda: GemmTemplate(bias=True, act="swish"), ValueError),
    (lambda: GemmTemplate(bias=True, act="relu", w_layout="kk"), ValueError),
    (lambda: get_template("gemm").apply(s_tir.Schedule(get_template("gemm").primfunc({"m": 64, "n": 64, "k": 64})),
                                        {"warps_m": 1}), ValueError),
])
def test_bad_inputs_raise_named_errors(call, error):
    with pytest.raises(error):
        call()


@pytest.mark.parametrize("name, family", [("gemm_bias_gelu_erf", "gemm"), ("gemm", "gemm"),
                                          ("gemm_bias_residual_layernorm", "gemm_layernorm"),
                                          ("bias_residual_layernorm", "layernorm"), ("qkv_projection", "qkv"),
                                          ("split_heads", "qkv")])
def test_knob_space_fits_the_h200(name, family):
    t = get_template(name)
    shape = BERT[family]
    space = t.knob_space(shape, "float16")
    assert space, name
    for knobs in space:
        assert set(knobs) == set(t.knob_names)
        res = t.resources(shape, "float16", knobs)
        assert 32 <= res["threads"] <= H200.max_threads_per_block
        assert res["shared_bytes"] <= H200.max_shared_bytes_per_block
        assert res["grid"] >= 1
        if "block_m" in res:
            assert shape.get("m", shape.get("batch", 0) * shape.get("seq", 0)) % res["block_m"] == 0


def test_knob_space_respects_a_smaller_device():
    small = type(H200)(name="small", max_shared_bytes_per_block=49152)
    shape = BERT["gemm"]
    full = get_template("gemm").knob_space(shape)
    limited = get_template("gemm").knob_space(shape, hw=small)
    assert 0 < len(limited) < len(full)
    assert all(get_template("gemm").resources(shape, "float16", k)["shared_bytes"] <= 49152 for k in limited)


def test_chains_cover_fused_and_unfused_forms():
    dims = {"tokens": 4096, "hidden": 768, "ffn": 3072, "heads": 12, "batch": 8, "seq": 512}
    for chain in CHAINS.values():
        forms = [True, False] if chain.has_fused and chain.name != "ffn" else [False]
        for fused in forms:
            for name, shape in chain_stages(chain.name, dims, fused):
                assert get_template(name).knob_space(shape)
    with pytest.raises(ValueError, match="does not fit"):   # the fused FFN holds hidden <= 256 only
        chain_stages("ffn", dims, True)
    with pytest.raises(ValueError):
        chain_stages("qkv", dict(dims, batch=4), False)


@pytest.mark.parametrize("name", ["qkv_projection", "qkv_projection_kn"])
def test_qkv_projection_takes_any_sequence_length(name):
    """Sequences that are not a multiple of 16 (ViT's 197 tokens) take the flat-row definition: x rows padded to
    16, tiles free to span two sequences; multiples of 16 keep the definition whose tiles stay in one sequence."""
    t = get_template(name)
    vit = {"batch": 8, "seq": 197, "heads": 12, "head_dim": 64}
    assert t.flat_rows(vit) and t.rows(vit) == 1584 and t.arguments(vit)[0][1] == (1584, 768)
    assert any(16 * k["warps_m"] * k["frag_m"] > 16 for k in t.knob_space(dict(vit, batch=32)))   # 6304 rows
    bert = BERT["qkv"]
    assert not t.flat_rows(bert) and t.rows(bert) == 4096
    assert all(bert["seq"] % (16 * k["warps_m"] * k["frag_m"]) == 0 for k in t.knob_space(bert))
    with pytest.raises(ValueError, match="multiples of 16"):
        t.primfunc(dict(vit, head_dim=40))


# ---- CPU numerics -----------------------------------------------------------------------------------------

LLVM_CASES = [("gemm", "gemm", "float16"), ("gemm_kn", "gemm", "float16"), ("gemm_bias_gelu_erf", "gemm", "float16"),
              ("gemm_bias_gelu_tanh_kn", "gemm", "bfloat16"), ("gemm_bias_relu", "gemm", "bfloat16"),
              ("gemm_bias_residual_layernorm", "gemm_layernorm", "float16"),
              ("gemm_bias_residual_layernorm_kn", "gemm_layernorm", "bfloat16"),
              ("bias_residual_layernorm", "layernorm", "float16"), ("layernorm", "layernorm", "bfloat16"),
              ("qkv_projection", "qkv", "float16"), ("qkv_projection_kn", "qkv", "bfloat16"),
              ("qkv_projection", "qkv_flat", "float16"), ("qkv_projection_kn", "qkv_flat", "bfloat16"),
              ("split_heads", "qkv", "float16")]


@pytest.mark.parametrize("name, family, dtype", LLVM_CASES)
def test_template_definition_matches_numpy_float64(name, family, dtype):
    """Each template's PrimFunc, built for llvm, against its float64 reference (random inputs, poisoned out; the QKV
    projection's padding rows are random too, and must not reach the output)."""
    t = get_template(name)
    shape = SMALL[family]
    rng = np.random.default_rng(7)
    inputs = random_inputs(t, shape, dtype, rng)
    if name == "split_heads":
        y_shape = t.arguments(shape, dtype)[0][1]
        inputs = {"y": rng.standard_normal(y_shape).astype(np_dtype(dtype))}
    out_name, out_shape, _ = t.arguments(shape, dtype)[-1]
    out = tvm.runtime.tensor(np.full(out_shape, np.nan, dtype=np_dtype(dtype)))
    ex = tvm.compile(t.primfunc(shape, dtype), target=LLVM)
    ex["main"](*[tvm.runtime.tensor(inputs[n]) for n, _, _ in t.arguments(shape, dtype)[:-1]], out)
    got = out.numpy().astype(np.float64)
    assert np.isfinite(got).all(), f"{name}: unwritten outputs"
    (ref,) = t.reference(shape, inputs)
    assert got.shape == ref.shape
    assert relative_error(got, ref) < TOL[dtype], f"{name} {dtype}: rel err {relative_error(got, ref):.2e}"


# ---- CUDA code generation ---------------------------------------------------------------------------------

CUDA_CASES = [("gemm_bias_gelu_erf", {"m": 256, "n": 256, "k": 128}, "float16", True),
              ("gemm_bias_relu_kn", {"m": 128, "n": 768, "k": 256}, "bfloat16", True),
              ("gemm_bias_residual_layernorm", {"m": 64, "n": 768, "k": 256}, "float16", True),
              ("qkv_projection", {"batch": 2, "seq": 128, "heads": 4, "head_dim": 64}, "float16", True),
              ("qkv_projection_kn", {"batch": 8, "seq": 197, "heads": 12, "head_dim": 64}, "float16", True),  # ViT
              ("bias_residual_layernorm", {"m": 256, "n": 768}, "bfloat16", False),
              ("split_heads", {"batch": 2, "seq": 64, "heads": 4, "head_dim": 64}, "float16", False)]


@pytest.mark.parametrize("name, shape, dtype, tensor_cores", CUDA_CASES)
def test_cuda_codegen_compiles_to_sm90_without_spills(name, shape, dtype, tensor_cores, tmp_path):
    t = get_template(name)
    sch = t.schedule(shape, dtype)
    script = sch.mod.script()
    assert not any(key in script for key in (COOP_KEY, ROWS_KEY, STAGES_KEY)), "deferred steps left undone"
    ex = build(sch, cuda_target())
    src = cuda_source(ex)
    if tensor_cores:
        ptx_type = {"float16": "f16", "bfloat16": "bf16"}[dtype]
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32" in src
        assert "ldmatrix.sync.aligned" in src
        assert "cp.async.cg.shared.global" in src and "cp.async.wait_group" in src
    report = sm90_ptxas_report(src, tmp_path)
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), report
    assert re.search(r"\b0 bytes stack frame", report), report


def test_shared_memory_estimate_bounds_the_lowered_kernel():
    """resources()['shared_bytes'] (the tuner's prefilter input) >= what TVM actually allocates."""
    t = get_template("gemm_bias")
    shape = {"m": 512, "n": 512, "k": 256}
    knobs = t.knob_space(shape)[0]
    seen = []

    @tvm.instrument.pass_instrument
    class Dyn:
        def run_after_pass(self, mod, info):
            if info.name == "tirx.LowerWarpMemory":
                for _, f in mod.functions_items():
                    seen.extend(int(m) for m in re.findall(r'alloc_buffer\(\((\d+),\), "uint8", scope="shared.dyn"',
                                                           f.script()))

    with tvm.transform.PassContext(opt_level=3, config=BUILD_CONFIG, instruments=[Dyn()]):
        tvm.compile(t.schedule(shape, "float16", knobs).mod, target=cuda_target())
    assert seen and max(seen) <= t.resources(shape, "float16", knobs)["shared_bytes"]


# ---- MetaSchedule design space ----------------------------------------------------------------------------

def _replay(template, sch, decisions):
    """Replay ``sch``'s trace on a fresh schedule with new categorical decisions, then the postprocessors."""
    trace = sch.trace
    for inst, value in zip([i for i in trace.insts if i.kind.name == "SampleCategorical"], decisions):
        trace = trace.with_decision(inst, value, remove_postproc=True)
    fresh = s_tir.Schedule(template_func(template, sch))
    trace.apply_to_schedule(fresh, remove_postproc=True)
    return fresh


def template_func(template, sch):
    spec = template.spec_of(sch)
    return template.primfunc(spec["shape"], spec["dtype"])


def test_sampled_knobs_flow_into_the_schedule():
    """Changing a sample_categorical decision in the trace changes the tiles (MetaSchedule's replay/mutation)."""
    t = get_template("gemm_bias")
    shape = {"m": 256, "n": 256, "k": 128}
    candidates = [k for k in t.knob_space(shape) if k["stages"] == 3 and k["vec"] == 8][:6]
    sch = s_tir.Schedule(t.primfunc(shape))
    t.sample(sch, candidates)
    grids = set()
    for target_knobs in candidates[:3]:
        values = t._values(t.spec_of(sch), candidates)
        decisions = [values[k].index(target_knobs[k]) for k in t.knob_names if len(values[k]) > 1]
        replayed = _replay(t, sch, decisions)
        assert t.decode(replayed, candidates) == target_knobs
        keep = KeepCandidates(t.name, t.spec_of(sch), candidates)
        assert keep.apply(replayed)
        assert Finalize().apply(replayed)
        bx = [l for l in replayed.mod.script().splitlines() if '"blockIdx.x"' in l][0]
        grids.add(int(re.search(r"thread_binding\((\d+)", bx).group(1)))
        assert int(re.search(r"thread_binding\((\d+)", bx).group(1)) == t.resources(shape, "float16",
                                                                                   target_knobs)["grid"]
    assert len(grids) > 1


def test_keep_candidates_drops_other_combinations():
    t = get_template("gemm")
    shape = {"m": 256, "n": 256, "k": 128}
    space = t.knob_space(shape)
    keep_two = [space[0], space[-1]]
    sch = s_tir.Schedule(t.primfunc(shape))
    t.sample(sch, keep_two)
    values = t._values(t.spec_of(sch), keep_two)
    mixed = {k: values[k][0] for k in t.knob_names}  # first value of every knob: usually not a candidate
    decisions = [0 for k in t.knob_names if len(values[k]) > 1]
    replayed = _replay(t, sch, decisions)
    expect = any(all(c[k] == mixed[k] for k in t.knob_names) for c in keep_two)
    assert KeepCandidates(t.name, t.spec_of(sch), keep_two).apply(replayed) == expect


def test_design_space_candidates_build_for_cuda():
    """MetaSchedule generates, postprocesses and builds (no GPU run) candidates of a template's space."""
    import logging

    from tvm.s_tir import meta_schedule as ms

    from stof_tvm.schedules.templates.build import ms_builder

    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    t = get_template("gemm_bias_gelu_tanh")
    shape = {"m": 256, "n": 256, "k": 128}
    candidates = t.knob_space(shape)[:4]
    target = cuda_target()
    func = t.primfunc(shape).with_attr("global_symbol", "main")
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target,
                         space_generator=t.space_generator(shape, "float16", candidates),
                         search_strategy="replay-trace", num_threads=1)
    spaces = ctx.generate_design_space()
    assert len(spaces) == 1
    ctx.pre_tuning(max_trials=4, num_trials_per_iter=4, design_spaces=spaces)
    measured = ctx.search_strategy.generate_measure_candidates()
    assert measured, "no candidate survived the postprocessors"
    for cand in measured:
        assert t.decode(cand.sch, candidates) in candidates
    results = ms_builder(timeout_sec=300, max_workers=1).build(
        [ms.builder.BuilderInput(c.sch.mod, target) for c in measured[:2]])
    assert all(r.error_msg is None for r in results), [r.error_msg for r in results]
