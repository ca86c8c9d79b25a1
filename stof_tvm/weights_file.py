"""An artifact's weights: ``weights.npz`` (one array per weight, in the dtype the module takes it) and the checks
that what reaches the module is what the manifest's ``weights`` entry says.

Numpy and the standard library only (the runtime-only loader reads this, :mod:`stof_tvm.runtime`). The file is
written and read with ``allow_pickle=False``. A float16 module takes most weights as float16
(:mod:`stof_tvm.compiler.weight_storage`), so its file holds half the bytes of the ONNX model's float32 ones;
artifacts written before that record float32 and hold float32, and load as they are.
"""
from __future__ import annotations

import zipfile

import numpy as np

WEIGHTS = "weights.npz"


def write_weights(path: str, weights: dict[str, np.ndarray]) -> None:
    """Write ``weights`` (name -> array, already in their stored dtypes) to the ``.npz`` file ``path``."""
    np.savez(path, **weights)


def read_weights(path: str, specs: list[dict]) -> dict[str, np.ndarray]:
    """The weights ``specs`` (the manifest's ``weights`` entry) lists, read from ``path``; each must have the
    spec's dtype and shape exactly. A clear ``ValueError`` for a truncated or corrupt file, or one that does not
    belong to the manifest beside it."""
    values = {}
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = set(data.files)
            missing = [spec["name"] for spec in specs if spec["name"] not in stored]
            if missing:
                raise _Mismatch(f"it lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
            for spec in specs:
                values[spec["name"]] = data[spec["name"]]
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as err:
        raise ValueError(f"weights: {path} is truncated or corrupt ({type(err).__name__}: {err}); save the "
                         f"artifact again") from None
    except _Mismatch as err:
        raise ValueError(f"weights: {path} does not match the artifact's manifest: {err}; save the artifact "
                         f"again") from None
    for spec in specs:
        value = values[spec["name"]]
        if str(value.dtype) != spec["dtype"] or value.shape != tuple(spec["shape"]):
            raise ValueError(f"weights: {path} does not match the artifact's manifest: weight {spec['name']!r} is "
                             f"{value.dtype} {list(value.shape)}, the module takes {spec['dtype']} {spec['shape']}; "
                             f"save the artifact again")
    return values


class _Mismatch(Exception):
    """A readable weights file whose arrays are not the manifest's (kept apart from the read errors)."""


def as_weight(spec: dict, value) -> np.ndarray:
    """``value`` (a weight passed by the caller, e.g. the ONNX model's float32 initializer) as the contiguous array
    of the dtype and shape ``spec`` records: the shape must match; a float value is cast to the spec's float
    dtype, refusing values a float16 weight cannot hold."""
    value = np.asarray(value)
    name, dtype = spec["name"], np.dtype(spec["dtype"])
    if value.shape != tuple(spec["shape"]):
        raise ValueError(f"weight {name!r}: expected shape {spec['shape']}, got {list(value.shape)}")
    if value.dtype != dtype:
        if value.dtype.kind != "f" or dtype.kind != "f":
            raise ValueError(f"weight {name!r}: expected {dtype} values, got {value.dtype}")
        limit = float(np.finfo(dtype).max)
        if np.finfo(value.dtype).max > limit and value.size and \
                not (-limit <= value.min() and value.max() <= limit):
            raise ValueError(f"weight {name!r}: the module takes it as {dtype}, but it has values beyond "
                             f"{dtype}'s range (+-{limit:g}) or not finite")
    return np.ascontiguousarray(value, dtype=dtype)
