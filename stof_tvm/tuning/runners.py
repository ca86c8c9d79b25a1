"""Builders and runners for stage 2: local measurement or a TVM RPC tracker, with valid sparse-format inputs.

MetaSchedule's runners fill every kernel argument with random data. Our sparse kernels read index arrays
(row pointers, column indices, bitmaps) that must describe a real mask, or they read out of bounds.
:class:`ArgumentFactory` is the runners' ``f_alloc_argument``: it allocates as the default does, then copies
the registered arrays into the arguments that need them. It is looked up by the argument signature (dtype and
shape of every parameter), the only thing a runner knows about the kernel it measures. The factory is a plain
picklable object: MetaSchedule ships it to its worker processes with cloudpickle.

:func:`make_runner` is the one place that picks local or RPC measurement (the docker and multi-GPU tooling
reuses it); :func:`parse_tracker` reads ``HOST:PORT``.
"""
from __future__ import annotations

import hashlib

import numpy as np
import tvm
from tvm.s_tir import meta_schedule as ms

from .rpc import count_servers
from .task import TuningTask

__all__ = ["ArgumentFactory", "make_builder", "make_runner", "parse_tracker", "evaluator_config"]


# Arguments the local runner's worker process (a long-lived child) already allocated and filled, by device,
# signature and fixed arrays, oldest first: filling a GPU argument with random data goes through host memory
# and costs about a second per candidate for a 16x2048 BERT layer's GEMM, the same for every candidate of a
# signature. Bounded to the last few signatures: enough for a model's calls (a base model's untuned choices,
# measured first, are 7 signatures: QKV, two GEMMs, GELU GEMM, attention, two LayerNorms), a few GB at 16x2048.
_LOCAL_ARGUMENTS: dict = {}
_LOCAL_ARGUMENTS_KEPT = 8


class ArgumentFactory:
    """``f_alloc_argument`` for MetaSchedule runners: random arguments, except registered fixed arrays.

    ``rpc=False`` gives the LocalRunner signature ``(device, args_info, alloc_repeat)``, ``rpc=True`` the
    RPCRunner one ``(session, device, args_info, alloc_repeat)``. Locally, the arguments of a signature are
    allocated and filled once per worker process and reused by every later candidate of that signature (their
    contents only need to be valid: random data, the registered format arrays).
    """

    def __init__(self, rpc: bool = False):
        self.rpc = rpc
        self.fixed: dict[tuple, dict[int, np.ndarray]] = {}
        self.digests: dict[tuple, str] = {}

    def register(self, task: TuningTask) -> bool:
        """Add ``task``'s fixed arrays; False when another task with the same signature needs other arrays
        (then the two must be measured in separate runs)."""
        if not task.fixed_args:
            return True
        signature = task.signature()
        arrays = {int(i): np.ascontiguousarray(a) for i, a in task.fixed_args.items()}
        for index, array in arrays.items():
            dtype, shape = signature[index]
            if array.dtype != np.dtype(dtype) or array.shape != shape:
                raise ValueError(f"task {task.name}: fixed argument {index} is {array.dtype}{list(array.shape)}, "
                                 f"the kernel expects {dtype}{list(shape)}")
        known = self.fixed.get(signature)
        if known is not None:
            same = known.keys() == arrays.keys() and all(np.array_equal(known[i], arrays[i]) for i in arrays)
            return same
        self.fixed[signature] = arrays
        self.digests[signature] = hashlib.sha256(b"".join(arrays[i].tobytes() for i in sorted(arrays))).hexdigest()
        return True

    def __call__(self, *args):
        if self.rpc:
            session, device, args_info, alloc_repeat = args
            repeated = ms.runner.rpc_runner.default_alloc_argument(session, device, args_info, alloc_repeat)
        else:
            device, args_info, alloc_repeat = args
            signature = _signature(args_info)
            key = (str(device), signature, self.digests.get(signature), alloc_repeat)
            if key in _LOCAL_ARGUMENTS:
                return _LOCAL_ARGUMENTS[key]
            repeated = ms.runner.local_runner.default_alloc_argument(device, args_info, alloc_repeat)
            while len(_LOCAL_ARGUMENTS) >= _LOCAL_ARGUMENTS_KEPT:
                _LOCAL_ARGUMENTS.pop(next(iter(_LOCAL_ARGUMENTS)))
            _LOCAL_ARGUMENTS[key] = repeated
        for index, array in self.fixed.get(_signature(args_info), {}).items():
            for arguments in repeated:
                arguments[index].copyfrom(array)
        return repeated


