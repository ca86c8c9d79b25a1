"""stof-tvm: sparse-attention transformer inference on NVIDIA GPUs through Apache TVM."""
from stof_tvm.attention import AttentionPlan, sparse_attention
from stof_tvm.sparse_formats import make_mask, normalize_mask

__all__ = ["AttentionPlan", "sparse_attention", "make_mask", "normalize_mask"]
