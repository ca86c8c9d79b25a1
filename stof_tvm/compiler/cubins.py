"""Prebuild an executable's CUDA code with nvcc, so the artifact carries cubins instead of relying on the GPU
machine's compile at load.

Needed for the wgmma GEMM templates (``compile(..., gemm="wgmma")``) and the wgmma attention kernel: their
``wgmma`` and ``setmaxnreg`` instructions exist only on ``sm_90a``, and TVM's compile callback on the GPU machine
(NVRTC) builds for the plain ``sm_90`` it reads from the device. Each CUDA module of the executable is compiled
here with ``nvcc -gencode=arch=compute_90a,code=sm_90a`` (the shorthand ``-arch=sm_90a`` also runs a plain sm_90 pass
with nvcc 13.0, which rejects those instructions) and stored under the hash of its source
(:func:`stof_tvm.cuda_runtime.source_key`); :func:`stof_tvm.cuda_runtime.serve_cubins` answers TVM's
callback with them when the artifact is loaded. A source built before (a recompile with the same records) takes
its cubin from the persistent cubin cache (:mod:`.cubin_cache`) instead of running nvcc again.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from stof_tvm.cuda_runtime import source_key

from . import cubin_cache


def cuda_sources(executable) -> list[str]:
    """The CUDA C++ source of every CUDA module under ``executable`` (searching its imports)."""
    sources, pending = [], [executable.mod]
    while pending:
        module = pending.pop()
        if module.kind == "cuda":
            sources.append(module.inspect_source())
        pending.extend(module.imports)
    return sources


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def nvcc_flags(arch: str) -> list[str]:
    """nvcc's flags for a cubin of ``arch`` (``sm_90a`` -> ``compute_90a`` / ``sm_90a``)."""
    digits = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{digits},code=sm_{digits}", "-cubin", "-O3"]


def nvcc_cubin(source: str, arch: str, nvcc: str) -> bytes:
    """Compile ``source`` into a cubin for ``arch``, or take it from the cubin cache (:mod:`.cubin_cache`) where
    the same source was built before with the same flags and toolkit."""
    flags = nvcc_flags(arch)
    return cubin_cache.cached(cubin_cache.cache_key(source, flags, nvcc), lambda: run_nvcc(source, flags, nvcc))


def run_nvcc(source: str, flags: list[str], nvcc: str) -> bytes:
    """nvcc ``flags`` on ``source`` in a temporary folder; the cubin's bytes, or the compile errors raised."""
    with tempfile.TemporaryDirectory(prefix="stof_cubin_") as tmp:
        cu, cubin = os.path.join(tmp, "module.cu"), os.path.join(tmp, "module.cubin")
        with open(cu, "w") as f:
            f.write(source)
        proc = subprocess.run([nvcc, *flags, "-o", cubin, cu], capture_output=True, text=True)
        if proc.returncode:
            errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line]
            raise RuntimeError(f"nvcc failed to compile the module's CUDA code ({' '.join(flags)}):\n"
                               + "\n".join(errors[:20]))
        with open(cubin, "rb") as f:
            return f.read()


def prebuild_cubins(executable, arch: str) -> dict[str, bytes]:
    """``{source_key: cubin bytes}`` for every CUDA module of ``executable``; a clear error without nvcc."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise ValueError(f"wgmma kernels (gemm='wgmma', the wgmma attention kernel) must be prebuilt for {arch} "
                         f"with nvcc here (the GPU machine's compile at load targets plain sm_90), but nvcc is not on "
                         f"PATH or in /usr/local/cuda")
    sources = cuda_sources(executable)
    if not sources:
        raise RuntimeError("the executable has no CUDA module to prebuild")
    return {source_key(src): nvcc_cubin(src, arch, nvcc) for src in sources}
