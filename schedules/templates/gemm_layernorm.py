"""Template family 2: GEMM + bias + residual + LayerNorm in one kernel (the output projection of a layer).

``out = LayerNorm(A @ W^T + bias + residual) * gamma + beta`` over rows of ``n`` (the hidden size). Each
thread block owns ``block_m`` whole rows: the tensor-core main loop (:mod:`.mainloop`) runs with
``block_n = n`` (warps side by side along the row), the float32 accumulators land in the shared staging
tile, and the LayerNorm runs there as a row epilogue: each warp takes rows in turn, two warp-shuffle
reductions (sum, then sum of squared deviations) and one normalising pass that reads bias, residual,
gamma and beta with ``vec``-wide loads and writes ``vec`` outputs per access. ``y = acc + bias + residual``
is recomputed in each pass rather than stored (the staging tile already holds the row).

Cost of the fusion: every block re-reads all of W (block_n = n), so small ``block_m`` trades L2 traffic for
parallelism; registers cap the warp tile at 16*frag_m x 16*frag_n with frag_m*frag_n <= 16. Whether this
beats the unfused pair (``gemm`` then ``bias_residual_layernorm``) depends on the shape; the tuner decides.
"""
from __future__ import annotations

import numpy as np
from tvm import te

from .deferred import row_epilogue
from .epilogue import LN_EPS, layernorm_np
from .gemm import (ELEM_BYTES, KFRAG_CHOICES, MAX_ACC_REGISTERS, STAGE_CHOICES, gemm_compute, knob_columns,
                   mainloop_columns, mainloop_resources, rank_order)
from .layernorm import layernorm_compute
from .mainloop import COPY_BYTES, schedule_mainloop
from .registry import Template, register

WARPS_M_CHOICES = (1, 2, 4)
WARPS_N_CHOICES = (2, 3, 4, 6, 8, 12, 16)
FRAG_M_CHOICES = (1, 2, 4)
FRAG_N_CHOICES = (1, 2, 3, 4, 6, 8)
VEC_CHOICES = (4, 8)


