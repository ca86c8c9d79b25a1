"""Sparse multi-head attention as a Python API: ``sparse_attention`` and the plan-once/run-many ``AttentionPlan``.

The data flow is design.md's: mask (any form :func:`stof_tvm.make_mask` / :func:`normalize_mask` accepts) ->
normalised ``[Bm, Hm, Sq, Sk]`` mask -> kernel choice (:func:`decide_kernel`) -> sparse format (row-compressed
or tiled) -> compiled TensorIR kernel (cached per problem, kernel, configuration and target) -> run.

Inputs are ``[B, H, S, D]`` numpy arrays or torch tensors (float16 or bfloat16; float32 too on the CPU). A torch
CUDA tensor goes to the kernel through DLPack with no copy, on torch's current stream, and the output is a torch
tensor on the same device; numpy inputs are copied to the target's device and the output comes back as numpy.

A plan can be saved (:meth:`AttentionPlan.save`) and loaded (:meth:`AttentionPlan.load`) with TVM's runtime
alone, e.g. built on a CPU machine for CUDA and run on the GPU machine. This module imports TVM's compiler
(``tvm.target``, the TensorIR kernels) only when it compiles.
"""
from __future__ import annotations

import collections
import json
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import tvm

from stof_tvm.sparse_formats.masks import normalize_mask
from stof_tvm.sparse_formats.rows import build_rows
from stof_tvm.sparse_formats.stats import mask_stats, stof_rule
from stof_tvm.sparse_formats.tiled import build_tiled
from stof_tvm.torch_views import tvm_tensor

__all__ = ["sparse_attention", "AttentionPlan", "choose_kernel", "choose_kernel_config", "decide_kernel", "is_hopper",
           "resolve_target", "KERNELS", "clear_kernel_cache"]

KERNELS = ("auto", "row", "block", "wgmma")   # "wgmma": the Hopper block-wise kernel (sm_90 targets, built for sm_90a)
_SYMBOLS = {"row": "rowwise_attention", "block": "blockwise_attention", "wgmma": "wgmma_attention"}
_CUDA_DTYPES = ("float16", "bfloat16")
_CPU_DTYPES = ("float16", "bfloat16", "float32")
# The sparse kernels' SUPPORTED_HEAD_DIMS (multiples of 16 from 32 to 256), kept here so that importing this module
# does not import the kernels; tests/test_attention_api.py checks that they agree.
_HEAD_DIMS = tuple(range(32, 257, 16))
_LIBRARY, _PLAN_FILE = "kernel.so", "plan.json"
# Byte offsets at which each kernel reads a Q/K/V view in place (its buffers' offset_factor, VIEW_ALIGN elements of
# 2 bytes; tests/test_attention_api.py checks them against the kernels); the row-wise kernel takes none.
_VIEW_BYTES = {"block": 16, "wgmma": 16}


@dataclass(frozen=True)
class Problem:
    """Everything a compiled kernel is specialised to, apart from the mask's contents."""

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str
    mask_batch: int
    mask_heads: int
    scale: float
    kv_heads: int | None = None     # K and V heads where fewer than ``heads`` (grouped-query attention)

    @property
    def kv_shape(self) -> tuple:
        return self.batch, self.kv_heads or self.heads, self.seq_k, self.head_dim


# ---------------------------------------------------------------------------------------------------------------
# Kernel choice and targets

def choose_kernel_config(mask: np.ndarray, *, batch: int, heads: int, head_dim: int, dtype: str,
                         target_kind: str, target_arch: str | None = None):
    """Pick the kernel (``"row"``, ``"block"`` or ``"wgmma"``) and its configuration for a normalised
    ``[Bm, Hm, Sq, Sk]`` mask: :func:`decide_kernel`'s pick without its reason."""
    kind, config, _ = decide_kernel(mask, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype,
                                    target_kind=target_kind, target_arch=target_arch)
    return kind, config


def is_hopper(target_arch) -> bool:
    """The CUDA architectures the wgmma kernel is built for (sm_90 targets build it for sm_90a)."""
    return str(target_arch) in ("sm_90", "sm_90a")


