"""Per-batch key padding summary, computed on the device from a model's ``attention_mask`` input.

The sparse attention kernels apply a Hugging Face padding mask (``mask[b, j] != 0``: key j of batch b is kept)
without the host ever seeing it. This kernel reads the ``[B, S]`` mask once and writes what they need:

- ``pad_range[B, 3]`` int32: ``lo`` (first kept key), ``hi`` (last kept key + 1) and ``holes`` (1 when some key
  in ``[lo, hi)`` is dropped). Right padding (the common case) is ``lo = 0, hi = length, holes = 0``; a batch row
  that keeps no key has ``lo = hi = 0``. The kernels skip key tiles wholly outside ``[lo, hi)``, mask the tiles
  that cross it by a column predicate, and write query rows outside it as 0 (padded positions, which models
  ignore).
- ``pad_bits[B, ceil(S / 32)]`` uint32: bit ``j % 32`` of word ``j // 32`` set when key j is kept; the kernels
  read it only for batch rows with ``holes`` (any other padding pattern, e.g. left and right, or gaps).

CUDA: one thread block of four warps per batch row; each warp builds one 32-key word per step with a ballot
and the block reduces the first/last kept key and the kept count through warp shuffles and shared memory.
llvm: a loop per batch row computing the same arrays (what the CPU tests check).
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

__all__ = ["key_padding_primfunc", "KEY_PADDING_SYMBOL", "bit_words"]

KEY_PADDING_SYMBOL = "stof_key_padding"
_WARPS = 4
_FULL_MASK = 0xFFFFFFFF


def bit_words(seq_k: int) -> int:
    """Words of ``pad_bits`` per batch row."""
    return -(-seq_k // 32)


def key_padding_primfunc(*, batch: int, seq_k: int, dtype: str, target_kind: str) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``(mask[B, S] dtype, pad_range[B, 3] int32, pad_bits[B, ceil(S/32)] uint32)``."""
    for name, value in (("batch", batch), ("seq_k", seq_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if target_kind == "cuda":
        body = _cuda_body(batch, seq_k, dtype)
    elif target_kind == "llvm":
        body = _cpu_body(batch, seq_k, dtype)
    else:
        raise ValueError(f"target_kind must be 'cuda' or 'llvm', got {target_kind!r}")
    B, S, KW = batch, seq_k, bit_words(seq_k)

    @T.prim_func
    def key_padding(mask_h: T.handle, range_h: T.handle, bits_h: T.handle):
        T.func_attr({"tirx.noalias": True, "global_symbol": KEY_PADDING_SYMBOL})
        mask = T.match_buffer(mask_h, (B, S), dtype)
        pad_range = T.match_buffer(range_h, (B, 3), "int32")
        pad_bits = T.match_buffer(bits_h, (B, KW), "uint32")
        body(mask, pad_range, pad_bits)

    return key_padding


def _kept(mask, b, key, S):
    """Key ``key`` of batch row ``b`` is kept (keys past the end are not)."""
    return tvm.tirx.all(key < S, T.Cast("float32", mask[b, T.min(key, S - 1)]) != T.float32(0))


@T.macro
def _finish(pad_range, b, lo, hi, count):
    # A row keeping nothing has lo = hi = 0; holes: fewer kept keys than the span between the first and last.
    pad_range[b, 0] = T.Select(count > 0, lo, 0)
    pad_range[b, 1] = T.Select(count > 0, hi, 0)
    pad_range[b, 2] = T.Select(tvm.tirx.all(count > 0, count != hi - lo), 1, 0)


def _cpu_body(B: int, S: int, dtype: str):
    KW = bit_words(S)

    @T.macro
    def body(mask, pad_range, pad_bits):
        for b in T.parallel(B):
            # red = [first kept key, last kept key + 1, kept count]
            red = T.alloc_buffer((3,), "int32", scope="local")
            word = T.alloc_buffer((1,), "uint32", scope="local")
            red[0] = S
            red[1] = 0
            red[2] = 0
            for w in range(KW):
                word[0] = T.uint32(0)
                for lane in range(32):
                    if _kept(mask, b, w * 32 + lane, S):
                        word[0] = T.bitwise_or(word[0], T.shift_left(T.uint32(1), T.Cast("uint32", lane)))
                        red[0] = T.min(red[0], w * 32 + lane)
                        red[1] = T.max(red[1], w * 32 + lane + 1)
                        red[2] = red[2] + 1
                pad_bits[b, w] = word[0]
            _finish(pad_range, b, red[0], red[1], red[2])

    return body


def _cuda_body(B: int, S: int, dtype: str):
    KW = bit_words(S)
    NT = 32 * _WARPS
    STEPS = -(-KW // _WARPS)

    def shuffle(value, lane_mask):
        return T.tvm_warp_shuffle_xor(T.uint32(_FULL_MASK), value, lane_mask, 32, 32)

    @T.macro
    def body(mask, pad_range, pad_bits):
        for b in T.thread_binding(B, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                red = T.alloc_buffer((3,), "int32", scope="local")
                word = T.alloc_buffer((1,), "uint32", scope="local")
                part = T.alloc_buffer((3 * _WARPS,), "int32", scope="shared")
                warp: T.let = tx // 32
                lane: T.let = tx % 32
                red[0] = S
                red[1] = 0
                red[2] = 0
                for step in range(STEPS):
                    key: T.let = (step * _WARPS + warp) * 32 + lane
                    word[0] = T.cuda.ballot_sync(T.uint32(_FULL_MASK), T.Cast("int32", _kept(mask, b, key, S)))
                    if lane == 0 and step * _WARPS + warp < KW:
                        pad_bits[b, step * _WARPS + warp] = word[0]
                    if _kept(mask, b, key, S):
                        red[0] = T.min(red[0], key)
                        red[1] = T.max(red[1], key + 1)
                    if lane == 0:
                        red[2] = red[2] + T.Cast("int32", T.popcount(word[0]))
                for offset in T.unroll(5):
                    red[0] = T.min(red[0], shuffle(red[0], 16 >> offset))
                    red[1] = T.max(red[1], shuffle(red[1], 16 >> offset))
                if lane == 0:
                    part[warp * 3] = red[0]
                    part[warp * 3 + 1] = red[1]
                    part[warp * 3 + 2] = red[2]
                T.tvm_storage_sync("shared")
                if tx == 0:
                    for w in range(1, _WARPS):
                        red[0] = T.min(red[0], part[w * 3])
                        red[1] = T.max(red[1], part[w * 3 + 1])
                        red[2] = red[2] + part[w * 3 + 2]
                    _finish(pad_range, b, red[0], red[1], red[2])

    return body
