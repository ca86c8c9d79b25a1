"""The exp2-polynomial GELU of the wgmma epilogue (schedules/templates/fast_gelu.py) against the float64 GELU: the
TIR expressions compiled for llvm in float32 and run on every finite float16 input and a fine float32 grid."""
from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from stof_tvm.schedules.templates.epilogue import activation_np
from stof_tvm.schedules.templates.fast_gelu import TAIL_POLYNOMIALS, check_fast_gelu, gelu_from_tail, tail_exponent

# relative error bound where |GELU| > 1e-4 (float16 rounds at 2.4e-4 relative)
RELATIVE = {"gelu_erf": 1e-5, "gelu_tanh": 3e-5}


def _fast_gelu_llvm(act: str, x: np.ndarray) -> np.ndarray:
    n = x.size
    inp = te.placeholder((n,), "float32", name="x")

    def element(i):
        t = tirx.abs(inp[i])
        return gelu_from_tail(inp[i], t, tirx.exp2(tail_exponent(act, t)))

    out = te.compute((n,), element, name="out")
    lib = tvm.compile(te.create_prim_func([inp, out]), target="llvm")
    dev = tvm.cpu()
    res = tvm.runtime.empty((n,), "float32", dev)
    lib(tvm.runtime.tensor(x.astype(np.float32), dev), res)
    return res.numpy()


def _inputs() -> np.ndarray:
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)].astype(np.float32)
    grid = np.linspace(-12.0, 12.0, 480001, dtype=np.float32)
    return np.concatenate([halves, grid])


@pytest.mark.parametrize("act", ["gelu_erf", "gelu_tanh"])
def test_fast_gelu_matches_float64_gelu_below_float16_rounding(act):
    x = _inputs()
    got = _fast_gelu_llvm(act, x).astype(np.float64)
    ref = activation_np(act, x)
    assert np.isfinite(got).all()
    err = np.abs(got - ref)
    big = np.abs(ref) > 1e-4
    assert (err[big] / np.abs(ref[big])).max() <= RELATIVE[act]
    # everywhere (tiny outputs, the far tails up to +-65504): within t * 2**q(T) of the truth, q(T) the tail
    # exponent at the fit's end (about 1e-9), plus float32 rounding
    fit_end, _ = TAIL_POLYNOMIALS[act]
    floor = 2.0 ** float(np.polyval(TAIL_POLYNOMIALS[act][1], fit_end))
    assert floor < 2e-9
    assert (err <= RELATIVE[act] * np.abs(ref) + 1.01 * floor * np.abs(x) + 1e-12).all()
    # rounded to float16 (|x| < 8: outputs above the subnormals): the correctly rounded value or its neighbour, the
    # neighbour only near a rounding midpoint (erf 0.1%, tanh 0.5% of these inputs)
    near = np.abs(x) < 8
    ulps = np.abs(_ordered(got[near].astype(np.float16)) - _ordered(ref[near].astype(np.float16)))
    assert ulps.max() <= 1 and ulps.mean() < {"gelu_erf": 3e-3, "gelu_tanh": 1e-2}[act], ulps.mean()


def _ordered(h: np.ndarray) -> np.ndarray:
    """float16 values as integers in value order (neighbours differ by 1; -0 and +0 both 0)."""
    bits = h.view(np.int16).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFF), bits)


def test_tail_polynomials_decrease_past_their_fit_so_no_clamp_is_needed():
    for act, (fit_end, coefficients) in TAIL_POLYNOMIALS.items():
        t = np.concatenate([np.linspace(fit_end, 100.0, 20001), np.geomspace(100.0, 1e7, 2001)])
        q = np.polyval(np.asarray(coefficients, np.float64), t)
        assert (np.diff(q) <= 0).all(), act
        assert q[0] < -29 and math.isclose(coefficients[-1], -1.0, abs_tol=1e-4)   # Phi(0) = 1/2


def test_nan_propagates_and_zero_stays_zero():
    got = _fast_gelu_llvm("gelu_erf", np.array([np.nan, 0.0, -0.0], np.float32))
    assert np.isnan(got[0]) and got[1] == 0.0 and got[2] == 0.0


def test_only_gelu_activations_have_a_fast_form():
    for act in ("none", "relu", "gelu"):
        with pytest.raises(ValueError, match="fast_gelu applies to"):
            check_fast_gelu(act)
