"""The model's last LayerNorm writes its float32 output itself (``bias_residual_layernorm_to_float32``), so no cast
kernel follows it: the template's definition against the float64 reference on llvm, its CUDA schedule, where the
compile path takes it (an output that nothing else reads), and the whole model against onnx's reference evaluator."""
from __future__ import annotations

import numpy as np
import pytest
import tvm

import stof_tvm
import stof_tvm.compiler
from stof_tvm.models import BertConfig, make_bert
from stof_tvm.models.reference import random_inputs, reference_outputs
from stof_tvm.schedules.templates import cuda_source, cuda_target, get_template
from stof_tvm.schedules.templates.build import build as build_template
from stof_tvm.sparse_formats.masks import make_mask

from attention_reference import relative_error

NAME = "bias_residual_layernorm_to_float32"


def test_definition_writes_float32_and_matches_the_reference():
    t = get_template(NAME)
    shape = {"m": 64, "n": 256}
    args = t.arguments(shape)
    assert args[-1] == ("out", (64, 256), "float32") and all(dt == "float16" for _, _, dt in args[:-1])
    rng = np.random.default_rng(7)
    inputs = {name: rng.standard_normal(s).astype(dt) for name, s, dt in args[:-1]}
    lib = tvm.compile(tvm.IRModule({"main": t.primfunc(shape, "float16", eps=1e-12)}), target="llvm")
    out = tvm.runtime.tensor(np.zeros((64, 256), "float32"))
    lib["main"](*[tvm.runtime.tensor(inputs[name]) for name, _, _ in args[:-1]], out)
    ref = t.reference(shape, inputs)[0]
    # no 16-bit rounding of the output: within float32 arithmetic of the float64 reference
    assert np.abs(out.numpy() - ref).max() < 1e-4 * np.abs(ref).max()


def test_cuda_schedule_stores_float32_rows():
    """The scheduled kernel (first knob set) builds for CUDA and stores the output 32 bytes (8 floats) at a time."""
    t = get_template(NAME)
    shape = {"m": 128, "n": 768}
    src = cuda_source(build_template(t.schedule(shape, "float16", t.knob_space(shape)[0]), cuda_target()))
    assert "float* __restrict__ out" in src and "ulonglong4" in src


def _calls(model, **options):
    front = stof_tvm.compiler.front_end(model, mask="bigbird", batch=1, seq_len=128, target="cuda", dtype="float16",
                                        gemm="wgmma", schedule=False, **options)
    return front.template_entry["calls"], front.mod["main"]


def test_the_last_layernorm_of_a_float32_output_writes_it():
    """BERT (2 layers, output float32): the last FFN-down LayerNorm is the float32 form and no cast follows it; the
    others stay 16-bit."""
    model = make_bert(BertConfig(hidden=256, layers=2, heads=4, ffn=1024, vocab=500), batch=1, seq_len=128)
    calls, main = _calls(model)
    assert calls[NAME] == 1 and calls["bias_residual_layernorm"] == 3, calls
    # the output variable is the reshaped template output itself, not a cast of it
    output = main.body.body.fields[0] if isinstance(main.body.body, tvm.relax.Tuple) else main.body.body
    bound = {b.var: b.value for block in main.body.blocks for b in block.bindings}
    assert bound[output].op.name == "relax.reshape", bound[output]
    assert "to_float32" in bound[bound[output].args[0]].args[0].name_hint


def test_only_an_output_nothing_else_reads_is_widened():
    """``_model_output``: a variable that leaves the dataflow block and that no binding reads (``c``); not one another
    output reads (``b``, e.g. a last hidden state the pooler also reads), nor a dataflow variable (``a``)."""
    from tvm import relax

    from stof_tvm.compiler.downstream import _model_output
    from stof_tvm.compiler.linear_match import users_of

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.add(x, x))
            b = bb.emit_output(relax.op.multiply(a, a))
            c = bb.emit_output(relax.op.add(b, b))
        bb.emit_func_output(relax.Tuple([b, c]))
    func = bb.get()["main"]
    var2val, users = relax.analysis.get_var2val(func), users_of(func)
    by_name = {var.name: value for var, value in var2val.items()}
    assert [_model_output(by_name[name], var2val, users) for name in (a.name, b.name, c.name)] == [
        False, False, True]


@pytest.mark.parametrize("batch", [1, 2])
def test_whole_model_matches_the_reference(batch):
    """Compiled on llvm with templates, the float32-output LayerNorm included, against onnx's reference."""
    model = make_bert(BertConfig(hidden=128, layers=2, heads=2, ffn=512, vocab=300), batch=batch, seq_len=64)
    art = stof_tvm.compile(model, mask="bigbird", batch=batch, seq_len=64, target="llvm", dtype="float16",
                           templates=True)
    assert art.manifest["templates"]["calls"][NAME] == 1
    data = random_inputs(model, {"input_ids": (batch, 64), "attention_mask": (batch, 64)}, seed=3)
    out = art.load()(data)["last_hidden_state"]
    assert out.dtype == np.float32
    ref = reference_outputs(model, make_mask("bigbird", 64)[None, None], data)["last_hidden_state"]
    assert relative_error(out, ref) < 2e-2
