"""scripts/bench_e2e_torch.py's CPU-side pieces: the ONNX-initializer -> torch state_dict weight map, and (with a
torch interpreter) the whole path the H200 run takes, on tiny models for llvm: export, compile without weights,
load with the torch model's weights through the map, compare with the torch model in float32 under the same
mask (its attention replaced by SDPA and by FlexAttention, as the benchmark's baselines do).

Torch is not a stof-tvm dependency: the torch half runs in another interpreter, ``STOF_TORCH_PYTHON`` (default
/work/torchvenv/bin/python), and is skipped when that has no torch."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import numpy_helper

import stof_tvm
from stof_tvm import runtime
from stof_tvm.models.reference import reference_outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_PYTHON = os.environ.get("STOF_TORCH_PYTHON", "/work/torchvenv/bin/python")


def _script():
    path = os.path.join(ROOT, "scripts", "bench_e2e_torch.py")
    spec = importlib.util.spec_from_file_location("bench_e2e_torch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e_torch"] = module
    spec.loader.exec_module(module)
    return module


bench = _script()


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------------------------------- without torch
def test_weight_map_finds_entries_directly_transposed_and_deduplicated(tiny):
    arrays = {t.name: numpy_helper.to_array(t) for t in tiny.graph.initializer}
    floats = [n for n, a in arrays.items() if a.dtype.kind == "f"]
    square = next(n for n in floats if arrays[n].ndim == 2 and arrays[n].shape[0] != arrays[n].shape[1])
    floats = [n for n in floats if n != square and arrays[n].ndim == 2]     # random matrices: unique values
    # a fake state_dict: one entry stored transposed (as nn.Linear keeps it), one renamed, one missing
    state = {f"sd.{n}": a for n, a in arrays.items() if n not in (square, floats[0])}
    state["linear.weight"] = arrays[square].T.copy()
    state["dup.a"] = state["dup.b"] = arrays[floats[0]].copy()
    state["sd." + floats[1]] = arrays[floats[1]] + 1.0          # same shape, other values: must not match
    got = bench.weight_map(tiny, state)
    assert got["initializers"][square] == {"key": "linear.weight", "transpose": True}
    assert got["initializers"][floats[0]]["key"] in ("dup.a", "dup.b")
    assert floats[1] in got["unmatched"]
    assert got["initializers"][floats[2]] == {"key": f"sd.{floats[2]}", "transpose": False}
    assert all(arrays[n].dtype.kind == "f" for n in list(got["initializers"]) + got["unmatched"])
    # and back: the artifact's weights rebuilt from the state_dict equal the ONNX initializers
    manifest = {"weights": [{"name": n} for n in got["initializers"]]}
    for name, value in bench.artifact_weights(manifest, got, state).items():
        np.testing.assert_array_equal(value, arrays[name])


def test_rename_initializers_keeps_the_graph_consistent(tiny):
    model = type(tiny)()
    model.CopyFrom(tiny)
    first = model.graph.initializer[0].name
    for node in model.graph.node:
        node.input[:] = ["onnx::W_1" if name == first else name for name in node.input]
    model.graph.initializer[0].name = "onnx::W_1"
    bench.rename_initializers(model)
    assert model.graph.initializer[0].name == "onnx_W_1"
    assert not any(name.startswith("onnx::") for node in model.graph.node for name in node.input)
    assert any("onnx_W_1" in node.input for node in model.graph.node)


def test_combined_keep_is_bigbird_and_causal_for_gpt2():
    big = stof_tvm.make_mask("bigbird", 256)
    np.testing.assert_array_equal(bench.combined_keep("bert-base", 256), big)
    np.testing.assert_array_equal(bench.combined_keep("gpt2", 256), big & np.tril(np.ones((256, 256), bool)))
    assert bench.combined_keep("gpt2", 256).any(axis=1).all()      # no empty row: outputs defined alike


# ----------------------------------------------------------------------------------- with a torch interpreter
def _torch_available() -> bool:
    if not os.path.isfile(TORCH_PYTHON):
        return False
    return subprocess.run([TORCH_PYTHON, "-c", "import torch, onnx"], capture_output=True).returncode == 0


def export_reference(tmp_path_factory, models, shape: str) -> str:
    """Run ``bench_e2e_torch.py reference`` for ``models`` at ``shape`` ("BxS") with the torch interpreter; the
    folder it wrote (ONNX graphs, weight maps, state_dicts, inputs, torch outputs). Skips without torch."""
    if not _torch_available():
        pytest.skip(f"no torch interpreter at {TORCH_PYTHON} (set STOF_TORCH_PYTHON)")
    out = tmp_path_factory.mktemp("torch_ref")
    subprocess.run([TORCH_PYTHON, os.path.join(ROOT, "scripts", "bench_e2e_torch.py"), "reference", "--dir", str(out),
                    "--models", *models, "--shapes", shape], check=True, capture_output=True, cwd=ROOT)
    return str(out)


def load_reference(stem: str) -> tuple[dict, dict, dict, dict]:
    """One model's files from :func:`export_reference`: (weight map, torch state_dict, model inputs, torch
    float32 outputs by attention: "sdpa", "flex")."""
    with open(stem + ".map.json") as f:
        mapping = json.load(f)
    with np.load(stem + ".state.npz") as data:
        state = {k: data[k] for k in data.files}
    with np.load(stem + ".io.npz") as data:
        feeds = {k[3:]: data[k] for k in data.files if k.startswith("in_")}
        outputs = {k: data[k] for k in data.files if not k.startswith("in_")}
    return mapping, state, feeds, outputs


@pytest.fixture(scope="module")
def torch_data(tmp_path_factory):
    return export_reference(tmp_path_factory, ["tiny-gpt2", "tiny-t5-encoder", "tiny-vit", "tiny-bert"], "2x128")


@pytest.mark.parametrize("name, kernel", [("tiny-gpt2", "row"), ("tiny-t5-encoder", "row"),   # T5: bias added by row
                                          ("tiny-vit", "row"), ("tiny-bert", "row")])
def test_artifact_with_mapped_torch_weights_matches_torch(torch_data, tmp_path, name, kernel):
    import onnx

    stem = os.path.join(torch_data, f"{name}_2x128")
    model = onnx.load(stem + ".onnx")
    mapping, state, feeds, torch_out = load_reference(stem)
    sdpa, flex = torch_out["sdpa"], torch_out["flex"]
    assert _rel(flex, sdpa) < 1e-5                      # the two baselines' attention agree on the mask
    ref = reference_outputs(model, stof_tvm.make_mask("bigbird", 128)[None, None], feeds)["last_hidden_state"]
    assert _rel(sdpa, ref) < 1e-5                       # torch with the mask == the exported graph with it
    art = stof_tvm.compile(model, mask="bigbird", batch=2, seq_len=128, target="llvm", dtype="float32")
    assert art.manifest["attention"]["kernel"]["kind"] == kernel
    weights = bench.artifact_weights(art.manifest, mapping, state)
    assert set(weights) == {w["name"] for w in art.manifest["weights"]} and weights
    path = art.save(tmp_path / "artifact", weights=False)            # as built for the GPU: no weights.npz
    assert not os.path.exists(os.path.join(path, "weights.npz"))
    out = runtime.load(path, weights=weights)(feeds)
    assert _rel(out["last_hidden_state"], sdpa) < 1e-5


def test_t5_padding_goes_to_the_mask_and_the_position_bias_stays_per_head(torch_data, tmp_path):
    """T5 adds ``position_bias + padding`` to its scores as one tensor; compiled, the padding is a run-time mask
    term of the sparse format and the bias input is the position bias alone ([1, H, S, S]), and a padded batch
    still matches the exported graph under the same mask."""
    import onnx

    stem = os.path.join(torch_data, "tiny-t5-encoder_2x128")
    model = onnx.load(stem + ".onnx")
    mapping, state, feeds, _ = load_reference(stem)
    feeds = dict(feeds, attention_mask=feeds["attention_mask"].copy())
    feeds["attention_mask"][1, 90:] = 0
    art = stof_tvm.compile(model, mask="bigbird", batch=2, seq_len=128, target="llvm", dtype="float32")
    kernel = art.manifest["attention"]["kernel"]
    assert kernel["kind"] == "row" and kernel["bias"][:2] == [1, kernel["bias"][1]] and kernel["bias"][1] > 1
    out = runtime.load(art.save(tmp_path / "t5", weights=False),
                       weights=bench.artifact_weights(art.manifest, mapping, state))(feeds)
    ref = reference_outputs(model, stof_tvm.make_mask("bigbird", 128)[None, None], feeds)["last_hidden_state"]
    assert _rel(out["last_hidden_state"], ref) < 1e-5
