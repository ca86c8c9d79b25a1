"""Linear layers as exporters emit them, matched for the fusion templates, and what every rewrite of them needs.

``LINEAR`` is ``add(astype(matmul(X, W)), b)`` in either add order (``X`` ``[..., K]``, ``W`` a ``[K, N]``
weight, ``b`` a constant), ``MATMUL`` the same without a bias (T5), ``ANY_LINEAR`` either (the biased form first, so
that it binds the bias). :func:`linear_dims` says whether a template can take a match; :func:`wgmma_misfit` why a
GEMM stays on mma.sync under ``gemm="wgmma"``; :func:`padded_rows` the rows a GEMM of any ``m`` runs on.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_op, wildcard

from ..schedules.templates.gemm_wgmma import space_rows, split_k_blocks
from ..schedules.templates.wgmma_kernel import BLOCK_N_CHOICES as WGMMA_WIDTHS
from .attention_match import resolve, static_shape

TEMPLATE_DTYPES = ("float16", "bfloat16")
# the wgmma kernels' tile granularity (n: the narrowest width, the others in WGMMA_WIDTHS); rows need none: a partial
# last row tile loads zeros past m and stores none
WGMMA_TILES = {"m": 128, "n": 128, "k": 64}
# the tile widths no narrower one divides (128, 192): n fits the kernel where one of them divides it
BASE_WIDTHS = tuple(w for w in WGMMA_WIDTHS if not any(w % v == 0 for v in WGMMA_WIDTHS if v < w))
# Fewest 128x128 output tiles for which a GEMM goes to wgmma: half the H200's SMs. Below that the wgmma kernel's
# 128-row tiles leave most SMs idle; measured on the H200 (BENCHMARKS.md, end to end): BERT-Base at 1x128 tokens
# ran 0.76 ms with mma.sync templates and 1.03 ms with wgmma, at 8x512 4.35 ms and 3.35 ms.
WGMMA_MIN_TILES = 66
# A GEMM with fewer tiles still goes to wgmma where split-K (:func:`...schedules.templates.gemm_wgmma.split_k_blocks`)
# launches SPLIT_K_MIN_BLOCKS blocks or more. H200, session 9 (scripts/bench_wgmma_small_k.py --plan s9splitk): at
# RoBERTa-base's four GEMMs at 128 and 512 rows split-K beat the mma.sync templates the compile path ran, 1.13-2.28x,
# down to the attention output at 128 rows (24 blocks: 0.0066 against 0.0077 ms)
SPLIT_K_GATE = True
SPLIT_K_MIN_BLOCKS = 24


def wgmma_misfit(m: int, n: int, k: int) -> str | None:
    """Why a GEMM of [m, k] x [k, n] stays on mma.sync under ``gemm="wgmma"`` (None: it goes to wgmma). ``n`` must
    be a whole number of some tile width of the kernel (128, 192 or 256 columns: SmolLM2-360M's hidden 960 is five
    of 192), ``k`` of 64."""
    misfit = [] if any(n % width == 0 for width in BASE_WIDTHS) else [
        " or ".join(f"n % {width} == 0" for width in BASE_WIDTHS)]
    if k % WGMMA_TILES["k"]:
        misfit.append(f"k % {WGMMA_TILES['k']} == 0")
    if misfit:
        return f"wgmma needs {', '.join(misfit)}: mma.sync"
    if fills_gpu(m, n) or (SPLIT_K_GATE and split_k_blocks(m, n, k) >= SPLIT_K_MIN_BLOCKS):
        return None
    return f"{wgmma_tiles(m, n)} wgmma tiles fill too few SMs (< {WGMMA_MIN_TILES}): mma.sync"


def wgmma_tiles(m: int, n: int) -> int:
    """The 128 x 128 output tiles of an [m, n] GEMM output, a partial last row tile counted whole."""
    return (space_rows(m) // WGMMA_TILES["m"]) * (n // WGMMA_TILES["n"])


def fills_gpu(m: int, n: int) -> bool:
    """Whether an [m, n] output's wgmma tiles fill enough of the GPU without split-K (:data:`WGMMA_MIN_TILES`)."""
    return wgmma_tiles(m, n) >= WGMMA_MIN_TILES


ROW_MULTIPLE = 16     # the mma.sync GEMM templates' row granularity


