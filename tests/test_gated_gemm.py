"""The gated linear unit template (schedules/templates/gated_gemm.py): silu(A Wg^T) * (A Wu^T) from one GEMM on the
interleaved weight. Its definition against numpy on llvm, its knob space (direct stores only), and its wgmma kernel
through nvcc and ptxas (no spill, no stack, HGMMA, one 2-byte store per output)."""
import numpy as np
import pytest
import tvm

from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gated_gemm import interleaved_rows, silu_mul_np
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel
from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig, wgmma_gemm_primfunc

from hopper_checks import sm90a_sass

NAME = "gemm_silu_mul_wgmma"


def test_interleaved_rows_alternate_gate_and_up():
    gate, up = np.arange(6.0).reshape(3, 2), -np.arange(6.0).reshape(3, 2)
    w = interleaved_rows(gate, up)
    np.testing.assert_array_equal(w[0::2], gate)
    np.testing.assert_array_equal(w[1::2], up)
    with pytest.raises(ValueError, match="alike"):
        interleaved_rows(gate, up[:2])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_definition_on_llvm_matches_silu_of_gate_times_up(dtype):
    """The TensorIR definition on the interleaved weight equals silu(A Wg^T) * (A Wu^T) computed apart, and the
    template's reference agrees with it."""
    import ml_dtypes

    template = get_template(NAME)
    shape = {"m": 64, "n": 64, "k": 64}
    rng = np.random.default_rng(3)
    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    a = rng.standard_normal((64, 64)).astype(np_dtype)
    gate = (rng.standard_normal((64, 64)) * 0.3).astype(np_dtype)
    up = (rng.standard_normal((64, 64)) * 0.3).astype(np_dtype)
    w = interleaved_rows(gate, up)
    lib = tvm.compile(template.primfunc(shape, dtype), target="llvm")
    out = tvm.runtime.tensor(np.zeros((64, 64), np_dtype))
    lib(tvm.runtime.tensor(a), tvm.runtime.tensor(w), out)
    a64 = a.astype(np.float64)
    expected = silu_mul_np(a64 @ gate.astype(np.float64).T, a64 @ up.astype(np.float64).T)
    got = out.numpy().astype(np.float64)
    tolerance = 2e-3 if dtype == "float16" else 1.6e-2
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < tolerance
    np.testing.assert_allclose(template.reference(shape, {"A": a, "W": w})[0], expected, rtol=1e-12)
    assert template.flops(shape) == 2 * 64 * 128 * 64


def test_knob_space_stores_from_the_accumulators():
    """No staged sets and no split-K (the gated epilogue stores each pair's product from the accumulators); the
    GEMM it tiles is 2n wide (SmolLM2-360M's gate and up: 5120 columns for 2560 outputs)."""
    template = get_template(NAME)
    shape = {"m": 8192, "n": 2560, "k": 960}
    space = template.knob_space(shape, "float16")
    assert space and all(not kn.get("staged") and kn.get("split_k", 1) == 1 for kn in space)
    assert all(5120 % kn["block_n"] == 0 for kn in space)
    assert template.gemm_dims(shape) == (8192, 5120, 960)


@pytest.mark.parametrize("knobs", [{"block_n": 128, "stages": 3, "staged": True},
                                   {"block_n": 128, "stages": 3, "persistent": False, "split_k": 2}])
def test_gated_epilogue_refuses_the_staged_and_split_forms(knobs):
    config = WgmmaConfig(**{"persistent": False, **knobs})
    with pytest.raises(ValueError, match="silu_mul"):
        wgmma_gemm_primfunc(128, 256, 256, "float16", bias=False, act="silu_mul", config=config)


@pytest.mark.parametrize("knobs", [None, {"block_n": 128, "stages": 4, "persistent": True, "pingpong": True}])
def test_kernel_compiles_for_sm90a_without_spills(knobs, tmp_path):
    """The default set and a ping-pong one: ptxas reports no spill, no stack frame, no warning (C7514: wgmma
    serialised; C7508: setmaxnreg ignored); one 2-byte store per output (the pair's product), no 16-byte staged
    stores; where a disassembler is found, HGMMA in the SASS and no local-memory traffic."""
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    shape = {"m": 4096, "n": 1280, "k": 960}
    src = cuda_source(build_kernel(NAME, shape, "float16", knobs))
    assert "expf(" in src and "st.global.v4.b32" not in src
    sass = sm90a_sass(src, tmp_path, any_warning=True)
    if sass is not None:
        assert "HGMMA" in sass and "STG.E.U16" in sass and " STL" not in sass


