"""Opt-in Hopper templates: the GEMM (+ bias) (+ activation) family on ``wgmma`` (sm_90a).

Names: ``gemm_wgmma``, ``gemm_bias_wgmma``, ``gemm_bias_<act>_wgmma`` (act in relu, gelu_erf, gelu_tanh); the
weight is [n, k] (``torch.nn.Linear``) only. Same parameters, semantics and float64 reference as the
mma.sync ``gemm*`` templates of :mod:`.gemm`, so they are drop-in alternatives for a caller that opts in.

**Not a default anywhere.** No compile or tuning path picks these templates by itself: the compile path
maps GEMM calls to the ``gemm*`` names, and the tuner plans only the names it is given. Their numerics have
only been checked through compilation (nvcc sm_90a, SASS with HGMMA and no spills; tests/test_templates_wgmma.py)
until ``scripts/check_wgmma_gpu.py`` has run on an H200; use them explicitly (``get_template("gemm_wgmma")``).

Why the Template API differs here: the kernel (:mod:`.wgmma_kernel`) is written at thread level, because
TensorIR's schedule primitives cannot produce it: warp-specialized roles with ``setmaxnreg``, mbarrier
phases across a shared-memory ring, wgmma matrix descriptors over a 128-byte-swizzled layout, and
accumulators whose register layout is the instruction's. So:

- :meth:`~.registry.Template.primfunc` gives the knob-free TensorIR definition (the same as ``gemm*``,
  llvm-buildable: the CPU numerics reference, same signature as the kernel);
- :meth:`WgmmaGemmTemplate.kernel` gives the CUDA kernel for a shape, dtype and knobs;
- ``apply`` / ``sample`` raise ValueError (there is nothing to schedule); knobs are chosen from
  :meth:`~.registry.Template.knob_space` and the kernel is rebuilt per choice.

Knobs: ``block_n`` (128 or 256: wgmma N, output columns per block) and ``stages`` (2-5, ring depth).
The block is 128 rows (two consumer warpgroups of 64) and ``block_k`` is 64.
"""
from __future__ import annotations

import tvm

from .epilogue import ACTIVATIONS
from .gemm import GemmTemplate
from .registry import H200, Hardware, Template, register
from .wgmma_kernel import (BLOCK_K, BLOCK_M, BLOCK_N_CHOICES, CONSUMER_REGS, STAGE_CHOICES, THREADS, WgmmaConfig,
                           check_wgmma_shape, wgmma_gemm_primfunc)

ARCH = "sm_90a"


