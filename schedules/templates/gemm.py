"""Template family 1: GEMM (+ bias) (+ ReLU / GELU-erf / GELU-tanh), on tensor cores.

``out[m, n] = act(sum_k A[m, k] * W[n, k] + bias[n])`` with A, W, bias, out in float16 or bfloat16 and
a float32 accumulator. ``W`` is [n, k] (``w_layout="nk"``, torch.nn.Linear) or [k, n] (``"kn"``, ONNX
MatMul); the layout is part of the template name (``gemm_bias_gelu_erf`` / ``gemm_bias_gelu_erf_kn``).

Schedule: :func:`.mainloop.schedule_mainloop` (mma.sync + ldmatrix + cp.async pipeline); the epilogue
reads the float32 staging tile with ``vec``-wide accesses, adds the bias, applies the activation and
stores ``vec`` outputs per thread. Knobs: warps_m, frag_m, warps_n, frag_n (block tile = 16*warps*frag
per side), k_frags (block_k = 16*k_frags), stages (pipeline depth), vec (epilogue width).
"""
from __future__ import annotations

import math

import numpy as np
from tvm import te

from .epilogue import ACTIVATIONS, activation, activation_np, check_activation
from .deferred import cooperative
from .mainloop import ACC_PAD, COPY_BYTES, PAD, schedule_mainloop
from .registry import H200, Hardware, Template, register

WARP_CHOICES = (1, 2, 4)
FRAG_CHOICES = (1, 2, 4, 8)
KFRAG_CHOICES = (2, 4)
STAGE_CHOICES = (2, 3, 4)
VEC_CHOICES = (4, 8)
MAX_ACC_REGISTERS = 128
ELEM_BYTES = 2


