"""A compiled model: the TVM executable, a JSON manifest, and the mask arrays the runtime needs.

On disk (``Artifact.save(dir)``)::

    dir/module.so        the Relax VM executable (export_library; CUDA kernels travel as source and are
                         compiled by NVRTC/nvcc when loaded on a GPU machine)
    dir/manifest.json    inputs/outputs (names, shapes, dtypes), mask inputs, the mask and its format,
                         the kernel choice, target, tuning provenance, TVM version
    dir/*.npy            the default mask when it was given as an array, the model's constant masks
    dir/cubins/*.cubin   prebuilt CUDA binaries by source hash, when the build needs them (``gemm="wgmma"``:
                         sm_90a code the GPU machine's own compile would not produce)
    dir/weights.npz      the model's weights (its large float initializers, as in the ONNX file); the module
                         takes them as parameters and prepares them once at load (main_transform_params)

No pickle anywhere: ``.npy``/``.npz`` files are written and read with ``allow_pickle=False``.
"""
from __future__ import annotations

import json
import os

import numpy as np

LIBRARY = "module.so"
MANIFEST = "manifest.json"
WEIGHTS = "weights.npz"
CUBINS = "cubins"


class Artifact:
    """The result of :func:`stof_tvm.compile`."""

    def __init__(self, executable, manifest: dict, arrays: dict[str, np.ndarray], weights: dict[str, np.ndarray],
                 binaries: dict[str, bytes] | None = None):
        self.executable = executable
        self.manifest = manifest
        self.arrays = arrays
        self.weights = weights
        self.binaries = binaries or {}

    def save(self, path: str | os.PathLike, *, weights: bool = True) -> str:
        """Write the library, manifest and arrays into directory ``path`` (created if needed); return it.

        ``weights=False`` leaves out weights.npz (for shipping code to a machine that has the weights; pass
        them to :func:`stof_tvm.runtime.load` there)."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.executable.export_library(os.path.join(path, LIBRARY))
        for name, array in self.arrays.items():
            np.save(os.path.join(path, name), array, allow_pickle=False)
        if weights and self.weights:
            np.savez(os.path.join(path, WEIGHTS), **self.weights)
        if self.binaries:
            os.makedirs(os.path.join(path, CUBINS), exist_ok=True)
            for key, binary in self.binaries.items():
                with open(os.path.join(path, CUBINS, key + ".cubin"), "wb") as f:
                    f.write(binary)
        with open(os.path.join(path, MANIFEST), "w") as f:
            json.dump(self.manifest, f, indent=2)
            f.write("\n")
        return path

    def load(self, device=None):
        """A callable :class:`~stof_tvm.runtime.CompiledModel` of this artifact, without saving it."""
        from stof_tvm.runtime import CompiledModel, device_for

        device = device or device_for(self.manifest)
        if self.binaries and self.manifest["target"]["kind"] == "cuda":
            from stof_tvm.cuda_runtime import serve_cubins

            serve_cubins(self.binaries)
        return CompiledModel(self.executable, self.manifest, self.arrays, device,
                             self.weights)

    def __repr__(self) -> str:
        att = self.manifest["attention"]
        return (f"Artifact(kernel={att['kernel']['kind']!r}, target={self.manifest['target']['kind']!r}, "
                f"batch={att['batch']}, seq_len={att.get('seq_q')}, dtype={self.manifest['dtype']!r})")
