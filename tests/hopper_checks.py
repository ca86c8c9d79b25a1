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


def sm90_ptxas_report(src: str, tmp_path, arch: str = "sm_90") -> str:
    """ptxas's ``-v`` report (registers, spills, stack frame, shared memory) of CUDA source ``src`` compiled for
    ``arch`` (sm_90, or sm_90a for wgmma kernels) into ``tmp_path / "kernel.cubin"``; fails the test if nvcc rejects
    it, skips it without nvcc."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    cu = tmp_path / "kernel.cu"
    cu.write_text(src)
    proc = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-O3", "-Xptxas", "-v", "-o",
                           str(tmp_path / "kernel.cubin"), str(cu)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def kernel_alone(src: str, name: str) -> str:
    """TVM's CUDA source ``src`` cut down to its preamble (includes, types, device helpers: everything before the
    first kernel) and kernel ``name``'s definition: what ptxas needs to report that kernel's registers, spills and
    stack frame (figures per kernel, the same as in the whole module) without compiling the module's other
    kernels."""
    match = re.search(rf'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?{name}\([^)]*\)\s*\{{', src)
    assert match, f"no definition of kernel {name}"
    return src[:src.index('extern "C" __global__')] + src[match.start():src.index("\n}\n", match.end()) + 3]


# ptxas notes that would each cost a wgmma kernel its overlap: C7514 / C7520 / C7511 (wgmma serialised; C7511 for
# lack of registers, e.g. a local whose address is taken), C7508 (setmaxnreg ignored), C7515
OVERLAP_WARNINGS = re.compile(r"C75(14|08|15|20|11)")


def sm90a_sass(src: str, tmp_path, any_warning: bool = False) -> str | None:
    """Compile ``src`` for sm_90a into ``tmp_path / "kernel.cubin"`` and check what every wgmma kernel must show:
    no stack frame, no spills, none of :data:`OVERLAP_WARNINGS` (``any_warning``: no ptxas warning at all).
    Returns the cubin's SASS, or None where there is no cuobjdump to read it."""
    report = nvcc_cubin(src, tmp_path / "kernel.cubin")
    assert report["stack_frame"] == report["spill_stores"] == report["spill_loads"] == 0, report
    warnings = report["warnings"] if any_warning else [w for w in report["warnings"] if OVERLAP_WARNINGS.search(w)]
    assert warnings == [], report["warnings"]
    tool = disassembler()
    if tool is None:
        return None
    return subprocess.run([tool, "--dump-sass", str(tmp_path / "kernel.cubin")], capture_output=True, text=True,
                          check=True).stdout


def clean_sm90a_sass(src: str, tmp_path) -> str:
    """Compile ``src`` for sm_90a and return its SASS after the checks every wgmma kernel must pass: no stack
    frame, no spills, no ptxas warning (C7514: wgmma serialised; C7508: setmaxnreg ignored), at least one HGMMA
    and no local-memory traffic. Skips the test without nvcc or cuobjdump."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    sass = sm90a_sass(src, tmp_path, any_warning=True)
    if sass is None:
        pytest.skip("no cuobjdump to read the SASS")
    assert "HGMMA" in sass, "no HGMMA in the SASS"
    assert not re.search(r"\b(LDL|STL)\b", sass), "local-memory traffic in the SASS"
    return sass
