"""Which float32 score biases may reach the sparse kernel in 16 bits (stof_tvm.compiler.bias_precision), and the
compile path's use of it on HF DeBERTa-v3, whose relative-position bias is made of float16 products."""
import numpy as np
import pytest
from tvm import relax

from stof_tvm.compiler.bias_precision import narrows_exactly_enough

S = 16


def _bias_of(build) -> tuple[relax.Expr, dict]:
    """The last binding of a one-block function built by ``build(bb, x16, w32)`` (x16 a float16 [S, S] input, w32 a
    float32 [S, S] weight), with the function's bindings."""
    bb = relax.BlockBuilder()
    x16 = relax.Var("x16", relax.TensorType((S, S), "float16"))
    w32 = relax.Var("w32", relax.TensorType((S, S), "float32"))
    with bb.function("main", [x16, w32]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, x16, w32))
        bb.emit_func_output(out)
    func = bb.get()["main"]
    return func.body.blocks[0].bindings[-1].var, relax.analysis.get_var2val(func)


def _wide(bb, x):
    return bb.emit(relax.op.astype(x, "float32"))


TABLE = relax.const(np.arange(S, dtype="int32")[::-1].copy())

CASES = {
    # DeBERTa's form: gathers of float16 products cast up, divided by the scale, summed
    "relative terms": (lambda bb, x, w: bb.emit(relax.op.add(
        bb.emit(relax.op.divide(bb.emit(relax.op.take(_wide(bb, x), TABLE, axis=1)), relax.const(13.9, "float32"))),
        bb.emit(relax.op.permute_dims(bb.emit(relax.op.divide(_wide(bb, x), relax.const(13.9, "float32"))))))),
        True),
    "product of float16 operands": (lambda bb, x, w: bb.emit(relax.op.matmul(
        _wide(bb, x), bb.emit(relax.op.permute_dims(_wide(bb, x))), out_dtype="float32")), True),
    "scaled down": (lambda bb, x, w: bb.emit(relax.op.multiply(relax.const(0.5, "float32"), _wide(bb, x))), True),
    "plus a scalar": (lambda bb, x, w: bb.emit(relax.op.add(_wide(bb, x), relax.const(1.0, "float32"))), True),
    "a float32 weight": (lambda bb, x, w: bb.emit(relax.op.add(_wide(bb, x), w)), False),
    "scaled up": (lambda bb, x, w: bb.emit(relax.op.multiply(_wide(bb, x), relax.const(4.0, "float32"))), False),
    "divided by a small scalar": (lambda bb, x, w: bb.emit(relax.op.divide(_wide(bb, x), relax.const(0.5, "float32"))),
                                  False),
    "a product of two tensors": (lambda bb, x, w: bb.emit(relax.op.multiply(_wide(bb, x), _wide(bb, x))), False),
    "an exponential": (lambda bb, x, w: bb.emit(relax.op.exp(_wide(bb, x))), False),
    "a float32 constant tensor": (lambda bb, x, w: bb.emit(relax.op.add(
        _wide(bb, x), relax.const(np.full((S, S), 3.0, "float32")))), False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_which_biases_narrow(name):
    build, narrows = CASES[name]
    bias, var2val = _bias_of(build)
    assert narrows_exactly_enough(bias, var2val) is narrows


def test_deberta_bias_reaches_the_kernel_in_float16(hf_export, deberta_on_llvm):
    """HF DeBERTa-v3's c2p + p2c bias (float32 in the graph, made of float16 products) is passed to the block-wise
    kernel in float16 by default and in float32 with ``narrow_bias=False``; on llvm both compiles match torch."""
    from stof_tvm.compiler import front_end

    batch, seq = 2, 64
    path = hf_export("deberta", "eager", "torchscript", 17, False, batch, seq)
    dtypes = {narrow: front_end(path, mask="bigbird", batch=batch, seq_len=seq, target="cuda", dtype="float16",
                                kernel="block", schedule=False, narrow_bias=narrow).choice.bias[2]
              for narrow in (True, False)}
    assert dtypes == {True: "float16", False: "float32"}
    outputs = {}
    for narrow in (True, False):
        outputs[narrow], kept, art = deberta_on_llvm(batch, seq, narrow_bias=narrow)
        assert art.manifest["attention"]["kernel"]["bias"][2] == dtypes[narrow]
    assert np.isfinite(outputs[True]).all()
    difference = np.linalg.norm(outputs[True][kept] - outputs[False][kept]) / np.linalg.norm(outputs[False][kept])
    assert 0 < difference < 2e-3, difference


def test_modernbert_site_masks_stay_float32(hf_export):
    """ModernBERT's sliding-window layers add their stricter mask as a bias of float32 fills, which is not made of
    16-bit values: it stays float32."""
    from stof_tvm.compiler import front_end

    path = hf_export("modernbert", "eager", "torchscript", 17, False, 2, 64)
    front = front_end(path, mask="bigbird", batch=2, seq_len=64, target="cuda", dtype="float16", kernel="block",
                      schedule=False)
    assert front.choice.bias[2] == "float32"
