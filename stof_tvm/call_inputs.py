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


class InputBinder:
    """Binds a call's inputs (by name) to tensors on ``device``, checking each against its manifest entry;
    what the checks compare is worked out once, so a call costs a few microseconds per input."""

    def __init__(self, specs: list[dict], device):
        self.specs, self.device = specs, device
        self.names = [spec["name"] for spec in specs]
        self._shapes = [tuple(spec["shape"]) for spec in specs]
        self._dtypes = [spec["dtype"] for spec in specs]
        self._cuda = device.dlpack_device_type() == tvm.cuda(0).dlpack_device_type()

    def _fail_shape(self, i: int, shape):
        raise ValueError(f"input {self.names[i]!r}: expected shape {list(self._shapes[i])}, got {list(shape)}")

    def _torch(self, i: int, value):
        """(device tensor, None) for a torch tensor on the module's device; (None, numpy view) for a CPU tensor
        that a CUDA module copies like a numpy array."""
        if value.shape != self._shapes[i]:
            self._fail_shape(i, value.shape)
        if str(value.dtype)[6:] != self._dtypes[i]:
            raise TypeError(f"input {self.names[i]!r}: expected dtype {self._dtypes[i]}, got {_torch_dtype(value)}")
        if value.is_cuda:
            if not self._cuda or value.get_device() != self.device.index:
                raise ValueError(f"input {self.names[i]!r}: is on {value.device} but the model runs on {self.device}")
        elif self._cuda:
            return None, value.detach().numpy()
        if value.requires_grad:
            value = value.detach()
        if not value.is_contiguous() or value.data_ptr() % 64:
            value = value.contiguous().clone()
        return tvm.runtime.from_dlpack(value), None

    def _host(self, i: int, value) -> np.ndarray:
        array = np.asarray(value)
        if array.shape != self._shapes[i]:
            self._fail_shape(i, array.shape)
        want = np.dtype(self._dtypes[i])
        if array.dtype != want:
            if array.dtype.kind != want.kind:
                raise TypeError(f"input {self.names[i]!r}: expected dtype {self._dtypes[i]}, got {array.dtype}")
            array = array.astype(want)
        return array

    def bind(self, given: dict) -> BoundInputs:
        """Check every input and bind it; raises before anything runs when one is wrong."""
        if len(given) != len(self.names) or any(name not in given for name in self.names):
            check_names(self.specs, given)
        args, host, on_device, stream, torch_given = [], {}, set(), None, False
        for i, name in enumerate(self.names):
            value = given[name]
            tensor = array = None
            if is_torch(value):
                torch_given = True
                tensor, array = self._torch(i, value)
            else:
                array = self._host(i, value)
            if tensor is None:
                tensor = tvm.runtime.tensor(np.ascontiguousarray(array), self.device)
                host[name] = array
            elif value.is_cuda:
                on_device.add(name)
                if stream is None:
                    import torch

                    stream = torch.cuda.current_stream(self.device.index).cuda_stream
            else:
                host[name] = value.detach().numpy()
            args.append(tensor)
        return BoundInputs(args, host, on_device, torch_given, stream)


def bind_inputs(specs: list[dict], given: dict, device) -> BoundInputs:
    """Check every input against its manifest entry and bind it to a tensor on ``device``."""
    return InputBinder(specs, device).bind(given)


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
