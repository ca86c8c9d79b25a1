"""Artifacts on disk and the runtime-only loader: round trip in a TVM_USE_RUNTIME_LIB=1 subprocess, the CLI's
main job, and clear errors for bad inputs, wrong masks and artifacts built for another device."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import stof_tvm
from stof_tvm import make_mask
from stof_tvm import runtime
from stof_tvm.cli import main as cli_main
from stof_tvm.commands.run import model_inputs
from stof_tvm.hardware import DeviceUnavailable
from stof_tvm.models import BERT_CONFIGS
from stof_tvm.profiling import profile_artifact
from stof_tvm.models import builtin_model
from stof_tvm.models.reference import random_inputs

B, S = 2, 128


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(artifact dir, inputs, in-process outputs) of tiny BERT compiled with a sliding mask (row kernel)."""
    model = builtin_model("tiny-bert")
    art = stof_tvm.compile(model, mask="sliding", batch=B, seq_len=S, target="llvm", dtype="float32")
    path = art.save(tmp_path_factory.mktemp("art") / "tiny")
    feeds = random_inputs(model, {"input_ids": (B, S), "attention_mask": (B, S)}, seed=5)
    feeds["attention_mask"][0, 64:] = 0
    return path, feeds, art.load()(feeds)["last_hidden_state"]


_LOADER = """
import sys, numpy as np, tvm
from stof_tvm import runtime
model = runtime.load(sys.argv[1])
with np.load(sys.argv[2]) as data:
    out = model({name: data[name] for name in data.files})["last_hidden_state"]
np.save(sys.argv[3], out)
print("runtime_only", tvm.base._RUNTIME_ONLY, "tvm.relax" in sys.modules, "tvm_compiler" in tvm.base._LOADED_LIBS)
"""


