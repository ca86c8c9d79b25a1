"""Template family 5: the QKV projection, GEMM + bias written straight into the attention layout.

``qkv[w, b, h, s, d] = x[b*S + s, :] @ W[w*H*D + h*D + d, :] + bias[w*H*D + h*D + d]`` for w in (Q, K, V):
one [3, B, H, S, D] output whose three [B, H, S, D] slices are what the attention kernels read, so no
separate reshape/transpose pass runs. The main loop is :mod:`.mainloop`; the epilogue writes each
(row, column) tile of the accumulator to its head-major place with ``vec``-wide stores along D.

Any sequence length: ``x`` has :meth:`QKVTemplate.rows` rows, ``B*S`` rounded up to a multiple of
:attr:`QKVTemplate.row_multiple` (16 for mma.sync; the caller zero-pads them, their results are never stored).
Where ``S`` is a multiple of 16 (BERT, GPT-2, T5 at their usual lengths) every tile of ``block_m`` rows lies inside
one sequence and the epilogue is the TE definition over ``[3, B, H, S, D]``. Other lengths (ViT: 197, 577 tokens)
take the *flat-row* definition, whose epilogue iterates over (Q/K/V, head, row, d) and stores row ``r`` at
``(r // S, r % S)``: a tile may then span two sequences, as the rows of one GEMM do.

``split_heads`` is the unfused second half: a copy of a [B*S, 3*H*D] GEMM output into [3, B, H, S, D].
"""
from __future__ import annotations

import numpy as np
from tvm import te
from tvm.script import tirx as T

from .deferred import cooperative
from .gemm import gemm_compute, knob_columns, mainloop_columns, mainloop_space, mainloop_resources
from .mainloop import schedule_mainloop
from .registry import Template, register

COPY_ROWS = (1, 2, 4, 8, 16)
COPY_VECS = (2, 4, 8)


def _dims(shape):
    b, s, h, d = shape["batch"], shape["seq"], shape["heads"], shape["head_dim"]
    return b, s, h, d, b * s, h * d


def _to_heads(y: np.ndarray, b, s, h, d) -> np.ndarray:
    """[B*S, 3*H*D] -> [3, B, H, S, D]."""
    return y.reshape(b, s, 3, h, d).transpose(2, 0, 3, 1, 4)