def mainloop_resources(m, n, k, knobs) -> dict:
    """Per-block resources of the shared main loop for an (m x n x k) problem."""
    bm = 16 * knobs["warps_m"] * knobs["frag_m"]
    bn = 16 * knobs["warps_n"] * knobs["frag_n"]
    bk = 16 * knobs["k_frags"]
    threads = 32 * knobs["warps_m"] * knobs["warps_n"]
    pipeline = knobs["stages"] * (bm + bn) * (bk + PAD) * ELEM_BYTES
    staging = bm * (bn + ACC_PAD) * 4
    return {
        "block_m": bm, "block_n": bn, "block_k": bk, "threads": threads,
        # the staging tile reuses the pipeline buffers once the k loop is done (TVM's storage rewrite)
        "shared_bytes": max(pipeline, staging),
        "acc_registers": 8 * knobs["frag_m"] * knobs["frag_n"],
        "operand_registers": 8 * (knobs["frag_m"] + knobs["frag_n"]),
        "grid": (m // bm) * (n // bn),
    }


def mainloop_tiles_ok(m, n, k, knobs) -> bool:
    """Whether the tiles divide the problem and the copies/epilogue divide over the threads."""
    res = mainloop_resources(m, n, k, knobs)
    bm, bn, bk, threads = res["block_m"], res["block_n"], res["block_k"], res["threads"]
    copy_vec = COPY_BYTES // ELEM_BYTES
    return (m % bm == 0 and n % bn == 0 and k % bk == 0
            and (bm * bk) % (threads * copy_vec) == 0 and (bn * bk) % (threads * copy_vec) == 0
            and (bm * bn) % (threads * knobs["vec"]) == 0
            and res["acc_registers"] <= MAX_ACC_REGISTERS)


def mainloop_space(m, n, k, *, warps_n=WARP_CHOICES, frag_n=FRAG_CHOICES) -> list[dict]:
    """All main-loop configurations that tile (m, n, k); ordered by :func:`rank_key`."""
    space = []
    for wm in WARP_CHOICES:
        for wn in warps_n:
            for fm in FRAG_CHOICES:
                for fn in frag_n:
                    for kf in KFRAG_CHOICES:
                        for st in STAGE_CHOICES:
                            for vec in VEC_CHOICES:
                                knobs = {"warps_m": wm, "frag_m": fm, "warps_n": wn, "frag_n": fn,
                                         "k_frags": kf, "stages": st, "vec": vec}
                                if mainloop_tiles_ok(m, n, k, knobs):
                                    space.append(knobs)
    space.sort(key=lambda kn: rank_key(m, n, k, kn))
    return space


# Rough per-SM rates for ordering configurations (mma.sync float16 and L2 -> SM bandwidth on an H200).
MMA_FLOPS_PER_SM = 4.5e12
L2_BYTES_PER_SM = 5.0e10


def estimate_seconds(m, n, k, knobs, hw: Hardware = H200) -> float:
    """A roofline guess for the main loop (not the tuner's calibrated model): waves of blocks, each wave
    limited by tensor-core rate (scaled by warp-tile efficiency and warps per SM) or by L2 traffic."""
    res = mainloop_resources(m, n, k, knobs)
    by_threads = 2048 // res["threads"]
    by_smem = hw.max_shared_bytes_per_block // max(res["shared_bytes"], 1)
    per_sm = max(1, min(by_threads, by_smem, math.ceil(res["grid"] / hw.sm_count)))
    waves = math.ceil(res["grid"] / (hw.sm_count * per_sm))
    fm, fn = knobs["frag_m"], knobs["frag_n"]
    tile_eff = min(1.0, fm * fn / (fm + fn) / 2)
    occupancy = min(1.0, per_sm * res["threads"] / 32 / 8)
    compute = per_sm * 2 * res["block_m"] * res["block_n"] * k / (MMA_FLOPS_PER_SM * tile_eff * occupancy)
    memory = per_sm * (res["block_m"] + res["block_n"]) * k * ELEM_BYTES / L2_BYTES_PER_SM
    return waves * max(compute, memory)


def rank_key(m, n, k, knobs, hw: Hardware = H200):
    """Order configurations by :func:`estimate_seconds`, then prefer 3 stages, block_k 32, a wide epilogue."""
    return (round(estimate_seconds(m, n, k, knobs, hw), 7), abs(knobs["stages"] - 3), knobs["k_frags"],
            -knobs["vec"])


class GemmTemplate(Template):
    """GEMM with optional bias and activation in the epilogue."""

    family = "gemm"
    shape_keys = ("m", "n", "k")
    knob_names = ("warps_m", "frag_m", "warps_n", "frag_n", "k_frags", "stages", "vec")

    def __init__(self, bias: bool, act: str, w_layout: str = "nk"):
        check_activation(act)
        if w_layout not in ("nk", "kn"):
            raise ValueError(f"w_layout must be 'nk' or 'kn', got {w_layout!r}")
        self.bias, self.act, self.w_layout = bias, act, w_layout
        parts = ["gemm"] + (["bias"] if bias else []) + ([act] if act != "none" else [])
        self.name = "_".join(parts) + ("_kn" if w_layout == "kn" else "")
        self.fused = bias or act != "none"
        self.description = f"out = {act}(A @ W{'^T' if w_layout == 'nk' else ''}{' + bias' if bias else ''})"

    def _check(self, shape):
        for key in ("m", "n", "k"):
            if shape[key] % 16:
                raise ValueError(f"{self.name}: shape[{key!r}] must be a multiple of 16, got {shape[key]}")

    def arguments(self, shape, dtype="float16"):
        m, n, k = shape["m"], shape["n"], shape["k"]
        args = [("A", (m, k), dtype), ("W", (n, k) if self.w_layout == "nk" else (k, n), dtype)]
        if self.bias:
            args.append(("bias", (n,), dtype))
        return args + [("out", (m, n), dtype)]

    def flops(self, shape):
        return 2 * shape["m"] * shape["n"] * shape["k"]

    def _primfunc(self, shape, dtype):
        m, n, k = shape["m"], shape["n"], shape["k"]
        A = te.placeholder((m, k), dtype, name="A")
        W = te.placeholder((n, k) if self.w_layout == "nk" else (k, n), dtype, name="W")
        acc = gemm_compute(A, W, self.w_layout)
        params = [A, W]
        if self.bias:
            bias = te.placeholder((n,), dtype, name="bias")
            params.append(bias)

        def epilogue(i, j):
            x = acc[i, j] + bias[j].astype("float32") if self.bias else acc[i, j]
            return activation(self.act, x).astype(dtype)

        out = te.compute((m, n), epilogue, name="out")
        return te.create_prim_func(params + [out])

    def reference(self, shape, inputs):
        a = np.asarray(inputs["A"], np.float64)
        w = np.asarray(inputs["W"], np.float64)
        y = a @ (w.T if self.w_layout == "nk" else w)
        if self.bias:
            y = y + np.asarray(inputs["bias"], np.float64)
        return [activation_np(self.act, y)]

    def _knob_space(self, shape, dtype, hw):
        return mainloop_space(shape["m"], shape["n"], shape["k"])

    def resources(self, shape, dtype, knobs):
        return mainloop_resources(shape["m"], shape["n"], shape["k"], knobs)

    def _schedule(self, sch, spec, knobs):
        schedule_mainloop(sch, "gemm", dtype=spec["dtype"], b_layout=self.w_layout,
                                 **{key: knobs[key] for key in ("warps_m", "frag_m", "warps_n", "frag_n",
                                                                "k_frags", "stages")},
                                 consumers=["out"])
        out = sch.get_sblock("out")
        cooperative(sch, out, knobs["vec"], stage_io=True)


def gemm_compute(A, W, w_layout: str, name: str = "gemm"):
    """float32 accumulation of A[m, k] times W ([n, k] or [k, n]) as a TE reduction named ``name``."""
    m, k = A.shape
    n = W.shape[0] if w_layout == "nk" else W.shape[1]
    r = te.reduce_axis((0, k), name="k")
    if w_layout == "nk":
        return te.compute((m, n), lambda i, j: te.sum(A[i, r].astype("float32") * W[j, r].astype("float32"), axis=r),
                          name=name)
    return te.compute((m, n), lambda i, j: te.sum(A[i, r].astype("float32") * W[r, j].astype("float32"), axis=r),
                      name=name)


for _layout in ("nk", "kn"):
    register(GemmTemplate(bias=False, act="none", w_layout=_layout))
    for _act in ACTIVATIONS:
        register(GemmTemplate(bias=True, act=_act, w_layout=_layout))
