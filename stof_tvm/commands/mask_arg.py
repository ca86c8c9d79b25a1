"""The ``--mask`` argument every subcommand takes: a mask spec, or the path of a ``.npy`` boolean array."""
from __future__ import annotations

import os

import numpy as np

HELP = "mask spec (e.g. bigbird, sliding:window=64) or a .npy boolean array"


def load_mask_arg(text: str | None):
    """``text`` as the mask it names: None stays None (the compiled default), a ``.npy`` path is loaded (without
    pickle), anything else is a spec string for :func:`stof_tvm.sparse_formats.normalize_mask`."""
    if text is None or not text.endswith(".npy"):
        return text
    if not os.path.isfile(text):
        raise FileNotFoundError(f"--mask: no such file {text!r}")
    return np.load(text, allow_pickle=False)
