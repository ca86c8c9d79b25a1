"""The downstream chains of an encoder layer, each in a fused and an unfused form made of templates.

Fusing is not always a win (design.md 1B), so a chain can be built both ways and the tuner measures both.
:func:`chain_stages` turns the layer dimensions into the (template name, shape) list of either form; the
stages run in order, each stage's output feeding the next. A fused form is offered only where its templates
accept the layer's shapes: the FFN's (``ffn_gelu_erf_bias_wgmma``, a Hopper kernel keeping the intermediate in
registers) exists for hidden 128-256 only, so :func:`chain_stages` raises ValueError for it at BERT-Base sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

LAYER_KEYS = ("tokens", "hidden", "ffn", "heads", "batch", "seq")


@dataclass(frozen=True)
class Chain:
    """One chain: what it computes and the templates of its two forms."""

    name: str
    computes: str
    fused: tuple[str, ...]  # empty: no fused form
    unfused: tuple[str, ...]

    @property
    def has_fused(self) -> bool:
        return bool(self.fused)


CHAINS: dict[str, Chain] = {c.name: c for c in (
    Chain("qkv", "[3, B, H, S, D] = x @ W_qkv^T + b_qkv, split into heads",
          ("qkv_projection",), ("gemm_bias", "split_heads")),
    Chain("attn_out_ln", "LayerNorm(attn @ W_o^T + b_o + x)",
          ("gemm_bias_residual_layernorm",), ("gemm", "bias_residual_layernorm")),
    Chain("ffn", "GELU(x @ W_1^T + b_1) @ W_2^T + b_2", ("ffn_gelu_erf_bias_wgmma",),
          ("gemm_bias_gelu_erf", "gemm_bias")),
    Chain("ffn_down_ln", "LayerNorm(h @ W_2^T + b_2 + x)",
          ("gemm_bias_residual_layernorm",), ("gemm", "bias_residual_layernorm")),
)}


def check_layer(dims: Mapping[str, int]) -> dict[str, int]:
    """Validate layer dimensions: tokens = batch * seq, hidden divisible by heads."""
    missing = [k for k in LAYER_KEYS if k not in dims]
    if missing:
        raise ValueError(f"layer dims need {list(LAYER_KEYS)} (missing {missing})")
    out = {k: int(dims[k]) for k in LAYER_KEYS}
    if any(v <= 0 for v in out.values()):
        raise ValueError(f"layer dims must be positive, got {out}")
    if out["tokens"] != out["batch"] * out["seq"]:
        raise ValueError(f"tokens ({out['tokens']}) must equal batch * seq ({out['batch']} * {out['seq']})")
    if out["hidden"] % out["heads"]:
        raise ValueError(f"hidden ({out['hidden']}) must be divisible by heads ({out['heads']})")
    return out


def chain_stages(chain: str, dims: Mapping[str, int], fused: bool) -> list[tuple[str, dict]]:
    """(template name, shape) of each kernel of ``chain`` in its fused or unfused form."""
    if chain not in CHAINS:
        raise ValueError(f"unknown chain {chain!r}; known: {sorted(CHAINS)}")
    if fused and not CHAINS[chain].has_fused:
        raise ValueError(f"chain {chain!r} has no fused form; use fused=False")
    d = check_layer(dims)
    m, h, f = d["tokens"], d["hidden"], d["ffn"]
    heads = {"batch": d["batch"], "seq": d["seq"], "heads": d["heads"], "head_dim": h // d["heads"]}
    shapes = {
        ("qkv", True): [heads],
        ("qkv", False): [{"m": m, "n": 3 * h, "k": h}, heads],
        ("attn_out_ln", True): [{"m": m, "n": h, "k": h}],
        ("attn_out_ln", False): [{"m": m, "n": h, "k": h}, {"m": m, "n": h}],
        ("ffn", True): [{"m": m, "hidden": h, "ffn": f}],
        ("ffn", False): [{"m": m, "n": f, "k": h}, {"m": m, "n": h, "k": f}],
        ("ffn_down_ln", True): [{"m": m, "n": h, "k": f}],
        ("ffn_down_ln", False): [{"m": m, "n": h, "k": f}, {"m": m, "n": h}],
    }[(chain, bool(fused))]
    names = CHAINS[chain].fused if fused else CHAINS[chain].unfused
    stages = list(zip(names, shapes))
    if fused:
        from .registry import get_template

        for name, shape in stages:
            try:
                get_template(name).knob_space(shape)
            except ValueError as err:
                raise ValueError(f"the fused form of chain {chain!r} does not fit these dims: {err}") from err
    return stages
