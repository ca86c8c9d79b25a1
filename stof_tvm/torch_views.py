"""Torch tensors handed to a TVM kernel without a copy, views into a larger allocation included.

TVM's DLPack import (``tvm.runtime.from_dlpack``) refuses a tensor whose data pointer is not 64-byte aligned
("FromDLPack: Data is not aligned to 64 bytes"), and torch exports a view at an offset (Q, K and V sliced from
one packed projection, a slice of a flat buffer) with that offset folded into the pointer. The attention kernels
whose Q/K/V buffers take an element offset (``offset_factor``: the block-wise and wgmma kernels, 8 elements = 16
bytes, the width of their cp.async copies and TMA's address rule) read such a view in place when it is passed
the way TVM passes its own views: the 64-byte aligned address below it as the data pointer, the rest as DLPack's
``byte_offset``. :func:`tvm_tensor` does that; anything else that is not contiguous or aligned is copied.

This module imports TVM's runtime only (torch is the caller's).
"""
from __future__ import annotations

import tvm

ALIGNMENT = 64          # bytes: tvm.runtime.from_dlpack's rule for a DLPack tensor's data pointer


def tvm_tensor(t, offset_bytes: int = 0):
    """``(TVM tensor, torch tensor that must outlive it)`` for torch tensor ``t``.

    ``offset_bytes``: the byte offsets the kernel's buffer accepts are the multiples of this (0: none). A
    contiguous ``t`` that is 64-byte aligned, or whose misalignment is such a multiple and lies inside its
    storage, is shared (zero copy; the second element is ``t``); otherwise a contiguous, aligned copy is made
    and shared (the second element is the copy: an output written there must be copied back by the caller).
    """
    if t.is_contiguous():
        misaligned = t.data_ptr() % ALIGNMENT
        if not misaligned:
            return tvm.runtime.from_dlpack(t), t
        item = t.element_size()
        if offset_bytes and misaligned % offset_bytes == 0 and t.storage_offset() * item >= misaligned:
            start = t.storage_offset() - misaligned // item
            base = t.as_strided((t.numel() + misaligned // item,), (1,), start)    # aligned, same storage
            return tvm.runtime.from_dlpack(base)._create_view(tuple(t.shape), relative_byte_offset=misaligned), t
    copy = t.clone() if t.is_contiguous() else t.contiguous()
    return tvm.runtime.from_dlpack(copy), copy
