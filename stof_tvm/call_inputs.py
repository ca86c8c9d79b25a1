"""The model inputs of one call of a compiled model: checked from their metadata, bound for the module.

- Shapes, dtypes and devices are checked from tensor metadata, before any kernel runs; a wrong one raises a
  ``ValueError``/``TypeError`` naming the input. What each check compares (shape tuple, numpy dtype, torch
  dtype object) is worked out once per input, so a call costs well under a microsecond per input here.
- Torch tensors already on the module's device are passed to the module as they are: TVM's FFI converts them
  through DLPack's C exchange API in C (no Python-side DLPack object), launches on torch's current stream of
  their device, and returns the outputs as torch tensors sharing the module's memory. A device-side copy is
  made only for a tensor that is not contiguous or not 64-byte aligned (the kernels assume both); one that
  requires grad is passed detached. Numpy arrays (and torch CPU tensors for a CUDA module) are copied to the
  device once.
- The valid ranges the module checks (token ids within their embedding table, a 0/1 attention mask) are checked
  here for inputs that live on the host (no copy needed: the values are there, and the error comes before any
  kernel runs); for inputs on the device the module's own check output is read after the call
  (:func:`value_error`).

This module imports only TVM's runtime and numpy (torch only when given torch tensors).
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import tvm

ALIGNMENT = 64          # bytes: the module's kernels assume their inputs start on this boundary
_UNSIGNED = {np.dtype(f"int{bits}"): np.dtype(f"uint{bits}") for bits in (8, 16, 32, 64)}


def is_torch(value) -> bool:
    return type(value).__module__.startswith("torch")


def _torch_dtype(value) -> str:
    return str(value.dtype).removeprefix("torch.")


def to_numpy(value) -> np.ndarray:
    """A module output (TVM or torch tensor, on any device) as a host numpy array (a copy)."""
    if is_torch(value):
        return value.detach().cpu().numpy()
    return value.numpy()


@dataclasses.dataclass(slots=True)
class BoundInputs:
    """The model inputs in manifest order as the module takes them, and where they came from.

    ``args``: torch tensors on the module's device (passed as they are) or TVM tensors; ``host``: numpy views of
    the inputs given on the host (for the host-side checks and the host padding path); ``on_device``: names of
    the inputs given as device tensors (checked by the module); ``torch``: some input was a torch tensor
    (outputs go back as torch tensors).
    """

    args: list
    host: dict
    on_device: tuple
    torch: bool

    def tvm_args(self) -> list:
        """``args`` with every torch tensor as a TVM tensor (zero copy), for callers that keep them."""
        return [tvm.runtime.from_dlpack(a) if is_torch(a) else a for a in self.args]


def check_names(specs: list[dict], given: dict) -> None:
    names = [spec["name"] for spec in specs]
    missing = [n for n in names if n not in given]
    unknown = [n for n in given if n not in names]
    if missing:
        raise ValueError(f"inputs: missing {missing}; the model takes {names}")
    if unknown:
        raise ValueError(f"inputs: unknown {unknown}; the model takes {names}")


class InputBinder:
    """Binds a call's inputs (by name) for the module on ``device``, checking each against its manifest entry."""

    def __init__(self, specs: list[dict], device):
        self.specs, self.device = specs, device
        self.names = [spec["name"] for spec in specs]
        self._names_set = frozenset(self.names)
        self._shapes = [tuple(spec["shape"]) for spec in specs]
        self._dtypes = [spec["dtype"] for spec in specs]
        self._np_dtypes = [np.dtype(d) for d in self._dtypes]
        self._torch_dtypes = None                       # torch dtype objects, the first time torch is given
        self._cuda = device.dlpack_device_type() == tvm.cuda(0).dlpack_device_type()
        self._index = device.index

    def _fail_shape(self, i: int, shape):
        raise ValueError(f"input {self.names[i]!r}: expected shape {list(self._shapes[i])}, got {list(shape)}")

    def _want_torch_dtype(self, i: int):
        if self._torch_dtypes is None:
            torch = sys.modules["torch"]
            self._torch_dtypes = [getattr(torch, d, None) for d in self._dtypes]
        return self._torch_dtypes[i]

    def _torch(self, i: int, value):
        """(tensor for the module, None) for a torch tensor on the module's device; (None, numpy view) for a CPU
        tensor that a CUDA module copies like a numpy array."""
        if value.shape != self._shapes[i]:
            self._fail_shape(i, value.shape)
        if value.dtype is not self._want_torch_dtype(i):
            raise TypeError(f"input {self.names[i]!r}: expected dtype {self._dtypes[i]}, got {_torch_dtype(value)}")
        if value.is_cuda:
            if not self._cuda or value.get_device() != self._index:
                raise ValueError(f"input {self.names[i]!r}: is on {value.device} but the model runs on {self.device}")
        elif self._cuda:
            return None, value.detach().numpy()
        if value.requires_grad:
            value = value.detach()
        if not value.is_contiguous() or value.data_ptr() % ALIGNMENT:
            value = value.clone(memory_format=sys.modules["torch"].contiguous_format)
        return value, None

    def _host(self, i: int, value) -> np.ndarray:
        array = np.asarray(value)
        if array.shape != self._shapes[i]:
            self._fail_shape(i, array.shape)
        want = self._np_dtypes[i]
        if array.dtype != want:
            if array.dtype.kind != want.kind:
                raise TypeError(f"input {self.names[i]!r}: expected dtype {self._dtypes[i]}, got {array.dtype}")
            array = array.astype(want)
        return array

    def bind(self, given: dict) -> BoundInputs:
        """Check every input and bind it; raises before anything runs when one is wrong."""
        if len(given) != len(self.names) or not self._names_set.issuperset(given):
            check_names(self.specs, given)
        args, host, on_device, torch_given = [], {}, (), False
        for i, name in enumerate(self.names):
            value = given[name]
            if is_torch(value):
                torch_given = True
                tensor, array = self._torch(i, value)
                if tensor is not None:
                    if tensor.is_cuda:
                        on_device += (name,)
                    else:
                        host[name] = tensor.numpy()
                    args.append(tensor)
                    continue
            else:
                array = self._host(i, value)
            host[name] = array
            args.append(self._upload(array))
        return BoundInputs(args, host, on_device, torch_given)

    def _upload(self, array: np.ndarray):
        """A host array as a tensor on the module's device: for a CPU module the array itself when it is
        contiguous, writeable and aligned (zero copy; the module never writes its inputs), else an aligned copy
        (numpy's own copy, cheaper than TVM's generic one); for a CUDA module a copy to the device."""
        if self._cuda:
            return tvm.runtime.tensor(np.ascontiguousarray(array), self.device)
        flags = array.flags
        if flags.c_contiguous and flags.writeable and array.__array_interface__["data"][0] % ALIGNMENT == 0:
            return tvm.runtime.from_dlpack(array)
        raw = np.empty(array.nbytes + ALIGNMENT, np.uint8)
        start = -raw.__array_interface__["data"][0] % ALIGNMENT
        copy = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
        np.copyto(copy, array)
        return tvm.runtime.from_dlpack(copy)


