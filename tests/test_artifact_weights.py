"""Artifact weights in the dtype the module takes (float16 for a float16 model: half the bytes), checked at load
against the manifest, and saves that replace an existing artifact only once every file is written."""
import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

import stof_tvm
import stof_tvm.artifact
import stof_tvm.compiler
from stof_tvm import runtime
from stof_tvm.compiler import front_end, lower
from stof_tvm.compiler.weight_storage import FLOAT16_MAX, fits_float16
from stof_tvm.models.reference import random_inputs
from stof_tvm.weights_file import as_weight

B, S = 1, 128
OUT = "last_hidden_state"


def _compile(model, dtype):
    return stof_tvm.compile(model, mask="sliding", batch=B, seq_len=S, target="llvm", dtype=dtype)


@pytest.fixture(scope="module")
def feeds(tiny):
    data = random_inputs(tiny, {"input_ids": (B, S), "attention_mask": (B, S)}, seed=3)
    data["attention_mask"][0, 100:] = 0
    return data


@pytest.fixture(scope="module")
def saved(tiny, feeds, tmp_path_factory):
    """{dtype: (artifact dir, in-process output)} of tiny BERT compiled for llvm in float16 and float32."""
    result = {}
    for dtype in ("float16", "float32"):
        art = _compile(tiny, dtype)
        result[dtype] = (art.save(tmp_path_factory.mktemp(dtype) / "art"), art.load()(feeds)[OUT])
    return result


def _manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def _write_manifest(path, manifest):
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)


_LOADER = """
import sys, numpy as np, tvm
from stof_tvm import runtime
with np.load(sys.argv[2]) as data:
    out = runtime.load(sys.argv[1])({name: data[name] for name in data.files})["last_hidden_state"]
np.save(sys.argv[3], out)
print("runtime_only", tvm.base._RUNTIME_ONLY, "tvm.relax" in sys.modules)
"""


def test_float16_weights_round_trip_with_runtime_only(saved, feeds, tmp_path):
    path, expected = saved["float16"]
    specs = _manifest(path)["weights"]
    assert specs and {w["dtype"] for w in specs} == {"float16"} and _manifest(path)["weights_file"] == "weights.npz"
    with np.load(os.path.join(path, "weights.npz")) as data:
        assert {data[w["name"]].dtype for w in specs} == {np.dtype(np.float16)}
    np.savez(tmp_path / "x.npz", **feeds)
    proc = subprocess.run([sys.executable, "-c", _LOADER, path, str(tmp_path / "x.npz"), str(tmp_path / "y.npy")],
                          env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "runtime_only True False" in proc.stdout
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected)


def test_float32_weights_stay_float32(saved, feeds):
    path, expected = saved["float32"]
    assert {w["dtype"] for w in _manifest(path)["weights"]} == {"float32"}
    np.testing.assert_array_equal(runtime.load(path)(feeds)[OUT], expected)


def test_float16_weights_take_half_the_bytes(saved):
    half, full = (os.path.getsize(os.path.join(saved[d][0], "weights.npz")) for d in ("float16", "float32"))
    assert 0.49 < half / full < 0.52


def test_float16_output_close_to_float32(saved):
    """The stored rounding changes what the embeddings read (as in a float16 torch model), not the accuracy."""
    (_, half), (_, full) = saved["float16"], saved["float32"]
    assert np.isfinite(half).all()
    assert np.linalg.norm(half - full) / np.linalg.norm(full) < 2e-3


