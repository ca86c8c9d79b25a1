"""Shared checks of CUDA kernels built here for Hopper (sm_90 / sm_90a): ptxas's report and, where cuobjdump
exists, the SASS."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stof_tvm.schedules.templates.gemm_wgmma import nvcc_cubin


def disassembler():
    """cuobjdump from PATH, the CUDA toolkit, or $STOF_CUOBJDUMP (None when none is installed)."""
    for candidate in (os.environ.get("STOF_CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def sm90_ptxas_report(src: str, tmp_path) -> str:
    """ptxas's ``-v`` report (registers, spills, stack frame, shared memory) of CUDA source ``src`` compiled for
    sm_90 into ``tmp_path / "kernel.cubin"``; fails the test if nvcc rejects it, skips it without nvcc."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    cu = tmp_path / "kernel.cu"
    cu.write_text(src)
    proc = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "-o",
                           str(tmp_path / "kernel.cubin"), str(cu)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def clean_sm90a_sass(src: str, tmp_path) -> str:
    """Compile ``src`` for sm_90a and return its SASS after the checks every wgmma kernel must pass: no stack
    frame, no spills, no ptxas warning (C7514: wgmma serialised; C7508: setmaxnreg ignored), at least one HGMMA
    and no local-memory traffic. Skips the test without nvcc or cuobjdump."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    report = nvcc_cubin(src, tmp_path / "kernel.cubin")
    assert report["stack_frame"] == report["spill_stores"] == report["spill_loads"] == 0, report
    assert report["warnings"] == [], report["warnings"]
    tool = disassembler()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS")
    sass = subprocess.run([tool, "--dump-sass", str(tmp_path / "kernel.cubin")], capture_output=True,
                          text=True, check=True).stdout
    assert "HGMMA" in sass, "no HGMMA in the SASS"
    assert not re.search(r"\b(LDL|STL)\b", sass), "local-memory traffic in the SASS"
    return sass