class QKVTemplate(Template):
    """x @ W_qkv^T + bias, written as [3, B, H, S, D]."""

    family = "qkv"
    fused = True
    shape_keys = ("batch", "seq", "heads", "head_dim")
    knob_names = ("warps_m", "frag_m", "warps_n", "frag_n", "k_frags", "stages", "vec")
    row_multiple = 16        # x's rows: B*S rounded up to this (the GEMM tiles' row granularity)

    def __init__(self, w_layout: str = "nk"):
        if w_layout not in ("nk", "kn"):
            raise ValueError(f"w_layout must be 'nk' or 'kn', got {w_layout!r}")
        self.w_layout = w_layout
        self.name = "qkv_projection" + ("_kn" if w_layout == "kn" else "")
        self.description = "qkv[3, B, H, S, D] = x @ W^T + bias"

    def _check(self, shape):
        b, s, h, d, m, hidden = _dims(shape)
        if d % 16 or hidden % 16:
            raise ValueError(f"{self.name}: head_dim and heads*head_dim must be multiples of 16, got {shape}")

    def rows(self, shape) -> int:
        """Rows of ``x``: ``batch * seq`` rounded up to :attr:`row_multiple` (the caller zero-pads the rest)."""
        m = shape["batch"] * shape["seq"]
        return -(-m // self.row_multiple) * self.row_multiple

    def flat_rows(self, shape) -> bool:
        """Whether ``shape`` takes the flat-row definition (module docstring): seq not a multiple of 16, or
        padded rows."""
        return shape["seq"] % 16 != 0 or self.rows(shape) != shape["batch"] * shape["seq"]

    def arguments(self, shape, dtype="float16"):
        b, s, h, d, m, hidden = _dims(shape)
        w = (3 * hidden, hidden) if self.w_layout == "nk" else (hidden, 3 * hidden)
        return [("x", (self.rows(shape), hidden), dtype), ("W", w, dtype), ("bias", (3 * hidden,), dtype),
                ("qkv", (3, b, h, s, d), dtype)]

    def flops(self, shape):
        b, s, h, d, m, hidden = _dims(shape)
        return 2 * m * 3 * hidden * hidden

    def _primfunc(self, shape, dtype):
        if self.flat_rows(shape):
            return _flat_row_primfunc(shape, self.rows(shape), dtype, self.w_layout)
        b, s, h, d, m, hidden = _dims(shape)
        x = te.placeholder((m, hidden), dtype, name="x")
        W = te.placeholder((3 * hidden, hidden) if self.w_layout == "nk" else (hidden, 3 * hidden), dtype, name="W")
        bias = te.placeholder((3 * hidden,), dtype, name="bias")
        acc = gemm_compute(x, W, self.w_layout)

        def heads(w, bi, hi, si, di):
            col = w * hidden + hi * d + di
            return (acc[bi * s + si, col] + bias[col].astype("float32")).astype(dtype)

        out = te.compute((3, b, h, s, d), heads, name="qkv")
        return te.create_prim_func([x, W, bias, out])

    def reference(self, shape, inputs):
        b, s, h, d, m, _ = _dims(shape)
        x = np.asarray(inputs["x"], np.float64)[:m]
        w = np.asarray(inputs["W"], np.float64)
        y = x @ (w.T if self.w_layout == "nk" else w) + np.asarray(inputs["bias"], np.float64)
        return [_to_heads(y, b, s, h, d)]

    def _knob_space(self, shape, dtype, hw):
        b, s, h, d, m, hidden = _dims(shape)
        flat = self.flat_rows(shape)
        space = []
        for kn in mainloop_space(self.rows(shape), 3 * hidden, hidden):
            bm = 16 * kn["warps_m"] * kn["frag_m"]
            bn = 16 * kn["warps_n"] * kn["frag_n"]
            # a tile covers whole heads (or lies inside one head), and (but in the flat-row definition) stays
            # inside one sequence
            if (flat or s % bm == 0) and (bn % d == 0 or d % bn == 0) and hidden % bn == 0 \
                    and min(bn, d) % kn["vec"] == 0:
                space.append(kn)
        return space

    def resources(self, shape, dtype, knobs):
        b, s, h, d, m, hidden = _dims(shape)
        return mainloop_resources(self.rows(shape), 3 * hidden, hidden, knobs)

    def resource_columns(self, shape, dtype, space):
        b, s, h, d, m, hidden = _dims(shape)
        return mainloop_columns(self.rows(shape), 3 * hidden, hidden, knob_columns(space))

    def _schedule(self, sch, spec, knobs):
        schedule_mainloop(sch, "gemm", dtype=spec["dtype"], b_layout=self.w_layout,
                          **{key: knobs[key] for key in ("warps_m", "frag_m", "warps_n", "frag_n", "k_frags",
                                                         "stages")},
                          consumers=["qkv"])
        cooperative(sch, sch.get_sblock("qkv"), knobs["vec"], stage_io=True)


def _flat_row_primfunc(shape, rows: int, dtype: str, w_layout: str):
    """The flat-row definition (module docstring): the GEMM over ``rows`` rows of ``x`` (``batch * seq`` real ones,
    then zero padding), the epilogue over (w, h, r, d) for the real rows, storing row ``r`` at sequence ``r // S``,
    position ``r % S``. Written in TVMScript because a TE output is indexed by its own loop variables."""
    b, s, h, d, m, hidden = _dims(shape)
    n = 3 * hidden
    w_shape = (n, hidden) if w_layout == "nk" else (hidden, n)

    def weight(W, j, k):
        return W[j, k] if w_layout == "nk" else W[k, j]

    @T.prim_func(s_tir=True)
    def main(x_h: T.handle, w_h: T.handle, bias_h: T.handle, qkv_h: T.handle):
        x = T.match_buffer(x_h, (rows, hidden), dtype)
        W = T.match_buffer(w_h, w_shape, dtype)
        bias = T.match_buffer(bias_h, (n,), dtype)
        qkv = T.match_buffer(qkv_h, (3, b, h, s, d), dtype)
        gemm = T.sblock_alloc_buffer((rows, n), "float32")
        for i, j, k in T.grid(rows, n, hidden):
            with T.sblock("gemm"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    gemm[vi, vj] = T.float32(0)
                gemm[vi, vj] = gemm[vi, vj] + T.Cast("float32", x[vi, vk]) * T.Cast("float32", weight(W, vj, vk))
        for w, hi, r, di in T.grid(3, h, m, d):
            with T.sblock("qkv"):
                vw, vh, vr, vd = T.axis.remap("SSSS", [w, hi, r, di])
                qkv[vw, vr // s, vh, vr % s, vd] = T.Cast(dtype, gemm[vr, vw * hidden + vh * d + vd]
                                                          + T.Cast("float32", bias[vw * hidden + vh * d + vd]))

    return main          # global symbol "main", as te.create_prim_func names the TE definition


class SplitHeadsTemplate(Template):
    """Copy a [B*S, 3*H*D] projection into [3, B, H, S, D] (the unfused QKV epilogue)."""

    family = "qkv"
    shape_keys = ("batch", "seq", "heads", "head_dim")
    knob_names = ("rows", "vec")
    name = "split_heads"
    description = "qkv[3, B, H, S, D] = y[B*S, 3*H*D] rearranged"

    def arguments(self, shape, dtype="float16"):
        b, s, h, d, m, hidden = _dims(shape)
        return [("y", (m, 3 * hidden), dtype), ("qkv", (3, b, h, s, d), dtype)]

    def _primfunc(self, shape, dtype):
        b, s, h, d, m, hidden = _dims(shape)
        y = te.placeholder((m, 3 * hidden), dtype, name="y")
        out = te.compute((3, b, h, s, d), lambda w, bi, hi, si, di: y[bi * s + si, w * hidden + hi * d + di],
                         name="qkv")
        return te.create_prim_func([y, out])

    def reference(self, shape, inputs):
        b, s, h, d, _, _ = _dims(shape)
        return [_to_heads(np.asarray(inputs["y"], np.float64), b, s, h, d)]

    def _knob_space(self, shape, dtype, hw):
        b, s, h, d, m, hidden = _dims(shape)
        space = [{"rows": r, "vec": v} for r in COPY_ROWS for v in COPY_VECS
                 if s % r == 0 and d % v == 0 and (r * d // v) % 32 == 0 and r * d // v <= hw.max_threads_per_block]
        space.sort(key=lambda k: (-k["vec"], abs(k["rows"] * d // k["vec"] - 256)))
        return space

    def resources(self, shape, dtype, knobs):
        b, s, h, d, m, hidden = _dims(shape)
        return {"threads": knobs["rows"] * d // knobs["vec"], "shared_bytes": 0, "acc_registers": 0,
                "operand_registers": knobs["vec"], "grid": 3 * b * h * s // knobs["rows"]}

    def _schedule(self, sch, spec, knobs):
        block = sch.get_sblock("qkv")
        w, bi, hi, si, di = sch.get_loops(block)
        so, si = sch.split(si, [None, knobs["rows"]])
        sch.bind(sch.fuse(w, bi, hi, so), "blockIdx.x")
        di, v = sch.split(di, [None, knobs["vec"]])
        sch.bind(sch.fuse(si, di), "threadIdx.x")
        sch.vectorize(v)


register(QKVTemplate("nk"))
register(QKVTemplate("kn"))
register(SplitHeadsTemplate())