def test_truncated_or_corrupt_weights_are_reported(saved, tmp_path):
    path, _ = saved["float16"]
    broken = shutil.copytree(path, tmp_path / "truncated")
    weights = broken / "weights.npz"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"weights\.npz is truncated or corrupt .*save the artifact again"):
        runtime.load(broken)
    flipped = shutil.copytree(path, tmp_path / "flipped")
    data = bytearray((flipped / "weights.npz").read_bytes())
    with zipfile.ZipFile(flipped / "weights.npz") as npz:
        first = npz.infolist()[0]
    name_len, extra_len = np.frombuffer(bytes(data[first.header_offset + 26: first.header_offset + 30]), "<u2")
    data[first.header_offset + 30 + int(name_len) + int(extra_len) + first.file_size // 2] ^= 0xFF   # array bytes
    (flipped / "weights.npz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        runtime.load(flipped)


def test_weights_file_of_another_artifact_is_refused(saved, tmp_path):
    path, _ = saved["float16"]
    mixed = shutil.copytree(path, tmp_path / "mixed")
    shutil.copy(os.path.join(saved["float32"][0], "weights.npz"), mixed / "weights.npz")
    name = _manifest(path)["weights"][0]["name"]
    with pytest.raises(ValueError, match=f"does not match the artifact's manifest: weight '{name}' is float32"):
        runtime.load(mixed)
    with np.load(os.path.join(path, "weights.npz")) as data:
        np.savez(mixed / "weights.npz", **{k: data[k] for k in data.files if k != name})
    with pytest.raises(ValueError, match=f"does not match the artifact's manifest: it lacks \\['{name}'\\]"):
        runtime.load(mixed)


def test_artifact_of_the_previous_format_loads(tiny, feeds, tmp_path, monkeypatch):
    """Before this change a float16 compile kept float32 weight parameters and files, and its manifest had no
    ``weights_file``: built here by skipping the storage step, it loads and runs as it did."""
    monkeypatch.setattr(stof_tvm.compiler, "store_weights_float16", lambda mod, weights, model: (mod, weights))
    art = _compile(tiny, "float16")
    path = art.save(tmp_path / "old")
    manifest = _manifest(path)
    del manifest["weights_file"]
    _write_manifest(path, manifest)
    assert {w["dtype"] for w in manifest["weights"]} == {"float32"}
    with np.load(os.path.join(path, "weights.npz")) as data:
        assert {data[k].dtype for k in data.files} == {np.dtype(np.float32)}
    np.testing.assert_array_equal(runtime.load(path)(feeds)[OUT], art.load()(feeds)[OUT])
    os.remove(os.path.join(path, "weights.npz"))
    with pytest.raises(FileNotFoundError, match="saved without weights.npz"):
        runtime.load(path)


def test_onnx_float32_weights_passed_at_load(tiny, saved, feeds, tmp_path):
    """Weights shipped apart (``save(weights=False)``) may be the ONNX file's float32 arrays: cast at load."""
    path, expected = saved["float16"]
    code_only = shutil.copytree(path, tmp_path / "code_only", ignore=shutil.ignore_patterns("weights.npz"))
    manifest = _manifest(code_only)
    manifest["weights_file"] = None
    _write_manifest(code_only, manifest)
    onnx_weights = {t.name: numpy_helper.to_array(t) for t in tiny.graph.initializer}
    np.testing.assert_array_equal(runtime.load(code_only, weights=onnx_weights)(feeds)[OUT], expected)
    name = manifest["weights"][0]["name"]
    big = onnx_weights[name].copy()
    big[0, 0] = 1e6
    with pytest.raises(ValueError, match=f"weight '{name}': the module takes it as float16, but it has values"):
        runtime.load(code_only, weights={**onnx_weights, name: big})
    with pytest.raises(ValueError, match=f"weight '{name}': expected float16 values, got int32"):
        runtime.load(code_only, weights={**onnx_weights, name: big.astype(np.int32)})


def test_weight_beyond_float16_range_stays_float32(tiny, feeds):
    """A weight float16 cannot hold stays float32 (rounding would make it infinite); the others go float16."""
    model = onnx.ModelProto()
    model.CopyFrom(tiny)
    table = next(t for t in model.graph.initializer if t.name.startswith("word_embeddings"))
    values = numpy_helper.to_array(table).copy()
    values[0, :] = 1e5               # a row no input below reads
    table.CopyFrom(numpy_helper.from_array(values, table.name))
    art = _compile(model, "float16")
    dtypes = {w["name"]: w["dtype"] for w in art.manifest["weights"]}
    assert dtypes.pop(table.name) == "float32" and set(dtypes.values()) == {"float16"}
    assert art.weights[table.name].dtype == np.float32 and art.weights[table.name][0, 0] == 1e5
    ids = feeds["input_ids"].copy()
    ids[ids == 0] = 1
    assert np.isfinite(art.load()({**feeds, "input_ids": ids})[OUT]).all()


def test_float32_reads_of_float16_weights_run_once_at_load(tiny):
    """An embedding table stored float16 is widened to the float32 its gather reads in main_transform_params
    (once at load), not in every call: ``main`` takes the widened table, the transform the stored one."""
    front = front_end(tiny, mask="sliding", batch=B, seq_len=S, target="llvm", dtype="float16")
    optimized, _ = lower(front, None, cuda_graph=False)
    stored = [str(t.dtype) for t in optimized["main_transform_params"].params[0].ty.fields]
    assert stored == [w.dtype for w in front.weights] == ["float16"] * len(front.weights)
    main = optimized["main"]
    taken = {p.name: str(p.ty.dtype) for p in main.params[int(main.attrs["num_input"]):]}
    tables = [name for name in taken if "embeddings" in name]
    assert tables and {taken[name] for name in tables} == {"float32"}, taken


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=8))
def test_fits_float16_means_a_finite_cast(values):
    array = np.array(values, dtype=np.float32)
    fits = fits_float16(array)
    assert fits == bool(np.isfinite(array).all() and np.abs(array).max() <= FLOAT16_MAX)
    if fits:
        with np.errstate(over="raise"):
            assert np.isfinite(as_weight({"name": "w", "shape": [len(values)], "dtype": "float16"}, array)).all()


