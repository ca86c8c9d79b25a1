"""GELU (erf or tanh form) from one ``exp2`` of a fitted polynomial: the wgmma kernels' cheap epilogue.

``GELU(y) = y * Phi(y)`` and, with ``t = |y|`` and ``P(t) = Phi(-t)`` (the lower tail, in (0, 1/2]),

    GELU(y) = max(y, 0) - t * P(t)

holds for both signs (y >= 0: ``y - y Phi(-y) = y Phi(y)``; y < 0: ``-|y| Phi(y) = y Phi(y)``). ``P`` is computed as
``2 ** q(t)`` with ``q`` a polynomial fitted to ``log2 P`` on [0, T]: per element one MUFU.EX2, ``degree`` FMAs, a
max and a final FMA, against ~40 instructions for CUDA's ``erff`` (two branches, both run in a warp) and the GELU
around it, which left the tensor cores idle through most of a K = 768 GEMM's epilogue (BENCHMARKS.md, session 4).

Why ``log2 P`` and not ``erf``: ``log2 P`` is smooth and slowly varying (-1 at 0, about -0.72 t^2 far out), so a
low-degree polynomial holds it to a *relative* accuracy of ``P`` (``ln 2 * |dq|``) on the whole range, which is the
relative accuracy of the output on both sides: the negative tail, where GELU is tiny, keeps its digits (a
``1 - erf`` form would cancel them).

Coefficients (float32, highest degree first) are a near-minimax fit (Lawson's iteratively reweighted least squares
on 6000 Chebyshev points) of the float64 ``log2 P``; they were chosen so that the polynomial keeps decreasing beyond
T (checked up to 1e7), so ``t`` needs no clamp: past T, ``P`` stays below ``2 ** q(T)`` (about 1e-9 for both forms)
and the output is within ``t * 2 ** q(T)`` of the true one (a millionth of one float16 ulp of ``y``), and a NaN
propagates. Evaluated in float32, the output is within 1e-5 (erf) and 3e-5 (tanh) relative of the float64 GELU
wherever it is above 1e-4 in magnitude (tests/test_fast_gelu.py, every finite float16 and a fine grid of float32
inputs): well below float16's rounding (2.4e-4), so the float16 output is the correctly rounded one or, near a
rounding midpoint, its neighbour (0.1% of inputs for erf, 0.2% for tanh). Degree 7 (erf) and 10 (tanh, whose
exponent grows like t^3).
"""
from __future__ import annotations

import numpy as np
from tvm import tirx

FAST_GELU_ACTIVATIONS = ("gelu_erf", "gelu_tanh")
# act -> (fit range T, coefficients of q(t) ~ log2 Phi(-t), highest degree first)
TAIL_POLYNOMIALS = {
    "gelu_erf": (6.0, (-1.8348104e-06, 6.159827e-05, -0.00093052466, 0.00850789, -0.053960066, -0.45846438,
                       -1.1512511, -0.9999953)),
    "gelu_tanh": (5.5, (-4.386182e-07, 1.546712e-05, -0.00022458324, 0.0017097418, -0.0070283953, 0.01356747,
                        -0.008517144, -0.040658977, -0.46285683, -1.1506327, -1.0000101)),
}


def check_fast_gelu(act: str) -> str:
    if act not in FAST_GELU_ACTIVATIONS:
        raise ValueError(f"fast_gelu applies to the GELU activations {FAST_GELU_ACTIVATIONS}, got {act!r}")
    return act


def tail_exponent(act: str, t):
    """``q(t)``, the float32 TIR expression (Horner; nvcc contracts every step to one FFMA) whose ``exp2`` is the
    tail ``Phi(-t)`` of ``act``'s GELU; ``t = |y|``."""
    _, coefficients = TAIL_POLYNOMIALS[check_fast_gelu(act)]
    f32 = "float32"
    q = tirx.const(coefficients[0], f32)
    for c in coefficients[1:]:
        q = q * t + tirx.const(c, f32)
    return q


def gelu_from_tail(y, t, tail):
    """``GELU(y) = max(y, 0) - t * tail`` with ``t = |y|`` and ``tail = 2 ** tail_exponent(act, t)`` (one FMA)."""
    return tirx.max(y, tirx.const(0.0, "float32")) - t * tail


# ---- the ``gelu_form`` "tanh" of the wgmma epilogue: GELU from one tanh -------------------------------------------
#
# ``GELU(y) = 0.5 y (1 + tanh(u(y)))``; for the tanh GELU ``u`` is its own argument sqrt(2/pi) (y + 0.044715 y^3), for
# the erf GELU ``u = y (c1 + c3 s + c5 s^2)`` with ``s = min(y^2, ERF_TANH_CLAMP)``, fitted (minimax, Nelder-Mead on the
# output error) so that ``0.5 y (tanh(u) - erf(y / sqrt 2))`` stays within 2.6e-5 in absolute value for every y; the
# clamp keeps u growing past y = 8 (the fit's c5 < 0 would turn it round near 8.3), where tanh(u) is 1 in float32.
# "tanh" (per output 8 instructions instead of 10 for erf, 6 instead of 13 for tanh, MUFU included; shorter chains):
# tanh.approx.f32 (MUFU.TANH, relative error up to 2^-11: about fp16's rounding, so the output's error can reach twice
# the rounding's), 0.5 y + 0.5 y t in float32. (Two other forms were dropped: a pair's u through one
# tanh.approx.f16x2, which ptxas for sm_90a splits into two MUFU.TANH.F16 and a PRMT, measured no faster on the H200;
# 1 / (1 + 2^(-2 u log2 e)) from ex2.approx and rcp.approx, near float32-exact, spilled 32-72 bytes in the 128 x 192
# ping-pong kernel.)
GELU_FORMS = ("tail", "tanh", "half")
ERF_TANH_ARGUMENT = (7.97507884e-01, 3.70056461e-02, -3.51516793e-04)   # c1, c3, c5
ERF_TANH_CLAMP = 64.0
TANH_GELU_ARGUMENT = (0.7978845608028654, 0.7978845608028654 * 0.044715)


