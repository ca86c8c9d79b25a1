"""The model inputs of one call of a compiled model: checked from their metadata, bound to device tensors.

- Shapes, dtypes and devices are checked from tensor metadata, before any kernel runs; a wrong one raises a
  ``ValueError``/``TypeError`` naming the input.
- Torch tensors already on the module's device are passed through DLPack without a copy (a device-side copy
  only when one is not contiguous or not 64-byte aligned); numpy arrays (and torch CPU tensors for a CUDA
  module) are copied to the device once.
- The valid ranges the module checks (token ids within their embedding table, a 0/1 attention mask) are checked
  here for inputs that live on the host (no copy needed: the values are there, and the error comes before any
  kernel runs); for inputs on the device the module's own check output is read after the call
  (:func:`value_error`).

This module imports only TVM's runtime and numpy (torch only when given torch tensors).
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import tvm


def is_torch(value) -> bool:
    return type(value).__module__.startswith("torch")


def _torch_dtype(value) -> str:
    return str(value.dtype).removeprefix("torch.")


@dataclasses.dataclass
class BoundInputs:
    """Device tensors of the model inputs in manifest order, and where they came from.

    ``host``: numpy views of the inputs given on the host (for the host-side checks and the host padding path);
    ``on_device``: names of the inputs given as device tensors (checked by the module); ``torch``: some input
    was a torch tensor (outputs go back as torch tensors); ``stream``: torch's current CUDA stream, when the
    inputs are torch CUDA tensors (the module runs on it).
    """

    args: list
    host: dict
    on_device: set
    torch: bool
    stream: int | None

    def stream_scope(self, device):
        """A context in which TVM launches on torch's current stream (a no-op without one)."""
        if self.stream is None:
            return contextlib.nullcontext()
        import tvm_ffi

        return tvm_ffi.use_raw_stream(device, self.stream)


def check_names(specs: list[dict], given: dict) -> None:
    names = [spec["name"] for spec in specs]
    missing = [n for n in names if n not in given]
    unknown = [n for n in given if n not in names]
    if missing:
        raise ValueError(f"inputs: missing {missing}; the model takes {names}")
    if unknown:
        raise ValueError(f"inputs: unknown {unknown}; the model takes {names}")


def _check_shape(spec: dict, shape) -> None:
    if tuple(shape) != tuple(spec["shape"]):
        raise ValueError(f"input {spec['name']!r}: expected shape {list(spec['shape'])}, got {list(shape)}")


def _torch_tensor(spec: dict, value, device):
    """(device tensor, None) for a torch tensor on the module's device; (None, numpy view) for a CPU tensor that
    a CUDA module copies like a numpy array."""
    _check_shape(spec, value.shape)
    if _torch_dtype(value) != spec["dtype"]:
        raise TypeError(f"input {spec['name']!r}: expected dtype {spec['dtype']}, got {_torch_dtype(value)}")
    on_cuda = device.dlpack_device_type() == tvm.cuda(0).dlpack_device_type()
    if value.device.type == "cuda":
        if not on_cuda or (value.device.index or 0) != device.index:
            raise ValueError(f"input {spec['name']!r}: is on {value.device} but the model runs on {device}")
    elif on_cuda:
        return None, value.detach().numpy()
    value = value.detach()
    if not value.is_contiguous() or value.data_ptr() % 64:
        value = value.contiguous().clone()
    return tvm.runtime.from_dlpack(value), None


def _host_array(spec: dict, value) -> np.ndarray:
    array = np.asarray(value)
    _check_shape(spec, array.shape)
    want = np.dtype(spec["dtype"])
    if array.dtype != want:
        if array.dtype.kind != want.kind:
            raise TypeError(f"input {spec['name']!r}: expected dtype {spec['dtype']}, got {array.dtype}")
        array = array.astype(want)
    return array


def bind_inputs(specs: list[dict], given: dict, device) -> BoundInputs:
    """Check every input against its manifest entry and bind it to a tensor on ``device``."""
    check_names(specs, given)
    args, host, on_device, streams = [], {}, set(), set()
    for spec in specs:
        value = given[spec["name"]]
        tensor, array = _torch_tensor(spec, value, device) if is_torch(value) else (None, _host_array(spec, value))
        if tensor is not None:
            args.append(tensor)
            if value.device.type == "cuda":
                on_device.add(spec["name"])
                import torch

                streams.add(torch.cuda.current_stream(value.device).cuda_stream)
            else:
                host[spec["name"]] = value.detach().numpy()
        else:
            args.append(tvm.runtime.tensor(np.ascontiguousarray(array), device))
            host[spec["name"]] = array
    torch_given = any(is_torch(v) for v in given.values())
    return BoundInputs(args, host, on_device, torch_given, streams.pop() if streams else None)


def _range_message(check: dict, values: np.ndarray | None, count: int | None = None) -> str:
    what = "token ids" if check["high"] > 2 else "values"
    found = (f"values from {int(values.min())} to {int(values.max())}" if values is not None
             else f"{count} value(s) outside it")
    return (f"input {check['name']!r}: {what} must be in [{check['low']}, {check['high']}) (the model's "
            f"{'embedding table' if check['high'] > 2 else 'padding mask: 1 keep, 0 pad'}); got {found}")


def check_host_values(checks: list[dict], bound: BoundInputs) -> None:
    """Raise ``ValueError`` before any kernel runs when a checked input given on the host is out of range."""
    for check in checks:
        values = bound.host.get(check["name"])
        if values is not None and values.size and (values.min() < check["low"] or values.max() >= check["high"]):
            raise ValueError(_range_message(check, values))


def value_error(checks: list[dict], counts, bound: BoundInputs) -> str | None:
    """The error message for the module's out-of-range counts of the inputs given on the device (``counts``:
    its ``stof_value_errors`` output, read here: a few bytes), or None when every value is in range."""
    if not bound.on_device:
        return None
    if bound.torch:
        import torch

        numbers = torch.from_dlpack(counts).tolist()
    else:
        numbers = counts.numpy().tolist()
    for check, count in zip(checks, numbers):
        if count and check["name"] in bound.on_device:
            return _range_message(check, None, int(count))
    return None
