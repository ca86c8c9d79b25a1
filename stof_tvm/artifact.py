"""A compiled model: the TVM executable, a JSON manifest, and the mask arrays the runtime needs.

On disk (``Artifact.save(dir)``)::

    dir/module.so        the Relax VM executable (export_library; CUDA kernels travel as source and are
                         compiled by NVRTC/nvcc when loaded on a GPU machine)
    dir/manifest.json    inputs/outputs (names, shapes, dtypes), mask inputs, the mask and its format,
                         the kernel choice, target, tuning provenance, TVM version
    dir/*.npy            the default mask when it was given as an array, the model's constant masks
    dir/cubins/*.cubin   prebuilt CUDA binaries by source hash, when the build needs them (``gemm="wgmma"``:
                         sm_90a code the GPU machine's own compile would not produce)
    dir/weights.npz      the model's weights (its large float initializers) in the dtypes the module takes them
                         (the manifest's ``weights`` entry: float16 for a float16 module, where the values fit;
                         :mod:`stof_tvm.weights_file`); the module prepares them once at load
                         (main_transform_params). The manifest's ``weights_file`` names it, or is null when the
                         artifact was saved without it

No pickle anywhere: ``.npy``/``.npz`` files are written and read with ``allow_pickle=False``. A save writes every
file under a temporary name and renames them into place at the end, the manifest last
(:mod:`stof_tvm.staged_files`): one that fails midway leaves an artifact already in the directory as it was.
"""
from __future__ import annotations

import json
import os

import numpy as np

from stof_tvm.staged_files import StagedFiles
from stof_tvm.weights_file import WEIGHTS, write_weights

LIBRARY = "module.so"
MANIFEST = "manifest.json"
CUBINS = "cubins"


def check_output_dir(path: str | os.PathLike) -> str:
    """``path`` as a string when an artifact can be written there: an existing directory, or a new one whose
    nearest existing parent is a writable directory; ValueError otherwise. ``stof-tvm compile`` asks before it
    compiles, so that a long compile is not lost to an output path that could never take it."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"output: {path!r} exists and is not a directory")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"output: cannot write into {parent!r} (for {path!r})")
    return path


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
        them to :func:`stof_tvm.runtime.load` there). An artifact already in ``path`` is replaced only once
        every file is written; its files the new one does not have are then removed."""
        path = check_output_dir(path)
        os.makedirs(path, exist_ok=True)
        stored = WEIGHTS if weights and self.weights else None
        manifest = {**self.manifest, "weights_file": stored}
        with StagedFiles(path) as staged:
            self.executable.export_library(staged.path(LIBRARY))
            for name, array in self.arrays.items():
                np.save(staged.path(name), array, allow_pickle=False)
            if stored:
                write_weights(staged.path(stored), self.weights)
            for key, binary in self.binaries.items():
                with open(staged.path(os.path.join(CUBINS, key + ".cubin")), "wb") as f:
                    f.write(binary)
            with open(staged.path(MANIFEST), "w") as f:
                json.dump(manifest, f, indent=2)
                f.write("\n")
            staged.commit(stale=_previous_files(path))
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


def _previous_files(path: str) -> set[str]:
    """The files of the artifact already in ``path`` (by its manifest; none if it has none or it does not
    parse), relative to ``path``: those a new save into ``path`` removes when it does not write them."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        mask = manifest.get("mask") or {}
        files = {LIBRARY, MANIFEST, WEIGHTS}
        files |= {os.path.basename(name) for name in (mask.get("array"), mask.get("model_keep")) if name}
        binaries = manifest.get("cuda_binaries") or {}
        files |= {os.path.join(CUBINS, os.path.basename(key) + ".cubin") for key in binaries.get("files", [])}
    except (OSError, ValueError, TypeError, AttributeError):
        return set()
    return files
