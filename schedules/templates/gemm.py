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


MAINLOOP_KNOBS = ("warps_m", "frag_m", "warps_n", "frag_n", "k_frags", "stages", "vec")


def knob_columns(space, names=MAINLOOP_KNOBS) -> dict[str, np.ndarray]:
    """The knob dicts of ``space`` as one int64 column per knob name, so formulas run once over the space."""
    return {key: np.array([knobs[key] for knobs in space], dtype=np.int64) for key in names}


def _product_columns(**choices) -> dict[str, np.ndarray]:
    """Every combination of the choices as int64 columns, in nested-loop order (first keyword outermost)."""
    grids = np.meshgrid(*[np.asarray(values, dtype=np.int64) for values in choices.values()], indexing="ij")
    return {key: grid.ravel() for key, grid in zip(choices, grids)}


def mainloop_columns(m, n, k, knobs) -> dict:
    """Per-block resources of the shared main loop for an (m x n x k) problem.

    ``knobs`` values are ints or equal-length numpy arrays (one entry per configuration); the results follow
    suit, so one definition serves a single configuration and a whole knob space at once."""
    bm = 16 * knobs["warps_m"] * knobs["frag_m"]
    bn = 16 * knobs["warps_n"] * knobs["frag_n"]
    bk = 16 * knobs["k_frags"]
    threads = 32 * knobs["warps_m"] * knobs["warps_n"]
    pipeline = knobs["stages"] * (bm + bn) * (bk + PAD) * ELEM_BYTES
    staging = bm * (bn + ACC_PAD) * 4
    return {
        "block_m": bm, "block_n": bn, "block_k": bk, "threads": threads,
        # the staging tile reuses the pipeline buffers once the k loop is done (TVM's storage rewrite)
        "shared_bytes": np.maximum(pipeline, staging),
        "acc_registers": 8 * knobs["frag_m"] * knobs["frag_n"],
        "operand_registers": 8 * (knobs["frag_m"] + knobs["frag_n"]),
        "grid": (m // bm) * (n // bn),
    }


def mainloop_resources(m, n, k, knobs) -> dict:
    """:func:`mainloop_columns` of one configuration, as plain ints (JSON-ready)."""
    return {key: int(value) for key, value in mainloop_columns(m, n, k, knobs).items()}


def mainloop_tiles_ok(m, n, k, knobs):
    """Whether the tiles divide the problem and the copies/epilogue divide over the threads (elementwise when
    ``knobs`` holds arrays)."""
    res = mainloop_columns(m, n, k, knobs)
    bm, bn, bk, threads = res["block_m"], res["block_n"], res["block_k"], res["threads"]
    copy_vec = COPY_BYTES // ELEM_BYTES
    return ((m % bm == 0) & (n % bn == 0) & (k % bk == 0)
            & ((bm * bk) % (threads * copy_vec) == 0) & ((bn * bk) % (threads * copy_vec) == 0)
            & ((bm * bn) % (threads * knobs["vec"]) == 0)
            & (res["acc_registers"] <= MAX_ACC_REGISTERS))


def mainloop_space(m, n, k, *, warps_n=WARP_CHOICES, frag_n=FRAG_CHOICES) -> list[dict]:
    """All main-loop configurations that tile (m, n, k); ordered by :func:`rank_order`.

    The 1728-combination grid is filtered and ranked as numpy columns (stage 1 of the tuner does this for every
    GEMM of a model, so a Python call per combination was most of its time); only survivors become dicts."""
    grid = _product_columns(warps_m=WARP_CHOICES, warps_n=warps_n, frag_m=FRAG_CHOICES, frag_n=frag_n,
                            k_frags=KFRAG_CHOICES, stages=STAGE_CHOICES, vec=VEC_CHOICES)
    ok = mainloop_tiles_ok(m, n, k, grid)
    kept = {key: grid[key][ok] for key in MAINLOOP_KNOBS}
    rows = np.stack([kept[key] for key in MAINLOOP_KNOBS], axis=1)[rank_order(m, n, k, kept)]
    return [dict(zip(MAINLOOP_KNOBS, row)) for row in rows.tolist()]


# Rough per-SM rates for ordering configurations (mma.sync float16 and L2 -> SM bandwidth on an H200).
MMA_FLOPS_PER_SM = 4.5e12
L2_BYTES_PER_SM = 5.0e10


def estimate_seconds(m, n, k, knobs, hw: Hardware = H200):
    """A roofline guess for the main loop (not the tuner's calibrated model): waves of blocks, each wave
    limited by tensor-core rate (scaled by warp-tile efficiency and warps per SM) or by L2 traffic.

    Elementwise when ``knobs`` holds arrays (see :func:`mainloop_columns`)."""
    res = mainloop_columns(m, n, k, knobs)
    threads, grid = res["threads"], res["grid"]
    by_threads = 2048 // threads
    by_smem = hw.max_shared_bytes_per_block // np.maximum(res["shared_bytes"], 1)
    per_sm = np.maximum(1, np.minimum(np.minimum(by_threads, by_smem), -(-grid // hw.sm_count)))
    waves = -(-grid // (hw.sm_count * per_sm))
    fm, fn = knobs["frag_m"], knobs["frag_n"]
    tile_eff = np.minimum(1.0, fm * fn / (fm + fn) / 2)
    occupancy = np.minimum(1.0, per_sm * threads / 32 / 8)
    compute = per_sm * 2 * res["block_m"] * res["block_n"] * k / (MMA_FLOPS_PER_SM * tile_eff * occupancy)
    memory = per_sm * (res["block_m"] + res["block_n"]) * k * ELEM_BYTES / L2_BYTES_PER_SM
    return waves * np.maximum(compute, memory)


def rank_order(m, n, k, columns, hw: Hardware = H200) -> np.ndarray:
    """Indices that order the configurations in ``columns`` (see :func:`knob_columns`) by
    :func:`estimate_seconds` rounded to 0.1 us, then prefer 3 stages, block_k 32, a wide epilogue.

    The sort is stable, so ties keep the enumeration order."""
    rounded = np.array([round(t, 7) for t in np.atleast_1d(estimate_seconds(m, n, k, columns, hw)).tolist()])
    return np.lexsort((-columns["vec"], columns["k_frags"], np.abs(columns["stages"] - 3), rounded))


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

    def resource_columns(self, shape, dtype, space):
        return mainloop_columns(shape["m"], shape["n"], shape["k"], knob_columns(space))

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
