"""A gated linear unit in one GEMM: ``out[m, j] = silu(A @ Wg^T)[m, j] * (A @ Wu^T)[m, j]`` (SwiGLU: the gate and up
projections of HF Llama, Qwen2 and Mistral's MLPs, and the elementwise product that joins them).

``W`` is [2n, k] with the gate and up rows interleaved: row ``2j`` is the gate's row ``j``, row ``2j + 1`` the up
projection's (:func:`interleaved_rows`). Each output column is then a pair of adjacent GEMM columns, and on wgmma a
thread's accumulator pair (columns ``2t``, ``2t + 1`` of each 8-column group) is one gate/up pair: the epilogue
writes ``silu(gate) * up`` straight from the accumulators, half the GEMM's columns, and the gate and up activations
never reach memory (separately they are written, read back and the product written again: 3x the output's bytes).

``gemm_silu_mul_wgmma`` is the Hopper kernel of :mod:`.wgmma_kernel` (``act="silu_mul"``; direct stores, no
split-K); ``primfunc`` its TensorIR definition, which runs anywhere.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .epilogue import GATED_ACT
from .gemm import gemm_compute
from .gemm_wgmma import WgmmaKernelMixin
from .registry import Template, register


def interleaved_rows(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The template's ``W`` from the gate's and up projection's [n, k] weights: their rows alternated."""
    if gate.shape != up.shape or gate.ndim != 2:
        raise ValueError(f"gate and up weights must be [n, k] alike, got {gate.shape} and {up.shape}")
    return np.stack([gate, up], axis=1).reshape(2 * gate.shape[0], gate.shape[1])


def silu_mul_np(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """float64 ``silu(gate) * up``."""
    gate = np.asarray(gate, np.float64)
    return gate / (1.0 + np.exp(-gate)) * np.asarray(up, np.float64)


class WgmmaGatedGemmTemplate(WgmmaKernelMixin, Template):
    """``silu(A @ Wg^T) * (A @ Wu^T)`` with ``W`` = :func:`interleaved_rows` ``(Wg, Wu)``, [2n, k]; shape keys
    ``m, n, k`` with ``n`` the output's columns (the GEMM's are 2n)."""

    name = "gemm_silu_mul_wgmma"
    family = "gated_gemm_wgmma"
    shape_keys = ("m", "n", "k")
    act = GATED_ACT
    description = "out = silu(A @ Wg^T) * (A @ Wu^T), gate and up rows of W interleaved (wgmma, sm_90a)"

    def _check(self, shape):
        self._check_tiles(shape)

    def gemm_dims(self, shape):
        return shape["m"], 2 * shape["n"], shape["k"]

    def kernel_options(self, shape):
        return {"bias": False, "act": GATED_ACT}

    def arguments(self, shape, dtype="float16"):
        m, n, k = shape["m"], shape["n"], shape["k"]
        return [("A", (m, k), dtype), ("W", (2 * n, k), dtype), ("out", (m, n), dtype)]

    def flops(self, shape):
        return 2 * shape["m"] * 2 * shape["n"] * shape["k"]

    def _primfunc(self, shape, dtype):
        m, n, k = shape["m"], shape["n"], shape["k"]
        A = te.placeholder((m, k), dtype, name="A")
        W = te.placeholder((2 * n, k), dtype, name="W")
        acc = gemm_compute(A, W, "nk")

        def gated(i, j):
            gate, up = acc[i, 2 * j], acc[i, 2 * j + 1]
            return (gate / (tirx.const(1.0, "float32") + tirx.exp(-gate)) * up).astype(dtype)

        out = te.compute((m, n), gated, name="out")
        return te.create_prim_func([A, W, out])

    def reference(self, shape, inputs):
        y = np.asarray(inputs["A"], np.float64) @ np.asarray(inputs["W"], np.float64).T
        return [silu_mul_np(y[:, 0::2], y[:, 1::2])]

    def _knob_space(self, shape, dtype, hw):
        # the gated epilogue stores from the accumulators: no staged sets, no split-K
        return [knobs for knobs in super()._knob_space(shape, dtype, hw)
                if not knobs.get("staged") and knobs.get("split_k", 1) == 1]


register(WgmmaGatedGemmTemplate())
