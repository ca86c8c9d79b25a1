"""``python -m stof_tvm.tuning.rpc_server ARGS``: TVM's stock RPC server (``tvm.exec.rpc_server``, same arguments)
made to serve CUDA devices.

Two things the stock program gets wrong on a GPU host, both seen on the two-H200 host:

- it only imports ``tvm``; with the pip build of TVM the CUDA device API lives in a separate runtime library that
  nothing loads then, so no CUDA module could be loaded (every measurement failed);
- it serves each session in a *forked* child; once the server process has touched the CUDA driver, a forked
  child cannot use it (``cudaErrorInitializationError`` on every measurement).

So on a host with a CUDA device this wrapper loads the CUDA runtime library, and serves sessions in *spawned*
children (``--no-fork``) that load the same library first (``--load-library``). On a host without CUDA it runs
the stock server unchanged (forked sessions, CPU only)."""
import runpy
import sys

from stof_tvm.cuda_runtime import cuda_runtime_library, ensure_cuda_runtime


def _cuda_arguments() -> list[str]:
    """Extra server arguments for serving CUDA: spawned sessions that load TVM's CUDA runtime library."""
    import tvm

    if not ensure_cuda_runtime() or not tvm.cuda(0).exist:
        return []
    library = cuda_runtime_library()
    return ["--no-fork"] + (["--load-library", library] if library else [])


if __name__ == "__main__":
    sys.argv += _cuda_arguments()
    runpy.run_module("tvm.exec.rpc_server", run_name="__main__", alter_sys=True)
