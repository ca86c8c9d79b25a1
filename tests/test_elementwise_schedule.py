"""The vectorised elementwise rule (stof_tvm.schedules.elementwise) ahead of dlight's one-thread-per-element fallback.

Its lowered CUDA kernels run on the CPU (tests/cuda_emulation.py) against numpy: an output cast (fp16 -> fp32, four
lanes), an fp16 sum (eight lanes: 16-byte accesses) and an embedding lookup like the one RoBERTa's export fuses
(row gathers from fp32 tables by clamped int64 ids, a shifted position row, the sum cast to fp16), each with a grid
whose last block is partial. Where a vector access could be misaligned or is not at unit stride the rule declines,
and so it does off the GPU; a property test draws shapes, offsets and element types and checks that the rule
vectorises exactly the safe ones and that those stay exact."""
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import te
from tvm.script import tirx as T

from stof_tvm.compiler.pipeline import CUDA_DEFAULTS, make_target
from stof_tvm.schedules.elementwise import VectorizedElementwise

ROWS, WIDTH, VOCAB, POSITIONS = 7, 96, 50, 40
CUDA = make_target(dict(CUDA_DEFAULTS))


@T.prim_func(private=True, s_tir=True)
def output_cast(a: T.Buffer((ROWS, WIDTH), "float16"), b: T.Buffer((1, ROWS, WIDTH), "float32")):
    for i, j in T.grid(ROWS, WIDTH):
        with T.sblock("cast"):
            vi, vj = T.axis.remap("SS", [i, j])
            b[0, vi, vj] = T.Cast("float32", a[vi, vj])


@T.prim_func(private=True, s_tir=True)
def half_sum(a: T.Buffer((ROWS, WIDTH), "float16"), c: T.Buffer((ROWS, WIDTH), "float16"),
             d: T.Buffer((ROWS, WIDTH), "float16")):
    for i, j in T.grid(ROWS, WIDTH):
        with T.sblock("sum"):
            vi, vj = T.axis.remap("SS", [i, j])
            d[vi, vj] = a[vi, vj] + c[vi, vj] * T.float16(2)


