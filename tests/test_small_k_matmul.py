"""The tensor-core rule for short-reduction float16 matmuls (stof_tvm.schedules.small_k_matmul), ahead of dlight's
matmul rule, which keeps k <= 64 on the CUDA cores.

It takes DeBERTa's relative-position score products ([B*H, S, 64] x [B*H, 64, 2 * buckets]) and declines what it
must not: k above 64 or not a multiple of 16, float32 operands, i or j below 64. The CUDA it generates has wmma
products and nvcc builds it for sm_90 without spills; dlight alone gives the same function no tensor core.

The exact batched ``float16(A @ B^T)`` in whole tiles (DeBERTa's products as the compiler fuses them, B read by rows)
gets stof-tvm's own kernel (stof_tvm.schedules.batched_nt_matmul): recognised in the te form and in the form Relax's
legalisation gives, declined where any part differs (layout, dtype, an extra operation, tiles); its CUDA has mma.sync
products and 16-byte stores, and nvcc builds it for sm_90a without spills at every tile height. Its numbers are
checked on the GPU (scripts/check_nt_matmul_gpu.py)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tvm
from tvm import te
from tvm.s_tir import dlight as dl

from stof_tvm.compiler.pipeline import CUDA_DEFAULTS, make_target
from stof_tvm.schedules.batched_nt_matmul import ROW_CHOICES, batched_nt_matmul, fits
from stof_tvm.schedules.small_k_matmul import SmallKTensorCoreMatmul, nt_product

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


def nt_matmul(batch, rows, cols, depth, scale=None):
    """``float16(A @ B^T)`` in te: A [b, i, k], B [b, j, k] (``scale``: the sum times it before the cast)."""
    a = te.placeholder((batch, rows, depth), "float16", name="a")
    b = te.placeholder((batch, cols, depth), "float16", name="b")
    k = te.reduce_axis((0, depth), name="k")
    acc = te.compute((batch, rows, cols), lambda n, i, j: te.sum(a[n, i, k].astype("float32") *
                                                                  b[n, j, k].astype("float32"), axis=k), name="mm")
    out = te.compute((batch, rows, cols), lambda n, i, j: (acc[n, i, j] if scale is None else acc[n, i, j] * scale)
                     .astype("float16"), name="cast")
    return te.create_prim_func([a, b, out])


def relax_nt_matmul(batch, rows, cols, depth):
    """The same product as the compiler meets it (Relax matmul by a permuted operand, cast, fused into one PrimFunc:
    the GPU check's builder)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from check_nt_matmul_gpu import relax_product

    return relax_product(batch, rows, cols, depth)


@pytest.mark.parametrize("build", [nt_matmul, relax_nt_matmul])
def test_the_exact_nt_product_gets_its_own_kernel(build):
    func = build(96, 512, 512, 64)
    assert nt_product(func) == (96, 512, 512, 64)
    sch = SmallKTensorCoreMatmul().apply(func, CUDA, False)
    src = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}),
                      target=CUDA).mod.imports[0].inspect_source()
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src and "st.global.v4.b32" in src
    assert "wmma" not in src


@pytest.mark.parametrize("func", [
    batched_matmul(96, 512, 512, 64),                           # B laid [b, k, j]
    nt_matmul(96, 512, 512, 64, scale=0.125),                   # something besides the cast
    batched_matmul(96, 512, 512, 64, cast_to="float32"),        # float32 out
], ids=["kn-layout", "scaled", "float32-out"])
def test_nt_product_declines_other_functions(func):
    assert nt_product(func) is None


def test_untiled_nt_products_keep_the_wmma_form():
    func = nt_matmul(8, 64, 192, 64)                            # 192 columns: no 128-column tile
    assert nt_product(func) == (8, 64, 192, 64) and not any(fits(64, 192, 64, rows) for rows in ROW_CHOICES)
    sch = SmallKTensorCoreMatmul().apply(func, CUDA, False)
    assert sch is not None and "wmma" in sch.mod["main"].script()


@pytest.mark.parametrize("block_rows", ROW_CHOICES)
@pytest.mark.parametrize("depth", [64, 32])
def test_nt_kernel_builds_for_sm90a_without_spills(tmp_path, block_rows, depth):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    target = make_target({**CUDA_DEFAULTS, "arch": "sm_90a"})
    func = batched_nt_matmul(12, 512, 256, depth, block_rows=block_rows).with_attr("global_symbol", "main")
    (tmp_path / "k.cu").write_text(tvm.compile(tvm.IRModule({"main": func}), target=target).mod.imports[0]
                                   .inspect_source())
    log = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v", "-o",
                          str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
                         capture_output=True, text=True, check=True).stderr
    assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log


@pytest.mark.parametrize("shape", [(12, 512, 256, 48, 64), (12, 96, 256, 64, 128), (12, 512, 200, 64, 128),
                                   (12, 512, 256, 80, 128), (12, 512, 256, 64, 32)])
def test_nt_kernel_refuses_shapes_it_cannot_tile(shape):
    *dims, block_rows = shape
    assert not fits(*dims[1:], block_rows=block_rows)
    with pytest.raises(ValueError, match="block_rows must be one of"):
        batched_nt_matmul(*dims, block_rows=block_rows)
