"""scripts/benchlib.py: the timing, checking and reporting helpers every benchmark script shares (CPU parts)."""
import importlib.util
import json
import math
import os
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("benchlib", os.path.join(ROOT, "scripts", "benchlib.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchlib"] = module
    spec.loader.exec_module(module)
    return module


bl = _load()


def test_errors_measure_max_relative_and_frobenius():
    ref = np.array([[1.0, -4.0], [2.0, 0.0]], np.float32)
    out = ref + np.array([[0.0, 0.4], [0.0, -0.1]], np.float32)
    got = bl.errors(out, ref)
    assert got["max_abs"] == pytest.approx(0.4, rel=1e-6)
    assert got["max_rel"] == pytest.approx(0.1, rel=1e-6)        # 0.4 / max |ref| = 4
    assert got["rel"] == pytest.approx(math.sqrt(0.17) / math.sqrt(21.0), rel=1e-6)
    assert got["nonfinite"] == 0
    assert bl.within(got, 0.1) and not bl.within(got, 0.05)


def test_errors_count_nonfinite_and_fail_them():
    ref = np.ones((3, 4))
    out = ref.copy()
    out[1, 2], out[0, 0] = np.nan, np.inf
    got = bl.errors(out, ref)
    assert got["nonfinite"] == 2 and math.isinf(got["rel"])
    assert not bl.within(got, 1e9)
    with pytest.raises(ValueError, match="shape"):
        bl.errors(np.ones(3), np.ones(4))


def test_poison_fills_every_element_so_an_unwritten_one_fails():
    floats = bl.poison(np.zeros((2, 3), np.float16))
    assert np.isnan(floats).all()
    ints = bl.poison(np.zeros(4, np.int32))
    assert (ints == np.iinfo(np.int32).min).all()
    half_written = floats.copy()
    half_written[0] = 1.0
    assert bl.errors(half_written, np.ones((2, 3)))["nonfinite"] == 3


def test_limit_takes_the_longer_floor():
    # 790 TFLOP in one second of compute floor; 4.2 TB in one second of memory floor
    got = bl.limit(2000.0, flops=790e12, bytes_moved=2.1e12)
    assert got["limit_ms"] == pytest.approx(1000.0)
    assert got["fraction"] == pytest.approx(0.5)
    assert got["tflops"] == pytest.approx(395.0)
    memory_bound = bl.limit(1.0, flops=0.0, bytes_moved=4.2e9)
    assert memory_bound["fraction"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bl.limit(0.0, flops=1.0)


def test_time_ms_on_the_cpu_cycles_inputs_and_measures_the_call():
    seen = []

    def fn(x):
        seen.append(x)
        time.sleep(0.002)

    got = bl.time_ms(fn, device="cpu", inputs=[(1,), (2,), (3,)], warmup=1, samples=5, number=2)
    assert 1.9 <= got.median_ms < 50 and got.min_ms <= got.median_ms <= got.max_ms
    assert got.samples == 5 and got.calls_per_sample == 2
    assert set(seen) == {1, 2, 3}


def test_time_ms_stops_at_its_budget_after_three_samples():
    got = bl.time_ms(lambda: time.sleep(0.01), device="cpu", warmup=0, samples=1000, number=1, budget_s=0.0)
    assert got.samples == 3


def test_budget_and_guarded_record_failures_without_raising():
    budget = bl.Budget(1000.0)
    assert budget.allows(10.0) and not budget.allows(2000.0)
    row = {}
    assert bl.guarded(row, "x", lambda a, b: a + b, 1, b=2) == 3
    assert "x_failed" not in row
    assert bl.guarded(row, "y", lambda: 1 / 0) is None
    assert row["y_failed"].startswith("ZeroDivisionError")


def test_write_json_is_atomic_and_takes_numpy(tmp_path):
    path = tmp_path / "sub" / "r.json"
    bl.write_json(path, {"a": np.float32(1.5), "b": np.arange(3), "c": tmp_path})
    got = json.loads(path.read_text())
    assert got == {"a": 1.5, "b": [0, 1, 2], "c": str(tmp_path)}
    assert not (tmp_path / "sub" / "r.json.tmp").exists()


def test_format_table_aligns_and_marks_missing_cells():
    rows = [{"m": "bert", "ms": 1.23456, "x": None}, {"m": "gpt2-long", "ms": 10.0, "x": float("nan")}]
    text = bl.format_table(rows, [("m", "model", ""), ("ms", "ms", ".2f"), ("x", "ratio", ".1f")])
    lines = text.splitlines()
    assert lines[0].split() == ["model", "ms", "ratio"]
    assert lines[2].split() == ["bert", "1.23", "-"] and lines[3].split() == ["gpt2-long", "10.00", "-"]
    assert len({len(line) for line in lines[:2]}) == 1


def test_ptxas_report_reads_the_figures():
    text = ("ptxas info    : Used 168 registers, used 1 barriers, 16 bytes stack frame\n"
            "ptxas info    : 8 bytes spill stores, 12 bytes spill loads\n")
    assert bl.ptxas_report(text) == {"registers": 168, "spill_stores": 8, "spill_loads": 12, "stack_frame": 16}
    assert bl.ptxas_report("")["registers"] is None
    assert bl.source_key("abc") == bl.source_key("abc") != bl.source_key("abd")
    assert len(bl.source_key("abc")) == 24
