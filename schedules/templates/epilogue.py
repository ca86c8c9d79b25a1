"""Elementwise epilogue math shared by the templates (TIR expressions and float64 numpy references)."""
from __future__ import annotations

import math

import numpy as np
from tvm import tirx

ACTIVATIONS = ("none", "relu", "gelu_erf", "gelu_tanh")
# a gated linear unit's epilogue (SwiGLU: Llama, Qwen2, Mistral): the GEMM's columns interleave the gate and up
# projections, and each pair (2j, 2j + 1) becomes output column j, silu(gate) * up (:mod:`.gated_gemm`)
GATED_ACT = "silu_mul"
LN_EPS = 1e-5


def check_activation(act: str) -> str:
    if act not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {act!r}")
    return act


def activation(act: str, x):
    """``act`` applied to a float32 TIR expression."""
    f32 = "float32"
    if act == "none":
        return x
    if act == "relu":
        return tirx.max(x, tirx.const(0.0, f32))
    if act == "gelu_erf":
        return tirx.const(0.5, f32) * x * (tirx.const(1.0, f32) + tirx.erf(x * tirx.const(1.0 / math.sqrt(2.0), f32)))
    if act == "gelu_tanh":
        inner = tirx.const(math.sqrt(2.0 / math.pi), f32) * (x + tirx.const(0.044715, f32) * x * x * x)
        return tirx.const(0.5, f32) * x * (tirx.const(1.0, f32) + tirx.tanh(inner))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {act!r}")


def activation_np(act: str, x: np.ndarray) -> np.ndarray:
    """Float64 reference of :func:`activation`."""
    x = np.asarray(x, dtype=np.float64)
    if act == "none":
        return x
    if act == "relu":
        return np.maximum(x, 0.0)
    if act == "gelu_erf":
        from math import erf

        return 0.5 * x * (1.0 + np.vectorize(erf)(x / math.sqrt(2.0)))
    if act == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {act!r}")


def layernorm_np(y: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = LN_EPS) -> np.ndarray:
    """Float64 LayerNorm over the last axis."""
    y = np.asarray(y, dtype=np.float64)
    mean = y.mean(axis=-1, keepdims=True)
    var = ((y - mean) ** 2).mean(axis=-1, keepdims=True)
    return (y - mean) / np.sqrt(var + eps) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)
