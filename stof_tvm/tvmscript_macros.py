"""Faster TVMScript parsing: find the running parser and the decorator's calling frames without ``inspect``'s
source look-ups.

Two look-ups in TVM 0.27's parser cost far more than the parse itself, for the same reason: ``inspect`` builds a
``FrameInfo`` with source context for *every* frame of the stack, and for a frame whose file is no module's
(``<frozen importlib._bootstrap>`` during an import, ``<string>`` under ``python -c``) ``inspect.getmodule``
scans all of ``sys.modules``, several times per frame, each time (thousands of modules once torch is loaded).

- Every ``T.macro`` call inside a ``T.prim_func`` looks up the parser that is parsing the caller
  (``ScriptMacro._find_parser_def``, with ``inspect.getouterframes``). Our thread-level kernels (the wgmma GEMMs,
  the block-wise attention) expand hundreds of macros: 0.36 s instead of 1.29 s per wgmma GEMM kernel here.
- Every ``@T.prim_func`` and ``@I.ir_module`` takes ``inspect.stack()`` at decoration. Importing TVM's tensor
  intrinsics (``tvm.s_tir.tensor_intrin``: MetaSchedule imports it for every tuning task context, dlight for
  float16 CUDA GEMMs) parses ~150 prim_funcs from inside an import, so that was ~80 s of CPU per process with
  torch loaded (every pytest worker, every ``stof-tvm tune`` process).

:func:`install` replaces the macro look-up with the same search (outermost-last walk of the calling frames, first
frame whose globals hold the parser object) done with ``frame.f_back``, and gives the decorators' modules an
``inspect`` whose ``stack()`` is :func:`outer_frames`: the same records (frame, file, line, function, the current
line as context), read from the frame and ``linecache`` without ``getmodule``. Parsed functions are unchanged.
It does nothing where TVM's script parser is absent (runtime-only TVM) or has no such method (another TVM version).
"""
from __future__ import annotations

import importlib
import inspect
import linecache
import sys
import types

__all__ = ["install", "installed", "outer_frames"]

# The parser modules whose decorators take ``inspect.stack()`` (T.prim_func, I.ir_module).
_STACK_USERS = ("tvm.tirx.script.parser.entry", "tvm.script.parser.ir.entry")


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


def outer_frames(frame, context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.getouterframes(frame, context)`` for ``context`` 0 or 1 without ``inspect.getmodule``: each
    record's file is the code's file and its context the current source line (None where there is no source,
    as ``inspect`` gives)."""
    records = []
    while frame is not None:
        code, lineno = frame.f_code, frame.f_lineno
        lines = index = None
        if context > 0:
            linecache.checkcache(code.co_filename)
            line = linecache.getline(code.co_filename, lineno, frame.f_globals)
            if line:
                lines, index = [line], 0
        records.append(inspect.FrameInfo(frame, code.co_filename, lineno, code.co_name, lines, index))
        frame = frame.f_back
    return records


class _InspectWithFastStack(types.ModuleType):
    """``inspect`` as the parser modules see it, with :func:`outer_frames` behind ``stack()``."""

    def __getattr__(self, name):
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        if context > 1:                  # more context lines than outer_frames reads: inspect's own
            return inspect.getouterframes(sys._getframe(1), context)
        return outer_frames(sys._getframe(1), context)


_FAST_INSPECT = _InspectWithFastStack("inspect")


def install() -> bool:
    """Use the frame-walking look-ups in TVMScript's parser; True when they are in place."""
    try:
        from tvm.script.parser.core.parser import ScriptMacro
        users = [importlib.import_module(name) for name in _STACK_USERS]
    except (ImportError, AttributeError, RuntimeError):      # no script parser in this TVM (runtime only)
        return False
    if not callable(getattr(ScriptMacro, "_find_parser_def", None)):
        return False
    ScriptMacro._find_parser_def = _find_parser_by_frames
    for module in users:
        if getattr(module, "inspect", None) is inspect:
            module.inspect = _FAST_INSPECT
    return True


def installed() -> bool:
    """Whether :func:`install` has replaced the look-ups."""
    try:
        from tvm.script.parser.core.parser import ScriptMacro
    except (ImportError, AttributeError, RuntimeError):
        return False
    return (getattr(ScriptMacro, "_find_parser_def", None) is _find_parser_by_frames
            and all(getattr(sys.modules.get(name), "inspect", None) is _FAST_INSPECT for name in _STACK_USERS))
