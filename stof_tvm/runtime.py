"""Load and run compiled stof-tvm artifacts with TVM's runtime alone.

This module imports only ``tvm``'s runtime, numpy and :mod:`stof_tvm.sparse_formats`, so it works in a
process started with ``TVM_USE_RUNTIME_LIB=1`` (no compiler library, no ``tvm.relax``).

A call (``model(input_ids=..., attention_mask=...)``) does no per-call host work beyond binding its inputs:

- inputs are checked from their metadata and bound without copies (:mod:`stof_tvm.call_inputs`); torch CUDA
  tensors run on torch's current stream and the outputs come back as torch tensors sharing the module's memory;
- the mask's sparse format is built once per mask (the default at load, a new ``mask=`` the first time it is
  given: any form :func:`stof_tvm.make_mask` accepts) and stays on the device (:mod:`stof_tvm.mask_formats`);
  the model's constant masks (a causal buffer) are ANDed into it;
- the model's own padding (Hugging Face ``attention_mask``) is applied by the kernels on the device, from the
  input itself (:mod:`stof_tvm.schedules.key_padding`), nothing is built per call; a query row left with no
  kept key (a fully padded batch row) gives 0, where the model's additive mask would spread its weight evenly;
- token ids are clamped into their embedding table inside the module (never read out of bounds) and counted
  when out of range; the call raises a ``ValueError`` naming the input if any were (inputs on the host are
  checked before any kernel runs; for torch CUDA inputs the module's few-byte count is copied back on the call's
  stream and checked by a later call or :meth:`CompiledModel.synchronize` without waiting for the GPU
  (:mod:`stof_tvm.deferred_checks`); ``check_values="sync"`` at :func:`load` reads it at once, waiting for the
  call, and ``check_values=False`` skips it: out-of-range ids then silently use the nearest table row).

Models whose input-dependent masking is not key padding of one input (the compiler says so in the manifest:
``mask.model_terms``) take the exact, slower host path: the term is evaluated by the module, copied back,
checked to be a mask and ANDed into the format on the host (cached per distinct value).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine
from tvm_ffi import Array

from stof_tvm.deferred_checks import DeferredRangeChecks
from stof_tvm.hardware import DeviceUnavailable
from stof_tvm.call_inputs import BoundInputs, InputBinder, check_host_values, is_torch, to_numpy, value_error
from stof_tvm.mask_formats import MaskFormats
from stof_tvm.weights_file import WEIGHTS, as_weight, read_weights

LIBRARY = "module.so"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
MASKED_FILL = -1.0e4


def device_for(manifest: dict):
    """The device an artifact runs on; a clear error when this machine does not have it."""
    target = manifest["target"]
    if target["kind"] == "llvm":
        return tvm.cpu(0)
    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    dev = tvm.cuda(0)
    if not ensure_cuda_runtime() or not dev.exist:
        raise DeviceUnavailable(f"artifact was built for CUDA ({target.get('arch')}) but this machine has no CUDA "
                                f"device")
    want = str(target.get("arch", "")).removeprefix("sm_").rstrip("a")
    have = str(dev.compute_version).replace(".", "")
    if want and want != have:
        raise DeviceUnavailable(f"artifact was built for CUDA arch sm_{want} but the GPU here is sm_{have} "
                                f"({dev.device_name}); recompile with target={{'kind': 'cuda', 'arch': 'sm_{have}'}}")
    return dev


def load(path: str | os.PathLike, device=None, weights: dict | None = None,
         check_values: bool | str = True) -> "CompiledModel":
    """Load an artifact directory written by :meth:`stof_tvm.artifact.Artifact.save`.

    ``weights``: the model's weights by name (numpy arrays) when the artifact was saved without weights.npz.
    ``check_values``: check the module's out-of-range count of device inputs: True (deferred to a later call or
    :meth:`CompiledModel.synchronize`, no wait), ``"sync"`` (after each call, waiting for it) or False (see the
    module docstring).
    """
    path = os.fspath(path)
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(f"path: {path!r} is not a stof-tvm artifact (no {MANIFEST})")
    with open(manifest_path) as f:
        manifest = json.load(f)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"artifact format version {manifest.get('format_version')!r} is not supported "
                         f"(expected {FORMAT_VERSION})")
    device = device or device_for(manifest)
    arrays = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".npy"):
            arrays[name] = np.load(os.path.join(path, name), allow_pickle=False)
    if weights is None and manifest.get("weights"):
        stored = manifest.get("weights_file", WEIGHTS)     # no such key: saved before it existed, with the file
        if stored is None or not os.path.isfile(os.path.join(path, stored)):
            raise FileNotFoundError(f"weights: {path!r} was saved without {WEIGHTS}; pass weights={{name: array}}")
        weights = read_weights(os.path.join(path, stored), manifest["weights"])
    binaries = manifest.get("cuda_binaries")
    if binaries and manifest["target"]["kind"] == "cuda":
        from stof_tvm.cuda_runtime import serve_cubins

        cubins = {}
        for key in binaries["files"]:
            cubin_path = os.path.join(path, "cubins", key + ".cubin")
            if not os.path.isfile(cubin_path):
                raise FileNotFoundError(f"path: the artifact lists prebuilt cubin {key!r} but {cubin_path} is missing")
            with open(cubin_path, "rb") as f:
                cubins[key] = f.read()
        serve_cubins(cubins)
    module = tvm.runtime.load_module(os.path.join(path, LIBRARY))
    return CompiledModel(module, manifest, arrays, device, weights or {}, check_values=check_values)


class ModelOutputs(dict):
    """A call's outputs by name, readable too as a Hugging Face model's are: ``outputs.last_hidden_state``,
    ``outputs[0]`` and ``outputs.to_tuple()`` (the outputs in the model's order)."""

    __slots__ = ()

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"outputs: no {name!r}; the model gives {list(self)}") from None

    def __getitem__(self, key):
        if isinstance(key, int):
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple:
        return tuple(self.values())


