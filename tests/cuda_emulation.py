"""Run a TVM-generated CUDA kernel on the CPU: enough of CUDA (``tests/cuda_emulation.h``) for the row-norm
templates' kernels (fp16 loads and stores through vector types, warp shuffles, ``__syncthreads``, ``__shared__``
arrays), so that a schedule's *lowered* kernel, not only its definition, is checked against numpy without a GPU.

Blocks run one after another; a block's threads run as ``std::thread`` s, warp shuffles exchange values through a
per-warp buffer between two barriers (every lane of a warp takes part, as in the kernels TVM emits), ``__shared__``
arrays are function statics (one block at a time). Needs g++ with C++20 ``<barrier>`` and ``_Float16``."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

HEADER = Path(__file__).with_name("cuda_emulation.h")


def kernel_body(src: str) -> tuple[str, list[str]]:
    """The definition of the ``main_kernel`` in TVM's CUDA source ``src`` (TVM's preamble and the declaration
    dropped, ``__shared__`` arrays made static) and its parameter names without the ``_ptr`` suffix."""
    body = src[src.index('extern "C" __global__'):]
    body = body[body.index(";\n") + 2:]
    body = re.sub(r"__shared__ alignas\((\d+)\)", r"alignas(\1) static", body).replace("__shared__", "static")
    signature = re.search(r"main_kernel\((.*?)\)\s*\{", body).group(1)
    return body, [p.split()[-1].removesuffix("_ptr") for p in signature.split(",")]


# element types the emulated kernels' buffers may have: numpy dtype -> (C type, fill of fresh outputs)
C_TYPES = {"float16": ("half", np.nan), "float32": ("float", np.nan), "int32": ("int32_t", -12345),
           "int64": ("int64_t", -12345)}


def run_on_cpu(src: str, arrays: dict[str, np.ndarray], outputs: dict[str, tuple], grid: int, block: tuple[int, int],
               workdir: Path, dtype: str | dict[str, str] = "float16") -> dict[str, np.ndarray]:
    """Launch ``src``'s kernel on ``grid`` blocks of ``block`` = (x, y) threads with ``arrays`` (by parameter
    name) and fresh ``outputs`` (name -> shape; NaN-filled for floats), every buffer of element type ``dtype``
    (:data:`C_TYPES`), or of ``dtype[name]`` where a dict names each buffer's; returns the outputs."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    body, params = kernel_body(src)
    types = dtype if isinstance(dtype, dict) else dict.fromkeys([*arrays, *outputs], dtype)
    buffers = {**{k: np.ascontiguousarray(v, types[k]) for k, v in arrays.items()},
               **{k: np.full(s, C_TYPES[types[k]][1], types[k]) for k, s in outputs.items()}}
    missing = [p for p in params if p not in buffers]
    if missing:
        raise ValueError(f"kernel parameters without data: {missing}")
    lines = [f'#include "{HEADER}"', body, "int main() {"]
    for p in params:
        ctype, width = C_TYPES[types[p]][0], buffers[p].itemsize
        buffers[p].tofile(workdir / f"{p}.in")
        lines += [f"  std::vector<{ctype}> {p}({buffers[p].size});",
                  f'  {{ FILE* f = fopen("{workdir / p}.in", "rb"); if (fread({p}.data(), {width}, {p}.size(), f) '
                  f"!= {p}.size()) return 2; fclose(f); }}"]
    call = ", ".join(f"{p}.data()" for p in params)
    lines.append(f"  launch([&] {{ main_kernel({call}); }}, {grid}, {block[0]}, {block[1]});")
    for p in outputs:
        lines.append(f'  {{ FILE* f = fopen("{workdir / p}.out", "wb"); fwrite({p}.data(), {buffers[p].itemsize}, '
                     f"{p}.size(), f); fclose(f); }}")
    lines.append("}")
    (workdir / "kernel.cpp").write_text("\n".join(lines))
    build = subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-w", "-o", str(workdir / "kernel"),
                            str(workdir / "kernel.cpp")], capture_output=True, text=True)
    if build.returncode:
        raise RuntimeError(f"g++ failed:\n{build.stderr[-3000:]}")
    subprocess.run([str(workdir / "kernel")], check=True, timeout=120)
    return {p: np.fromfile(workdir / f"{p}.out", types[p]).reshape(s) for p, s in outputs.items()}
