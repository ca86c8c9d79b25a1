"""The end-to-end benchmark's torch side: the same Hugging Face model with its attention under the benchmark's
sparse mask, as the float32 reference and as FlexAttention, next to its stock dense forms.

transformers (5.x) routes every attention call of these models through ``AttentionInterface``; two
implementations are registered here (``model.set_attn_implementation`` switches a built model between them and
the stock ``"sdpa"``):

- ``stof_masked_sdpa``: scaled-dot-product attention restricted to ``keep`` (the sparse mask, [S, S] bool) AND
  the model's own masking: the padding mask transformers builds (``sdpa_mask``, boolean), causality for causal
  modules (GPT-2, Llama, Qwen2), T5's relative position bias added to the scores. The float32 reference of every
  sparse-masked result;
- ``stof_flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` of the same keep-mask (and causality),
  T5's bias through a ``score_mod``, the decoders' fewer key/value heads through ``enable_gqa``; no padding
  (transformers builds no mask for it: the benchmark's inputs are unpadded, which :func:`check_unpadded` enforces).

Both read the mask of the shape being run from :data:`MASKS` (set by :func:`set_mask`).

DeBERTa's disentangled attention (its scores plus c2p and p2c terms gathered by relative position bucket) is its
own code, not an ``AttentionInterface`` call, and transformers gives it no SDPA form: its dense baselines run it
as it is (``eager``, :func:`dense_attention`), and ``stof_masked_sdpa`` means, for it, that same attention with
the keep-mask ANDed into the mask it applies (:func:`keep_in_own_mask`: a forward pre-hook on each attention
module, no edit to transformers). FlexAttention would need the disentangled terms as a ``score_mod``; it is not
run (:data:`UNSUPPORTED`). Like HF's eager attention everywhere, a query row whose keys are all masked would get
a uniform average where stof-tvm's kernels give 0; the benchmark's inputs are unpadded and its masks keep the
diagonal, so no such row arises.
"""
from __future__ import annotations

import numpy as np

MASKED_SDPA = "stof_masked_sdpa"
FLEX = "stof_flex"
MASKS: dict = {}          # "keep": [S, S] bool tensor, "causal": bool, "block": BlockMask or None
# families whose attention bypasses AttentionInterface -> the module class that applies the model's mask
OWN_ATTENTION = {"deberta": "DisentangledSelfAttention"}
KEEP_FLAG = "stof_keep_mask"     # attribute of such a module: AND MASKS["keep"] into its mask (keep_in_own_mask)
# stages of bench_e2e a family cannot run, and why (recorded as the stage's "_skipped" reason)
UNSUPPORTED = {"deberta": {"torch-flex": "FlexAttention would need DeBERTa's disentangled attention (c2p / p2c "
                                         "terms gathered by relative bucket) as a score_mod; it bypasses "
                                         "transformers' AttentionInterface, so none is registered"}}


def _causal(module, q_len: int) -> bool:
    return bool(getattr(module, "is_causal", False)) and q_len > 1


def masked_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_bias=None,
                **kwargs):
    """Attention over ``MASKS["keep"]`` AND the model's masks (see the module docstring); returns transformers'
    ``(output [B, S, H, D], None)``."""
    import torch
    import torch.nn.functional as F

    q_len, k_len = query.shape[2], key.shape[2]
    keep = MASKS["keep"][:q_len, :k_len][None, None]
    if attention_mask is None:
        if _causal(module, q_len):
            keep = keep & torch.ones(q_len, k_len, dtype=torch.bool, device=keep.device).tril()
        bias = None
    elif attention_mask.dtype == torch.bool:
        keep, bias = keep & attention_mask, None
    else:                                          # an additive mask (0 or very negative)
        bias = attention_mask
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    if bias is None:
        attn_mask = keep
    else:
        attn_mask = torch.where(keep, bias.to(query.dtype), torch.finfo(query.dtype).min)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=0.0, scale=scaling,
                                         enable_gqa=_grouped(query, key))
    return out.transpose(1, 2).contiguous(), None


def _grouped(query, key) -> bool:
    """Grouped-query attention (Llama): transformers hands K and V over with their own, fewer, heads."""
    return query.shape[1] != key.shape[1]


_FLEX = {}