def _signature(args_info) -> tuple:
    """(dtype, shape) of each argument, from a runner's JSON argument info."""
    return tuple((str(info[1]), tuple(int(s) for s in info[2])) for info in args_info)


def evaluator_config(target_kind: str) -> ms.runner.EvaluatorConfig:
    """Timing settings: on a GPU, enough repeats of >= 20 ms for a stable median; on a CPU, quicker."""
    if target_kind == "cuda":
        return ms.runner.EvaluatorConfig(number=5, repeat=5, min_repeat_ms=20, enable_cpu_cache_flush=False)
    return ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=10, enable_cpu_cache_flush=False)


def build_candidate(mod, target, _params):
    """The builder's ``f_build``: lower and compile one scheduled candidate.

    MetaSchedule's default build first imports every tensor intrinsic TVM ships (``tvm.s_tir.tensor_intrin``),
    which costs 30 s of CPU per batch here, in a fresh worker process each batch. Our candidates are complete
    schedules (any tensorization already applied in the main process), so plain compilation is enough.
    """
    return tvm.tirx.build(mod, target=target)


def make_builder(max_workers: int | None = None, timeout_sec: float = 120.0) -> ms.builder.LocalBuilder:
    """Local parallel builder (candidates always build on this machine) with :func:`build_candidate`; a
    generous timeout because CPUs are shared."""
    return ms.builder.LocalBuilder(max_workers=max_workers, timeout_sec=timeout_sec, f_build=build_candidate)


def parse_tracker(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> (host, port)."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rpc-tracker must look like HOST:PORT (e.g. 127.0.0.1:9190), got {text!r}")
    return host, int(port)


def make_runner(target_kind: str, *, arguments: ArgumentFactory | None = None, rpc_tracker: str | None = None,
                rpc_key: str | None = None, timeout_sec: float = 60.0, max_workers: int | None = None,
                session_timeout_sec: float = 120.0):
    """A LocalRunner, or an RPCRunner on every device registered under ``rpc_key`` with ``rpc_tracker``.

    ``arguments`` supplies valid sparse-format inputs (see :class:`ArgumentFactory`); its ``rpc`` flag is set
    to match the runner. ``max_workers`` bounds concurrent RPC sessions; by default it is the number of servers
    registered under ``rpc_key`` when the runner is made, so every device measures at once (MetaSchedule's own
    default is one session, which leaves all devices but one idle).
    """
    config = evaluator_config(target_kind)
    if rpc_tracker is None:
        if rpc_key is not None:
            raise ValueError("--rpc-key needs --rpc-tracker")
        if arguments is not None:
            arguments.rpc = False
        return ms.runner.LocalRunner(timeout_sec=timeout_sec, evaluator_config=config, f_alloc_argument=arguments)
    if not rpc_key:
        raise ValueError("--rpc-tracker needs --rpc-key (the key the RPC servers registered with)")
    host, port = parse_tracker(rpc_tracker)
    if arguments is not None:
        arguments.rpc = True
    if max_workers is None:
        max_workers = count_servers(rpc_tracker, rpc_key)
        if max_workers == 0:
            raise ValueError(f"no RPC server is registered under key {rpc_key!r} with {rpc_tracker} "
                             f"(check with: stof-tvm rpc status --tracker {rpc_tracker})")
    rpc_config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=rpc_key,
                                     session_timeout_sec=session_timeout_sec)
    return ms.runner.RPCRunner(rpc_config=rpc_config, evaluator_config=config, f_alloc_argument=arguments,
                               max_workers=max_workers)
