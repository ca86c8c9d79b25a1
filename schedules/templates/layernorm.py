"""Template family 3: (bias +) (residual +) LayerNorm over the last axis, memory bound.

``y = x + bias + residual`` (float32), ``out = (y - mean) / sqrt(var + eps) * gamma + beta`` with the mean
and the variance over each row of ``n`` elements, computed in two passes over ``y`` held in shared memory
(one read of each input from device memory). ``layernorm`` is the plain form (no bias, no residual),
``bias_residual_layernorm`` the post-attention / post-FFN form that follows an unfused GEMM. ``residual_layernorm`` is
the pre-LN form (GPT-2, ViT: ``h = h + sublayer(...)``, then ``LayerNorm(h)``, the GEMM's bias already in its
epilogue): it adds ``x + residual``, rounds the sum to the 16-bit dtype and writes it (``sum``, the next residual)
and the LayerNorm of the rounded sum, as the unfused 16-bit add followed by ``layernorm`` would, with one read of
each input and one write of each output instead of the add's own kernel (the RMSNorm family's ``residual_rmsnorm``
for LayerNorm).

Schedule: ``rows`` rows per thread block (threadIdx.y), each row spread over ``lanes`` threads
(threadIdx.x) reading ``vec`` consecutive elements per access (16 bytes at vec 8); the two row sums are
cross-thread reductions (warp shuffles, plus shared memory when a row spans several warps). ``y`` is staged as
float32 in each thread's registers (``registers`` 1: its ``n / lanes`` values; every load of the row is issued
before the first reduction, no shared memory, no block-wide barrier) or in shared memory (0: the form for rows
too long for the registers, the only one offered past ``MAX_ROW_REGISTERS`` values per thread).
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx
from tvm.script import tirx as T

from .deferred import row_epilogue
from .epilogue import LN_EPS, layernorm_np
from .registry import Template, register

ROW_CHOICES = (1, 2, 4, 8)
LANE_CHOICES = (32, 64, 128, 256)
VEC_CHOICES = (2, 4, 8)
REGISTER_CHOICES = (1, 0)
MAX_ROW_REGISTERS = 64  # float32 values of the row per thread above which only shared-memory staging is offered


def layernorm_compute(y, gamma, beta, dtype: str, eps: float = LN_EPS):
    """TE stages of a row LayerNorm of ``y`` ([m, n] float32 tensor): (mean_sum, var_sum, out).

    Block names: ``mean_sum`` (sum of y per row), ``var_sum`` (sum of squared deviations), ``out``."""
    m, n = y.shape
    inv_n = tirx.const(1.0 / int(n), "float32")
    r1 = te.reduce_axis((0, n), name="r1")
    mean_sum = te.compute((m,), lambda i: te.sum(y[i, r1], axis=r1), name="mean_sum")
    r2 = te.reduce_axis((0, n), name="r2")

    def deviation2(i, j):
        d = y[i, j] - mean_sum[i] * inv_n
        return d * d

    var_sum = te.compute((m,), lambda i: te.sum(deviation2(i, r2), axis=r2), name="var_sum")

    def normalise(i, j):
        rstd = tirx.rsqrt(var_sum[i] * inv_n + tirx.const(eps, "float32"))
        return ((y[i, j] - mean_sum[i] * inv_n) * rstd * gamma[j].astype("float32")
                + beta[j].astype("float32")).astype(dtype)

    out = te.compute((m, n), normalise, name="out")
    return mean_sum, var_sum, out


class RowNormTemplate(Template):
    """What the row-normalisation families share (LayerNorm here, RMSNorm in :mod:`.rmsnorm`): an [m, n] activation
    normalised per row, ``rows`` rows per thread block, each spread over ``lanes`` threads reading ``vec`` elements
    per access, the row staged as float32 in registers (``registers`` 1) or shared memory (0). ``row_producers``
    names the blocks that the schedule computes per row before the ``out`` block (the row, its statistics)."""

    shape_keys = ("m", "n")
    knob_names = ("rows", "lanes", "vec", "registers")
    row_producers: tuple[str, ...] = ()

    def _check(self, shape):
        if shape["n"] % 64:
            raise ValueError(f"{self.name}: shape['n'] must be a multiple of 64, got {shape['n']}")

    def _knob_space(self, shape, dtype, hw):
        m, n = shape["m"], shape["n"]
        space = [{"rows": r, "lanes": l, "vec": v, "registers": g} for r in ROW_CHOICES for l in LANE_CHOICES
                 for v in VEC_CHOICES for g in REGISTER_CHOICES
                 if m % r == 0 and n % (l * v) == 0 and (not g or n // l <= MAX_ROW_REGISTERS)]
        # fill the SMs first, then 16-byte accesses, fewer lanes per row (cheaper reductions), more rows per block,
        # each in registers and then in shared memory: the first is the register row, and the tuner's top 8 (the
        # model ties the two forms) measure both forms of the leading tilings
        space.sort(key=lambda k: (m // k["rows"] < 2 * hw.sm_count, -k["vec"], k["lanes"], -k["rows"],
                                  -k["registers"]))
        return space

    def resources(self, shape, dtype, knobs):
        # ``rows`` float32 rows (plus two statistics) staged in shared memory, or n / lanes values per thread
        n, registers = shape["n"], knobs["registers"]
        return {"threads": knobs["rows"] * knobs["lanes"], "grid": shape["m"] // knobs["rows"],
                "shared_bytes": 0 if registers else knobs["rows"] * (n + 2) * 4, "acc_registers": 0,
                "operand_registers": 4 * knobs["vec"] + (n // knobs["lanes"] if registers else 0)}

    def _schedule(self, sch, spec, knobs):
        out = sch.get_sblock("out")
        rows, _ = sch.get_loops(out)
        block_loop, _ = sch.split(rows, [None, knobs["rows"]])
        sch.bind(block_loop, "blockIdx.x")
        producers = [sch.get_sblock(name) for name in self.row_producers]
        row_epilogue(sch, out, producers, knobs["vec"], knobs["lanes"], knobs["registers"])


class LayerNormTemplate(RowNormTemplate):
    """(bias +) (residual +) LayerNorm of an [m, n] activation."""

    family = "layernorm"
    row_producers = ("y", "mean_sum", "var_sum")

    def __init__(self, bias: bool, residual: bool):
        self.bias, self.residual = bias, residual
        self.name = "_".join((["bias"] if bias else []) + (["residual"] if residual else []) + ["layernorm"])
        self.fused = bias or residual
        self.description = "out = LayerNorm(x" + (" + bias" if bias else "") + (" + residual" if residual else "") + ")"

    def arguments(self, shape, dtype="float16"):
        m, n = shape["m"], shape["n"]
        args = [("x", (m, n), dtype)]
        if self.bias:
            args.append(("bias", (n,), dtype))
        if self.residual:
            args.append(("residual", (m, n), dtype))
        return args + [("gamma", (n,), dtype), ("beta", (n,), dtype), ("out", (m, n), dtype)]

    def _primfunc(self, shape, dtype, eps: float = LN_EPS):
        m, n = shape["m"], shape["n"]
        x = te.placeholder((m, n), dtype, name="x")
        params = [x]
        if self.bias:
            bias = te.placeholder((n,), dtype, name="bias")
            params.append(bias)
        if self.residual:
            residual = te.placeholder((m, n), dtype, name="residual")
            params.append(residual)
        gamma = te.placeholder((n,), dtype, name="gamma")
        beta = te.placeholder((n,), dtype, name="beta")

        def row(i, j):
            v = x[i, j].astype("float32")
            if self.bias:
                v = v + bias[j].astype("float32")
            if self.residual:
                v = v + residual[i, j].astype("float32")
            return v

        y = te.compute((m, n), row, name="y")
        _, _, out = layernorm_compute(y, gamma, beta, dtype, eps)
        return te.create_prim_func(params + [gamma, beta, out])

    def reference(self, shape, inputs):
        y = np.asarray(inputs["x"], np.float64)
        if self.bias:
            y = y + np.asarray(inputs["bias"], np.float64)
        if self.residual:
            y = y + np.asarray(inputs["residual"], np.float64)
        return [layernorm_np(y, inputs["gamma"], inputs["beta"])]


def _residual_layernorm(m: int, n: int, dtype: str, eps: float):
    """The ``residual_layernorm`` PrimFunc: blocks ``y`` (the rounded sum as float32, staged per row), ``mean_sum``,
    ``var_sum`` and ``out``, which writes both outputs (the sum from the staged row: exact, it holds 16-bit values).
    TVMScript for the reason :func:`.rmsnorm._residual_rmsnorm` gives: a block writing a function output can only be
    the row's anchor."""
    inv_n = 1.0 / n

    @T.prim_func(s_tir=True)
    def main(x_h: T.handle, residual_h: T.handle, gamma_h: T.handle, beta_h: T.handle, total_h: T.handle,
             out_h: T.handle):
        x = T.match_buffer(x_h, (m, n), dtype)
        residual = T.match_buffer(residual_h, (m, n), dtype)
        gamma = T.match_buffer(gamma_h, (n,), dtype)
        beta = T.match_buffer(beta_h, (n,), dtype)
        total = T.match_buffer(total_h, (m, n), dtype)
        out = T.match_buffer(out_h, (m, n), dtype)
        y = T.sblock_alloc_buffer((m, n), "float32")
        mean_sum = T.sblock_alloc_buffer((m,), "float32")
        var_sum = T.sblock_alloc_buffer((m,), "float32")
        for i, j in T.grid(m, n):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.Cast("float32", T.Cast(dtype, T.Cast("float32", x[vi, vj])
                                                     + T.Cast("float32", residual[vi, vj])))
        for i, r in T.grid(m, n):
            with T.sblock("mean_sum"):
                vi, vr = T.axis.remap("SR", [i, r])
                with T.init():
                    mean_sum[vi] = T.float32(0)
                mean_sum[vi] = mean_sum[vi] + y[vi, vr]
        for i, r in T.grid(m, n):
            with T.sblock("var_sum"):
                vi, vr = T.axis.remap("SR", [i, r])
                with T.init():
                    var_sum[vi] = T.float32(0)
                var_sum[vi] = var_sum[vi] + (y[vi, vr] - mean_sum[vi] * T.float32(inv_n)) * (
                    y[vi, vr] - mean_sum[vi] * T.float32(inv_n))
        for i, j in T.grid(m, n):
            with T.sblock("out"):
                vi, vj = T.axis.remap("SS", [i, j])
                total[vi, vj] = T.Cast(dtype, y[vi, vj])
                out[vi, vj] = T.Cast(dtype, (y[vi, vj] - mean_sum[vi] * T.float32(inv_n))
                                     * T.rsqrt(var_sum[vi] * T.float32(inv_n) + T.float32(eps))
                                     * T.Cast("float32", gamma[vj]) + T.Cast("float32", beta[vj]))

    return main          # global symbol "main", as te.create_prim_func names the other templates' functions


class ResidualLayerNormTemplate(LayerNormTemplate):
    """``sum = x + residual`` rounded to the 16-bit dtype, ``out = LayerNorm(sum)``: both are outputs."""

    def __init__(self):
        super().__init__(bias=False, residual=True)
        self.description = "sum = x + residual; out = LayerNorm(sum)"

    def arguments(self, shape, dtype="float16"):
        m, n = shape["m"], shape["n"]
        return [("x", (m, n), dtype), ("residual", (m, n), dtype), ("gamma", (n,), dtype), ("beta", (n,), dtype),
                ("sum", (m, n), dtype), ("out", (m, n), dtype)]

    def outputs(self) -> int:
        return 2

    def _primfunc(self, shape, dtype, eps: float = LN_EPS):
        return _residual_layernorm(shape["m"], shape["n"], dtype, eps)

    def reference(self, shape, inputs):
        y = np.asarray(inputs["x"], np.float64) + np.asarray(inputs["residual"], np.float64)
        return [y, layernorm_np(y, inputs["gamma"], inputs["beta"])]


register(LayerNormTemplate(bias=False, residual=False))
register(LayerNormTemplate(bias=True, residual=True))
register(ResidualLayerNormTemplate())
