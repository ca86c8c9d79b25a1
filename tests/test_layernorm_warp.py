"""The thread-level warp LayerNorm kernel (schedules/templates/layernorm_warp.py): its CUDA source (16-byte loads
and stores, no shared memory, no barrier, no spills at the shapes it runs), and the lowered kernel itself run on CPU
threads (tests/cuda_emulation.py) against float64 numpy at row counts that leave the last warps without a row and
the last rows of a warp without a successor (ViT's 197 rows), with and without bias + residual; a kernel whose
prefetch of the next row is dropped does not match."""
from __future__ import annotations

import re

import numpy as np
import pytest

from stof_tvm.schedules.templates import get_template
from stof_tvm.schedules.templates.build import build, cuda_source, cuda_target
from stof_tvm.schedules.templates.layernorm_warp import grid, supports, warp_layernorm_primfunc

from attention_reference import relative_error
from cuda_emulation import run_on_cpu
from hopper_checks import sm90_ptxas_report


def _source(m, n, fused, **knobs):
    func = warp_layernorm_primfunc(m, n, "float16", bias=fused, residual=fused, **knobs)
    return cuda_source(build(func, cuda_target()))


def _emulated(src, m, n, fused, warps, rows_per_warp, tmp_path):
    name = "bias_residual_layernorm" if fused else "layernorm"
    t = get_template(name)
    shape = {"m": m, "n": n}
    rng = np.random.default_rng(0)
    inputs = {}
    for arg, arg_shape, _ in t.arguments(shape)[:-1]:
        scale = np.geomspace(0.05, 20.0, m)[:, None] if len(arg_shape) == 2 else 1.0
        inputs[arg] = (rng.standard_normal(arg_shape) * scale + (3.0 if arg == "x" else 0.0)).astype(np.float16)
    kernel_inputs = {("res" if k == "residual" else "bias_buf" if k == "bias" else k): v for k, v in inputs.items()}
    got = run_on_cpu(src, kernel_inputs, {"out": (m, n)}, grid=grid(m, warps, rows_per_warp),
                     block=(32, warps), workdir=tmp_path)
    return got["out"].astype(np.float64), t.reference(shape, inputs)[0]


def test_source_is_one_warp_per_row_in_registers(tmp_path):
    src = _source(32768, 768, True, warps=8, rows_per_warp=4)
    assert "__shared__" not in src and "__syncthreads" not in src
    assert len(re.findall(r"\*\(uint4\*\)\((?:x|res)_ptr", src)) == 2 * 3 * 2   # first row + prefetch, 3 chunks
    assert len(re.findall(r"\*\(uint4\*\)\(out_ptr", src)) == 3
    assert src.count("__shfl_xor_sync") == 10
    report = sm90_ptxas_report(src, tmp_path)
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", report), report
    assert re.search(r"\b0 bytes stack frame", report), report


@pytest.mark.parametrize("m, n, fused, warps, rows_per_warp, reload", [
    (197, 768, True, 4, 2, False),       # 25 blocks: the last warps have no row, odd rows have no successor
    (40, 1024, True, 2, 4, True),        # the vectors through ld.global.nc words, unpacked per element
    (37, 512, False, 1, 3, False)])
def test_lowered_kernel_matches_numpy_on_cpu_threads(m, n, fused, warps, rows_per_warp, reload, tmp_path):
    src = _source(m, n, fused, warps=warps, rows_per_warp=rows_per_warp, reload=reload)
    out, ref = _emulated(src, m, n, fused, warps, rows_per_warp, tmp_path)
    assert np.isfinite(out).all(), "unwritten outputs"
    assert relative_error(out, ref) < 2e-3, relative_error(out, ref)


def test_cpu_emulation_catches_a_dropped_prefetch(tmp_path):
    """The negative control: without the next row's loads, a warp's second row normalises its first row again."""
    src = _source(64, 768, True, warps=2, rows_per_warp=2)
    broken, count = re.subn(r"if \(\(?it < 1\)?[^{]*\{", "if (false) {", src)
    assert count == 1, "the prefetch guard was not found"
    out, ref = _emulated(broken, 64, 768, True, 2, 2, tmp_path)
    assert relative_error(out, ref) > 0.1


def test_supported_rows():
    assert supports(768) and supports(1024) and supports(1536)
    assert not supports(384) and not supports(1600) and not supports(2048)
    with pytest.raises(ValueError):
        warp_layernorm_primfunc(128, 384, "float16", bias=True, residual=True, warps=4, rows_per_warp=1)