@T.prim_func(private=True, s_tir=True)
def embeddings(ids: T.Buffer((1, ROWS), "int64"), words: T.Buffer((VOCAB, WIDTH), "float32"),
               positions: T.Buffer((POSITIONS, WIDTH), "float32"), out: T.Buffer((ROWS, WIDTH), "float16")):
    for i, j in T.grid(ROWS, WIDTH):
        with T.sblock("embed"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.Cast("float16", words[T.min(T.max(T.int64(0), ids[0, vi]), T.int64(VOCAB - 1)), vj]
                                 + positions[vi + 2, vj])


@T.prim_func(private=True, s_tir=True)
def scaled(a: T.Buffer((ROWS, WIDTH), "float16"), s: T.Buffer((), "float16"), b: T.Buffer((ROWS, WIDTH), "float16")):
    for i, j in T.grid(ROWS, WIDTH):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            b[vi, vj] = a[vi, vj] * s[()]       # a 0-d tensor (HF BLOOM's exports hold one): read once, invariant


@T.prim_func(private=True, s_tir=True)
def transpose(a: T.Buffer((WIDTH, WIDTH), "float16"), b: T.Buffer((WIDTH, WIDTH), "float16")):
    for i, j in T.grid(WIDTH, WIDTH):
        with T.sblock("t"):
            vi, vj = T.axis.remap("SS", [i, j])
            b[vi, vj] = a[vj, vi]


@T.prim_func(private=True, s_tir=True)
def shifted(a: T.Buffer((ROWS, WIDTH + 8), "float16"), b: T.Buffer((ROWS, WIDTH), "float16")):
    for i, j in T.grid(ROWS, WIDTH):
        with T.sblock("s"):
            vi, vj = T.axis.remap("SS", [i, j])
            b[vi, vj] = a[vi, vj + 1]           # one element off a 16-byte boundary


@T.prim_func(private=True, s_tir=True)
def odd_rows(a: T.Buffer((ROWS, 6), "float32"), b: T.Buffer((ROWS, 6), "float32")):
    for i, j in T.grid(ROWS, 6):
        with T.sblock("o"):
            vi, vj = T.axis.remap("SS", [i, j])
            b[vi, vj] = a[vi, vj] * T.float32(3)     # rows of 6 floats: a 4-lane access would straddle two rows


@T.prim_func(private=True, s_tir=True)
def bool_mask(m: T.Buffer((ROWS, WIDTH), "bool"), b: T.Buffer((ROWS, WIDTH), "float16")):
    for i, j in T.grid(ROWS, WIDTH):
        with T.sblock("m"):
            vi, vj = T.axis.remap("SS", [i, j])
            b[vi, vj] = T.Select(m[vi, vj], T.float16(1), T.float16(0))


@T.prim_func(private=True, s_tir=True)
def row_sums(a: T.Buffer((ROWS, WIDTH), "float32"), b: T.Buffer((ROWS,), "float32")):
    for i, j in T.grid(ROWS, WIDTH):
        with T.sblock("r"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                b[vi] = T.float32(0)
            b[vi] = b[vi] + a[vi, vj]


def _lowered(func):
    """The rule's schedule of ``func``, its CUDA source, and its grid (blocks, threads)."""
    sch = VectorizedElementwise().apply(func, CUDA, False)
    assert sch is not None
    scheduled = sch.mod["main"].with_attr("global_symbol", "main")
    src = tvm.compile(tvm.IRModule({"main": scheduled}), target=CUDA).mod.imports[0].inspect_source()
    threads = VectorizedElementwise().threads
    return src, threads


@pytest.mark.parametrize("func, lanes, vector_type", [(output_cast, 4, "float4"), (half_sum, 8, "uint4"),
                                                      (embeddings, 4, "float4"), (scaled, 8, "uint4")])
def test_kernels_are_vectorised_and_exact_on_cpu_threads(func, lanes, vector_type, tmp_path):
    from cuda_emulation import run_on_cpu

    rng = np.random.default_rng(lanes)
    src, threads = _lowered(func)
    assert f"*({vector_type}*)" in src, src[-1500:]
    grid = -(-ROWS * WIDTH // lanes // threads)
    assert ROWS * WIDTH // lanes % threads, "the test wants a partial last block"
    if func is output_cast:
        a = rng.standard_normal((ROWS, WIDTH)).astype(np.float16)
        got = run_on_cpu(src, {"a": a}, {"b": (1, ROWS, WIDTH)}, grid, (threads, 1), tmp_path,
                         dtype={"a": "float16", "b": "float32"})["b"]
        np.testing.assert_array_equal(got[0], a.astype(np.float32))
    elif func is half_sum:
        a, c = (rng.standard_normal((ROWS, WIDTH)).astype(np.float16) for _ in range(2))
        got = run_on_cpu(src, {"a": a, "c": c}, {"d": (ROWS, WIDTH)}, grid, (threads, 1), tmp_path)["d"]
        np.testing.assert_array_equal(got, a + c * np.float16(2))
    elif func is scaled:
        a, s = rng.standard_normal((ROWS, WIDTH)).astype(np.float16), np.array(1.75, np.float16)
        got = run_on_cpu(src, {"a": a, "s": s}, {"b": (ROWS, WIDTH)}, grid, (threads, 1), tmp_path)["b"]
        np.testing.assert_array_equal(got, a * s)
    else:
        ids = rng.integers(-3, VOCAB + 3, size=(1, ROWS)).astype(np.int64)     # some out of range: clamped
        words = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
        positions = rng.standard_normal((POSITIONS, WIDTH)).astype(np.float32)
        got = run_on_cpu(src, {"ids": ids, "words": words, "positions": positions}, {"out": (ROWS, WIDTH)}, grid,
                         (threads, 1), tmp_path, dtype={"ids": "int64", "words": "float32",
                                                        "positions": "float32", "out": "float16"})["out"]
        want = (words[np.clip(ids[0], 0, VOCAB - 1)] + positions[2:ROWS + 2]).astype(np.float16)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("func", [transpose, shifted, odd_rows, bool_mask, row_sums])
def test_declines_where_a_vector_access_would_be_wrong(func):
    assert VectorizedElementwise().apply(func, CUDA, False) is None


def test_declines_off_the_gpu():
    assert VectorizedElementwise().apply(output_cast, tvm.target.Target("llvm"), False) is None


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 4), width=st.integers(1, 5).map(lambda k: 8 * k) | st.integers(1, 40),
       offset=st.sampled_from([0, 8, 16, 4, 1, 2, 3, 6]),
       types=st.sampled_from([("float16", "float32"), ("float16", "float16"), ("float32", "float16")]))
def test_vectorises_exactly_the_aligned_unit_stride_cases(rows, width, offset, types):
    """``out[i, j] = cast(a[i, j + offset]) * 2``: vectorised iff each row of both buffers and the offset are whole
    vectors of the widest type (16 bytes each), and then exact on the CPU-emulated kernel."""
    from cuda_emulation import run_on_cpu

    source, target_dtype = types
    a = te.placeholder((rows, width + offset), source, name="a")
    out = te.compute((rows, width), lambda i, j: a[i, j + offset].astype(target_dtype) * tvm.tirx.const(2, target_dtype),
                     name="out")
    func = te.create_prim_func([a, out])
    lanes = 16 // max(np.dtype(source).itemsize, np.dtype(target_dtype).itemsize)
    safe = width % lanes == 0 and offset % lanes == 0
    sch = VectorizedElementwise().apply(func, CUDA, False)
    assert (sch is not None) == safe
    if not safe:
        return
    src = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}),
                      target=CUDA).mod.imports[0].inspect_source()
    data = np.random.default_rng(width).standard_normal((rows, width + offset)).astype(source)
    threads = VectorizedElementwise().threads
    with tempfile.TemporaryDirectory() as workdir:
        got = run_on_cpu(src, {"a": data}, {"out": (rows, width)}, -(-rows * width // lanes // threads),
                         (threads, 1), Path(workdir), dtype={"a": source, "out": target_dtype})["out"]
    want = data[:, offset:].astype(target_dtype) * np.array(2, target_dtype)
    np.testing.assert_array_equal(got, want)