# -- saving over an existing artifact --------------------------------------------------------------------------
def _contents(path):
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def test_failed_save_leaves_the_existing_artifact(tiny, saved, feeds, tmp_path, monkeypatch):
    path, expected = saved["float16"]
    target = shutil.copytree(path, tmp_path / "art")
    before = _contents(target)
    art = _compile(tiny, "float32")

    def fail_midway(file, weights):
        with open(file, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stof_tvm.artifact, "write_weights", fail_midway)
    with pytest.raises(OSError, match="No space left"):
        art.save(target)
    assert _contents(target) == before                 # nothing replaced, no temporary file left
    np.testing.assert_array_equal(runtime.load(target)(feeds)[OUT], expected)
    monkeypatch.undo()
    art.save(target)
    assert {w["dtype"] for w in _manifest(target)["weights"]} == {"float32"}
    assert sorted(os.listdir(target)) == sorted(before)


def test_save_removes_the_previous_artifacts_files(tiny, feeds, tmp_path):
    """Saving over an artifact replaces it: its files the new one lacks (a mask array, the weights of a save
    without them) go, so the loader never reads a stale one."""
    target = tmp_path / "art"
    with_array = stof_tvm.compile(tiny, mask=np.tril(np.ones((S, S), bool)), batch=B, seq_len=S, target="llvm",
                                  dtype="float16")
    with_array.save(target)
    assert "mask.npy" in os.listdir(target)
    (target / "notes.txt").write_text("the user's own file")
    art = _compile(tiny, "float16")
    art.save(target, weights=False)
    assert sorted(os.listdir(target)) == ["manifest.json", "module.so", "notes.txt"]
    assert _manifest(target)["weights_file"] is None
    with pytest.raises(FileNotFoundError, match="saved without weights.npz"):
        runtime.load(target)
    np.testing.assert_array_equal(runtime.load(target, weights=art.weights)(feeds)[OUT], art.load()(feeds)[OUT])