class CompiledModel:
    """A loaded artifact. Call it with the model inputs by name (``model(input_ids=..., attention_mask=...)`` or
    one dict), or by position in the model's input order as a Hugging Face model takes them (``model(ids, mask)``);
    returns ``{output name: array}`` (a :class:`ModelOutputs`: ``outputs.last_hidden_state`` and ``outputs[0]``
    work too).

    Inputs may be numpy arrays or torch tensors (passed through DLPack without a copy when they already live
    on the module's device); outputs come back as the same kind (torch if any input was torch).
    """

    def __init__(self, module, manifest: dict, arrays: dict[str, np.ndarray], device, weights: dict,
                 check_values: bool | str = True):
        if check_values not in (True, False, "sync"):
            raise ValueError(f"check_values: expected True, False or 'sync', got {check_values!r}")
        self.manifest = manifest
        self.device = device
        self.check_values = check_values
        self.vm = VirtualMachine(module, device)
        self._main = self.vm["main"]
        self._params = self._prepare_weights(weights)
        self.kernel = manifest["attention"]["kernel"]["kind"]   # "none": no stof-tvm attention (no mask input)
        self._host_terms = manifest["mask"].get("model_terms", []) if self.kernel != "dense" else []
        checks = manifest.get("value_checks") or {}
        self._checks, self._checks_output = checks.get("inputs", []), checks.get("output")
        self._pending_checks = DeferredRangeChecks(self._checks)
        self.formats = MaskFormats(manifest, arrays, device, static=bool(manifest.get("static_mask_inputs"))) \
            if self.kernel != "none" else None
        self._binder = InputBinder(self.inputs, device)
        self._output_names = [spec["name"] for spec in self.outputs]
        # numpy outputs: a CPU module's own output memory (zero copy, the array keeps it alive), else a copy
        self._to_host = np.from_dlpack if device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type() else \
            _tensor_numpy
        if self.formats is not None and not self._host_terms:
            self.formats.tensors(None)          # the default mask's format, built once at load

    @property
    def params(self) -> list:
        """The prepared weight tensors every call passes after the inputs (for timing the module directly)."""
        return self._params

    @property
    def inputs(self) -> list[dict]:
        return self.manifest["inputs"]

    @property
    def outputs(self) -> list[dict]:
        return self.manifest["outputs"]

    def _prepare_weights(self, weights: dict) -> list:
        """Check the weights against the manifest, move them to the device and run the module's one-time
        weight transform (casts, layout changes); returns the parameters every call passes after the inputs."""
        specs = self.manifest.get("weights", [])
        missing = [w["name"] for w in specs if w["name"] not in weights]
        if missing:
            raise ValueError(f"weights: missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        tensors = [tvm.runtime.tensor(as_weight(spec, weights[spec["name"]]), self.device) for spec in specs]
        if not self.manifest.get("transform_params"):
            return tensors
        return list(self.vm[self.manifest["transform_params"]](tensors))

    # -- the mask -------------------------------------------------------------------------------------------
    def _host_keeps(self, bound: BoundInputs) -> tuple:
        """The host path: keep-masks of the model's input-dependent terms, evaluated by the module and copied
        back (checked to be a mask: added values 0 or very negative)."""
        names = [spec["name"] for spec in self.inputs]
        keeps = []
        for term in self._host_terms:
            args = [bound.args[names.index(name)] for name in term["inputs"]]
            values = to_numpy(self.vm[term["function"]](*args))
            if term["kind"] == "where":
                keep = values.astype(bool) == term["keep_if_true"]
            else:
                keep = values == 0
                if not np.all(keep | (values <= MASKED_FILL)):
                    raise ValueError(f"inputs {term['inputs']}: the model's attention mask term has values that are "
                                     f"neither 0 nor <= {MASKED_FILL:g}; it is a bias, not a mask")
            keeps.append(keep.reshape((1,) * (4 - keep.ndim) + keep.shape))
        return tuple(keeps)

    def mask_tensors(self, mask=None, bound: BoundInputs | None = None) -> list:
        """The module's mask inputs (format arrays or dense keep-mask, on the device) for ``mask``; ``bound``:
        the call's inputs, needed only on the host path."""
        if self.formats is None:
            if mask is not None:
                raise ValueError(f"mask: this artifact takes no mask: its attention runs as the model computes it "
                                 f"({self.manifest['attention']['fallback']})")
            return []
        keeps = self._host_keeps(bound) if self._host_terms and bound is not None else ()
        return self.formats.tensors(mask, keeps)

    # -- running --------------------------------------------------------------------------------------------
    def _bind(self, inputs: dict) -> BoundInputs:
        bound = self._binder.bind(inputs)
        if bound.host and self._checks:
            check_host_values(self._checks, bound)
        return bound

    def random_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Inputs valid for the model, drawn with ``seed``: token ids inside their embedding's range, all-ones
        attention masks, standard normal values for float inputs."""
        rng = np.random.default_rng(seed)
        inputs = {}
        for spec in self.inputs:
            dtype = np.dtype(spec["dtype"])
            if dtype.kind in "iu":
                high = spec.get("index_range")
                values = rng.integers(0, high, spec["shape"]) if high else np.ones(spec["shape"])
                inputs[spec["name"]] = values.astype(dtype)
            else:
                inputs[spec["name"]] = rng.standard_normal(spec["shape"]).astype(dtype)
        return inputs

    def prepare(self, inputs: dict, mask=None) -> list:
        """TVM device tensors for one call (model inputs then mask inputs), checked; reuse with :meth:`run`."""
        bound = self._bind(inputs)
        return bound.tvm_args() + self.mask_tensors(mask, bound)

    def _invoke(self, args: list) -> list:
        out = self._main(*args, *self._params)
        return list(out) if isinstance(out, (tuple, list, Array)) else [out]

    def run(self, args: list) -> list:
        """Run the module on prepared device tensors; returns the model's output tensors (TVM)."""
        return self._invoke(args)[:len(self.outputs)]

    def __call__(self, *inputs, mask=None, **kwargs) -> dict:
        given = self._given(inputs, kwargs) if inputs else kwargs
        bound = self._bind(given)
        # Torch tensors go in as they are: TVM's FFI launches on torch's current stream and returns torch tensors.
        out = self._main(*bound.args, *self.mask_tensors(mask, bound), *self._params)
        if not isinstance(out, Array):
            out = (out,)
        if self._checks and self.check_values and bound.on_device:
            if self.check_values == "sync":
                message = value_error(self._checks, out[self._checks_output], bound)
                if message is not None:
                    raise ValueError(message)
            else:
                self._pending_checks.record(out[self._checks_output], bound.on_device)
                self._pending_checks.raise_arrived()
        if not bound.torch:
            return ModelOutputs((name, self._to_host(out[i])) for i, name in enumerate(self._output_names))
        results = ModelOutputs()
        for i, name in enumerate(self._output_names):
            value = out[i]
            results[name] = value if is_torch(value) else _torch_from_dlpack(value)
        return results

    def _given(self, inputs: tuple, kwargs: dict) -> dict:
        """A call's inputs by name, from a dict of them or from tensors in the model's input order (a Hugging Face
        model's forward takes ``input_ids, attention_mask, ...`` by position too), and those given by keyword."""
        names = self._binder.names
        if len(inputs) == 1 and isinstance(inputs[0], Mapping):
            return {**inputs[0], **kwargs} if kwargs else inputs[0]
        if any(isinstance(value, Mapping) for value in inputs):
            raise TypeError("inputs: give one dict of inputs by name, or tensors by position, not both")
        if len(inputs) > len(names):
            raise TypeError(f"inputs: {len(inputs)} given by position, but the model takes {len(names)}: {names}")
        given = dict(zip(names, inputs))
        twice = [name for name in given if name in kwargs]
        if twice:
            raise TypeError(f"inputs: {twice} given both by position and by name")
        return {**given, **kwargs}

    def synchronize(self) -> None:
        """Wait for the value checks of every earlier call on device inputs; raises ``ValueError`` for the first
        call that was given out-of-range token ids (their outputs used the nearest table rows)."""
        self._pending_checks.synchronize()


def _tensor_numpy(value) -> np.ndarray:
    return value.numpy()


def _torch_from_dlpack(value):
    import torch

    return torch.from_dlpack(value)
