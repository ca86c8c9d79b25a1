"""Row-wise sparse attention: every query row gathers only its kept keys from the row-compressed format.

STOF's kernel for very sparse or irregular masks (design.md 1A). For each (batch b, head h, query i) the kernel
reads the row ``g * Sq + i`` of the row-compressed mask (``indptr``/``indices``, :mod:`stof_tvm.sparse_formats.rows`;
g is the mask group of (b, h)), and for those keys only computes scores, an online softmax in float32 and the
weighted sum of V rows. Masked pairs cost nothing: no load, no arithmetic. A row with no kept key outputs zeros.

The algorithm is one TensorIR PrimFunc (TVMScript, ``s_tir``) with data-dependent loops; a schedule maps it to a
target without changing what it computes, so the CPU build that CI checks against numpy is the same program the
GPU runs:

- ``key_groups`` (KG) groups share a row's keys round-robin; each group keeps its own running max, sum and
  accumulator (a split-K online softmax) and a final ``merge`` combines the KG partial states exactly.
- Per step a group takes ``keys_per_step`` (U) keys: U index loads, U key-row loads, U dot products, one rescale,
  U value-row loads. (Issuing the value loads together with the key loads measured no faster on the H200.)
- On CUDA a group is ``lanes`` threads (threadIdx.x), each owning 8 of the D channels, so every K/V row is read as one
  16-byte vector per lane; the dot product is a cross-thread reduction that TVM lowers to warp shuffles within the
  group. ``lanes`` is D / 8 rounded up to a power of two (shuffles stay inside a warp and a group never straddles
  two), so at D = 80 or 96 the last 6 or 4 of 16 lanes idle. KG groups (threadIdx.y) fill one or more whole warps,
  so every shuffle runs with the whole warp converged; ``rows_per_block`` rows (threadIdx.z) share a thread block
  and, being neighbours, mostly the same keys in L1. The partial states go through shared memory to the merge (one
  barrier, outside every data-dependent loop).
- On the CPU (llvm) rows run in parallel and each row is plain loops.

Scores are computed in the log2 domain (the query is pre-multiplied by ``scale * log2(e)``) so the softmax uses
``exp2``; the result is the same softmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir
from tvm.script import tirx as T

from .key_padding import bit_words

__all__ = ["RowConfig", "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "default_row_config", "rowwise_attention_template",
           "schedule_rowwise", "rowwise_attention_primfunc", "ROWWISE_SYMBOL", "check_score_bias", "cuda_lanes",
           "cuda_config_fits"]

ROWWISE_SYMBOL = "rowwise_attention"
# Every multiple of 16 from 32 to 256 (as the block-wise kernel): a K/V row is 4 to 32 16-byte vectors.
SUPPORTED_HEAD_DIMS = tuple(range(32, 257, 16))
# Storage dtypes per target kind; all arithmetic is float32.
SUPPORTED_DTYPES = {"cuda": ("float16", "bfloat16"), "llvm": ("float16", "bfloat16", "float32")}
_VECTOR_BYTES = 16          # one K/V load per lane on CUDA
_WARP = 32


@dataclass(frozen=True)
class RowConfig:
    """Work split of the row-wise kernel (see the module docstring).

    key_groups: groups splitting one row's keys, each with its own online-softmax state (KG).
    keys_per_step: keys a group handles per loop step (U): more loads in flight, fewer rescales.
    rows_per_block: query rows per CUDA thread block (ignored on the CPU); reduced automatically to a divisor
        of Sq so that no thread block is partly idle.
    """

    key_groups: int = 4
    keys_per_step: int = 2
    rows_per_block: int = 4

    def __post_init__(self):
        for name in ("key_groups", "keys_per_step", "rows_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RowConfig.{name} must be a positive integer, got {value!r}")


def default_row_config(head_dim: int, dtype: str, target_kind: str) -> RowConfig:
    """A sound starting configuration: one warp per row on CUDA, one group per row on the CPU."""
    if target_kind == "cuda":
        return RowConfig(key_groups=_WARP // cuda_lanes(head_dim, dtype), keys_per_step=2, rows_per_block=4)
    return RowConfig(key_groups=1, keys_per_step=4, rows_per_block=1)


def _vector(dtype: str) -> int:
    """Elements of ``dtype`` in one 16-byte vector: what one lane loads of a K or V row."""
    return _VECTOR_BYTES * 8 // tvm.DataType(dtype).bits


def cuda_lanes(head_dim: int, dtype: str) -> int:
    """Threads per key on CUDA: each lane loads one 16-byte vector of a K or V row; the count is rounded up to
    a power of two so that a group's shuffles stay inside one warp."""
    return 1 << (-(-head_dim // _vector(dtype)) - 1).bit_length()


def _check_problem(batch, heads, seq_q, seq_k, head_dim, dtype, mask_batch, mask_heads, scale, target_kind):
    for name, value in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if target_kind not in SUPPORTED_DTYPES:
        raise ValueError(f"target_kind must be one of {sorted(SUPPORTED_DTYPES)}, got {target_kind!r}")
    if dtype not in SUPPORTED_DTYPES[target_kind]:
        raise TypeError(f"row-wise attention on {target_kind} supports dtypes {SUPPORTED_DTYPES[target_kind]}, "
                        f"got {dtype!r}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"row-wise attention supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim!r}")
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise ValueError(f"mask_batch must be 1 or {batch} and mask_heads 1 or {heads}, "
                         f"got {mask_batch} and {mask_heads}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")


def _check_config(config, head_dim, dtype, target_kind):
    if not isinstance(config, RowConfig):
        raise TypeError(f"config must be a RowConfig, got {type(config).__name__}")
    if target_kind == "cuda" and not cuda_config_fits(config, head_dim, dtype, 1024):
        lanes = cuda_lanes(head_dim, dtype)
        raise ValueError(
            f"on CUDA, lanes ({lanes}) x key_groups must be a multiple of {_WARP} and at most head_dim "
            f"({head_dim}), and times rows_per_block at most 1024; got key_groups={config.key_groups}, "
            f"rows_per_block={config.rows_per_block}")


def cuda_config_fits(config: RowConfig, head_dim: int, dtype: str, max_threads: int) -> bool:
    """Whether the CUDA schedule takes ``config``: a row's lanes x key_groups threads fill whole warps and do not
    outnumber the head dim (each finishes at least one channel in the merge), and a block has at most
    ``max_threads`` threads."""
    threads = cuda_lanes(head_dim, dtype) * config.key_groups
    return threads % _WARP == 0 and threads <= head_dim and threads * config.rows_per_block <= max_threads


def check_score_bias(bias, batch: int, heads: int):
    """``bias`` of a sparse kernel (None or ``(bias_batch, bias_heads, dtype)``), checked; raises otherwise."""
    if bias is None:
        return None
    if not (isinstance(bias, tuple) and len(bias) == 3):
        raise TypeError(f"bias must be None or (bias_batch, bias_heads, dtype), got {bias!r}")
    bias_batch, bias_heads, dtype = bias
    if bias_batch not in (1, batch) or bias_heads not in (1, heads):
        raise ValueError(f"bias_batch must be 1 or {batch} and bias_heads 1 or {heads}, got {bias_batch} and "
                         f"{bias_heads}")
    if dtype not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"bias dtype must be float16, bfloat16 or float32, got {dtype!r}")
    return bias


def check_kv_heads(kv_heads, heads: int) -> int:
    """``kv_heads`` of a sparse kernel (None: ``heads``; else a positive divisor of ``heads``: grouped-query
    attention, query head ``h`` reading key/value head ``h // (heads / kv_heads)``), checked; raises otherwise."""
    if kv_heads is None:
        return heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads must be a positive divisor of heads ({heads}), got {kv_heads!r}")
    return kv_heads


def rowwise_attention_template(*, batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: str,
                               mask_batch: int, mask_heads: int, scale: float, key_groups: int,
                               keys_per_step: int, bias: tuple[int, int, str] | None = None,
                               padding: bool = False, kv_heads: int | None = None) -> tvm.tirx.PrimFunc:
    """The unscheduled row-wise PrimFunc. ``nnz`` (length of ``indices``) is symbolic.

    Params: ``q[B,H,Sq,D], k[B,Hkv,Sk,D], v[B,Hkv,Sk,D], indptr[G*Sq+1] int32, indices[nnz] int32, out[B,H,Sq,D]``
    (``Hkv = kv_heads``, default ``heads``: query head ``h`` reads key/value head ``h // (H / Hkv)``).
    ``bias = (bias_batch, bias_heads, dtype)`` adds a parameter ``bias[Bb, Hb, Sq, Sk]`` before ``out`` (Bb 1 or B,
    Hb 1 or H) that is added to each kept score after scaling, as models with a position bias (T5) add it to their
    scores; it is read only where the mask keeps a key.

    ``padding=True`` (Sq == Sk) adds ``pad_range[B, 3] int32, pad_bits[B, ceil(Sk/32)] uint32`` after
    ``indices`` (:mod:`stof_tvm.schedules.key_padding`): batch b keeps only keys in ``[lo, hi)`` whose bit is set
    (read only where ``holes``), at every query row.
    """
    B, H, Sq, Sk, D, KG, U = batch, heads, seq_q, seq_k, head_dim, key_groups, keys_per_step
    G = mask_batch * mask_heads
    group_of_b = mask_heads if mask_batch > 1 else 0      # g = b * group_of_b + h * group_of_h
    group_of_h = 1 if mask_heads > 1 else 0
    q_scale = float(scale) * math.log2(math.e)             # scores in the log2 domain -> exp2
    log2e = math.log2(math.e)
    step = KG * U
    HAS_BIAS = bias is not None
    BB, BH, BIAS_DTYPE = bias if HAS_BIAS else (1, 1, "float32")
    bias_b = 1 if BB > 1 else 0                            # the bias row of (b, h): [b * bias_b, h * bias_h]
    bias_h = 1 if BH > 1 else 0
    PAD, KW = padding, bit_words(seq_k)
    HKV = check_kv_heads(kv_heads, heads)
    KVG = H // HKV

    def row_reads(q, k, v, indptr, indices, bias_buf, pad_range, pad_bits, nnz, b, h, i):
        """What computing row (b, h, i) reads: its query, the format, K and V (and the bias row, the padding)."""
        regions = [q[b, h, i, 0:D], indptr[0:G * Sq + 1], indices[0:nnz], k[b, h // KVG, 0:Sk, 0:D],
                   v[b, h // KVG, 0:Sk, 0:D]]
        if HAS_BIAS:
            regions.append(bias_buf[b * bias_b, h * bias_h, i, 0:Sk])
        if PAD:
            regions += [pad_range[b, 0:3], pad_bits[b, 0:KW]]
        return regions

    def kept_key(pad_range, pad_bits, b, slot_valid, key):
        """Key slot in use and, with padding, its key inside batch b's kept span and not at a hole."""
        if not PAD:
            return slot_valid
        word = pad_bits[b, T.min(key // 32, KW - 1)]
        bit = T.bitwise_and(T.shift_right(word, T.Cast("uint32", key % 32)), T.uint32(1))
        return tvm.tirx.all(slot_valid, pad_range[b, 0] <= key, key < pad_range[b, 1],
                            tvm.tirx.any(pad_range[b, 2] == 0, bit != T.uint32(0)))

    @T.macro
    def body(q, k, v, indptr, indices, bias_buf, pad_range, pad_bits, out, nnz):
        # Per (row, key group) online-softmax state: running max (log2 domain), running sum, accumulator.
        part_max = T.sblock_alloc_buffer((B, H, Sq, KG), "float32")
        part_sum = T.sblock_alloc_buffer((B, H, Sq, KG), "float32")
        part_acc = T.sblock_alloc_buffer((B, H, Sq, KG, D), "float32")
        for b, h, i in T.grid(B, H, Sq):
            with T.sblock("row"):
                rb, rh, ri = T.axis.remap("SSS", [b, h, i])
                T.reads(row_reads(q, k, v, indptr, indices, bias_buf, pad_range, pad_bits, nnz, rb, rh, ri))
                T.writes(out[rb, rh, ri, 0:D])
                for kg in range(KG):
                    with T.sblock("partial"):
                        vb = T.axis.spatial(B, rb)
                        vh = T.axis.spatial(H, rh)
                        vi = T.axis.spatial(Sq, ri)
                        vg = T.axis.spatial(KG, kg)
                        T.reads(row_reads(q, k, v, indptr, indices, bias_buf, pad_range, pad_bits, nnz, vb, vh, vi))
                        T.writes(part_max[vb, vh, vi, vg], part_sum[vb, vh, vi, vg], part_acc[vb, vh, vi, vg, 0:D])
                        qf = T.alloc_buffer((D,), "float32", scope="local")
                        acc = T.alloc_buffer((D,), "float32", scope="local")
                        kk = T.alloc_buffer((U, D), dtype, scope="local")
                        vv = T.alloc_buffer((U, D), dtype, scope="local")
                        score = T.alloc_buffer((U,), "float32", scope="local")
                        prob = T.alloc_buffer((U,), "float32", scope="local")
                        key = T.alloc_buffer((U,), "int32", scope="local")
                        # state: 0 running max, 1 running sum, 2 new max, 3 rescale factor of the old state
                        state = T.alloc_buffer((4,), "float32", scope="local")
                        row = (vb * group_of_b + vh * group_of_h) * Sq + vi
                        start = indptr[row]
                        n_keys = indptr[row + 1] - start
                        for d in range(D):
                            with T.sblock("load_q"):
                                vd = T.axis.remap("S", [d])
                                qf[vd] = T.Cast("float32", q[vb, vh, vi, vd]) * T.float32(q_scale)
                        for d in range(D):
                            with T.sblock("init_acc"):
                                vd = T.axis.remap("S", [d])
                                acc[vd] = T.float32(0)
                        state[0] = T.min_value("float32")
                        state[1] = T.float32(0)
                        for it in range((n_keys + step - 1) // step):
                            # Key slot j of this group; slots past the row's end reuse its last key and get
                            # probability 0, so every lane of a warp runs the same instructions.
                            for u in range(U):
                                key[u] = indices[start + T.min((it * U + u) * KG + vg, n_keys - 1)]
                            for u, d in T.grid(U, D):
                                with T.sblock("load_k"):
                                    vu, vd = T.axis.remap("SS", [u, d])
                                    kk[vu, vd] = k[vb, vh // KVG, key[vu], vd]
                            for u, d in T.grid(U, D):
                                with T.sblock("dot"):
                                    vu, vd = T.axis.remap("SR", [u, d])
                                    with T.init():
                                        score[vu] = T.float32(0)
                                    score[vu] = score[vu] + qf[vd] * T.Cast("float32", kk[vu, vd])
                            if HAS_BIAS:    # the model's score bias, in the log2 domain like the scores
                                for u in range(U):
                                    score[u] = score[u] + T.Cast(
                                        "float32", bias_buf[vb * bias_b, vh * bias_h, vi, key[u]]) * T.float32(log2e)
                            state[2] = state[0]
                            for u in range(U):
                                if kept_key(pad_range, pad_bits, vb, (it * U + u) * KG + vg < n_keys, key[u]):
                                    state[2] = T.max(state[2], score[u])
                            state[3] = T.exp2(state[0] - state[2])
                            for u in range(U):
                                prob[u] = T.Select(kept_key(pad_range, pad_bits, vb, (it * U + u) * KG + vg < n_keys,
                                                            key[u]), T.exp2(score[u] - state[2]), T.float32(0))
                            state[1] = state[1] * state[3]
                            for u in range(U):
                                state[1] = state[1] + prob[u]
                            for u, d in T.grid(U, D):
                                with T.sblock("load_v"):
                                    vu, vd = T.axis.remap("SS", [u, d])
                                    vv[vu, vd] = v[vb, vh // KVG, key[vu], vd]
                            for d, u in T.grid(D, U):
                                with T.sblock("update"):
                                    vd, vu = T.axis.remap("SR", [d, u])
                                    with T.init():
                                        acc[vd] = acc[vd] * state[3]
                                    acc[vd] = acc[vd] + prob[vu] * T.Cast("float32", vv[vu, vd])
                            state[0] = state[2]
                        part_max[vb, vh, vi, vg] = state[0]
                        part_sum[vb, vh, vi, vg] = state[1]
                        for d in range(D):
                            with T.sblock("store_partial"):
                                vd = T.axis.remap("S", [d])
                                part_acc[vb, vh, vi, vg, vd] = acc[vd]
                for d in range(D):
                    with T.sblock("merge"):
                        vb = T.axis.spatial(B, rb)
                        vh = T.axis.spatial(H, rh)
                        vi = T.axis.spatial(Sq, ri)
                        vd = T.axis.spatial(D, d)
                        T.reads(part_max[vb, vh, vi, 0:KG], part_sum[vb, vh, vi, 0:KG], part_acc[vb, vh, vi, 0:KG, vd])
                        T.writes(out[vb, vh, vi, vd])
                        # total: 0 max over groups, 1 rescaled sum, 2 rescaled accumulator
                        total = T.alloc_buffer((3,), "float32", scope="local")
                        total[0] = T.min_value("float32")
                        for g in range(KG):
                            total[0] = T.max(total[0], part_max[vb, vh, vi, g])
                        total[1] = T.float32(0)
                        total[2] = T.float32(0)
                        for g in range(KG):
                            total[1] = total[1] + part_sum[vb, vh, vi, g] * T.exp2(part_max[vb, vh, vi, g] - total[0])
                            total[2] = total[2] + part_acc[vb, vh, vi, g, vd] * T.exp2(
                                part_max[vb, vh, vi, g] - total[0])
                        # A row with no kept key has sum 0: its output is defined as 0.
                        out[vb, vh, vi, vd] = T.Cast(dtype, T.Select(total[1] > T.float32(0), total[2] / total[1],
                                                                     T.float32(0)))


    # Written once with every parameter; the padding and bias parameters the problem does not have are dropped.
    @T.prim_func(s_tir=True)
    def rowwise_attention(q_h: T.handle, k_h: T.handle, v_h: T.handle, indptr_h: T.handle, indices_h: T.handle,
                          pad_range_h: T.handle, pad_bits_h: T.handle, bias_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "global_symbol": ROWWISE_SYMBOL})
        nnz = T.int32()
        q = T.match_buffer(q_h, (B, H, Sq, D), dtype)
        k = T.match_buffer(k_h, (B, HKV, Sk, D), dtype)
        v = T.match_buffer(v_h, (B, HKV, Sk, D), dtype)
        indptr = T.match_buffer(indptr_h, (G * Sq + 1,), "int32")
        indices = T.match_buffer(indices_h, (nnz,), "int32")
        pad_range = T.match_buffer(pad_range_h, (B, 3), "int32")
        pad_bits = T.match_buffer(pad_bits_h, (B, KW), "uint32")
        bias_buf = T.match_buffer(bias_h, (BB, BH, Sq, Sk), BIAS_DTYPE)
        out = T.match_buffer(out_h, (B, H, Sq, D), dtype)
        body(q, k, v, indptr, indices, bias_buf if HAS_BIAS else None, pad_range if PAD else None,
             pad_bits if PAD else None, out, nnz)

    dropped = ({"pad_range", "pad_bits"} if not PAD else set()) | ({"bias_buf"} if not HAS_BIAS else set())
    params = [param for param in rowwise_attention.params if param.name not in dropped]
    return tvm.tirx.PrimFunc(params, rowwise_attention.body, rowwise_attention.ret_type, rowwise_attention.attrs)


def _check_padding(padding, seq_q: int, seq_k: int) -> bool:
    if padding not in (False, True) or (padding and seq_q != seq_k):
        raise ValueError(f"padding must be a bool and needs seq_q == seq_k, got {padding!r} ({seq_q} x {seq_k})")
    return bool(padding)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def schedule_rowwise(func: tvm.tirx.PrimFunc, *, head_dim: int, dtype: str, seq_q: int, config: RowConfig,
                     target_kind: str) -> tvm.tirx.PrimFunc:
    """Apply the CUDA (sm_80+/sm_90) or CPU schedule to :func:`rowwise_attention_template`'s PrimFunc."""
    sch = s_tir.Schedule(func)
    if target_kind == "llvm":
        sch.parallel(sch.fuse(*sch.get_loops("row")))
        return sch.mod["main"]
    lanes = cuda_lanes(head_dim, dtype)
    vec = _vector(dtype)        # lanes * vec >= head_dim: lanes past the row's last vector are predicated off
    b, h, i = sch.get_loops("row")
    sch.bind(sch.fuse(b, h), "blockIdx.y")
    # Rows per block divide Sq so no block runs past the end: the merge barrier is then reached by every thread.
    blk, row = sch.split(i, [None, _largest_divisor_at_most(seq_q, config.rows_per_block)])
    sch.bind(blk, "blockIdx.x")
    sch.bind(row, "threadIdx.z")
    sch.bind(sch.get_loops("partial")[-1], "threadIdx.y")
    for name in ("load_q", "init_acc", "store_partial"):
        lane, _ = sch.split(sch.get_loops(name)[-1], [lanes, vec])
        sch.bind(lane, "threadIdx.x")
    for name in ("load_k", "load_v"):                       # one 16-byte vector per lane and key
        u, d = sch.get_loops(name)[-2:]
        lane, inner = sch.split(d, [lanes, vec])
        sch.reorder(lane, u, inner)
        sch.bind(lane, "threadIdx.x")
        sch.vectorize(inner)
    lane, _ = sch.split(sch.get_loops("dot")[-1], [lanes, vec])   # in-thread sum, then shuffles across lanes
    sch.bind(lane, "threadIdx.x")
    lane, _ = sch.split(sch.get_loops("update")[-2], [lanes, vec])
    sch.bind(lane, "threadIdx.x")
    # Merge: the row's KG x lanes threads each finish ceil(head_dim / (KG x lanes)) consecutive channels.
    group, lane, _ = sch.split(sch.get_loops("merge")[-1], [config.key_groups, lanes, None])
    sch.bind(group, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    for index in range(3):
        sch.set_scope("partial", index, "shared")
    return sch.mod["main"]


def rowwise_attention_primfunc(*, batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: str,
                               mask_batch: int, mask_heads: int, scale: float | None = None,
                               config: RowConfig | None = None, target_kind: str = "cuda",
                               bias: tuple[int, int, str] | None = None, padding: bool = False,
                               kv_heads: int | None = None) -> tvm.tirx.PrimFunc:
    """The scheduled row-wise attention PrimFunc for ``target_kind`` ("cuda" or "llvm"), ready for tvm.compile.

    ``scale`` defaults to 1/sqrt(head_dim); ``config`` to :func:`default_row_config`. The function's symbol is
    :data:`ROWWISE_SYMBOL`; ``nnz`` is symbolic, so one build serves every mask of this shape and group layout.
    ``bias``: ``(bias_batch, bias_heads, dtype)`` of an additive score bias input (see the template);
    ``padding``: the key padding inputs (see the template); ``kv_heads``: grouped-query K and V (see the template).
    """
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    _check_problem(batch, heads, seq_q, seq_k, head_dim, dtype, mask_batch, mask_heads, scale, target_kind)
    config = default_row_config(head_dim, dtype, target_kind) if config is None else config
    _check_config(config, head_dim, dtype, target_kind)
    func = rowwise_attention_template(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                                      dtype=dtype, mask_batch=mask_batch, mask_heads=mask_heads, scale=scale,
                                      key_groups=config.key_groups, keys_per_step=config.keys_per_step,
                                      bias=check_score_bias(bias, batch, heads),
                                      padding=_check_padding(padding, seq_q, seq_k),
                                      kv_heads=check_kv_heads(kv_heads, heads))
    return schedule_rowwise(func, head_dim=head_dim, dtype=dtype, seq_q=seq_q, config=config,
                            target_kind=target_kind)
