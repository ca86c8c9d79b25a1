"""The frame-walking TVMScript look-ups (stof_tvm.tvmscript_macros) parse exactly what TVM's own do."""
import inspect
import sys

import tvm
from tvm.script import ir as I
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


def _frame_records(frames):
    return [(f.frame, f.filename, f.lineno, f.function, f.code_context, f.index) for f in frames]


def test_outer_frames_are_inspects_records_inside_an_import(tmp_path, monkeypatch):
    """During an import (frames of ``<frozen importlib._bootstrap>``, which no module owns) and from pytest's
    frames: the same frame, file, line, function and context line as ``inspect.getouterframes``."""
    (tmp_path / "stof_probe_frames.py").write_text(
        "import inspect, sys\n"
        "from stof_tvm.tvmscript_macros import outer_frames\n"
        "here = sys._getframe(0)\n"
        "theirs, ours = inspect.getouterframes(here), outer_frames(here)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import stof_probe_frames as probe

    theirs, ours = _frame_records(probe.theirs), _frame_records(probe.ours)
    assert any(record[1].startswith("<frozen") for record in ours)          # the import machinery's frames
    assert ours == theirs
    here = sys._getframe(0)
    assert _frame_records(tvmscript_macros.outer_frames(here, 0)) == _frame_records(inspect.getouterframes(here, 0))


def _module_with_prim_funcs():
    @I.ir_module
    class Module:
        @T.prim_func
        def add_one(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
            for i in range(8):
                b[i] = a[i] + T.float32(1)

        @T.prim_func
        def twice(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
            for i in range(8):
                b[i] = a[i] * T.float32(2)

    return Module


def test_decorators_use_the_fast_stack_and_parse_the_same(monkeypatch):
    """``T.prim_func`` and ``I.ir_module`` (prim_funcs as class members: the decorator must see the class body
    in the stack to leave them to the module) parse the same with :func:`outer_frames` as with
    ``inspect.stack``."""
    from tvm.script.parser.ir import entry as ir_entry
    from tvm.tirx.script.parser import entry as tir_entry

    assert tir_entry.inspect.stack is not inspect.stack and ir_entry.inspect.stack is not inspect.stack
    fast_module, fast_func = _module_with_prim_funcs(), _parse_with_macros()
    for module in (tir_entry, ir_entry):
        monkeypatch.setattr(module, "inspect", inspect)
    tvm.ir.assert_structural_equal(fast_module, _module_with_prim_funcs())
    tvm.ir.assert_structural_equal(fast_func, _parse_with_macros())
    assert {gv.name_hint for gv in fast_module.get_global_vars()} == {"add_one", "twice"}
