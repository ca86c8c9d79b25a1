"""The module's mask inputs (the sparse format of the user's mask), built once per mask and kept on the device.

A compiled model takes the format arrays of its attention mask as inputs, so one artifact serves any mask of its
kind. :class:`MaskFormats` builds them on the host the first time a mask is used (the artifact's default mask
at load), ANDs in the model's constant masks (a causal buffer), uploads them, and keeps the device tensors under
a cheap key: ``None`` (the default mask), the spec string, or the identity of an array / tensor / callable
(so a mask array changed in place must be passed as a new array, or the cache cleared with :meth:`clear`). The
least recently used of at most ``limit`` masks is dropped.

The model's own padding never enters the format when the kernels apply it on the device (the common case).
For a model whose input-dependent masking is not key padding (the host path), :meth:`tensors` takes its
keep-masks for this call and builds the combined format (exact, one host build per distinct padding, cached).

``static=True`` (a module built with whole-forward CUDA graphs, manifest ``static_mask_inputs``): the graphs
read the format arrays at the addresses they were captured with, one capture per format size. So the device
tensors are kept per size, never freed (a handful: one per distinct size used), and a mask whose format has the
size of another's is copied into that size's tensors when it is used, after waiting for the device (earlier
calls may still read them). Alternating between two masks of one size therefore costs a device sync and an
upload per switch; the cache keeps each mask's host arrays.
"""
from __future__ import annotations

import collections

import numpy as np
import tvm

from stof_tvm.call_inputs import is_torch
from stof_tvm.sparse_formats.masks import normalize_mask
from stof_tvm.sparse_formats.rows import build_rows
from stof_tvm.sparse_formats.tiled import build_tiled

DENSE_MASKED = -1.0e30      # the dense kernel's additive bias at masked pairs


def _at_least_one(array: np.ndarray) -> np.ndarray:
    return array if array.shape[0] else np.zeros((1,) + array.shape[1:], array.dtype)


def format_arrays(manifest: dict, mask4d: np.ndarray) -> list[np.ndarray]:
    """The kernel's format arrays of a ``[Bm, Hm, Sq, Sk]`` mask; empty index lists get one dummy entry (never
    visited: the row pointers stay as they are) because the kernels' symbolic lengths must be at least 1."""
    kind = manifest["attention"]["kernel"]["kind"]
    if kind == "dense":
        return [np.where(mask4d, np.float32(0), np.float32(DENSE_MASKED)), mask4d.astype(np.float32)]
    if kind == "row":
        fmt = build_rows(mask4d)
        return [fmt.indptr, _at_least_one(fmt.indices)]
    kernel = manifest["attention"]["kernel"]
    config = kernel["config"]
    block_m, block_n = kernel["tile"] if "tile" in kernel else (config["block_m"], config["block_n"])
    fmt = build_tiled(mask4d, block_m, block_n)
    return [fmt.full_indptr, _at_least_one(fmt.full_indices), fmt.part_indptr,
            _at_least_one(fmt.part_indices), _at_least_one(fmt.part_bitmaps)]


def _cache_key(mask) -> tuple:
    if mask is None:
        return ("default",)
    if isinstance(mask, str):
        return ("spec", mask)
    return ("object", id(mask))


class MaskFormats:
    """Device tensors of the mask inputs, per mask (see the module docstring)."""

    def __init__(self, manifest: dict, arrays: dict[str, np.ndarray], device, limit: int = 8, static: bool = False):
        self.manifest, self.device, self.limit, self.static = manifest, device, limit, static
        self._slots: dict[tuple, list] = {}        # static: format size -> device tensors at a fixed address
        self._owners: dict[tuple, tuple] = {}      # static: format size -> cache key whose values the slot holds
        info = manifest["mask"]
        kernel = manifest["attention"]["kernel"]
        self.dims = (kernel["mask_batch"], kernel["mask_heads"], info["seq_q"], info["seq_k"])
        self._default = info["spec"] if info.get("spec") else arrays[info["array"]]
        self._model_keep = arrays[info["model_keep"]] if info.get("model_keep") and kernel["kind"] != "dense" else None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._default_tensors = None

    @property
    def default_mask(self):
        """The mask the artifact was compiled with: its spec string, or the array the artifact keeps."""
        return self._default

    def clear(self) -> None:
        """Forget every cached format (the next call of each mask builds it again)."""
        self._cache.clear()
        self._default_tensors = None
        self._owners.clear()          # static slots stay allocated: captured graphs hold their addresses

    def _normalized(self, mask) -> np.ndarray:
        if is_torch(mask):
            mask = mask.detach().cpu().numpy()
        att, info = self.manifest["attention"], self.manifest["mask"]
        try:
            user = normalize_mask(self._default if mask is None else mask, batch=att["batch"], heads=att["heads"],
                                  seq_q=info["seq_q"], seq_k=info["seq_k"])
        except (ValueError, TypeError) as err:
            raise type(err)(f"mask: {err}") from None
        bm, hm = self.dims[:2]
        if user.shape[0] > bm or user.shape[1] > hm:
            raise ValueError(f"mask: this artifact was compiled for a mask of {bm} batch x {hm} head groups, got "
                             f"{user.shape[0]} x {user.shape[1]}; recompile with a mask of this kind")
        return user

    def _build(self, user: np.ndarray, keeps) -> list:
        combined = user
        for keep in ([self._model_keep] if self._model_keep is not None else []) + list(keeps):
            combined = combined & keep
        combined = np.ascontiguousarray(np.broadcast_to(combined, self.dims))
        host = format_arrays(self.manifest, combined)
        return host if self.static else [tvm.runtime.tensor(a, self.device) for a in host]

    def _place(self, key: tuple, host: list) -> list:
        """static: the fixed device tensors of ``host``'s size, holding ``host``'s values (uploaded when another
        mask's values were there: after a device sync, since earlier calls may still read them)."""
        size = tuple((a.shape, a.dtype.str) for a in host)
        slot = self._slots.get(size)
        if slot is None:
            slot = self._slots[size] = [tvm.runtime.tensor(a, self.device) for a in host]
        elif self._owners.get(size) != key:
            self.device.sync()
            for tensor, array in zip(slot, host):
                tensor.copyfrom(array)
        self._owners[size] = key
        return slot

    def tensors(self, mask=None, keeps: tuple = ()) -> list:
        """The mask inputs for ``mask`` (None: the artifact's default) and the host path's keep-masks ``keeps``
        of this call (boolean arrays broadcastable to the format's dims)."""
        if mask is None and not keeps and self._default_tensors is not None:
            return self._default_tensors                # the common call: nothing to look up
        key = _cache_key(mask) + tuple(k.tobytes() for k in keeps)
        entry = self._cache.get(key)
        if entry is not None and (key[0] != "object" or entry[0] is mask):
            self._cache.move_to_end(key)
            built = entry[1]
        else:
            built = self._build(self._normalized(mask), keeps)
            self._cache[key] = (mask, built)
            while len(self._cache) > self.limit:
                self._cache.popitem(last=False)
        tensors = self._place(key, built) if self.static else built
        # the fast path holds only while the default mask's values are where its tensors point
        self._default_tensors = tensors if mask is None and not keeps else \
            None if self.static else self._default_tensors
        return tensors
