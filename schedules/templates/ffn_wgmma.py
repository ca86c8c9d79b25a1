"""Template family 4: the fused FFN ``out = act(x @ W1^T + b1) @ W2^T (+ b2)`` on wgmma (sm_90a), for hidden <= 256.

Names: ``ffn_<act>_wgmma`` (no second bias: the form a following ``bias_residual_layernorm`` completes) and
``ffn_<act>_bias_wgmma`` (``+ b2``), act in relu, gelu_erf, gelu_tanh. Shape keys ``m`` (tokens), ``hidden``,
``ffn``; parameters ``x [m, hidden], W1 [ffn, hidden], b1 [ffn], W2 [hidden, ffn] (, b2 [hidden]), out [m, hidden]``
(``torch.nn.Linear`` layouts), float16 or bfloat16 in and out, float32 accumulation. The intermediate is
rounded to the input dtype before the second GEMM, as the unfused pair stores it.

Only small models fit: the second GEMM's 128-row float32 accumulator stays in registers across the whole ffn
loop, so ``hidden`` must be 128, 192 or 256 (the tiny BERT of :mod:`stof_tvm.models`: hidden 128, ffn 512).
Anything else raises ValueError naming the limit; BERT-Base and larger keep the unfused
``gemm_bias_<act>`` + ``gemm_bias`` pair (:data:`.chains.CHAINS`).

Like the wgmma GEMMs (:mod:`.gemm_wgmma`), the kernel is thread-level (:mod:`.ffn_kernel`): ``primfunc`` is the
knob-free TensorIR definition (llvm-buildable, the CPU numerics reference), ``kernel(shape, dtype, knobs)`` the
CUDA kernel, and ``apply`` / ``sample`` raise. Knobs: ``chunk_f`` (64 or 128 intermediate columns per step) and
``stages`` (2-5 ring slots, each holding one chunk of W1 and of W2), within the register and shared-memory
budget (:func:`.ffn_kernel.check_ffn_shape`).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te

from .epilogue import activation, activation_np
from .ffn_kernel import (ADDRESSING_REGS, CHUNK_F_CHOICES, FfnConfig, check_ffn_dims, check_ffn_shape,
                         ffn_primfunc)
from .gemm import gemm_compute
from .registry import H200, Hardware, Template, register
from .wgmma_kernel import BLOCK_M, CONSUMER_REGS, LAUNCH_REGISTERS, STAGE_CHOICES, THREADS

ACTS = ("relu", "gelu_erf", "gelu_tanh")


class FfnWgmmaTemplate(Template):
    """The fused FFN as the warp-specialized kernel of :mod:`.ffn_kernel`."""

    family = "ffn_wgmma"
    fused = True
    shape_keys = ("m", "hidden", "ffn")
    knob_names = ("chunk_f", "stages")

    def __init__(self, act: str, bias2: bool):
        if act not in ACTS:
            raise ValueError(f"act must be one of {ACTS}, got {act!r}")
        self.act, self.bias2 = act, bias2
        self.name = f"ffn_{act}{'_bias' if bias2 else ''}_wgmma"
        self.description = (f"out = {act}(x @ W1^T + b1) @ W2^T{' + b2' if bias2 else ''} "
                            "(intermediate on chip; wgmma, sm_90a)")

    # ---- definition ----------------------------------------------------------------------------------------
    def _check(self, shape):
        check_ffn_dims(shape["m"], shape["hidden"], shape["ffn"])

    def arguments(self, shape, dtype="float16"):
        m, h, f = shape["m"], shape["hidden"], shape["ffn"]
        args = [("x", (m, h), dtype), ("W1", (f, h), dtype), ("b1", (f,), dtype), ("W2", (h, f), dtype)]
        if self.bias2:
            args.append(("b2", (h,), dtype))
        return args + [("out", (m, h), dtype)]

    def flops(self, shape):
        return 4 * shape["m"] * shape["hidden"] * shape["ffn"]

    def _primfunc(self, shape, dtype):
        m, h, f = shape["m"], shape["hidden"], shape["ffn"]
        x = te.placeholder((m, h), dtype, name="x")
        w1 = te.placeholder((f, h), dtype, name="W1")
        b1 = te.placeholder((f,), dtype, name="b1")
        w2 = te.placeholder((h, f), dtype, name="W2")
        up = gemm_compute(x, w1, "nk", name="up")
        mid = te.compute((m, f), lambda i, j: activation(self.act, up[i, j] + b1[j].astype("float32")).astype(dtype),
                         name="intermediate")
        down = gemm_compute(mid, w2, "nk", name="down")
        params = [x, w1, b1, w2]
        if self.bias2:
            b2 = te.placeholder((h,), dtype, name="b2")
            params.append(b2)
            out = te.compute((m, h), lambda i, j: (down[i, j] + b2[j].astype("float32")).astype(dtype), name="out")
        else:
            out = te.compute((m, h), lambda i, j: down[i, j].astype(dtype), name="out")
        return te.create_prim_func(params + [out])

    def reference(self, shape, inputs):
        f64 = lambda name: np.asarray(inputs[name], np.float64)  # noqa: E731
        mid = activation_np(self.act, f64("x") @ f64("W1").T + f64("b1"))
        out = mid @ f64("W2").T
        return [out + f64("b2") if self.bias2 else out]

    # ---- knobs and resources -------------------------------------------------------------------------------
    def config(self, knobs) -> FfnConfig:
        """The kernel configuration of ``knobs`` (ValueError naming a missing or bad knob)."""
        missing = [key for key in self.knob_names if key not in knobs]
        if missing:
            raise ValueError(f"{self.name}: knobs missing {missing}")
        config = FfnConfig(chunk_f=knobs["chunk_f"], stages=knobs["stages"])
        config.validate()
        return config

    def _knob_space(self, shape, dtype, hw: Hardware = H200):
        # Untuned order (not yet measured): the wider chunk (wgmma N 128 for the first GEMM, half the barrier
        # rounds), then the deepest ring up to 4 slots.
        space = [{"chunk_f": cf, "stages": st} for cf in CHUNK_F_CHOICES for st in STAGE_CHOICES
                 if shape["ffn"] % cf == 0]
        return sorted(space, key=lambda kn: (-kn["chunk_f"], abs(kn["stages"] - 4)))

    def resources(self, shape, dtype, knobs):
        config = self.config(knobs)
        acc, operand = config.fragment_registers(shape["hidden"])
        return {"threads": THREADS, "shared_bytes": config.shared_bytes(shape["hidden"]), "acc_registers": acc,
                "operand_registers": operand, "max_registers_per_thread": CONSUMER_REGS,
                "launch_registers": LAUNCH_REGISTERS,
                "grid": shape["m"] // BLOCK_M, "chunks": shape["ffn"] // config.chunk_f}

    def _fits_space(self, shape, dtype, space, hw: Hardware):
        # setmaxnreg gives each consumer thread 232 registers (the producer 40); one block per SM
        res = self.resource_columns(shape, dtype, space)
        return ((res["threads"] <= hw.max_threads_per_block) & (res["shared_bytes"] <= hw.max_shared_bytes_per_block)
                & (res["acc_registers"] + res["operand_registers"] + ADDRESSING_REGS <= CONSUMER_REGS))

    def _schedule(self, sch, spec, knobs):
        raise ValueError(f"{self.name} is a thread-level kernel with nothing to schedule: build "
                         f"get_template({self.name!r}).kernel(shape, dtype, knobs) for arch 'sm_90a'")

    # ---- the CUDA kernel -----------------------------------------------------------------------------------
    def kernel(self, shape, dtype="float16", knobs=None) -> tvm.tirx.PrimFunc:
        """The thread-level CUDA PrimFunc (build for ``arch="sm_90a"``); knobs default to the first choice."""
        func = self.primfunc(shape, dtype)  # validates shape and dtype
        knobs = self.default_knobs(shape, dtype) if knobs is None else knobs
        config = self.config(knobs)
        check_ffn_shape(shape["m"], shape["hidden"], shape["ffn"], config)
        kernel = ffn_primfunc(shape["m"], shape["hidden"], shape["ffn"], dtype, act=self.act, bias2=self.bias2,
                              config=config)
        return kernel.with_attr("stof.spec", func.attrs["stof.spec"])


for _act in ACTS:
    for _bias2 in (False, True):
        register(FfnWgmmaTemplate(_act, _bias2))
