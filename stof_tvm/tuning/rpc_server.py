"""``python -m stof_tvm.tuning.rpc_server ARGS``: TVM's stock RPC server (``tvm.exec.rpc_server``, same arguments)
with TVM's CUDA runtime loaded first, so that a server on a GPU host can run the CUDA modules it is sent.

The stock program only imports ``tvm``; with the pip build of TVM the CUDA device API lives in a separate
runtime library that nothing loads then, and every measurement on such a server failed (H200, two-GPU host).
On a host without CUDA the loader does nothing and the server serves the CPU as before."""
import runpy

from stof_tvm.cuda_runtime import ensure_cuda_runtime

if __name__ == "__main__":
    ensure_cuda_runtime()
    runpy.run_module("tvm.exec.rpc_server", run_name="__main__", alter_sys=True)
