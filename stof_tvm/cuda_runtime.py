"""Make TVM's CUDA runtime usable when ``tvm`` was imported without its compiler library.

Modules built for CUDA on a machine without a GPU carry CUDA source, compiled when they are loaded on the GPU
machine. A runtime-only ``import tvm`` (no ``libtvm_compiler.so``, or ``TVM_USE_RUNTIME_LIB=1``) breaks that
path twice: TVM's backend autoload is skipped, so ``libtvm_runtime_cuda.so`` (the CUDA module loader) is never
loaded, and TVM's compile callback asks ``Target.current()``, which the runtime library does not provide.
:func:`ensure_cuda_runtime` loads the library and, in runtime-only mode, registers a compile callback that takes
the architecture from the GPU itself. With the full compiler present it only confirms the library is loaded.
"""
from __future__ import annotations

from pathlib import Path


def cuda_runtime_library() -> str | None:
    """Path of TVM's CUDA runtime library once :func:`ensure_cuda_runtime` has loaded it (else None)."""
    import tvm.base

    lib = tvm.base._LOADED_LIBS.get("tvm_runtime_cuda")
    return None if lib is None else str(Path(lib._name).resolve())


def ensure_cuda_runtime() -> bool:
    """Load TVM's CUDA runtime library if needed; return True when CUDA modules can be loaded."""
    import tvm
    import tvm.base
    from tvm_ffi.libinfo import load_lib_ctypes

    if "tvm_runtime_cuda" not in tvm.base._LOADED_LIBS:
        runtime_dir = Path(tvm.base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent
        try:
            tvm.base._LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
                package="tvm", target_name="tvm_runtime_cuda", extra_lib_paths=[runtime_dir], mode="RTLD_LOCAL")
        except (OSError, FileNotFoundError, RuntimeError):
            return False
    if tvm.base._RUNTIME_ONLY:
        import tvm_ffi

        tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile_for_this_gpu, override=True)
    return True


def _compile_for_this_gpu(code: str) -> bytes:
    """Compile CUDA source to a cubin for GPU 0's architecture with NVRTC (TVM's nvcc path needs the compiler).

    Source using Hopper-only instructions (``wgmma``, ``setmaxnreg``: the wgmma templates' kernels, which the
    tuner sends to the GPU one knob set at a time) is compiled for ``sm_90a``, the only architecture with them."""
    import tvm
    from tvm.support import nvcc

    arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "")
    if arch == "sm_90" and ("wgmma." in code or "setmaxnreg" in code):
        arch = "sm_90a"
    return nvcc.compile_cuda(code, target_format="cubin", arch=arch, compiler="nvrtc")


def source_key(code: str) -> str:
    """The name a prebuilt binary of CUDA source ``code`` is stored under (its SHA-256, 24 hex digits)."""
    import hashlib

    return hashlib.sha256(code.encode()).hexdigest()[:24]


def serve_cubins(cubins: dict) -> None:
    """Answer TVM's CUDA compile callback with prebuilt binaries: ``cubins`` maps :func:`source_key` of a CUDA
    source to its cubin bytes; other sources go to the callback registered before (NVRTC or nvcc).

    Artifacts whose kernels need an architecture the GPU's own compile would not target (wgmma kernels need
    ``sm_90a``; TVM's callback compiles for plain ``sm_90``) carry such binaries; call this before loading them."""
    import tvm_ffi

    previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)

    def compile_or_serve(code, *rest):
        binary = cubins.get(source_key(code))
        if binary is not None:
            return bytearray(binary)
        if previous is None:
            raise RuntimeError("no prebuilt cubin for this CUDA source and no CUDA compile callback registered")
        return previous(code, *rest)

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_or_serve, override=True)
