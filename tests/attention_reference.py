"""Float64 dense references for the attention tests (imported by test_attention_*.py)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

# Relative Frobenius error bounds of the issue: fp16 2e-3, bf16 1e-2 (fp32 storage: float32 rounding only).
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}


def numpy_dtype(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def random_qkv(batch, heads, seq_q, seq_k, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, seq_q, head_dim)).astype(numpy_dtype(dtype))
    k = rng.standard_normal((batch, heads, seq_k, head_dim)).astype(numpy_dtype(dtype))
    v = rng.standard_normal((batch, heads, seq_k, head_dim)).astype(numpy_dtype(dtype))
    return q, k, v


def reference_attention(q, k, v, mask4: np.ndarray, scale: float, bias=None) -> np.ndarray:
    """softmax(scale * q k^T (+ bias) over kept pairs) v in float64; rows with no kept key are 0.

    ``mask4`` is a boolean ``[Bm, Hm, Sq, Sk]`` mask broadcast over batch and heads, ``bias`` an additive score
    bias broadcast the same way.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    scores = np.einsum("bhid,bhjd->bhij", q, k) * scale
    if bias is not None:
        scores = scores + np.asarray(bias, dtype=np.float64)
    scores = np.where(mask4, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    probs = np.exp(scores - row_max)
    total = probs.sum(axis=-1, keepdims=True)
    return np.where(total > 0, (probs @ v) / np.where(total > 0, total, 1.0), 0.0)


def relative_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_attention_close(out, ref, mask4, dtype):
    """Finite everywhere (so nothing was left unwritten), exact zeros on empty rows, error within bounds."""
    out = np.asarray(out, dtype=np.float64)
    assert np.isfinite(out).all(), f"{np.count_nonzero(~np.isfinite(out))} non-finite outputs"
    empty = np.broadcast_to(~mask4.any(axis=-1), out.shape[:3])
    assert (out[empty] == 0).all(), "rows with no kept key must be exactly 0"
    err = relative_error(out, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.3e} > {TOLERANCE[dtype]} ({dtype})"
