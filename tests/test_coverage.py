"""The coverage report (stof_tvm/compiler/coverage.py): per operator kind, how many run on stof-tvm's kernels and
templates and why the others fell back; kept in the manifest."""
import numpy as np
import pytest
from tvm import relax

from stof_tvm.compiler import front_end
from stof_tvm.compiler.coverage import census, coverage, coverage_lines
from stof_tvm.models import builtin_model

F16 = "float16"


def _linears(n_out: int) -> relax.Function:
    """x @ W1 -> GELU -> @ W2 (W2 [64, n_out]) -> LayerNorm over n_out: the chains a template may or may not take."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([32, 64], F16))
    rng = np.random.default_rng(0)
    with bb.function("main", [x], {"num_input": 1}):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.gelu(relax.op.matmul(x, relax.const(rng.standard_normal((64, 64)).astype(F16)))))
            y = bb.emit(relax.op.matmul(h, relax.const(rng.standard_normal((64, n_out)).astype(F16))))
            out = bb.emit_output(relax.op.nn.layer_norm(y, relax.const(np.ones(n_out, F16)),
                                                        relax.const(np.zeros(n_out, F16)), axes=[-1]))
        bb.emit_func_output(out)
    return bb.get()["main"]


def test_census_counts_each_kind():
    found = census(_linears(24))
    assert {kind: len(values) for kind, values in found.items() if values} == {"linear": 2, "layernorm": 1,
                                                                               "gelu": 1}


def test_what_is_left_falls_back_with_its_reason():
    """Nothing rewritten (final == canonical) with the templates on: each leftover says why a template did not
    take it: N = 24 is no multiple of 16, a LayerNorm row of 24 no multiple of 64."""
    func = _linears(24)
    entry = coverage(func, func, attention_kernel=None, attention_sites=0, attention_reason=None, templates=None)
    assert entry["linear"]["total"] == 2 and entry["linear"]["accelerated"] == 0
    reasons = {f["reason"]: f["count"] for f in entry["linear"]["fallback"]}
    assert reasons == {"K=64, N=24: the templates need multiples of 16": 1, "no template chain matched its form": 1}
    assert entry["layernorm"]["fallback"] == [{"reason": "rows of 24: the LayerNorm templates need multiples of 64",
                                               "count": 1}]
    lines = coverage_lines(entry)
    assert lines[0] == "coverage (on stof-tvm kernels / templates): linear 0/2, layernorm 0/1, gelu 0/1"
    assert "  linear: 1 fell back: K=64, N=24: the templates need multiples of 16" in lines


def test_templates_off_is_the_reason_for_every_chain():
    func = _linears(64)
    entry = coverage(func, func, attention_kernel=None, attention_sites=0, attention_reason=None,
                     templates="fusion templates off: target llvm (they are CUDA kernels)")
    assert all(f["reason"].startswith("fusion templates off") for kind in ("linear", "layernorm", "gelu")
               for f in entry[kind]["fallback"])


@pytest.mark.parametrize("target, dtype, on_templates", [("cuda", "float16", True), ("llvm", "float32", False)])
def test_front_end_reports_the_builtin_bert(target, dtype, on_templates):
    """The built-in tiny BERT: for CUDA float16 everything on kernels and templates; on llvm float32 the attention
    on the sparse kernel, every chain falling back (templates are CUDA float16 only)."""
    front = front_end(builtin_model("tiny-bert"), mask="bigbird", batch=2, seq_len=128, target=target, dtype=dtype,
                      schedule=False)
    cov = front.coverage
    layers = cov["attention"]["total"]
    assert layers == 2 and cov["attention"]["accelerated"] == layers and cov["attention"]["kernel"] != "dense"
    assert cov["linear"]["total"] == 6 * layers and cov["layernorm"]["total"] == 2 * layers + 1
    for kind in ("qkv", "linear", "layernorm", "gelu"):
        assert (cov[kind]["accelerated"] == cov[kind]["total"]) == on_templates, (kind, cov[kind])
        assert bool(cov[kind]["fallback"]) != on_templates


def test_dense_kernel_is_a_fallback_with_its_reason():
    front = front_end(builtin_model("tiny-bert"), mask="bigbird", batch=2, seq_len=128, target="llvm",
                      dtype="float32", kernel="dense")
    att = front.coverage["attention"]
    assert att["accelerated"] == 0 and att["kernel"] == "dense"
    assert att["fallback"][0]["count"] == 2 and att["fallback"][0]["reason"].startswith("dense kernel")
