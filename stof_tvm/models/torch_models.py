"""Transformer encoders written in PyTorch, exported to ONNX with PyTorch's own exporter (random weights).

These follow the Hugging Face implementations' computation and masking, so the exported graphs carry the forms
real exports do: BERT's extended additive mask, GPT-2's causal ``where`` over a registered bool buffer plus
padding, T5's relative position bias added to the scores (unscaled attention, RMSNorm, ReLU FFN), ViT's patch
embedding and unmasked pre-LN blocks. Needs ``torch`` (not a dependency of stof-tvm; install it to export).

``export(name, path, seq_len=...)`` writes ``path`` and returns the ModelProto. Sizes are the published
models' (``bert-base``, ``bert-large``, ``gpt2``, ``t5-base-encoder``, ``vit-base``) or ``tiny-*`` variants
for tests.
"""
from __future__ import annotations

import io
import math
import warnings

import onnx
import torch
from torch import nn
from torch.nn import functional as F

SIZES = {  # hidden, layers, heads, ffn
    "base": (768, 12, 12, 3072),
    "large": (1024, 24, 16, 4096),
    "tiny": (128, 2, 2, 256),
}


class _Attention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections (BERT, T5, ViT)."""

    def __init__(self, hidden: int, heads: int, bias: bool = True, scale: bool = True):
        super().__init__()
        self.heads, self.head_dim, self.scale = heads, hidden // heads, scale
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=bias) for _ in range(4))

    def _split(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x, additive=None):
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2))
        if self.scale:
            scores = scores / math.sqrt(self.head_dim)
        if additive is not None:
            scores = scores + additive
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).contiguous()
        return self.o(ctx.view(x.shape[0], x.shape[1], -1))


def _extended_mask(attention_mask, dtype=torch.float32):
    """Hugging Face's additive mask: 0 where attended, the lowest float where padded; [B, 1, 1, S]."""
    ext = attention_mask[:, None, None, :].to(dtype)
    return (1.0 - ext) * torch.finfo(dtype).min


class Bert(nn.Module):
    def __init__(self, hidden, layers, heads, ffn, vocab=30522, max_positions=4096):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.register_buffer("position_ids", torch.arange(max_positions)[None], persistent=False)
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "attn": _Attention(hidden, heads), "ln1": nn.LayerNorm(hidden, eps=1e-12),
            "fc1": nn.Linear(hidden, ffn), "fc2": nn.Linear(ffn, hidden), "ln2": nn.LayerNorm(hidden, eps=1e-12),
        }) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        seq = input_ids.shape[1]
        h = self.ln(self.word(input_ids) + self.position(self.position_ids[:, :seq]))
        mask = _extended_mask(attention_mask)
        for layer in self.layers:
            h = layer["ln1"](h + layer["attn"](h, mask))
            h = layer["ln2"](h + layer["fc2"](F.gelu(layer["fc1"](h))))
        return h


class Gpt2(nn.Module):
    """GPT-2: pre-LN blocks, fused QKV projection, causal ``where`` over a bool buffer, tanh GELU."""

    def __init__(self, hidden, layers, heads, ffn, vocab=50257, max_positions=4096):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(max_positions, hidden)
        self.register_buffer("bias", torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool))[None, None],
                             persistent=False)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(hidden), "c_attn": nn.Linear(hidden, 3 * hidden), "c_proj": nn.Linear(hidden, hidden),
            "ln2": nn.LayerNorm(hidden), "fc": nn.Linear(hidden, ffn), "proj": nn.Linear(ffn, hidden),
        }) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def _attention(self, block, x, padding):
        b, s, hidden = x.shape
        q, k, v = block["c_attn"](x).split(hidden, dim=2)
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = self.bias[:, :, :s, :s]
        scores = torch.where(causal, scores, torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype))
        scores = scores + padding
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).contiguous().view(b, s, hidden)
        return block["c_proj"](ctx)

    def forward(self, input_ids, attention_mask):
        s = input_ids.shape[1]
        h = self.wte(input_ids) + self.wpe(torch.arange(s)[None])
        padding = _extended_mask(attention_mask)
        for block in self.blocks:
            h = h + self._attention(block, block["ln1"](h), padding)
            h = h + block["proj"](F.gelu(block["fc"](block["ln2"](h)), approximate="tanh"))
        return self.ln_f(h)