def decide_kernel(mask: np.ndarray, *, batch: int, heads: int, head_dim: int, dtype: str, target_kind: str,
                  target_arch: str | None = None, no_wgmma: str | None = None,
                  padding: bool = False, kv_heads: int = 0) -> tuple[str, object, str]:
    """``(kind, configuration, reason)`` for a normalised ``[Bm, Hm, Sq, Sk]`` mask.

    On CUDA this is the analytical model (:func:`stof_tvm.cost_model.decide_attention`, constants calibrated on
    the H200): the fastest predicted kernel and configuration on the present GPU (the H200 profile when none is
    present). The Hopper wgmma kernel is a candidate on sm_90 / sm_90a targets (``target_arch``) for the head
    dims and dtypes it takes, unless ``no_wgmma`` gives a reason it cannot serve this call (the compile path's
    score bias; ``padding``: the kernel will also apply a model's key padding, which narrows the wgmma
    configurations; ``kv_heads``: grouped-query K and V, read once per key/value head); the reason says which kernel
    won and by how much. On the CPU, whose speed the model does not
    describe, STOF's rule (design.md 1A) picks the kind and the configuration is ``None`` (the kernel's default).
    float32 (CPU only) has only the row-wise kernel.
    """
    if dtype not in _CUDA_DTYPES:
        return "row", None, "the row-wise kernel: the only one for float32"
    if target_kind != "cuda":
        return (stof_rule(mask_stats(mask, tile_shapes=((16, 16),))), None,
                "chosen from the mask by STOF's rule (the CPU has no speed model); default configuration")
    from stof_tvm.cost_model import AttentionProblem, MaskProfile, decide_attention
    from stof_tvm.hardware import detect

    problem = AttentionProblem(batch=batch, heads=heads, head_dim=head_dim, dtype=dtype, mask=MaskProfile(mask),
                               padding=padding, kv_heads=kv_heads)
    wgmma = is_hopper(target_arch) and no_wgmma is None
    decision = decide_attention(problem, detect(), kinds=("block", "row", "wgmma") if wgmma else ("block", "row"))
    reason = decision.reason
    if no_wgmma is not None and is_hopper(target_arch):
        reason += f"; not the wgmma kernel: {no_wgmma}"
    elif not wgmma:
        reason += f"; the wgmma kernel needs an sm_90 / sm_90a target (this one: {target_arch})"
    return decision.best.candidate.kind, decision.best.candidate.config, reason


def choose_kernel(mask: np.ndarray, *, batch: int, heads: int, head_dim: int, dtype: str, target_kind: str,
                  target_arch: str | None = None) -> str:
    """The kernel kind :func:`choose_kernel_config` picks."""
    return choose_kernel_config(mask, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype,
                                target_kind=target_kind, target_arch=target_arch)[0]


def resolve_target(target=None):
    """A ``tvm.target.Target`` from None (cuda when a GPU is present, else llvm), a kind, a dict or a Target.

    CUDA targets without an ``arch`` get the present GPU's; with no GPU present that is an error.
    """
    from tvm.target import Target

    if target is None:
        target = "cuda" if tvm.cuda(0).exist else "llvm"
    if isinstance(target, Target):
        target = json.loads(str(target))
    if isinstance(target, str):
        target = {"kind": target}
    if not isinstance(target, dict) or "kind" not in target:
        raise TypeError(f"target must be None, 'cuda', 'llvm', a target dict or a tvm Target, got {target!r}")
    target = dict(target)
    target.pop("host", None)
    if target["kind"] == "llvm":
        return Target(target)
    if target["kind"] != "cuda":
        raise ValueError(f"target kind must be 'cuda' or 'llvm', got {target['kind']!r}")
    if "arch" not in target:
        if not tvm.cuda(0).exist:
            raise ValueError("target: a CUDA target without 'arch' takes it from the GPU, but no GPU is present "
                             "(give {'kind': 'cuda', 'arch': 'sm_90'} to build for another machine)")
        target["arch"] = "sm_" + tvm.cuda(0).compute_version.replace(".", "")
    target.setdefault("max_threads_per_block", 1024)
    target.setdefault("max_shared_memory_per_block", 232448 if target["arch"].startswith("sm_9") else 166912)
    return Target(target, host={"kind": "llvm"})


def _hopper_target(target):
    """The sm_90a twin of a CUDA sm_90 / sm_90a target (the wgmma kernel's instructions exist only there)."""
    from tvm.target import Target

    spec = json.loads(str(target))
    if spec["kind"] != "cuda" or spec.get("arch") not in ("sm_90", "sm_90a"):
        raise ValueError(f"kernel 'wgmma' needs a CUDA sm_90 / sm_90a (Hopper) target, got {spec.get('kind')} "
                         f"{spec.get('arch', '')}".rstrip())
    spec.pop("host", None)
    return Target({**spec, "arch": "sm_90a"}, host={"kind": "llvm"})


