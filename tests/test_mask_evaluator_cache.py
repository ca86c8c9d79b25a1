"""The CPU evaluator of a mask term (:func:`stof_tvm.compiler.mask_sources._cpu_evaluator`) is built once per
structurally equal function: a second compile of the same model reuses it (each build is ~0.3 s of LLVM)."""
from __future__ import annotations

import numpy as np
from tvm import relax

from stof_tvm.compiler import mask_sources


def _term(offset: float) -> relax.Function:
    """A fresh ``(1 - m) * offset`` function over a [2, 4] int64 input (new variables every call)."""
    m = relax.Var("m", relax.TensorType((2, 4), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("term", [m]):
        keep = bb.emit(relax.op.astype(m, "float32"))
        out = bb.emit(relax.op.multiply(relax.op.subtract(relax.const(1.0, "float32"), keep),
                                        relax.const(offset, "float32")))
        bb.emit_func_output(out)
    return bb.get()["term"]


def test_structurally_equal_terms_share_one_build_and_others_do_not():
    first = mask_sources._cpu_evaluator(_term(-1e4))
    assert mask_sources._cpu_evaluator(_term(-1e4)) is first
    other = mask_sources._cpu_evaluator(_term(-5.0))
    assert other is not first
    probe = np.array([[1, 1, 0, 0], [1, 0, 1, 0]])
    np.testing.assert_array_equal(first(probe), (1 - probe) * np.float32(-1e4))
    np.testing.assert_array_equal(other(probe), (1 - probe) * np.float32(-5.0))