def bind_inputs(specs: list[dict], given: dict, device) -> BoundInputs:
    """Check every input against its manifest entry and bind it for the module on ``device``."""
    return InputBinder(specs, device).bind(given)


def range_message(check: dict, values: np.ndarray | None, count: int | None = None) -> str:
    what = "token ids" if check["high"] > 2 else "values"
    found = (f"values from {int(values.min())} to {int(values.max())}" if values is not None
             else f"{count} value(s) outside it")
    return (f"input {check['name']!r}: {what} must be in [{check['low']}, {check['high']}) (the model's "
            f"{'embedding table' if check['high'] > 2 else 'padding mask: 1 keep, 0 pad'}); got {found}")


def _out_of_range(values: np.ndarray, low: int, high: int) -> bool:
    """Whether any value is outside [low, high): for integers with low == 0 and ``high`` within the type's range
    one reduction over the values as unsigned (a negative one becomes at least 2**(bits-1) >= high), else a min
    and a max."""
    unsigned = _UNSIGNED.get(values.dtype) if low == 0 else None
    if unsigned is not None and high > np.iinfo(values.dtype).max + 1:
        unsigned = None
    if unsigned is not None:
        return bool(np.maximum.reduce(values.view(unsigned), axis=None) >= high)
    return bool(np.minimum.reduce(values, axis=None) < low or np.maximum.reduce(values, axis=None) >= high)


def check_host_values(checks: list[dict], bound: BoundInputs) -> None:
    """Raise ``ValueError`` before any kernel runs when a checked input given on the host is out of range."""
    for check in checks:
        values = bound.host.get(check["name"])
        if values is not None and values.size and _out_of_range(values, check["low"], check["high"]):
            raise ValueError(range_message(check, values))


def value_error(checks: list[dict], counts, bound: BoundInputs) -> str | None:
    """The error message for the module's out-of-range counts of the inputs given on the device (``counts``:
    its ``stof_value_errors`` output, a TVM or torch tensor, read here: a few bytes), or None when every value
    is in range."""
    if not bound.on_device:
        return None
    return count_error(checks, read_counts(counts), bound.on_device)


def read_counts(counts) -> list:
    """The module's ``stof_value_errors`` output (a TVM or torch tensor) as a list of ints, read now."""
    return counts.tolist() if is_torch(counts) else counts.numpy().tolist()


def count_error(checks: list[dict], numbers: list, on_device: tuple) -> str | None:
    """The message for the first checked input given on the device (named in ``on_device``) whose out-of-range
    count (``numbers``, in the order of ``checks``) is not zero, or None."""
    for check, count in zip(checks, numbers):
        if count and check["name"] in on_device:
            return range_message(check, None, int(count))
    return None