class GemmLayerNormTemplate(Template):
    """GEMM + bias + residual + LayerNorm, whole rows per thread block."""

    family = "gemm_layernorm"
    fused = True
    shape_keys = ("m", "n", "k")
    knob_names = ("warps_m", "frag_m", "warps_n", "frag_n", "k_frags", "stages", "vec")

    def __init__(self, w_layout: str = "nk"):
        if w_layout not in ("nk", "kn"):
            raise ValueError(f"w_layout must be 'nk' or 'kn', got {w_layout!r}")
        self.w_layout = w_layout
        self.name = "gemm_bias_residual_layernorm" + ("_kn" if w_layout == "kn" else "")
        self.description = "out = LayerNorm(A @ W^T + bias + residual)"

    def _check(self, shape):
        for key in ("m", "n", "k"):
            if shape[key] % 16:
                raise ValueError(f"{self.name}: shape[{key!r}] must be a multiple of 16, got {shape[key]}")
        if shape["n"] % 128:
            raise ValueError(f"{self.name}: shape['n'] must be a multiple of 128, got {shape['n']}")

    def arguments(self, shape, dtype="float16"):
        m, n, k = shape["m"], shape["n"], shape["k"]
        return [("A", (m, k), dtype), ("W", (n, k) if self.w_layout == "nk" else (k, n), dtype),
                ("bias", (n,), dtype), ("residual", (m, n), dtype), ("gamma", (n,), dtype), ("beta", (n,), dtype),
                ("out", (m, n), dtype)]

    def flops(self, shape):
        return 2 * shape["m"] * shape["n"] * shape["k"]

    def _primfunc(self, shape, dtype, eps: float = LN_EPS):
        inputs, y = self.residual_sum(shape, dtype)
        _, _, out = layernorm_compute(y, inputs[4], inputs[5], dtype, eps)
        return te.create_prim_func(inputs + [out])

    def residual_sum(self, shape, dtype):
        """The definition's inputs (A, W, bias, residual, gamma, beta placeholders) and its float32 sum
        ``y = A @ W + bias + residual``, the LayerNorm's input."""
        m, n, k = shape["m"], shape["n"], shape["k"]
        A = te.placeholder((m, k), dtype, name="A")
        W = te.placeholder((n, k) if self.w_layout == "nk" else (k, n), dtype, name="W")
        bias = te.placeholder((n,), dtype, name="bias")
        residual = te.placeholder((m, n), dtype, name="residual")
        gamma = te.placeholder((n,), dtype, name="gamma")
        beta = te.placeholder((n,), dtype, name="beta")
        acc = gemm_compute(A, W, self.w_layout)
        y = te.compute((m, n), lambda i, j: acc[i, j] + bias[j].astype("float32") + residual[i, j].astype("float32"),
                       name="y")
        return [A, W, bias, residual, gamma, beta], y

    def residual_sum_np(self, inputs) -> np.ndarray:
        """``A @ W + bias + residual`` in float64 from the named inputs."""
        a = np.asarray(inputs["A"], np.float64)
        w = np.asarray(inputs["W"], np.float64)
        y = a @ (w.T if self.w_layout == "nk" else w) + np.asarray(inputs["bias"], np.float64)
        return y + np.asarray(inputs["residual"], np.float64)

    def reference(self, shape, inputs):
        return [layernorm_np(self.residual_sum_np(inputs), inputs["gamma"], inputs["beta"])]

    def _knob_space(self, shape, dtype, hw):
        m, n, k = shape["m"], shape["n"], shape["k"]
        copy_vec = COPY_BYTES // ELEM_BYTES
        space = []
        for wm in WARPS_M_CHOICES:
            for wn in WARPS_N_CHOICES:
                if (n // 16) % wn or (n // 16) // wn not in FRAG_N_CHOICES:
                    continue
                fn = (n // 16) // wn
                for fm in FRAG_M_CHOICES:
                    bm, threads = 16 * wm * fm, 32 * wm * wn
                    if m % bm or fm * fn * 8 > MAX_ACC_REGISTERS or threads > hw.max_threads_per_block:
                        continue
                    if bm % (wm * wn):  # the LayerNorm epilogue gives each warp whole rows
                        continue
                    for kf in KFRAG_CHOICES:
                        bk = 16 * kf
                        if k % bk or (bm * bk) % (32 * copy_vec) or (n * bk) % (threads * copy_vec):
                            continue
                        for st in STAGE_CHOICES:
                            for vec in VEC_CHOICES:
                                if n % (32 * vec) == 0:
                                    space.append({"warps_m": wm, "frag_m": fm, "warps_n": wn, "frag_n": fn,
                                                  "k_frags": kf, "stages": st, "vec": vec})
        return [space[i] for i in rank_order(m, n, k, knob_columns(space), hw)] if space else []

    def resources(self, shape, dtype, knobs):
        return mainloop_resources(shape["m"], shape["n"], shape["k"], knobs)

    def resource_columns(self, shape, dtype, space):
        return mainloop_columns(shape["m"], shape["n"], shape["k"], knob_columns(space))

    def _schedule(self, sch, spec, knobs):
        sch.compute_inline(sch.get_sblock("y"))
        schedule_mainloop(sch, "gemm", dtype=spec["dtype"], b_layout=self.w_layout,
                          **{key: knobs[key] for key in ("warps_m", "frag_m", "warps_n", "frag_n", "k_frags",
                                                         "stages")},
                          consumers=["mean_sum", "var_sum", "out"])
        row_epilogue(sch, sch.get_sblock("out"), [sch.get_sblock("mean_sum"), sch.get_sblock("var_sum")],
                     knobs["vec"], 32)


register(GemmLayerNormTemplate("nk"))
register(GemmLayerNormTemplate("kn"))
