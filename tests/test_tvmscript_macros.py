"""The frame-walking TVMScript macro lookup (stof_tvm.tvmscript_macros) parses exactly what TVM's own does."""
import tvm
from tvm.script import tirx as T
from tvm.script.parser.core.parser import ScriptMacro

import stof_tvm.schedules  # noqa: F401  (installs the lookup)
from stof_tvm import tvmscript_macros


def _parse_with_macros():
    @T.macro
    def scaled_copy(dst, src, i, factor):
        dst[i] = src[i] * T.float32(factor)

    @T.prim_func
    def func(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
        for i in range(8):
            scaled_copy(b, a, i, 2.0)
        for i in range(4):
            scaled_copy(b, b, i, 0.5)

    return func


def test_installed_by_the_schedules_package():
    assert tvmscript_macros.installed()
    assert ScriptMacro._find_parser_def is tvmscript_macros._find_parser_by_frames


def test_same_function_as_tvms_lookup(monkeypatch):
    fast = _parse_with_macros()
    import inspect

    def tvm_lookup(self):      # TVM 0.27's own lookup, as it was before install()
        for info in inspect.getouterframes(inspect.currentframe()):
            parser = info.frame.f_globals.get(ScriptMacro.parser_object_name)
            if parser is not None:
                return parser
        raise RuntimeError("no parser")

    monkeypatch.setattr(ScriptMacro, "_find_parser_def", tvm_lookup)
    slow = _parse_with_macros()
    tvm.ir.assert_structural_equal(fast, slow)
    assert "T.float32(0.5)" in fast.script() and "T.float32(2.0)" in fast.script()      # both expansions


def test_outside_a_parser_is_an_error():
    import pytest

    with pytest.raises(RuntimeError, match="not available"):
        tvmscript_macros._find_parser_by_frames(None)
