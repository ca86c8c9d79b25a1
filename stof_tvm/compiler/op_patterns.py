"""Relax's operator pattern kinds (``OpPatternKind``) that the compiler writes into PrimFuncs' ``op_pattern``
attribute, which ``FuseOps`` reads: an opaque function (a scheduled kernel: a template, an attention or scan kernel,
the input copy) fuses with nothing; an injective one fuses into its neighbours like any elementwise operator."""
from __future__ import annotations

INJECTIVE = 2       # kInjective
OPAQUE = 8          # kOpaque