@pytest.mark.parametrize("silu_form, constants", [("sigmoid", False), ("silu", False), ("sigmoid", True)])
def test_the_rewrite_computes_the_graphs_gated_unit(silu_form, constants, monkeypatch):
    """A gated MLP's ``sigmoid(g) * g * u`` (HF's export) or ``silu(g) * u`` on weight parameters (real-size
    models) or constants (tiny ones, folded here), rewritten under
    ``gated_epilogue`` into one template call on the interleaved weight (built for llvm through the template's
    definition: the rewrite and the weights' interleaving, not the CUDA kernel), equals the graph's own result; the
    gate, up, sigmoid and SiLU bindings are gone."""
    from tvm import relax

    from stof_tvm.compiler import linear_match
    from stof_tvm.compiler.downstream import use_templates
    from stof_tvm.schedules.templates import cuda_target

    monkeypatch.setattr(linear_match, "WGMMA_MIN_TILES", 1)   # a small GEMM still takes wgmma and the template
    batch, seq, k, n = 2, 64, 128, 128
    rng = np.random.default_rng(7)
    values = [rng.standard_normal((batch, seq, k)).astype(np.float16)]
    values += [(rng.standard_normal((k, n)) * 0.2).astype(np.float16) for _ in range(2)]
    x = relax.Var("x", relax.TensorType([batch, seq, k], "float16"))
    if constants:
        w_gate, w_up = (relax.const(v, "float16") for v in values[1:])
        params, args = [x], values[:1]
    else:
        w_gate, w_up = (relax.Var(name, relax.TensorType([k, n], "float16")) for name in ("w_gate", "w_up"))
        params, args = [x, w_gate, w_up], values
    bb = relax.BlockBuilder()
    with bb.function("main", params, attrs={"num_input": 1}):
        with bb.dataflow():
            gate, up = (bb.emit(relax.op.astype(relax.op.matmul(x, w, out_dtype="float32"), "float16"))
                        for w in (w_gate, w_up))
            if silu_form == "sigmoid":
                silu = bb.emit(relax.op.multiply(gate, bb.emit(relax.op.sigmoid(gate))))
            else:
                silu = bb.emit(relax.op.nn.silu(gate))
            out = bb.emit_output(relax.op.multiply(silu, up))
        bb.emit_func_output(out)
    graph = bb.get()
    rewritten, entry = use_templates(graph, cuda_target("sm_90a"), gemm="wgmma", schedule=False,
                                     gated_epilogue=True)
    assert entry["calls"] == {"gemm_silu_mul_wgmma": 1}
    ops = []
    relax.analysis.post_order_visit(rewritten["main"], lambda e: ops.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    assert not {"relax.sigmoid", "relax.nn.silu", "relax.multiply", "relax.matmul"} & set(ops)
    results = []
    for mod in (graph, rewritten):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        results.append(vm["main"](*[tvm.runtime.tensor(v) for v in args]).numpy().astype(np.float64))
    a = values[0].astype(np.float64)
    expected = silu_mul_np(a @ values[1].astype(np.float64), a @ values[2].astype(np.float64))
    for got in results:
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 2e-3
    assert np.abs(results[1] - results[0]).max() <= 0.02 * np.abs(expected).max()


def test_tuning_plans_the_gated_gemm_when_the_compile_takes_it(llama_export, monkeypatch):
    """``gated_epilogue`` reaches stage 1 too: a plan for a Llama export (real-size weights: parameters) has a task
    for the gated template and none for a GEMM of the two weights concatenated, as the compile makes the calls."""
    from stof_tvm.compiler import linear_match
    from stof_tvm.tuning import plan

    monkeypatch.setattr(linear_match, "WGMMA_MIN_TILES", 1)
    _, path = llama_export(256, 4, 2, 2, 64)

    def calls(gated):
        stage1 = plan(str(path), mask="bigbird", batch=2, seq_len=64, target="cuda", gemm="wgmma",
                      gated_epilogue=gated)
        return [(task.meta["template"], task.meta["shape"]) for task in stage1.tasks if "template" in task.meta]

    gate_and_up = ("gemm_wgmma", {"m": 128, "n": 1024, "k": 256})
    gated, plain = calls(True), calls(False)
    assert ("gemm_silu_mul_wgmma", {"m": 128, "n": 512, "k": 256}) in gated and gate_and_up not in gated
    assert gate_and_up in plain and not any(name == "gemm_silu_mul_wgmma" for name, _ in plain)
