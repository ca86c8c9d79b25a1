"""Attention kernel choice and the module inputs each kernel reads.

Four kernels can replace an attention site:

- ``block``: the block-wise sparse kernel (schedules/attention_blockwise.py) reading the tiled format;
- ``wgmma``: the same walk of the same format on Hopper wgmma (schedules/attention_wgmma.py; sm_90 targets, the
  module then built for sm_90a with nvcc, :mod:`.cubins`), chosen by ``auto`` where the analytical model predicts
  it faster (causal and dense masks; head dims 64 and 128, float16 / bfloat16; the model's key padding applied
  by a column predicate); where it cannot serve the call (:func:`wgmma_unavailable`: no score bias, nvcc needed
  here) the choice is among the others, with the reason;
- ``row``: the row-wise sparse kernel (schedules/attention_rowwise.py) reading the row-compressed format;
- ``dense``: the site stays a dense matrix product with the mask applied from two float inputs (an additive
  bias of 0 / -1e30 before the softmax, a 1 / 0 factor after it; TVM's own schedules): the "TVM default"
  baseline of the benchmarks.

Scores that carry a real bias (T5's position bias): both sparse kernels take the bias (computed by the graph) as
an input and add it at each kept key, so ``auto`` chooses between them as for unbiased scores. On the H200 the
block-wise kernel with T5's bias ran 9.4x faster than the row-wise one (``scripts/check_bias_gpu.py``,
BENCHMARKS.md).

The sparse-format arrays (or the dense keep-mask) are module inputs, so one compiled module serves any mask of
the same kind: the runtime builds the format of the mask it is given and passes the arrays.
"""
from __future__ import annotations

import dataclasses
import importlib
import warnings

import numpy as np

KERNELS = ("auto", "block", "row", "wgmma", "dense")
TILED = ("block", "wgmma")          # kernels reading the tiled format (and writing [B, S, H, D])