def check_gelu_form(form: str) -> str:
    if form not in GELU_FORMS:
        raise ValueError(f"gelu_form must be one of {GELU_FORMS}, got {form!r}")
    return form


def tanh_argument(act: str, y):
    """``u(y)``, the float32 TIR expression whose tanh is ``act``'s ``2 Phi(y) - 1`` (nvcc: FMUL, [FMNMX,] FFMA[,
    FFMA], FMUL)."""
    f32 = "float32"
    s = y * y
    if check_fast_gelu(act) == "gelu_erf":
        s = tirx.min(s, tirx.const(ERF_TANH_CLAMP, f32))
        c1, c3, c5 = ERF_TANH_ARGUMENT
        p = (tirx.const(c5, f32) * s + tirx.const(c3, f32)) * s + tirx.const(c1, f32)
    else:
        c1, c3 = TANH_GELU_ARGUMENT
        p = tirx.const(c3, f32) * s + tirx.const(c1, f32)
    return y * p


def gelu_from_tanh(y, t):
    """``0.5 y + 0.5 y t`` (FMUL, FFMA) with ``t = tanh(u(y))``."""
    h = tirx.const(0.5, "float32") * y
    return h + h * t


# ---- the ``gelu_form`` "half": the tail form evaluated on float16 pairs ---------------------------------------------
#
# The erf GELU's tail form in packed float16 arithmetic, two outputs per instruction, for float16 outputs: the pair
# (bias added in float32) rounded once to f16x2, ``s = -|y|`` by setting both sign bits, ``s`` clamped at ``-T``
# (max.f16x2), ``q(s)`` by Horner in ``fma.rn.f16x2`` (degree 5), one ``ex2.approx.f16x2``, and
# ``out = s * 2**q + max(y, 0)`` (max.f16x2, fma.rn.f16x2): about 15 instructions per pair against ~23 for the float32
# form, which matters because in the ping-pong kernel the epilogue's instructions share each SM sub-partition (issue
# slots, register-file ports) with the other consumer's wgmma (H100, ncu, 4096 x 3072 x 768: tensor pipe active 68%
# with the float32 GELU against 84% without it). The coefficients are float16 numbers, fitted (least squares
# reweighted towards minimax on 4000 Chebyshev points of [0, T]) to ``log2 Phi(-t)`` in the variable ``s = -t`` and
# rounded, the constant pinned to -1 (Phi(0) = 1/2). Evaluated in float16 (each fma rounded once), the output's
# Frobenius error on N(0, 1.5^2) inputs is 2.08e-4 against 1.95e-4 for the correctly rounded float16 GELU; outputs
# above 1e-2 are within a few float16 ulps of it (tests/test_gelu_forms.py emulates the arithmetic). Past T the tail
# 2**q(-T) is below float16's smallest subnormal, so the output is max(y, 0); a NaN propagates through ``s``.
# float16 only: bfloat16's 8-bit significand would lose the tail's digits.
HALF_TAIL_POLYNOMIALS = {
    "gelu_erf": (6.0, (2.0170211791992188e-04, 4.467010498046875e-03, 4.28466796875e-02, -0.472900390625,
                       1.14453125, -1.0)),
}
HALF_SIGN_BITS = 0x80008000   # both halves' sign bits: ``y | HALF_SIGN_BITS`` is ``-|y|`` on a pair


def check_half_form(act: str, dtype: str) -> None:
    """Raise ValueError unless ``gelu_form="half"`` applies: the erf GELU with float16 outputs."""
    if act not in HALF_TAIL_POLYNOMIALS:
        raise ValueError(f"gelu_form='half' is fitted for {sorted(HALF_TAIL_POLYNOMIALS)}, got {act!r}")
    if dtype != "float16":
        raise ValueError(f"gelu_form='half' computes in float16 pairs: float16 outputs only, got {dtype!r}")


def half_pair(value: float) -> int:
    """``value`` as float16 in both halves of a 32-bit word (an f16x2 operand)."""
    bits = int(np.array(value, np.float16).view(np.uint16))
    return bits << 16 | bits


def half_tail_words(act: str) -> tuple[int, tuple[int, ...]]:
    """The f16x2 words of the half form of ``act``: (``-T`` for the clamp, the coefficients highest degree first)."""
    fit_end, coefficients = HALF_TAIL_POLYNOMIALS[act]
    return half_pair(-fit_end), tuple(half_pair(c) for c in coefficients)