class _RmsNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden) + 0.1 * torch.randn(hidden)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class T5Encoder(nn.Module):
    """T5 encoder: RMSNorm pre-norm, unscaled attention with a bucketed relative position bias, ReLU FFN."""

    def __init__(self, hidden, layers, heads, ffn, vocab=32128, buckets=32, max_distance=128):
        super().__init__()
        self.heads, self.buckets, self.max_distance = heads, buckets, max_distance
        self.embed = nn.Embedding(vocab, hidden)
        self.relative_bias = nn.Embedding(buckets, heads)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": _RmsNorm(hidden), "attn": _Attention(hidden, heads, bias=False, scale=False),
            "ln2": _RmsNorm(hidden), "wi": nn.Linear(hidden, ffn, bias=False), "wo": nn.Linear(ffn, hidden, bias=False),
        }) for _ in range(layers))
        self.ln_f = _RmsNorm(hidden)

    def _bucket(self, relative):
        """T5's bidirectional bucketing of relative positions (exact buckets near, log-spaced far)."""
        half = self.buckets // 2
        bucket = (relative > 0).long() * half
        distance = relative.abs()
        exact = half // 2
        far = exact + (torch.log(distance.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
                       * (half - exact)).long()
        far = torch.minimum(far, torch.full_like(far, half - 1))
        return bucket + torch.where(distance < exact, distance, far)

    def forward(self, input_ids, attention_mask):
        s = input_ids.shape[1]
        positions = torch.arange(s)
        bias = self.relative_bias(self._bucket(positions[None, :] - positions[:, None]))     # [S, S, H]
        bias = bias.permute(2, 0, 1)[None] + _extended_mask(attention_mask)                  # [B, H, S, S]
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block["attn"](block["ln1"](h), bias)
            h = h + block["wo"](F.relu(block["wi"](block["ln2"](h))))
        return self.ln_f(h)


class Vit(nn.Module):
    """ViT: 16x16 patch embedding (no class token: the S patch tokens are the sequence), pre-LN blocks."""

    def __init__(self, hidden, layers, heads, ffn, patches=128):
        super().__init__()
        self.patch = nn.Conv2d(3, hidden, kernel_size=16, stride=16)
        self.position = nn.Parameter(torch.randn(1, patches, hidden) * 0.02)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(hidden, eps=1e-12), "attn": _Attention(hidden, heads),
            "ln2": nn.LayerNorm(hidden, eps=1e-12), "fc1": nn.Linear(hidden, ffn), "fc2": nn.Linear(ffn, hidden),
        }) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, pixel_values):
        h = self.patch(pixel_values).flatten(2).transpose(1, 2) + self.position
        for block in self.blocks:
            h = h + block["attn"](block["ln1"](h))
            h = h + block["fc2"](F.gelu(block["fc1"](block["ln2"](h))))
        return self.ln_f(h)


def _vit_grid(seq_len: int) -> tuple[int, int]:
    """Patch grid (rows, cols) with rows * cols == seq_len, as square as possible."""
    rows = max(r for r in range(1, int(math.isqrt(seq_len)) + 1) if seq_len % r == 0)
    return rows, seq_len // rows


FAMILIES = {"bert": Bert, "gpt2": Gpt2, "t5-encoder": T5Encoder, "vit": Vit}
MODELS = {"bert-base": ("bert", "base"), "bert-large": ("bert", "large"), "gpt2": ("gpt2", "base"),
          "t5-base-encoder": ("t5-encoder", "base"), "vit-base": ("vit", "base")}
MODELS.update({f"tiny-{family}": (family, "tiny") for family in FAMILIES})


def build(name: str, seq_len: int, seed: int = 0) -> nn.Module:
    """The PyTorch model ``name`` (see MODELS) with seeded random weights, in eval mode."""
    if name not in MODELS:
        raise ValueError(f"name: expected one of {sorted(MODELS)}, got {name!r}")
    family, size = MODELS[name]
    torch.manual_seed(seed)
    hidden, layers, heads, ffn = SIZES[size]
    extra = {"patches": seq_len} if family == "vit" else {}
    if size == "tiny" and family != "vit":
        extra["vocab"] = 1000
    return FAMILIES[family](hidden, layers, heads, ffn, **extra).eval()


def example_inputs(name: str, batch: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Valid inputs for ``name``: token ids (and an all-ones attention mask), or pixels for ViT."""
    generator = torch.Generator().manual_seed(seed)
    if MODELS[name][0] == "vit":
        rows, cols = _vit_grid(seq_len)
        return {"pixel_values": torch.randn(batch, 3, rows * 16, cols * 16, generator=generator)}
    vocab = 1000 if name.startswith("tiny-") else 30000
    return {"input_ids": torch.randint(0, vocab, (batch, seq_len), generator=generator),
            "attention_mask": torch.ones(batch, seq_len, dtype=torch.long)}


def export(name: str, path: str | None = None, *, seq_len: int = 128, seed: int = 0) -> onnx.ModelProto:
    """Export ``name`` with ``torch.onnx.export`` (TorchScript exporter, opset 17; batch dim symbolic, and the
    sequence dim too for token models). Writes ``path`` when given; returns the ModelProto."""
    model = build(name, seq_len, seed)
    inputs = example_inputs(name, 2, seq_len, seed)
    dims = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "pixel_values": {0: "batch"}}
    buffer = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(inputs.values()), buffer, input_names=list(inputs),
                          output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                          dynamic_axes={**{k: dims[k] for k in inputs}, "last_hidden_state": {0: "batch"}})
    proto = onnx.load_from_string(buffer.getvalue())
    if path is not None:
        onnx.save(proto, path)
    return proto