@dataclasses.dataclass(frozen=True)
class FormatInput:
    """A module input carrying mask data: ``shape`` entries are ints or names of symbolic sizes."""

    name: str
    shape: tuple
    dtype: str

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclasses.dataclass
class KernelChoice:
    """The kernel used for every attention site, its configuration, and the mask inputs it reads."""

    kind: str
    config: dict
    mask_batch: int
    mask_heads: int
    reason: str
    bias: tuple | None = None       # (bias_batch, bias_heads, dtype) of the sparse kernel's score bias input
    padding: bool = False           # the sparse kernel applies the model's key padding (pad_range / pad_bits)

    def format_inputs(self, seq_q: int, seq_k: int) -> list[FormatInput]:
        groups = self.mask_batch * self.mask_heads
        if self.kind == "dense":
            # Float, not bool: TVM 0.27's CUDA codegen loads 2-lane bool vectors as ushort2 (4-byte loads at
            # 2-byte-aligned addresses: cudaErrorMisalignedAddress), and a bool computed from another dtype is
            # not fused into the matmul epilogue that reads it.
            dims = (self.mask_batch, self.mask_heads, seq_q, seq_k)
            return [FormatInput("stof_bias", dims, "float32"), FormatInput("stof_keep", dims, "float32")]
        if self.kind == "row":
            return [FormatInput("stof_indptr", (groups * seq_q + 1,), "int32"),
                    FormatInput("stof_indices", ("nnz",), "int32")]
        bm, bn = self.tile
        rows = groups * (-(-seq_q // bm)) + 1
        return [FormatInput("stof_full_indptr", (rows,), "int32"),
                FormatInput("stof_full_indices", ("n_full",), "int32"),
                FormatInput("stof_part_indptr", (rows,), "int32"),
                FormatInput("stof_part_indices", ("n_part",), "int32"),
                FormatInput("stof_part_bitmaps", ("n_part", bm // 8, bn // 8), "uint64")]

    @property
    def tile(self) -> tuple[int, int]:
        """(BM, BN) of the tiled format a tiled kernel reads."""
        return config_object(self.kind, self.config).block_m, self.config["block_n"]

    @property
    def out_layout(self) -> str:
        """Layout of the sparse kernel's output: the tiled kernels write [B, S, H, D] (what the output
        projection reads, so no transpose follows it), the row-wise kernel [B, H, S, D]."""
        return "bshd" if self.kind in TILED else "bhsd"

    def to_json(self) -> dict:
        entry = {"kind": self.kind, "config": self.config, "mask_batch": self.mask_batch,
                 "mask_heads": self.mask_heads, "reason": self.reason,
                 "bias": list(self.bias) if self.bias is not None else None, "padding": self.padding}
        if self.kind in TILED:
            entry["tile"] = list(self.tile)       # what the runtime builds the format at (stof_tvm.mask_formats)
        return entry


_SPARSE_MODULES = {"row": "stof_tvm.schedules.attention_rowwise", "block": "stof_tvm.schedules.attention_blockwise",
                   "wgmma": "stof_tvm.schedules.attention_wgmma"}


def _schedule_module(kind: str):
    return importlib.import_module(_SPARSE_MODULES[kind])


def _supports_head_dim(kind: str, head_dim: int) -> bool:
    return head_dim in _schedule_module(kind).SUPPORTED_HEAD_DIMS


def _supports(kind: str, dtype: str, target_kind: str) -> bool:
    if kind == "wgmma" and target_kind != "cuda":
        return False
    supported = _schedule_module(kind).SUPPORTED_DTYPES
    return dtype in (supported[target_kind] if isinstance(supported, dict) else supported)


def _default_config(kind: str, head_dim: int, dtype: str, seq_q: int, target_kind: str, padding: bool = False):
    module = _schedule_module(kind)
    if kind == "wgmma":
        return module.default_config(head_dim, padding)
    if kind == "row":
        return module.default_row_config(head_dim, dtype, target_kind)
    return module.default_block_config(head_dim, dtype, seq_q)


def config_object(kind: str, config: dict):
    """The schedule's config dataclass (RowConfig / BlockConfig / WgmmaAttentionConfig) from its manifest dict."""
    module = _schedule_module(kind)
    classes = {"row": "RowConfig", "block": "BlockConfig", "wgmma": "WgmmaAttentionConfig"}
    return getattr(module, classes[kind])(**config)


def tuned_choice(database: str, mask4d: np.ndarray, *, batch: int, heads: int, head_dim: int,
                 dtype: str, kv_heads: int = 0) -> dict | None:
    """The measured-best attention kernel for this problem in a tuning work dir (``stof-tvm tune``), or None.

    Returns the tuner's record for the problem's group: ``{"name", "best_s", "meta": {"kind", "config"}}``.
    """
    from stof_tvm.cost_model import AttentionProblem
    from stof_tvm.records import attention_group, open_database

    problem = AttentionProblem.build(mask4d, batch=batch, heads=heads, seq_len=mask4d.shape[-1],
                                     head_dim=head_dim, dtype=dtype, kv_heads=kv_heads)
    return open_database(database).choice(attention_group(problem))


def wgmma_unavailable(*, head_dim: int, dtype: str, target_kind: str, target_arch, bias, padding: bool) -> str | None:
    """Why the wgmma kernel cannot serve sites of this kind here, or None when it can."""
    from stof_tvm.attention import is_hopper

    from .cubins import find_nvcc

    module = _schedule_module("wgmma")
    if target_kind != "cuda" or not is_hopper(target_arch):
        return f"it needs an sm_90 / sm_90a target, not {target_kind} {target_arch or ''}".rstrip()
    if head_dim not in module.CHECKED_HEAD_DIMS:      # built at more head dims; used where checked on a GPU
        return f"it is checked on the GPU at head dims {module.CHECKED_HEAD_DIMS}, the model's is {head_dim}"
    if dtype not in module.SUPPORTED_DTYPES:
        return f"it takes {module.SUPPORTED_DTYPES}, not {dtype}"
    if bias is not None:
        return "it takes no score bias"
    if padding and not getattr(module, "KEY_PADDING", False):
        return "it does not apply the model's key padding"
    if find_nvcc() is None:
        return "nvcc is not found (the kernel is prebuilt for sm_90a by nvcc; the GPU's own compile targets sm_90)"
    return None


def choose_kernel(requested: str, mask4d: np.ndarray, *, batch: int, heads: int, head_dim: int, dtype: str,
                  seq_q: int, target_kind: str, mask_batch: int, mask_heads: int, bias: tuple | None = None,
                  dense_only: bool = False, database: str | None = None, target_arch: str | None = None,
                  padding: bool = False, kv_heads: int = 0) -> KernelChoice:
    """Pick the kernel and its configuration for sites of this shape under the (combined) mask ``mask4d``.

    "auto" asks :func:`stof_tvm.attention.decide_kernel` (the one place the kernel-selection model lives; on
    sm_90 ``target_arch`` the wgmma kernel is a candidate where :func:`wgmma_unavailable` finds nothing against
    it). With a tuning ``database`` holding this problem, its measured-best kernel and configuration win (for
    "auto", or when it is of the requested kind), except over a wgmma pick: the tuner measures the mma.sync
    kernels only. Otherwise the schedule's default configuration is used. ``bias``: ``(bias_batch, bias_heads,
    dtype)`` when the scores carry a real bias: the sparse kernel adds it (an input after the format arrays).
    ``padding``: the sparse kernel will apply the model's key padding. ``kv_heads``: the kernel will read
    grouped-query K and V (fewer heads). ``dense_only``: the model masks in a way only the dense form applies.
    """
    if requested not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {requested!r}")
    if dense_only:
        if requested not in ("auto", "dense"):
            raise ValueError(f"kernel: {requested!r} cannot apply the model's own masking (a condition computed "
                             "from weights); use kernel='dense' or 'auto'")
        return KernelChoice("dense", {}, mask_batch, mask_heads, "the model's masking is computed from weights")
    bias = tuple(bias) if bias is not None and requested != "dense" else None
    if requested == "dense":
        return KernelChoice("dense", {}, mask_batch, mask_heads, "requested")
    if not _supports_head_dim("block", head_dim):       # the row-wise kernel takes the same head dims
        if requested != "auto":
            raise ValueError(f"kernel: {requested!r} supports head dims that are multiples of 16 from 32 to 256, "
                             f"the model's is {head_dim}; use kernel='dense' or 'auto'")
        reason = (f"head dim {head_dim}: the sparse kernels take multiples of 16 from 32 to 256; dense attention "
                  f"with the mask as an input (exact, not accelerated)")
        warnings.warn(f"attention: {reason}", stacklevel=3)
        return KernelChoice("dense", {}, mask_batch, mask_heads, reason)
    no_wgmma = wgmma_unavailable(head_dim=head_dim, dtype=dtype, target_kind=target_kind, target_arch=target_arch,
                                 bias=bias, padding=padding)
    if requested == "wgmma" and no_wgmma is not None:
        raise ValueError(f"kernel: 'wgmma' cannot serve this model: {no_wgmma}; use kernel='block' or 'auto'")
    model_config, reason = None, "requested"
    kind = requested
    if requested == "auto":
        from stof_tvm.attention import decide_kernel

        kind, model_config, reason = decide_kernel(mask4d, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype,
                                                   target_kind=target_kind, target_arch=target_arch,
                                                   no_wgmma=no_wgmma, padding=padding, kv_heads=kv_heads)
    tuned = tuned_choice(database, mask4d, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype,
                         kv_heads=kv_heads) \
        if database is not None and kind != "wgmma" else None
    if tuned is not None and requested in ("auto", tuned["meta"]["kind"]):
        meta = tuned["meta"]
        return KernelChoice(meta["kind"], dict(meta["config"]), mask_batch, mask_heads,
                            f"tuned: {tuned['name']} measured {tuned['best_s'] * 1e3:.3f} ms", bias=bias)
    if not _supports(kind, dtype, target_kind):
        raise ValueError(f"kernel: {kind!r} does not support dtype {dtype} on {target_kind}")
    config = model_config if model_config is not None else _default_config(kind, head_dim, dtype, seq_q,
                                                                           target_kind, padding)
    return KernelChoice(kind, dataclasses.asdict(config), mask_batch, mask_heads, reason, bias=bias)


def kernel_primfunc(choice: KernelChoice, *, batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                    dtype: str, scale: float, target_kind: str, kv_heads: int | None = None):
    """The scheduled PrimFunc of a sparse ``choice`` for one site shape (params: q, k, v, format arrays, the key
    padding summary where ``choice.padding``, the score bias where ``choice.bias``, out in ``choice.out_layout``).
    ``kv_heads``: K and V with fewer heads than Q, each shared by a group of query heads (grouped-query attention)."""
    module = _schedule_module(choice.kind)
    config = config_object(choice.kind, choice.config)
    common = dict(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim, dtype=dtype,
                  mask_batch=choice.mask_batch, mask_heads=choice.mask_heads, scale=scale, config=config,
                  kv_heads=kv_heads)
    extra = {"bias": tuple(choice.bias)} if choice.bias is not None else {}
    if choice.padding:
        extra["padding"] = True
    if choice.kind in TILED:
        extra["out_layout"] = choice.out_layout
    if choice.kind == "wgmma":
        return module.wgmma_attention_primfunc(**common, **extra)
    build = module.rowwise_attention_primfunc if choice.kind == "row" else module.blockwise_attention_primfunc
    return build(**common, target_kind=target_kind, **extra)