def flex(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_bias=None, **kwargs):
    """FlexAttention with ``MASKS["block"]`` (the keep-mask, and causality where the model is causal: the
    BlockMask is built with it) and T5's position bias as a ``score_mod``; transformers' output layout."""
    import torch

    if "compiled" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    score_mod = None
    if position_bias is not None:
        bias = position_bias.to(query.dtype)
        one_batch = bias.shape[0] == 1

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[0 if one_batch else b, h, q_idx, kv_idx]
    if query.device.type == "cpu":      # inductor's CPU lowering of flex_attention (torch 2.13) rejects these
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()   # transposed views
    out = _FLEX["compiled"](query, key, value, score_mod=score_mod, block_mask=MASKS["block"], scale=scaling,
                            enable_gqa=_grouped(query, key))
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    """The mask builder registered for ``stof_flex``: none (its BlockMask holds the whole mask)."""
    return None


def register() -> None:
    """Register both attention implementations with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(MASKED_SDPA, masked_sdpa)
    AttentionMaskInterface.register(MASKED_SDPA, sdpa_mask)
    AttentionInterface.register(FLEX, flex)
    AttentionMaskInterface.register(FLEX, _no_mask)


def set_mask(keep: np.ndarray, causal: bool, device: str, flex_mask: bool) -> None:
    """Make ``keep`` ([S, S] bool) the mask both implementations apply; ``flex_mask``: also build its BlockMask
    (causality folded in for causal models)."""
    import torch

    dense = torch.from_numpy(np.ascontiguousarray(keep)).to(device)
    MASKS.clear()
    MASKS.update(keep=dense, causal=causal, block=None)
    if flex_mask:
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            kept = dense[q_idx, kv_idx]
            return kept & (q_idx >= kv_idx) if causal else kept

        size = keep.shape[0]
        MASKS["block"] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=size, KV_LEN=size, device=device)


def dense_attention(family: str) -> str:
    """The attention of the dense torch baselines and the dense reference: ``sdpa``, or ``eager`` (the model's
    own) where transformers has no SDPA form of it (DeBERTa)."""
    from stof_tvm.models import hf_export as hf

    return "sdpa" if "sdpa" in hf.attention_kinds(family) else "eager"


def keep_in_own_mask(torch_model, on: bool) -> None:
    """AND ``MASKS["keep"]`` into the mask each of the model's own attention modules (:data:`OWN_ATTENTION`)
    applies (``on``), or stop: a forward pre-hook registered once per module, switched by the module's
    :data:`KEEP_FLAG` attribute, so that a deep copy of the model keeps both the hook and its state."""
    cls = OWN_ATTENTION[torch_model.family]
    modules = [m for m in torch_model.modules() if type(m).__name__ == cls]
    if not modules:
        raise RuntimeError(f"attention: {torch_model.family} model has no {cls} module to mask")
    for module in modules:
        if not hasattr(module, KEEP_FLAG):
            module.register_forward_pre_hook(_and_keep, with_kwargs=True)
        setattr(module, KEEP_FLAG, on)


def _and_keep(module, args, kwargs):
    """Forward pre-hook of DeBERTa's ``DisentangledSelfAttention(hidden_states, attention_mask, ...)``: while
    the module's :data:`KEEP_FLAG` is set, its mask ([B, 1, S, S], nonzero = attend: the padding mask as the
    encoder's ``get_attention_mask`` expands it) AND ``MASKS["keep"]``."""
    if not getattr(module, KEEP_FLAG):
        return None
    hidden_states, attention_mask, *rest = args
    q_len, k_len = attention_mask.shape[-2:]
    return (hidden_states, attention_mask.bool() & MASKS["keep"][:q_len, :k_len], *rest), kwargs


def use_attention(torch_model, name: str) -> None:
    """Switch a built (wrapped) model's attention implementation to ``name``; a clear error when it did not take.
    A model of :data:`OWN_ATTENTION` runs its own (eager) attention throughout: ``MASKED_SDPA`` switches the
    keep-mask on in it (:func:`keep_in_own_mask`), any other name off, and ``FLEX`` is refused."""
    inner = torch_model.model
    if torch_model.family in OWN_ATTENTION:
        if name == FLEX:
            raise ValueError(f"attention: {UNSUPPORTED[torch_model.family]['torch-flex']}")
        keep_in_own_mask(torch_model, on=name == MASKED_SDPA)
        name = "eager" if name == MASKED_SDPA else name
    inner.set_attn_implementation(name)
    got = inner.config._attn_implementation
    if got != name:
        raise RuntimeError(f"attention: asked for {name!r}, the model uses {got!r}")


def check_unpadded(feeds: dict) -> None:
    if "attention_mask" in feeds and not np.all(feeds["attention_mask"] == 1):
        raise ValueError("inputs: FlexAttention and the dense baselines run unpadded; the benchmark's inputs must be")


def forward(torch_model, args: tuple):
    """``torch_model(*args)`` without autograd: the callable every torch variant is timed through."""
    import torch

    def run():
        with torch.no_grad():
            return torch_model(*args)
    return run
