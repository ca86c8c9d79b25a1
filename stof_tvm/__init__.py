"""stof-tvm: sparse-attention transformer inference on NVIDIA GPUs through Apache TVM."""
