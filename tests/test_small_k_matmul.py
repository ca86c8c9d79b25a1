"""The tensor-core rule for short-reduction float16 matmuls (stof_tvm.schedules.small_k_matmul), ahead of dlight's
matmul rule, which keeps k <= 64 on the CUDA cores.

It takes DeBERTa's relative-position score products ([B*H, S, 64] x [B*H, 64, 2 * buckets]) and declines what it
must not: k above 64 or not a multiple of 16, float32 operands, i or j below 64. The CUDA it generates has wmma
products and nvcc builds it for sm_90 without spills; dlight alone gives the same function no tensor core."""
import shutil
import subprocess

import pytest
import tvm
from tvm import te
from tvm.s_tir import dlight as dl

from stof_tvm.compiler.pipeline import CUDA_DEFAULTS, make_target
from stof_tvm.schedules.small_k_matmul import SmallKTensorCoreMatmul

CUDA = make_target(dict(CUDA_DEFAULTS))


def batched_matmul(batch, rows, cols, depth, dtype="float16", out_dtype="float32", cast_to="float16"):
    """``cast(A @ B)`` as TVM legalizes a Relax matmul with ``out_dtype``: A [b, i, k], B [b, k, j]."""
    a = te.placeholder((batch, rows, depth), dtype, name="a")
    b = te.placeholder((batch, depth, cols), dtype, name="b")
    k = te.reduce_axis((0, depth), name="k")
    acc = te.compute((batch, rows, cols), lambda n, i, j: te.sum(a[n, i, k].astype(out_dtype) *
                                                                  b[n, k, j].astype(out_dtype), axis=k), name="mm")
    out = te.compute((batch, rows, cols), lambda n, i, j: acc[n, i, j].astype(cast_to), name="cast")
    return te.create_prim_func([a, b, out])


def _schedule(func, rules):
    mod = tvm.IRModule({"main": func})
    with CUDA:
        return dl.ApplyDefaultSchedule(*rules)(mod)


@pytest.mark.parametrize("shape", [(96, 512, 512, 64), (12, 128, 256, 32), (4, 64, 64, 16)])
def test_takes_short_float16_reductions(shape):
    assert SmallKTensorCoreMatmul().apply(batched_matmul(*shape), CUDA, False) is not None


@pytest.mark.parametrize("shape,dtype", [((96, 512, 512, 128), "float16"), ((96, 512, 512, 40), "float16"),
                                         ((96, 512, 512, 64), "float32"), ((96, 32, 512, 64), "float16"),
                                         ((96, 512, 48, 64), "float16")])
def test_declines_the_rest(shape, dtype):
    func = batched_matmul(*shape, dtype=dtype, cast_to=dtype)
    assert SmallKTensorCoreMatmul().apply(func, CUDA, False) is None


def test_declines_off_cuda():
    assert SmallKTensorCoreMatmul().apply(batched_matmul(8, 128, 128, 64), make_target({"kind": "llvm"}),
                                          False) is None


def test_cuda_has_tensor_core_products_and_builds_without_spills(tmp_path):
    func = batched_matmul(96, 512, 512, 64)
    plain = _schedule(func, [dl.gpu.Matmul(), dl.gpu.Fallback()])
    ours = _schedule(func, [SmallKTensorCoreMatmul(), dl.gpu.Matmul(), dl.gpu.Fallback()])
    sources = {name: tvm.compile(mod, target=CUDA).mod.imports[0].inspect_source()
               for name, mod in (("plain", plain), ("ours", ours))}
    assert "mma_sync" not in sources["plain"]          # dlight alone: CUDA-core FMAs
    assert "wmma::mma_sync" in sources["ours"]
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    (tmp_path / "k.cu").write_text(sources["ours"])
    log = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "--use_fast_math", "-Xptxas", "-v", "-o",
                          str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
                         capture_output=True, text=True, check=True).stderr
    assert "0 bytes spill stores" in log, log