# ---------------------------------------------------------------------------------------------------------------
# Compiled-kernel cache

_KERNEL_CACHE: dict[tuple, object] = {}


def clear_kernel_cache() -> None:
    """Forget every compiled kernel and every cached :func:`sparse_attention` plan (the next plan of each kind
    compiles again)."""
    _KERNEL_CACHE.clear()
    _PLAN_CACHE.clear()


def _default_config(kernel: str, problem: Problem, target_kind: str):
    if kernel == "wgmma":
        from stof_tvm.schedules.attention_wgmma import default_config
        return default_config(problem.head_dim)
    if kernel == "row":
        from stof_tvm.schedules.attention_rowwise import default_row_config
        return default_row_config(problem.head_dim, problem.dtype, target_kind)
    from stof_tvm.schedules.attention_blockwise import default_block_config
    return default_block_config(problem.head_dim, problem.dtype, problem.seq_q)


def _compiled_kernel(kernel: str, problem: Problem, config, target):
    """The compiled module of ``kernel`` for this problem, config and target: built once, then reused."""
    key = (kernel, problem, config, str(target))
    if key not in _KERNEL_CACHE and kernel == "wgmma":
        from stof_tvm.schedules.attention_wgmma import wgmma_attention_primfunc

        p = problem
        func = wgmma_attention_primfunc(batch=p.batch, heads=p.heads, seq_q=p.seq_q, seq_k=p.seq_k,
                                        head_dim=p.head_dim, dtype=p.dtype, mask_batch=p.mask_batch,
                                        mask_heads=p.mask_heads, scale=p.scale, config=config,
                                        kv_heads=p.kv_heads)
        _KERNEL_CACHE[key] = tvm.compile(func, target=target)
    if key not in _KERNEL_CACHE:
        if kernel == "row":
            from stof_tvm.schedules.attention_rowwise import rowwise_attention_primfunc as make_primfunc
        else:
            from stof_tvm.schedules.attention_blockwise import blockwise_attention_primfunc as make_primfunc
        func = make_primfunc(**asdict(problem), config=config, target_kind=target.kind.name)
        _KERNEL_CACHE[key] = tvm.compile(func, target=target)
    return _KERNEL_CACHE[key]


def _format_arrays(kernel: str, mask: np.ndarray, config) -> list[np.ndarray]:
    """The kernel's format arguments (between v and out), in parameter order; empty lists get one dummy entry
    (never read: the row pointers say the lists are empty)."""
    if kernel == "row":
        fmt = build_rows(mask)
        arrays = [fmt.indptr, fmt.indices]
    else:
        fmt = build_tiled(mask, config.block_m, config.block_n)
        arrays = [fmt.full_indptr, fmt.full_indices, fmt.part_indptr, fmt.part_indices, fmt.part_bitmaps]
    return [a if a.shape[0] else np.zeros((1,) + a.shape[1:], a.dtype) for a in arrays]


# ---------------------------------------------------------------------------------------------------------------
# Tensors in and out

