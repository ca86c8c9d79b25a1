"""scripts/check_families_gpu.py's two halves on llvm: ``--save`` builds a family here and writes its artifacts, inputs
and torch reference; ``--load`` checks them with the runtime alone, as the GPU machine does. A saved build must give
the same verdict as the in-process check, and a broken artifact must fail its row, not the run."""
import json
import os
import sys

import pytest

pytest.importorskip("torch", reason="the exports need torch (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="the exports need transformers (pip install -e '.[test]')")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import check_families_gpu as cf  # noqa: E402


def test_saved_builds_check_as_in_process_ones(tmp_path):
    saved = cf.check_family("bert", "dynamo", [1], "dense", str(tmp_path / "work"), target="llvm",
                            save=str(tmp_path / "saved"))
    assert saved[0]["dense_sites"] == saved[0]["sparse_sites"] == 2 and "dense_vs_torch" not in saved[0]
    folder = tmp_path / "saved" / "bert-b1"
    assert {"dense", "sparse", "sparse_ref"} <= set(os.listdir(folder))
    loaded = cf.check_saved(str(folder), target="llvm")
    assert loaded["ok"] is True and loaded["dense_vs_torch"]["rel"] < cf.TOLERANCE
    direct = cf.check_family("bert", "dynamo", [1], "dense", str(tmp_path / "work"), target="llvm")[0]
    assert direct["ok"] is True
    assert abs(direct["dense_vs_torch"]["rel"] - loaded["dense_vs_torch"]["rel"]) < 1e-6

    (folder / "sparse" / "manifest.json").unlink()          # a damaged artifact: its row fails, with the reason
    broken = cf.check_saved(str(folder), target="llvm")
    assert broken["ok"] is False and "FileNotFoundError" in broken["error"]
    json.dumps(broken)                                       # rows stay JSON-serialisable
