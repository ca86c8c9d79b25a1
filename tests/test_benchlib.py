"""scripts/benchlib.py: the timing, checking and reporting helpers every benchmark script shares (CPU parts)."""
import importlib.util
import json
import math
import os
import struct
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


def test_time_interleaved_rotates_the_cases_each_round_and_times_each_alike():
    """Round r starts with case r mod n, so each case runs first, second, ... equally often; every case gets the same
    calls per sample, and a case twice as slow measures about twice the time."""
    order = []

    def case(name, seconds):
        def fn(x):
            order.append(name)
            time.sleep(seconds)
        return fn, [(1,), (2,)]

    got = bl.time_interleaved({"a": case("a", 0.002), "b": case("b", 0.004), "c": case("c", 0.002)}, device="cpu",
                              warmup=1, rounds=6, sample_ms=1.0)
    assert {t.samples for t in got.values()} == {6} and {t.calls_per_sample for t in got.values()} == {1}
    timed = order[3 + 3:]                       # after the warm-up calls and the one call each that sizes a sample
    rounds = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    assert [r[0] for r in rounds] == ["a", "b", "c", "a", "b", "c"] and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert 1.6 < got["b"].median_ms / got["a"].median_ms < 2.6
    with pytest.raises(ValueError):
        bl.time_interleaved({}, device="cpu")


def test_time_interleaved_stops_at_its_budget_after_three_rounds():
    got = bl.time_interleaved({"x": (lambda: time.sleep(0.005), None)}, device="cpu", warmup=0, rounds=100,
                              budget_s=0.0)
    assert got["x"].samples == 3


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


def _trace(kernels):
    """A Chrome trace as torch.profiler exports it: kernel records ``(name, ts, dur)`` among other events."""
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels]
    events += [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 0.0, "dur": 50.0},
               {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1.0}]
    return {"traceEvents": events[::-1]}


def test_timeline_attributes_overlapping_kernels_by_the_time_they_expose():
    """Two calls of three kernels each. Under dependent launches a kernel starts (and waits) before the one before
    ends: a GEMM 0-10 us, a norm launched at 8 ending at 13 (exposes 3), attention 13-20 after a 0 us gap; the second
    call 1 us after the first ends (idle 1, counted to its first kernel). The exposed times add up to the span."""
    kernels = []
    for base in (0.0, 21.0):
        kernels += [("stof_gemm_wgmma_m128_kernel", base, 10.0), ("stof_bias_residual_layernorm_kernel", base + 8, 5.0),
                    ("stof_attention_block_kernel", base + 13, 7.0)]
    events = bl.kernel_events(_trace(kernels))
    assert [e["name"] for e in events][:3] == [k[0] for k in kernels[:3]]
    assert [round(us, 6) for us, _ in bl.exposed_us(events)] == [10.0, 3.0, 7.0, 11.0, 3.0, 7.0]
    assert [idle for _, idle in bl.exposed_us(events)] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]

    def classify(name):
        return next((c for c in ("gemm", "layernorm", "attention") if c in name), "other")

    summary = bl.timeline(events, 2, classify)
    assert summary["kernels_per_call"] == 3 and summary["span_us"] == pytest.approx(20.5)
    assert summary["idle_us"] == pytest.approx(0.5) and summary["kernel_us"] == pytest.approx(22.0)
    assert [(r["class"], r["us"], r["kernels"]) for r in summary["classes"]] == [
        ("gemm", 10.5, 1.0), ("attention", 7.0, 1.0), ("layernorm", 3.0, 1.0)]
    assert sum(r["share"] for r in summary["classes"]) == pytest.approx(1.0)
    assert summary["kernels"][0]["kernel"] == "stof_gemm_wgmma_m128_kernel"
    with pytest.raises(ValueError, match="do not split into 4 calls"):
        bl.timeline(events, 4, classify)


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
    two_kernels = text + ("ptxas info    : Used 40 registers, used 1 barriers, 0 bytes stack frame\n"
                          "ptxas info    : 4 bytes spill stores, 0 bytes spill loads\n")
    assert bl.ptxas_report(two_kernels) == {"registers": 168, "spill_stores": 12, "spill_loads": 12,
                                            "stack_frame": 16}
    assert bl.source_key("abc") == bl.source_key("abc") != bl.source_key("abd")
    assert len(bl.source_key("abc")) == 24