class WgmmaGemmTemplate(GemmTemplate):
    """GEMM (+ bias) (+ activation) as the warp-specialized wgmma kernel of :mod:`.wgmma_kernel`."""

    family = "gemm_wgmma"
    knob_names = ("block_n", "stages")

    def __init__(self, bias: bool, act: str):
        super().__init__(bias=bias, act=act, w_layout="nk")
        self.name = self.name + "_wgmma"
        self.description += " (wgmma, sm_90a, opt-in)"

    def _check(self, shape):
        for key, tile in (("m", BLOCK_M), ("n", min(BLOCK_N_CHOICES)), ("k", BLOCK_K)):
            if shape[key] % tile:
                raise ValueError(f"{self.name}: shape[{key!r}] must be a multiple of {tile}, got {shape[key]}")

    def config(self, knobs) -> WgmmaConfig:
        """The kernel configuration of ``knobs`` (ValueError naming a missing or bad knob)."""
        missing = [key for key in self.knob_names if key not in knobs]
        if missing:
            raise ValueError(f"{self.name}: knobs missing {missing}")
        config = WgmmaConfig(block_n=knobs["block_n"], stages=knobs["stages"])
        config.validate()
        return config

    def kernel(self, shape, dtype="float16", knobs=None) -> tvm.tirx.PrimFunc:
        """The thread-level CUDA PrimFunc (build for ``arch="sm_90a"``); knobs default to the first choice."""
        func = self.primfunc(shape, dtype)  # validates shape and dtype
        knobs = self.default_knobs(shape, dtype) if knobs is None else knobs
        config = self.config(knobs)
        check_wgmma_shape(shape["m"], shape["n"], shape["k"], config)
        kernel = wgmma_gemm_primfunc(shape["m"], shape["n"], shape["k"], dtype, bias=self.bias, act=self.act,
                                     config=config)
        return kernel.with_attr("stof.spec", func.attrs["stof.spec"])

    def _knob_space(self, shape, dtype, hw: Hardware = H200):
        space = [{"block_n": bn, "stages": st} for bn in BLOCK_N_CHOICES for st in STAGE_CHOICES
                 if shape["n"] % bn == 0]
        # prefer the wide tile when it still gives every SM a block, then 4 stages
        blocks = lambda kn: (shape["m"] // BLOCK_M) * (shape["n"] // kn["block_n"])  # noqa: E731
        return sorted(space, key=lambda kn: (blocks(kn) < hw.sm_count, -kn["block_n"], abs(kn["stages"] - 4)))

    def resources(self, shape, dtype, knobs):
        config = self.config(knobs)
        return {"block_m": BLOCK_M, "block_n": config.block_n, "block_k": BLOCK_K, "threads": THREADS,
                "shared_bytes": config.shared_bytes, "acc_registers": config.acc_registers,
                "max_registers_per_thread": CONSUMER_REGS,
                "grid": (shape["m"] // BLOCK_M) * (shape["n"] // config.block_n)}

    def resource_columns(self, shape, dtype, space):
        # not GemmTemplate's main-loop formulas: these resources come from WgmmaConfig, one knob set at a time
        return Template.resource_columns(self, shape, dtype, space)

    def _fits_space(self, shape, dtype, space, hw: Hardware):
        # setmaxnreg gives the consumers 232 registers and the producer 40 (the per-SM file holds one block)
        res = self.resource_columns(shape, dtype, space)
        return ((res["threads"] <= hw.max_threads_per_block) & (res["shared_bytes"] <= hw.max_shared_bytes_per_block)
                & (res["acc_registers"] + 40 <= CONSUMER_REGS))

    def _schedule(self, sch, spec, knobs):
        raise ValueError(f"{self.name} is a thread-level kernel with nothing to schedule: build "
                         f"get_template({self.name!r}).kernel(shape, dtype, knobs) for arch {ARCH!r}")


register(WgmmaGemmTemplate(bias=False, act="none"))
for _act in ACTIVATIONS:
    register(WgmmaGemmTemplate(bias=True, act=_act))


def build_kernel(name: str, shape, dtype: str = "float16", knobs=None):
    """Compile template ``name``'s wgmma kernel with TVM for CUDA sm_90a (host llvm); returns the executable,
    whose CUDA module is compiled from source when loaded (or from a cubin, see :func:`nvcc_cubin`)."""
    from .build import cuda_target
    from .registry import get_template

    template = get_template(name)
    if not isinstance(template, WgmmaGemmTemplate):
        raise ValueError(f"{name!r} is not a wgmma template (names end in '_wgmma')")
    return tvm.compile(tvm.IRModule({"main": template.kernel(shape, dtype, knobs)}), target=cuda_target(ARCH))


def nvcc_cubin(src: str, cubin_path, nvcc: str = "nvcc") -> dict:
    """Compile CUDA source for sm_90a with nvcc into ``cubin_path``; returns ptxas' figures (registers,
    stack_frame, spill_stores, spill_loads) and its performance warnings (``C75xx`` lines, e.g. a wgmma
    serialization or an ignored setmaxnreg). Raises RuntimeError with nvcc's output when it fails.

    ``-gencode=arch=compute_90a,code=sm_90a`` rather than ``-arch=sm_90a``: with nvcc 13.0 the shorthand also
    runs a plain sm_90 pass, which rejects wgmma and setmaxnreg."""
    import re
    import subprocess
    from pathlib import Path

    cubin_path = Path(cubin_path)
    cu = cubin_path.with_suffix(".cu")
    cu.write_text(src)
    proc = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-Xptxas", "-v",
                           "-o", str(cubin_path), str(cu)], capture_output=True, text=True)
    cu.unlink()
    text = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"nvcc failed for {cubin_path.name}:\n{text[-3000:]}")
    figures = {key: int(re.search(pattern, text).group(1)) for key, pattern in (
        ("registers", r"Used (\d+) registers"), ("stack_frame", r"(\d+) bytes stack frame"),
        ("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads"))}
    figures["warnings"] = [line.strip() for line in text.splitlines() if re.search(r"\(C75\d\d\)", line)]
    return figures
