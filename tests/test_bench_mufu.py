"""scripts/bench_mufu.py: its kernels compile for sm_90a without spills, and (where a cuobjdump is found) the packed
forms issue two MUFU instructions per packed exponential, one a half, which is what its GPU run weighs."""
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_mufu  # noqa: E402


def test_the_kernels_build_and_the_packed_forms_split_into_two_mufu(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    bench_mufu.main(["build", "--out", str(tmp_path)])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["forms"] == list(bench_mufu.FORMS)
    assert manifest["ptxas"]["spill_stores"] == 0
    if manifest["mufu_opcodes_all_kernels"] is None:
        pytest.skip("no cuobjdump: the SASS half of the check needs one")
    mufu = manifest["mufu_opcodes_all_kernels"]
    assert set(mufu) == {"MUFU.EX2", "MUFU.EX2.F16", "MUFU.EX2.BF16"}
    # the same chains and loop: a packed instruction is two half-precision MUFU, the f32 form one
    assert mufu["MUFU.EX2.F16"] == mufu["MUFU.EX2.BF16"] == 2 * mufu["MUFU.EX2"]


def test_the_checked_value_is_the_root_of_x_equals_two_to_the_minus_x():
    assert abs(2 ** -bench_mufu.FIXED_POINT - bench_mufu.FIXED_POINT) < 1e-12
