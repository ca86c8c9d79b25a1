"""Sparse storage formats and masks (installed as stof_tvm.sparse_formats)."""