def test_round_trip_with_runtime_only(saved, tmp_path):
    path, feeds, expected = saved
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert [i["name"] for i in manifest["inputs"]] == ["input_ids", "attention_mask"]
    assert manifest["outputs"] == [{"name": "last_hidden_state", "shape": [B, S, 128], "dtype": "float32"}]
    assert manifest["mask"]["spec"] == "sliding" and manifest["tvm_version"]
    assert not [f for f in os.listdir(path) if f.endswith((".pkl", ".pickle"))]
    np.savez(tmp_path / "x.npz", **feeds)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    proc = subprocess.run([sys.executable, "-c", _LOADER, path, str(tmp_path / "x.npz"), str(tmp_path / "y.npy")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "runtime_only True False False" in proc.stdout
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected)


def test_wrong_input_shape(saved):
    path, feeds, _ = saved
    model = runtime.load(path)
    with pytest.raises(ValueError, match=r"input 'input_ids': expected shape \[2, 128\], got \[2, 64\]"):
        model({**feeds, "input_ids": feeds["input_ids"][:, :64]})


def test_missing_and_unknown_inputs(saved):
    path, feeds, _ = saved
    model = runtime.load(path)
    with pytest.raises(ValueError, match=r"missing \['attention_mask'\]"):
        model(input_ids=feeds["input_ids"])
    with pytest.raises(ValueError, match=r"unknown \['token_type_ids'\]"):
        model({**feeds, "token_type_ids": feeds["input_ids"]})
    with pytest.raises(TypeError, match="expected dtype int64"):
        model({**feeds, "input_ids": feeds["input_ids"].astype(np.float32)})


def test_inputs_by_position_follow_the_models_input_order(saved):
    """``model(ids, mask)`` as a Hugging Face model's forward takes them: the same outputs as by name; a dict
    and keywords mix; what is given twice, too many or a dict among tensors is refused naming the inputs."""
    path, feeds, expected = saved
    model = runtime.load(path)
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    for call in (lambda: model(ids, mask), lambda: model(ids, attention_mask=mask),
                 lambda: model({"input_ids": ids}, attention_mask=mask)):
        np.testing.assert_array_equal(call()["last_hidden_state"], expected)
    with pytest.raises(ValueError, match=r"missing \['attention_mask'\]"):
        model(ids)
    with pytest.raises(TypeError, match=r"\['input_ids'\] given both by position and by name"):
        model(ids, mask, input_ids=ids)
    with pytest.raises(TypeError, match=r"3 given by position, but the model takes 2: \['input_ids', "):
        model(ids, mask, mask)
    with pytest.raises(TypeError, match="one dict of inputs by name, or tensors by position"):
        model(ids, {"attention_mask": mask})


def test_outputs_read_as_a_hugging_face_models_do(saved):
    path, feeds, expected = saved
    out = runtime.load(path)(feeds)
    assert list(out) == ["last_hidden_state"] and isinstance(out, dict)
    for value in (out["last_hidden_state"], out.last_hidden_state, out[0], out.to_tuple()[0]):
        np.testing.assert_array_equal(value, expected)
    with pytest.raises(AttributeError, match=r"no 'pooler_output'; the model gives \['last_hidden_state'\]"):
        out.pooler_output
    with pytest.raises(IndexError):
        out[1]


def test_mask_of_wrong_length_or_kind(saved):
    path, feeds, _ = saved
    model = runtime.load(path)
    with pytest.raises(ValueError, match=r"mask: .*\(128, 128\)"):
        model(feeds, mask=np.ones((64, 64), bool))
    with pytest.raises(ValueError, match="mask: .*unknown mask name"):
        model(feeds, mask="nosuch")
    # The model's padding is applied by the kernel, so the format is shared by the batch: per-batch masks are
    # another kind of mask for this artifact.
    with pytest.raises(ValueError, match="compiled for a mask of 1 batch x 1 head groups"):
        model(feeds, mask=np.ones((B, 2, S, S), bool))
    with pytest.raises(ValueError, match="compiled for a mask of 1 batch x 1 head groups, got 2 x 1"):
        model(feeds, mask=np.ones((B, 1, S, S), bool))


def test_artifact_for_another_device(saved, tmp_path, capsys):
    path, _, _ = saved
    copy = shutil.copytree(path, tmp_path / "cuda_copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["target"] = {"kind": "cuda", "arch": "sm_90"}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DeviceUnavailable, match="built for CUDA"):
        runtime.load(copy)
    # the command line says so in one line, without a traceback
    assert cli_main(["run", str(copy)]) == 2
    assert "stof-tvm run: error: artifact was built for CUDA" in capsys.readouterr().err


def test_a_mask_array_file_works_in_every_subcommand(tmp_path, capsys):
    """compile --mask x.npy keeps the array; run --check checks against it without being told again; run, bench
    and masks take a .npy mask as compile does (they took specs only, and run --check could not check an
    artifact compiled from an array)."""
    S = 64
    keep = make_mask("bigbird", S)
    keep[:, :3] = False                                  # not any spec's mask: the array itself must be used
    keep[np.arange(S), np.arange(S)] = True
    array = tmp_path / "keep.npy"
    np.save(array, keep)
    out = str(tmp_path / "arr")
    assert cli_main(["compile", "--builtin", "tiny-bert", "--mask", str(array), "--batch", "1", "--seq-len", str(S),
                     "--target", "llvm", "-o", out]) == 0
    capsys.readouterr()
    assert cli_main(["run", out, "--check"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert cli_main(["run", out, "--check", "--mask", str(array)]) == 0
    assert "PASS" in capsys.readouterr().out
    assert cli_main(["bench", out, "--mask", str(array), "--repeat", "1", "--number", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["median_ms"] > 0
    assert cli_main(["masks", str(array), "--seq-len", str(S), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["kept_pairs"] == int(keep.sum())
    assert cli_main(["run", out, "--mask", str(tmp_path / "missing.npy")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_an_output_path_that_cannot_hold_an_artifact_is_refused_before_compiling(tmp_path, capsys):
    from stof_tvm.artifact import check_output_dir

    a_file = tmp_path / "taken"
    a_file.write_text("")
    assert check_output_dir(tmp_path / "new" / "dir") == str(tmp_path / "new" / "dir")
    for bad in (a_file, a_file / "below"):
        with pytest.raises(ValueError, match="output: "):
            check_output_dir(bad)
    # the CLI asks first: an error line, no compile, no traceback
    assert cli_main(["compile", "--builtin", "tiny-bert", "--mask", "bigbird", "--batch", "1", "--seq-len", "64",
                     "--target", "llvm", "-o", str(a_file)]) == 2
    captured = capsys.readouterr()
    assert "exists and is not a directory" in captured.err and "importing" not in captured.err


def test_not_an_artifact(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a stof-tvm artifact"):
        runtime.load(tmp_path)


def test_cli_main_job(tmp_path, capsys):
    """README's main job: compile the built-in tiny BERT with a BigBird mask for llvm, run it with --check."""
    out = str(tmp_path / "tiny")
    assert cli_main(["compile", "--builtin", "tiny-bert", "--mask", "bigbird", "--batch", "1", "--seq-len", "128",
                     "--target", "llvm", "-o", out]) == 0
    captured = capsys.readouterr()
    steps = captured.err.splitlines()                  # progress of the long steps, timed, on stderr
    assert [line.split("] ", 1)[1].split(" ")[0] for line in steps] == ["importing", "building"]
    layers = BERT_CONFIGS["tiny-bert"].layers          # the coverage report: no templates on llvm, and why
    assert (f"coverage (on stof-tvm kernels / templates): attention {layers}/{layers} (row), qkv 0/{layers}, "
            f"linear 0/{6 * layers}") in captured.out
    assert f"linear: {6 * layers} fell back: fusion templates off: target llvm" in captured.out
    assert "building for llvm (attention kernel row, templates off)" in steps[1]
    assert cli_main(["run", out, "--check"]) == 0
    printed = capsys.readouterr().out
    assert "output last_hidden_state: shape [1, 128, 128] float32" in printed
    assert "PASS" in printed
    assert cli_main(["bench", out, "--repeat", "2", "--number", "1", "--json", "--profile"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["median_ms"] > 0 and report["seq_len"] == 128
    by_symbol = {row["symbol"]: row for row in report["profile"]}
    assert by_symbol["stof_attention_row"]["calls"] == BERT_CONFIGS["tiny-bert"].layers
    assert abs(sum(row["share"] for row in report["profile"]) - 1) < 1e-6
    profiled_ms = sum(row["ms"] for row in report["profile"])
    assert 0.5 * report["min_ms"] < profiled_ms < 5 * report["max_ms"]
    model = runtime.load(out)                            # the benchmark scripts' form: figures into a result row
    row = {}
    profile_artifact(model, model.prepare(model_inputs(model, None)), "tiny", row)
    assert {r["symbol"] for r in row["tiny_profile"]} == set(by_symbol)
    assert "per call" in capsys.readouterr().out


def test_cli_errors_are_reported(tmp_path, capsys):
    assert cli_main(["run", str(tmp_path)]) == 2
    assert "not a stof-tvm artifact" in capsys.readouterr().err


def test_weights_shipped_separately(saved, tmp_path):
    path, feeds, expected = saved
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert manifest["weights"] and manifest["transform_params"] == "main_transform_params"
    code_only = shutil.copytree(path, tmp_path / "code_only", ignore=shutil.ignore_patterns("weights.npz"))
    with pytest.raises(FileNotFoundError, match="saved without weights.npz"):
        runtime.load(code_only)
    with np.load(os.path.join(path, "weights.npz")) as data:
        weights = {name: data[name] for name in data.files}
    np.testing.assert_array_equal(runtime.load(code_only, weights=weights)(feeds)["last_hidden_state"], expected)
    name = manifest["weights"][0]["name"]
    with pytest.raises(ValueError, match=f"weight '{name}': expected shape"):
        runtime.load(code_only, weights={**weights, name: weights[name][:1]})
    with pytest.raises(ValueError, match="weights: missing"):
        runtime.load(code_only, weights={})