def test_sass_opcodes_lists_a_kernels_instructions(tmp_path, monkeypatch):
    """A one-line kernel's SASS through the first cuobjdump found: its global load, store and exit, with their
    modifiers, no NOPs; None (not an error) where no cuobjdump exists."""
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    bl.nvcc_cubin('extern "C" __global__ void bump(float* x) { x[threadIdx.x] += 1.0f; }', tmp_path / "k.cubin")
    ops = bl.sass_opcodes(tmp_path / "k.cubin")
    if ops is None:
        pytest.skip("no cuobjdump to read the SASS")
    assert any(op.startswith("LDG.E") for op in ops) and any(op.startswith("STG.E") for op in ops)
    assert "EXIT" in ops and "NOP" not in ops
    monkeypatch.setenv("STOF_CUOBJDUMP", str(tmp_path / "missing"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(bl.Path, "is_file", lambda self: False)
    assert bl.sass_opcodes(tmp_path / "k.cubin") is None


# ------------------------------------------------------------------------- scripts/ort_parts.py (fatbin pruning)
def _ort_parts():
    spec = importlib.util.spec_from_file_location("ort_parts", os.path.join(ROOT, "scripts", "ort_parts.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fatbin(entries) -> bytes:
    """One fatbin container of ``(kind, arch, payload)`` entries, 64-byte entry headers (arch at byte 28)."""
    body = b""
    for kind, arch, payload in entries:
        header = bytearray(64)
        struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
        struct.pack_into("<I", header, 28, arch)
        body += bytes(header) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf(sections: dict[str, bytes]) -> bytearray:
    """A minimal 64-bit little-endian ELF file holding ``sections`` (and its section-name table)."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in list(sections) + [".shstrtab"])
    blobs = list(sections.items()) + [(".shstrtab", names)]
    data = bytearray(64)
    offsets = []
    for _, blob in blobs:
        data += bytes(-len(data) % 8)
        offsets.append(len(data))
        data += blob
    data += bytes(-len(data) % 8)
    shoff = len(data)
    data += bytes(64)                                                    # the null section
    for (name, blob), offset in zip(blobs, offsets):
        data += struct.pack("<IIQQQQIIQQ", names.index(name.encode() + b"\0"), 1, 0, 0, offset, len(blob),
                            0, 0, 8, 0)
    data[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", data, 0x28, shoff)
    struct.pack_into("<HHH", data, 0x3A, 64, len(blobs) + 1, len(blobs))
    return data


def test_prune_fatbins_zeroes_other_architectures_only_where_sm90_exists():
    op = _ort_parts()
    with_90 = _fatbin([(2, 80, b"A" * 40), (2, 90, b"N" * 24), (1, 80, b"P" * 8), (2, 120, b"B" * 16)])
    without = _fatbin([(2, 86, b"C" * 32)])
    data = _elf({".text": b"\x90" * 24, ".nv_fatbin": with_90 + bytes(8) + without})
    before = bytes(data)
    report = op.prune_fatbins(data, 90)
    assert report == {"zeroed": 56, "kept": 24 + 8, "containers": 2}     # kept: in the containers pruned
    assert len(data) == len(before)
    for kept in (b"N" * 24, b"P" * 8, b"C" * 32, b"\x90" * 24):             # sm_90, PTX, a lone container, code
        assert kept in data
    assert b"A" * 40 not in data and b"B" * 16 not in data
    assert before.count(b"A" * 40) == 1
    assert op.part_sizes(10 * 2**20 + 5, [4, 4]) == [4 * 2**20, 4 * 2**20, 2 * 2**20 + 5]
    assert op.part_sizes(3 * 2**20, [4, 4]) == [3 * 2**20]


def test_time_ms_rejects_an_unknown_device():
    with pytest.raises(ValueError, match="device"):
        bl.time_ms(lambda: None, device="gpu")


def test_prebuilt_cubins_serve_the_folder_and_pass_other_sources_on(tmp_path):
    """The CUDA compile callback answers a source with ``<source_key>.cubin`` from the folder, hands any other to
    the callback registered before it and lists that source's key as a miss; the earlier callback is put back."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    pytest.importorskip("tvm.support.nvcc")      # registers TVM's own callback, which the test puts back after
    name = "tvm_callback_cuda_compile"
    before = tvm_ffi.get_global_func(name)
    seen = []
    tvm_ffi.register_global_func(name, lambda code, *rest: (seen.append(code), bytearray(b"built"))[1],
                                 override=True)
    try:
        (tmp_path / f"{bl.source_key('kernel A')}.cubin").write_bytes(b"prebuilt A")
        cubins = bl.PrebuiltCubins(tmp_path)
        callback = tvm_ffi.get_global_func(name)
        assert bytes(callback("kernel A", "cubin", "sm_90a")) == b"prebuilt A"
        assert bytes(callback("kernel B", "cubin", "sm_90a")) == b"built"
        assert cubins.hits == 1 and cubins.misses == [bl.source_key("kernel B")] and seen == ["kernel B"]
    finally:
        tvm_ffi.register_global_func(name, before, override=True)
