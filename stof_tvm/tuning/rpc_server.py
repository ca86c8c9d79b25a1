"""``python -m stof_tvm.tuning.rpc_server ARGS``: a TVM RPC server (``tvm.rpc.Server``, the arguments of
``tvm.exec.rpc_server``) that can measure CUDA modules, one fresh process per session.

The stock server gets three things wrong on a GPU host, all seen on the two-H200 host:

- it only imports ``tvm``; with the pip build of TVM the CUDA device API lives in a separate runtime library that
  nothing loads then, so no CUDA module could be loaded (every measurement failed);
- it serves each session in a *forked* child; once the serving process has touched the CUDA driver, a forked
  child cannot use it (``cudaErrorInitializationError`` on every measurement);
- its ``--no-fork`` mode spawns a new interpreter per session, which imports TVM again: 7 s per measurement.

Here each session is forked from a *fork server* (``multiprocessing``'s ``forkserver`` start method), a process
that has imported TVM's RPC server and nothing of CUDA, so a fork is cheap and its child starts with a clean
driver; the child loads TVM's CUDA runtime library (``--load-library``) before serving. On a host without that
library the sessions serve the CPU, the same way.

"Nothing of CUDA" needs one more step where torch is installed (the GPU machines): importing ``tvm_ffi`` then
calls ``torch.cuda.is_available()``, which initialises the CUDA driver (measured on the H200 host: a child forked
after a plain ``import tvm`` fails with ``cudaErrorInitializationError``). The fork server therefore starts with
``TVM_FFI_DISABLE_TORCH_C_DLPACK=1``, which skips that torch hook; the sessions do not exchange torch tensors.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os

# Imported once by the fork server, so that every session's fork starts with them loaded.
FORKSERVER_PRELOAD = ["tvm", "tvm.rpc.server"]
# Environment of the fork server: tvm_ffi's torch hook initialises CUDA on import unless disabled.
FORKSERVER_ENV = {"TVM_FFI_DISABLE_TORCH_C_DLPACK": "1"}


def use_fork_server() -> None:
    """Run by the server process before it serves: sessions fork from a fork server (see the module docstring).

    The fork server is started later, at the first session, with this process's environment."""
    os.environ.update(FORKSERVER_ENV)
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)


def cuda_library() -> str | None:
    """TVM's CUDA runtime library, for the sessions to load (None on a host without it)."""
    from stof_tvm.cuda_runtime import cuda_runtime_library, ensure_cuda_runtime

    return cuda_runtime_library() if ensure_cuda_runtime() else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to bind")
    parser.add_argument("--port", type=int, default=9090, help="first port to try")
    parser.add_argument("--port-end", type=int, default=9199, help="end of the port range")
    parser.add_argument("--tracker", help="tracker address HOST:PORT to register with")
    parser.add_argument("--key", default="", help="the key this server registers under (with --tracker)")
    parser.add_argument("--custom-addr", help="the address the tracker hands to clients (behind NAT)")
    parser.add_argument("--load-library", help="more libraries for each session to load, ':'-separated")
    parser.add_argument("--silent", action="store_true", help="log errors only")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    from tvm import rpc

    from stof_tvm.tuning.rpc import parse_address

    args = parse_args(argv)
    tracker = parse_address(args.tracker, "--tracker") if args.tracker else None
    if tracker is not None and not args.key:
        raise SystemExit("--key: a server registered with a tracker needs a key")
    libraries = [lib for lib in (cuda_library(), args.load_library) if lib]
    server = rpc.Server(args.host, args.port, args.port_end, key=args.key, tracker_addr=tracker,
                        load_library=":".join(libraries) or None, custom_addr=args.custom_addr,
                        silent=args.silent, server_init_callback=use_fork_server)
    server.proc.join()


if __name__ == "__main__":
    main()
