"""Load and run compiled stof-tvm artifacts with TVM's runtime alone.

This module imports only ``tvm``'s runtime, numpy and :mod:`stof_tvm.sparse_formats`, so it works in a
process started with ``TVM_USE_RUNTIME_LIB=1`` (no compiler library, no ``tvm.relax``).

The mask at run time: every call may pass ``mask=`` in any form :func:`stof_tvm.make_mask` accepts (default:
the mask the artifact was compiled with). For sparse kernels the runtime combines it with the model's own
masking before building the sparse format it passes to the module:

- constant masks found in the model (a causal buffer) are stored in the artifact and ANDed in;
- masks computed from model inputs (Hugging Face ``attention_mask`` padding) are evaluated by a small function
  of the module (same graph as in the model), checked to be a mask (added values 0 or very negative), and
  ANDed in per batch.

Formats for the default mask are cached per distinct padding, so repeated calls with the same inputs build
nothing. A query row left with no kept key (under causal or sliding masks this happens only at padded query
positions, whose outputs models ignore) gets output 0, stof-tvm's defined behaviour; the model's additive mask
would instead spread such a row's weight over masked keys.
"""
from __future__ import annotations

import json
import os

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from stof_tvm.sparse_formats.masks import normalize_mask
from stof_tvm.sparse_formats.rows import build_rows
from stof_tvm.sparse_formats.tiled import build_tiled

LIBRARY = "module.so"
MANIFEST = "manifest.json"
WEIGHTS = "weights.npz"
FORMAT_VERSION = 1
MASKED_FILL = -1.0e4
DENSE_MASKED = -1.0e30      # the dense kernel's additive bias at masked pairs


def device_for(manifest: dict):
    """The device an artifact runs on; a clear error when this machine does not have it."""
    target = manifest["target"]
    if target["kind"] == "llvm":
        return tvm.cpu(0)
    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    dev = tvm.cuda(0)
    if not ensure_cuda_runtime() or not dev.exist:
        raise RuntimeError(f"artifact was built for CUDA ({target.get('arch')}) but this machine has no CUDA device")
    want = str(target.get("arch", "")).removeprefix("sm_").rstrip("a")
    have = str(dev.compute_version).replace(".", "")
    if want and want != have:
        raise RuntimeError(f"artifact was built for CUDA arch sm_{want} but the GPU here is sm_{have} "
                           f"({dev.device_name}); recompile with target={{'kind': 'cuda', 'arch': 'sm_{have}'}}")
    return dev


