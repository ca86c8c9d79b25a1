"""Template family 3b: RMSNorm over the last axis (T5), plain or with the residual add, memory bound.

``out = y * rsqrt(mean(y * y) + eps) * weight`` over each row of ``n`` elements: no mean subtracted, no
bias; the row sum of squares is float32. ``rmsnorm`` normalises its input ``x``. ``residual_rmsnorm`` is the
pre-norm form (T5: ``h = h + sublayer(...)``, then ``RMSNorm(h)``): it adds ``x + residual``, rounds the sum to
the 16-bit dtype and writes it (``sum``, the next residual) and its normalisation (``out``, read back from the
rounded sum, as an unfused 16-bit add followed by ``rmsnorm`` would), one read of each input and one write of
each output instead of the add's own kernel.

Schedule: the LayerNorm template's (:mod:`.layernorm`): ``rows`` rows per thread block, each over ``lanes``
threads with ``vec``-wide accesses, the row staged in shared memory as float32, the sum of squares a
cross-thread reduction; same knob space and resources.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx
from tvm.script import tirx as T

from .layernorm import RowNormTemplate
from .registry import register

RMS_EPS = 1e-6  # T5's


def rmsnorm_np(y: np.ndarray, weight: np.ndarray, eps: float = RMS_EPS) -> np.ndarray:
    """Float64 RMSNorm over the last axis."""
    y = np.asarray(y, dtype=np.float64)
    return y / np.sqrt((y * y).mean(axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def rmsnorm_compute(y, weight, dtype: str, eps: float = RMS_EPS):
    """TE stages of a row RMSNorm of ``y`` ([m, n] float32 tensor): (sq_sum, out).

    Block names: ``sq_sum`` (sum of y * y per row), ``out``."""
    m, n = y.shape
    r = te.reduce_axis((0, n), name="r")
    sq_sum = te.compute((m,), lambda i: te.sum(y[i, r] * y[i, r], axis=r), name="sq_sum")
    inv_n = tirx.const(1.0 / int(n), "float32")

    def normalise(i, j):
        rstd = tirx.rsqrt(sq_sum[i] * inv_n + tirx.const(eps, "float32"))
        return (y[i, j] * rstd * weight[j].astype("float32")).astype(dtype)

    return sq_sum, te.compute((m, n), normalise, name="out")


def _residual_rmsnorm(m: int, n: int, dtype: str, eps: float):
    """The ``residual_rmsnorm`` PrimFunc: blocks ``y`` (the rounded sum as float32, staged per row), ``sq_sum`` and
    ``out``, which writes both outputs (the sum from the staged row: exact, it holds 16-bit values). Written in
    TVMScript because TE gives each output its own block, and a block writing a function output can only be the
    row's anchor, not a per-row producer."""
    inv_n = 1.0 / n

    @T.prim_func(s_tir=True)
    def main(x_h: T.handle, residual_h: T.handle, weight_h: T.handle, total_h: T.handle, out_h: T.handle):
        x = T.match_buffer(x_h, (m, n), dtype)
        residual = T.match_buffer(residual_h, (m, n), dtype)
        weight = T.match_buffer(weight_h, (n,), dtype)
        total = T.match_buffer(total_h, (m, n), dtype)
        out = T.match_buffer(out_h, (m, n), dtype)
        y = T.sblock_alloc_buffer((m, n), "float32")
        sq_sum = T.sblock_alloc_buffer((m,), "float32")
        for i, j in T.grid(m, n):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.Cast("float32", T.Cast(dtype, T.Cast("float32", x[vi, vj])
                                                     + T.Cast("float32", residual[vi, vj])))
        for i, r in T.grid(m, n):
            with T.sblock("sq_sum"):
                vi, vr = T.axis.remap("SR", [i, r])
                with T.init():
                    sq_sum[vi] = T.float32(0)
                sq_sum[vi] = sq_sum[vi] + y[vi, vr] * y[vi, vr]
        for i, j in T.grid(m, n):
            with T.sblock("out"):
                vi, vj = T.axis.remap("SS", [i, j])
                total[vi, vj] = T.Cast(dtype, y[vi, vj])
                out[vi, vj] = T.Cast(dtype, y[vi, vj] * T.rsqrt(sq_sum[vi] * T.float32(inv_n) + T.float32(eps))
                                     * T.Cast("float32", weight[vj]))

    return main          # global symbol "main", as te.create_prim_func names the other templates' functions


class RmsNormTemplate(RowNormTemplate):
    """(residual +) RMSNorm of an [m, n] activation; with the residual, the rounded sum is an output too."""

    family = "rmsnorm"
    row_producers = ("y", "sq_sum")

    def __init__(self, residual: bool):
        self.residual = residual
        self.name = "residual_rmsnorm" if residual else "rmsnorm"
        self.fused = residual
        self.description = ("sum = x + residual; out = RMSNorm(sum)" if residual else "out = RMSNorm(x)")

    def arguments(self, shape, dtype="float16"):
        m, n = shape["m"], shape["n"]
        args = [("x", (m, n), dtype)] + ([("residual", (m, n), dtype)] if self.residual else [])
        args.append(("weight", (n,), dtype))
        return args + ([("sum", (m, n), dtype)] if self.residual else []) + [("out", (m, n), dtype)]

    def outputs(self) -> int:
        return 2 if self.residual else 1

    def _primfunc(self, shape, dtype, eps: float = RMS_EPS):
        m, n = shape["m"], shape["n"]
        if self.residual:
            return _residual_rmsnorm(m, n, dtype, eps)
        x = te.placeholder((m, n), dtype, name="x")
        weight = te.placeholder((n,), dtype, name="weight")
        y = te.compute((m, n), lambda i, j: x[i, j].astype("float32"), name="y")
        _, out = rmsnorm_compute(y, weight, dtype, eps)
        return te.create_prim_func([x, weight, out])

    def reference(self, shape, inputs):
        y = np.asarray(inputs["x"], np.float64)
        if self.residual:
            y = y + np.asarray(inputs["residual"], np.float64)
            return [y, rmsnorm_np(y, inputs["weight"])]
        return [rmsnorm_np(y, inputs["weight"])]


register(RmsNormTemplate(residual=False))
register(RmsNormTemplate(residual=True))
