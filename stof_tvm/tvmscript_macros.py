"""Faster TVMScript macro expansion: find the running parser by walking frames instead of ``inspect``.

Every ``T.macro`` call inside a ``T.prim_func`` looks up the parser that is parsing the caller
(``ScriptMacro._find_parser_def`` in TVM 0.27). TVM does it with ``inspect.getouterframes``, which builds a
``FrameInfo`` with source context for *every* frame of the (deep, recursive) parser stack, and for frames of
evaluated expressions ``inspect.getmodule`` scans all of ``sys.modules`` each time. Our thread-level kernels (the
wgmma GEMMs, the block-wise attention) expand hundreds of macros, so that lookup was most of their parse time:
0.36 s instead of 1.29 s per wgmma GEMM kernel here (stage 1 of tuning parses ~50 of them for a base model, a
compile a handful).

:func:`install` replaces the lookup with the same search (outermost-last walk of the calling frames, first
frame whose globals hold the parser object) done with ``frame.f_back``; the result is the same parser object,
so parsed functions are unchanged. It does nothing where TVM's script parser is absent (runtime-only TVM) or
has no such method (another TVM version).
"""
from __future__ import annotations

import sys

__all__ = ["install", "installed"]


def _find_parser_by_frames(self):
    from tvm.script.parser.core.parser import ScriptMacro

    name = ScriptMacro.parser_object_name
    frame = sys._getframe(0)
    while frame is not None:
        parser = frame.f_globals.get(name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{name} not available")


def install() -> bool:
    """Use the frame-walking lookup for TVMScript macros; True when it is in place."""
    try:
        from tvm.script.parser.core.parser import ScriptMacro
    except (ImportError, AttributeError, RuntimeError):      # no script parser in this TVM (runtime only)
        return False
    if not callable(getattr(ScriptMacro, "_find_parser_def", None)):
        return False
    ScriptMacro._find_parser_def = _find_parser_by_frames
    return True


def installed() -> bool:
    """Whether :func:`install` has replaced the lookup."""
    try:
        from tvm.script.parser.core.parser import ScriptMacro
    except (ImportError, AttributeError, RuntimeError):
        return False
    return getattr(ScriptMacro, "_find_parser_def", None) is _find_parser_by_frames