def load(path: str | os.PathLike, device=None, weights: dict | None = None) -> "CompiledModel":
    """Load an artifact directory written by :meth:`stof_tvm.artifact.Artifact.save`.

    ``weights``: the model's weights by name (numpy arrays) when the artifact was saved without weights.npz.
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
        weights_path = os.path.join(path, WEIGHTS)
        if not os.path.isfile(weights_path):
            raise FileNotFoundError(f"weights: {path!r} was saved without {WEIGHTS}; pass weights={{name: array}}")
        with np.load(weights_path, allow_pickle=False) as data:
            weights = {name: data[name] for name in data.files}
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
    return CompiledModel(module, manifest, arrays, device, weights or {})


def _at_least_one(array: np.ndarray) -> np.ndarray:
    return array if array.shape[0] else np.zeros((1,) + array.shape[1:], array.dtype)


def _is_torch(value) -> bool:
    return type(value).__module__.startswith("torch")


class CompiledModel:
    """A loaded artifact. Call it with the model inputs by name; returns ``{output name: array}``.

    Inputs may be numpy arrays or torch tensors (passed through DLPack without a copy when they already live
    on the module's device); outputs come back as the same kind (torch if any input was torch).
    """

    def __init__(self, module, manifest: dict, arrays: dict[str, np.ndarray], device, weights: dict):
        self.manifest = manifest
        self.device = device
        self.vm = VirtualMachine(module, device)
        self._params = self._prepare_weights(weights)
        self._arrays = arrays
        self._format_cache: dict = {}
        att = manifest["attention"]
        self.kernel = att["kernel"]["kind"]           # "none": compiled without stof-tvm's attention (no mask input)
        self._mask_dims = None if self.kernel == "none" else (att["kernel"]["mask_batch"], att["kernel"]["mask_heads"],
                                                               att["seq_q"], att["seq_k"])
        self._default_mask = None

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
        tensors = []
        for spec in specs:
            value = np.asarray(weights[spec["name"]])
            if value.shape != tuple(spec["shape"]):
                raise ValueError(f"weight {spec['name']!r}: expected shape {spec['shape']}, got {list(value.shape)}")
            tensors.append(tvm.runtime.tensor(np.ascontiguousarray(value, dtype=spec["dtype"]), self.device))
        if not self.manifest.get("transform_params"):
            return tensors
        return list(self.vm[self.manifest["transform_params"]](tensors))

    # -- inputs ---------------------------------------------------------------------------------------------
    def _check_names(self, given: dict) -> None:
        names = [spec["name"] for spec in self.inputs]
        missing = [n for n in names if n not in given]
        unknown = [n for n in given if n not in names]
        if missing:
            raise ValueError(f"inputs: missing {missing}; the model takes {names}")
        if unknown:
            raise ValueError(f"inputs: unknown {unknown}; the model takes {names}")

    def _host_input(self, spec: dict, value) -> np.ndarray:
        """Validate one input's shape and dtype; return it as a numpy array (for host-side mask work)."""
        array = value.detach().cpu().numpy() if _is_torch(value) else np.asarray(value)
        want = tuple(spec["shape"])
        if array.shape != want:
            raise ValueError(f"input {spec['name']!r}: expected shape {list(want)}, got {list(array.shape)}")
        if array.dtype != np.dtype(spec["dtype"]):
            if np.dtype(spec["dtype"]).kind != array.dtype.kind or _is_torch(value):
                raise TypeError(f"input {spec['name']!r}: expected dtype {spec['dtype']}, got {array.dtype}")
            array = array.astype(spec["dtype"])
        return array

    def _device_tensor(self, value, host: np.ndarray):
        if _is_torch(value) and str(host.dtype) == str(value.dtype).removeprefix("torch."):
            try:
                return tvm.runtime.from_dlpack(value.contiguous())
            except (RuntimeError, ValueError, tvm.error.TVMError):
                pass
        return tvm.runtime.tensor(np.ascontiguousarray(host), self.device)

    # -- the mask -------------------------------------------------------------------------------------------
    def _normalized(self, mask) -> np.ndarray:
        info = self.manifest["mask"]
        if mask is None:
            if self._default_mask is None:
                source = info["spec"] if info.get("spec") else self._arrays[info["array"]]
                self._default_mask = self._normalized(source)
            return self._default_mask
        batch, heads = self.manifest["attention"]["batch"], self.manifest["attention"]["heads"]
        try:
            return normalize_mask(mask, batch=batch, heads=heads, seq_q=info["seq_q"], seq_k=info["seq_k"])
        except (ValueError, TypeError) as err:
            raise type(err)(f"mask: {err}") from None

    def _model_keep(self, host_inputs: dict) -> list[np.ndarray]:
        """Keep-masks of the model's own masking: the stored constants, then the terms computed from inputs."""
        info = self.manifest["mask"]
        keeps = [self._arrays[info["model_keep"]]] if info.get("model_keep") else []
        for term in info.get("model_terms", []):
            args = [tvm.runtime.tensor(np.ascontiguousarray(host_inputs[name]), self.device) for name in term["inputs"]]
            values = self.vm[term["function"]](*args).numpy()
            if term["kind"] == "where":
                keep = values.astype(bool) == term["keep_if_true"]
            else:
                keep = values == 0
                if not np.all(keep | (values <= MASKED_FILL)):
                    raise ValueError(f"inputs {term['inputs']}: the model's attention mask term has values that are "
                                     f"neither 0 nor <= {MASKED_FILL:g}; it is a bias, not a mask")
            keeps.append(keep.reshape((1,) * (4 - keep.ndim) + keep.shape))
        return keeps

    def mask_arrays(self, mask=None, host_inputs: dict | None = None) -> list[np.ndarray]:
        """The arrays of the module's mask inputs (format or dense keep-mask) for ``mask`` and these inputs."""
        if self.kernel == "none":
            if mask is not None:
                raise ValueError(f"mask: this artifact takes no mask: its attention runs as the model computes it "
                                 f"({self.manifest['attention']['fallback']})")
            return []
        user = self._normalized(mask)
        bm, hm, sq, sk = self._mask_dims
        if user.shape[0] > bm or user.shape[1] > hm:
            raise ValueError(f"mask: this artifact was compiled for a mask of {bm} batch x {hm} head groups, got "
                             f"{user.shape[0]} x {user.shape[1]}; recompile with a mask of this kind")
        keeps = self._model_keep(host_inputs or {}) if self.kernel != "dense" else []
        key = None
        if mask is None or isinstance(mask, str):
            key = (mask, tuple(k.tobytes() for k in keeps))
            if key in self._format_cache:
                return self._format_cache[key]
        combined = user
        for keep in keeps:
            combined = combined & keep
        combined = np.ascontiguousarray(np.broadcast_to(combined, (bm, hm, sq, sk)))
        arrays = self._format(combined)
        if key is not None:
            self._format_cache[key] = arrays
        return arrays

    def _format(self, mask4d: np.ndarray) -> list[np.ndarray]:
        """The kernel's format arrays; empty index lists get one dummy entry (never visited: the row pointers
        stay as they are) because the kernels' symbolic lengths must be at least 1."""
        if self.kernel == "dense":
            return [np.where(mask4d, np.float32(0), np.float32(DENSE_MASKED)), mask4d.astype(np.float32)]
        if self.kernel == "row":
            fmt = build_rows(mask4d)
            return [fmt.indptr, _at_least_one(fmt.indices)]
        config = self.manifest["attention"]["kernel"]["config"]
        fmt = build_tiled(mask4d, config["block_m"], config["block_n"])
        return [fmt.full_indptr, _at_least_one(fmt.full_indices), fmt.part_indptr,
                _at_least_one(fmt.part_indices), _at_least_one(fmt.part_bitmaps)]

    # -- running --------------------------------------------------------------------------------------------
    def prepare(self, inputs: dict, mask=None) -> list:
        """Device tensors for one call (model inputs then mask inputs), checked; reuse with :meth:`run`."""
        self._check_names(inputs)
        host = {spec["name"]: self._host_input(spec, inputs[spec["name"]]) for spec in self.inputs}
        args = [self._device_tensor(inputs[spec["name"]], host[spec["name"]]) for spec in self.inputs]
        args += [tvm.runtime.tensor(a, self.device) for a in self.mask_arrays(mask, host)]
        return args

    def run(self, args: list) -> list:
        """Run the module on prepared device tensors; returns the output tensors (TVM)."""
        out = self.vm["main"](*args, *self._params)
        return list(out) if isinstance(out, (tuple, list)) or type(out).__name__ == "Array" else [out]

    def __call__(self, inputs: dict | None = None, *, mask=None, **kwargs) -> dict:
        inputs = {**(inputs or {}), **kwargs}
        as_torch = any(_is_torch(v) for v in inputs.values())
        outs = self.run(self.prepare(inputs, mask))
        result = {}
        for spec, out in zip(self.outputs, outs):
            if as_torch:
                import torch

                result[spec["name"]] = torch.from_dlpack(out)
            else:
                result[spec["name"]] = out.numpy()
        return result
