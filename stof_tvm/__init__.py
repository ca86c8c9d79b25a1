"""stof-tvm: sparse-attention transformer inference on NVIDIA GPUs through Apache TVM."""
from stof_tvm.sparse_formats import make_mask, normalize_mask

__all__ = ["make_mask", "normalize_mask"]
