"""Downstream fusion templates (placeholder docstring, rewritten below)."""
from .registry import TEMPLATES, H200, Hardware, Template, get_template, register, template_of
from . import gemm, gemm_layernorm, layernorm, qkv  # noqa: F401  (register the families)