def padded_rows(m: int, n: int, k: int, gemm: str) -> int:
    """The rows a GEMM of [m, k] x [k, n] runs on: ``m`` itself where it goes to wgmma under ``gemm="wgmma"`` (any
    ``m``: ViT-Base's 197 tokens a sequence, with no pad before the GEMM nor slice after it), else ``m`` rounded up
    to a multiple of 16 (the mma.sync templates, zero-padded by the caller). H200, session 10 (bench_wgmma_small_k
    --plan s10ragged): ViT-Base's four GEMMs at 197, 1576 and 6304 rows, 24 kernels within 2.1e-4 of float32, no
    row past m written; the whole ViT-Base at 1 x 197 ran 0.517 ms (session 6, padded and partly on mma.sync:
    1.092)."""
    if gemm == "wgmma" and wgmma_misfit(m, n, k) is None:
        return m
    return -(-m // ROW_MULTIPLE) * ROW_MULTIPLE


LINEAR_X, LINEAR_W, LINEAR_BIAS = wildcard(), wildcard(), is_const()
MATMUL = is_op("relax.astype")(is_op("relax.matmul")(LINEAR_X, LINEAR_W))      # a linear without bias (T5)
LINEAR = is_op("relax.add")(MATMUL, LINEAR_BIAS) | is_op("relax.add")(LINEAR_BIAS, MATMUL)
ANY_LINEAR = LINEAR | MATMUL                                           # the biased form first: it binds LINEAR_BIAS


def fixed_weights(func: relax.Function) -> set:
    """``func``'s weight parameters: those after its ``num_input`` model inputs (large initializers are imported as
    parameters, :func:`.onnx_import.split_weights`, the rest folded into constants)."""
    num_input = int(func.attrs["num_input"]) if func.attrs is not None and "num_input" in func.attrs else 0
    return set(func.params[num_input:])


def is_weight(expr, var2val, weights: set) -> bool:
    """Whether ``expr`` is a weight: a parameter of ``weights`` or a constant, possibly cast (mixed precision),
    transposed or reshaped (a patch embedding's convolution kernel as a linear weight), so that whatever a rewrite
    computes from it alone is lifted into the weight transform."""
    value = resolve(expr, var2val)
    while any(is_call(value, op) for op in ("relax.astype", "relax.permute_dims", "relax.reshape")):
        value = resolve(value.args[0], var2val)
    return isinstance(value, Constant) or (isinstance(value, relax.Var) and value in weights)


def transposed(w: relax.Expr) -> relax.Expr:
    """``W^T`` of a [K, N] weight: folded here for a constant, else a weight-only op lifted into the transform."""
    if isinstance(w, Constant):
        return relax.const(np.ascontiguousarray(w.value.numpy().T), str(w.ty.dtype))
    return relax.op.permute_dims(w, [1, 0])


def linear_bias(matches):
    """The bias constant of a matched linear layer, None for one without (:data:`MATMUL`)."""
    return matches[LINEAR_BIAS] if LINEAR_BIAS in matches else None


def zero_bias(n: int, dtype: str) -> Constant:
    """A [n] zero bias: the GEMM + activation templates always add one (a bias-free linear + ReLU, T5's FFN)."""
    return relax.const(np.zeros(n, dtype), dtype)


def concat_weights(ws: list, axis: int) -> relax.Expr:
    """``ws`` concatenated along ``axis``: one constant where all are constants (folded here), else a concat."""
    if len(ws) == 1:
        return ws[0]
    if all(isinstance(w, Constant) for w in ws):
        return relax.const(np.concatenate([w.value.numpy() for w in ws], axis=axis), str(ws[0].ty.dtype))
    return relax.op.concat(ws, axis=axis)


def concatenated_linear(matches: list, dtype: str, visit=lambda expr: expr, bias_needed: bool = True) -> tuple:
    """(weight, bias) of the matched linear layers as one: weights concatenated along N (each through ``visit``,
    a mutator's remapping), biases too with zeros for a layer without one; bias None where no layer has one and
    ``bias_needed`` is False."""
    w = concat_weights([visit(m[LINEAR_W]) for m in matches], 1)
    if not bias_needed and not any(LINEAR_BIAS in m for m in matches):
        return w, None
    return w, concat_weights([m[LINEAR_BIAS] if LINEAR_BIAS in m else zero_bias(static_shape(m[LINEAR_W])[1], dtype)
                              for m in matches], 0)


def linear_dims(matches, out_dtype: str):
    """(x shape, m, n, k, dtype) of a matched linear layer (with or without bias), or None when a template
    cannot take it."""
    x, w, bias = matches[LINEAR_X], matches[LINEAR_W], linear_bias(matches)
    x_shape, w_shape = static_shape(x), static_shape(w)
    dtype = str(x.ty.dtype)
    if (x_shape is None or w_shape is None or len(w_shape) != 2 or dtype not in TEMPLATE_DTYPES
            or str(w.ty.dtype) != dtype or out_dtype != dtype or (bias is not None and str(bias.ty.dtype) != dtype)):
        return None
    k, n = w_shape
    m = int(np.prod(x_shape[:-1]))
    if x_shape[-1] != k or n % 16 or k % 16:      # any m: the rows are padded (:func:`padded_rows`)
        return None
    if bias is not None and tuple(static_shape(bias) or ()) != (n,):
        return None
    return x_shape, m, n, k, dtype


def users_of(func: relax.Function) -> dict:
    """Every variable's reading bindings (None for the function's result)."""
    users: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                users.setdefault(var, []).append(binding)
    if isinstance(func.body.body, relax.Var):
        users.setdefault(func.body.body, []).append(None)
    return users


def is_call(expr, op: str) -> bool:
    """Whether ``expr`` is a call of the Relax operator named ``op``."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == op