def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _dtype_name(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def _check_inputs(q, k, v, problem: Problem) -> None:
    kinds = {_is_torch(t) for t in (q, k, v)}
    if len(kinds) != 1 or not (_is_torch(q) or all(isinstance(t, np.ndarray) for t in (q, k, v))):
        raise TypeError("q, k and v must all be numpy arrays or all be torch tensors, got "
                        f"{type(q).__name__}, {type(k).__name__}, {type(v).__name__}")
    p = problem
    want = {"q": (p.batch, p.heads, p.seq_q, p.head_dim), "k": p.kv_shape, "v": p.kv_shape}
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tuple(tensor.shape) != want[name]:
            raise ValueError(f"{name} must have shape {want[name]} ([B, H, S, D]), got {tuple(tensor.shape)}")
        if _dtype_name(tensor) != p.dtype:
            raise TypeError(f"{name} must have dtype {p.dtype} like the plan, got {_dtype_name(tensor)}")
    if _is_torch(q) and not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_output(out, q) -> None:
    if _is_torch(out) != _is_torch(q) or (_is_torch(q) and out.device != q.device):
        raise TypeError(f"out must be the same kind of tensor as q, on q's device; got {type(out).__name__}")
    if tuple(out.shape) != tuple(q.shape) or _dtype_name(out) != _dtype_name(q):
        raise ValueError(f"out must have q's shape {tuple(q.shape)} and dtype {_dtype_name(q)}, got "
                         f"{tuple(out.shape)} {_dtype_name(out)}")




# ---------------------------------------------------------------------------------------------------------------
# The plan

class AttentionPlan:
    """Sparse attention planned once for a mask and a problem shape, run many times (FlashInfer style).

    Construction normalises the mask, chooses the kernel, builds its sparse format and compiles the kernel
    (or takes it from the cache); :meth:`run` only moves tensors and launches.

    Args:
        mask: any form :func:`stof_tvm.normalize_mask` accepts (spec string, bool array [S,S]/[B,S,S]/
            [B,H,S,S], callable f(b,h,i,j), per-batch valid lengths).
        shape: the shape of q, ``(B, H, Sq, D)``.
        dtype: "float16" or "bfloat16" ("float32" too on the CPU); q, k, v and the output share it.
        seq_k: key/value length (default Sq).
        kv_heads: key/value heads (default H): fewer for grouped-query attention, K and V then
            ``[B, kv_heads, Sk, D]`` and query head ``h`` reading key/value head ``h // (H / kv_heads)``.
        kernel: "auto" (:func:`decide_kernel`: on CUDA sm_90 targets the Hopper wgmma kernel where the model
            predicts it faster), "row", "block" or "wgmma" (the block-wise kernel on Hopper wgmma,
            :mod:`stof_tvm.schedules.attention_wgmma`; CUDA sm_90 targets, built for sm_90a).
        target: None (cuda if a GPU is present, else llvm), "cuda", "llvm", a target dict or a tvm Target.
            A CUDA plan can be built without a GPU (to :meth:`save` it), but not run.
        scale: softmax scale, default 1/sqrt(D).
        config: kernel configuration (``RowConfig`` / ``BlockConfig`` / ``WgmmaAttentionConfig``), default the
            kernel's own.

    Attributes: ``kernel`` ("row"/"block"/"wgmma"), ``reason`` (why that kernel: the model's predictions, or
    "requested"), ``problem`` (:class:`Problem`), ``target`` (the target as a dict), ``config`` (a dict in
    loaded plans).
    """

    def __init__(self, mask, shape, dtype, *, seq_k=None, kernel="auto", target=None, scale=None, config=None,
                 kv_heads=None):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if not isinstance(shape, (tuple, list)) or len(shape) != 4:
            raise ValueError(f"shape must be q's shape (B, H, Sq, D), got {shape!r}")
        batch, heads, seq_q, head_dim = (int(s) for s in shape)
        seq_k = seq_q if seq_k is None else int(seq_k)
        dtype = str(dtype).removeprefix("torch.")
        resolved = resolve_target(target)
        kind = resolved.kind.name
        allowed = _CUDA_DTYPES if kind == "cuda" else _CPU_DTYPES
        if dtype not in allowed:
            raise TypeError(f"dtype must be one of {allowed} on {kind}, got {dtype!r}")
        if head_dim not in _HEAD_DIMS:
            raise ValueError(f"head dimension D must be a multiple of 16 from 32 to 256, got {head_dim} "
                             f"(shape {tuple(shape)})")
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        if kv_heads is not None and (isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1
                                     or heads % kv_heads):
            raise ValueError(f"kv_heads must be a positive divisor of the {heads} heads, got {kv_heads!r}")
        if _is_torch(mask):
            mask = mask.detach().cpu().numpy()
        mask4 = np.ascontiguousarray(normalize_mask(mask, batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k))
        self.problem = Problem(batch, heads, seq_q, seq_k, head_dim, dtype, mask4.shape[0], mask4.shape[1],
                               float(scale), None if kv_heads in (None, heads) else kv_heads)
        chosen = None
        self.reason = "requested"
        if kernel == "auto":
            kernel, chosen, self.reason = decide_kernel(mask4, batch=batch, heads=heads, head_dim=head_dim,
                                                        dtype=dtype, target_kind=kind,
                                                        target_arch=json.loads(str(resolved)).get("arch"),
                                                        kv_heads=self.problem.kv_heads or 0)
        if kernel in ("block", "wgmma") and dtype == "float32":
            raise TypeError(f"the {kernel} kernel supports float16 and bfloat16, not float32")
        if kernel == "wgmma":
            resolved = _hopper_target(resolved)
        self.kernel = kernel
        if config is None:
            config = chosen if chosen is not None else _default_config(kernel, self.problem, kind)
        self.config = config
        self.target = json.loads(str(resolved))
        self._module = _compiled_kernel(kernel, self.problem, self.config, resolved)
        self._formats = _format_arrays(kernel, mask4, self.config)
        self._target_kind = kind
        self._device_formats = {}
        self._function = None

    @property
    def formats(self) -> list[np.ndarray]:
        """The sparse-format arrays the kernel reads, in parameter order (row: indptr, indices; block:
        full_indptr, full_indices, part_indptr, part_indices, part_bitmaps)."""
        return list(self._formats)

    # -- running -----------------------------------------------------------------------------------------------

    def run(self, q, k, v, out=None):
        """Attention of q, k, v ([B, H, S, D], numpy or torch) under the plan's mask; same kind as the input.

        ``out``: optional preallocated output (same kind, shape and dtype as q), written and returned.
        """
        _check_inputs(q, k, v, self.problem)
        if out is not None:
            _check_output(out, q)
        if _is_torch(q):
            return self._run_torch(q, k, v, out)
        dev = self._device()
        args = [tvm.runtime.tensor(np.ascontiguousarray(t), dev) for t in (q, k, v)]
        result = tvm.runtime.empty(tuple(q.shape), self.problem.dtype, dev)
        self._launch(dev, args, result)
        if out is None:
            return result.numpy()
        out[...] = result.numpy()
        return out

    def _run_torch(self, q, k, v, out_torch):
        import torch

        want = "cuda" if self._target_kind == "cuda" else "cpu"
        if q.device.type != want:
            raise ValueError(f"this plan runs on {want} ({self._target_kind} target) but q, k, v are on {q.device}")
        dev = tvm.cuda(q.device.index or 0) if want == "cuda" else tvm.cpu(0)
        if want == "cuda" and not dev.exist:
            raise ValueError(f"no CUDA device {q.device} is visible to TVM")
        keep = []                            # torch tensors that must outlive the launch
        args = []
        views = _VIEW_BYTES.get(self.kernel, 0)      # Q/K/V inside a larger allocation are read in place
        for t in (q, k, v):
            shared, owner = tvm_tensor(t, views)
            args.append(shared)
            keep.append(owner)
        if out_torch is None:
            out_torch = torch.empty_like(q, memory_format=torch.contiguous_format)
        out, written = tvm_tensor(out_torch)
        if want == "cuda":
            import tvm_ffi

            with tvm_ffi.use_raw_stream(dev, torch.cuda.current_stream(q.device).cuda_stream):
                self._launch(dev, args, out)
        else:
            self._launch(dev, args, out)
        if written is not out_torch:                 # out was not shareable: the kernel wrote a copy
            out_torch.copy_(written)
        return out_torch

    def _device(self):
        if self._target_kind == "llvm":
            return tvm.cpu(0)
        dev = tvm.cuda(0)
        if not dev.exist:
            raise ValueError("target is CUDA but no GPU is present on this machine (plans built here can be "
                             "saved and run elsewhere)")
        return dev

    def _launch(self, dev, args, out) -> None:
        key = (dev.dlpack_device_type(), dev.index)
        if key not in self._device_formats:
            self._device_formats[key] = [tvm.runtime.tensor(a, dev) for a in self._formats]
        if self._function is None:          # looked up once: a module lookup walks its import tree (~80 us)
            self._function = self._module[_SYMBOLS[self.kernel]]
        self._function(*args, *self._device_formats[key], out)

    # -- saving and loading ------------------------------------------------------------------------------------

    def save(self, path) -> str:
        """Write the compiled kernel, its format arrays and a description into directory ``path``."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self._module.export_library(os.path.join(path, _LIBRARY))
        for index, array in enumerate(self._formats):
            np.save(os.path.join(path, f"format{index}.npy"), array, allow_pickle=False)
        description = {"kernel": self.kernel, "reason": self.reason, "problem": asdict(self.problem),
                       "target": self.target,
                       "config": asdict(self.config), "formats": len(self._formats)}
        with open(os.path.join(path, _PLAN_FILE), "w") as f:
            json.dump(description, f, indent=2, default=str)
        return path

    @classmethod
    def load(cls, path) -> "AttentionPlan":
        """Load a saved plan; needs TVM's runtime only (on a GPU machine, CUDA source is compiled at load)."""
        path = os.fspath(path)
        plan_file = os.path.join(path, _PLAN_FILE)
        if not os.path.isfile(plan_file):
            raise FileNotFoundError(f"path: {path!r} holds no saved AttentionPlan (no {_PLAN_FILE})")
        with open(plan_file) as f:
            description = json.load(f)
        plan = cls.__new__(cls)
        plan.problem = Problem(**description["problem"])
        plan.kernel = description["kernel"]
        plan.reason = description.get("reason", "")
        plan.target = description["target"]
        plan.config = description["config"]
        plan._target_kind = description["target"]["kind"]
        if plan._target_kind == "cuda":
            from stof_tvm.cuda_runtime import ensure_cuda_runtime
            ensure_cuda_runtime()
        plan._module = tvm.runtime.load_module(os.path.join(path, _LIBRARY))
        plan._formats = [np.load(os.path.join(path, f"format{i}.npy"), allow_pickle=False)
                         for i in range(description["formats"])]
        plan._device_formats = {}
        plan._function = None
        return plan


_PLAN_CACHE: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_PLAN_CACHE_SIZE = 16


def _cached_plan(mask, shape, dtype, seq_k, kernel, target, scale, kv_heads=None) -> "AttentionPlan":
    """The plan of these arguments, built once: a mask is keyed by its spec string or by the identity of the
    array / tensor / callable (a mask changed in place must be passed as a new object)."""
    mask_key = ("spec", mask) if isinstance(mask, str) else ("object", id(mask))
    target_key = json.dumps(target, sort_keys=True) if isinstance(target, dict) else str(target)
    key = (mask_key, tuple(int(s) for s in shape), dtype, seq_k, kernel, target_key, scale, kv_heads)
    entry = _PLAN_CACHE.get(key)
    if entry is not None and (mask_key[0] == "spec" or entry[0] is mask):
        _PLAN_CACHE.move_to_end(key)
        return entry[1]
    resolved = resolve_target(target)
    if resolved.kind.name == "cuda" and not tvm.cuda(0).exist:
        raise ValueError(f"target: {resolved.kind.name} was asked for but no GPU is present on this machine")
    plan = AttentionPlan(mask, shape, dtype, seq_k=seq_k, kernel=kernel, target=resolved, scale=scale,
                         kv_heads=kv_heads)
    _PLAN_CACHE[key] = (mask, plan)
    while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
        _PLAN_CACHE.popitem(last=False)
    return plan


def sparse_attention(q, k, v, mask, *, kernel="auto", target=None, scale=None):
    """Multi-head attention of ``q, k, v`` ``[B, H, S, D]`` where only the pairs kept by ``mask`` are computed.

    ``softmax(scale * q k^T restricted to kept pairs) v``; rows with no kept key are 0. ``mask`` takes any form
    :func:`stof_tvm.normalize_mask` accepts. numpy in, numpy out; torch in, torch out (CUDA tensors without a
    copy). The plan (kernel choice, sparse format, compiled kernel) is built once per mask, shape, dtype and
    target and reused by later calls (the last 16 are kept; a mask array is recognised by identity, so pass a
    new array after changing one in place); :class:`AttentionPlan` holds one explicitly. K and V with fewer heads
    than Q (a divisor of them) are grouped-query attention: each key/value head serves ``H / Hkv`` query heads.
    """
    if not hasattr(q, "shape") or len(q.shape) != 4:
        raise ValueError(f"q must be a [B, H, S, D] array or tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if not hasattr(k, "shape") or len(k.shape) != 4:
        raise ValueError(f"k must be a [B, H, S, D] array or tensor, got {getattr(k, 'shape', type(k).__name__)}")
    if target is None and _is_torch(q):
        target = "cuda" if q.is_cuda else "llvm"
    kv_heads = int(k.shape[1]) if int(k.shape[1]) != int(q.shape[1]) else None
    plan = _cached_plan(mask, tuple(q.shape), _dtype_name(q), int(k.shape[2]), kernel, target, scale, kv_heads)
    return plan.run(q, k, v)
