"""Models exported by PyTorch's own ONNX exporter (BERT, GPT-2, T5 encoder, ViT; tiny sizes, random weights)
compile for the CPU and match onnx.reference under a BigBird mask, with padding where the model has it.
Skipped when torch is not installed (it is not a dependency of stof-tvm)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import stof_tvm  # noqa: E402
from stof_tvm import make_mask  # noqa: E402
from stof_tvm.compiler import front_end  # noqa: E402
from stof_tvm.compiler.kernels import config_object  # noqa: E402
from stof_tvm.models.reference import reference_outputs  # noqa: E402
from stof_tvm.models.torch_models import example_inputs, export  # noqa: E402

S = 128


@pytest.mark.parametrize("name, kernel, causal", [
    ("tiny-bert", "row", False),
    ("tiny-gpt2", "row", True),           # the model's causal buffer is folded into the sparse format
    ("tiny-t5-encoder", "row", False),    # the position bias is added by the sparse kernel, the padding masked
    ("tiny-vit", "row", False),
])
def test_exported_model_matches_reference(name, kernel, causal):
    model = export(name, seq_len=S)
    art = stof_tvm.compile(model, mask="bigbird", batch=2, seq_len=S, target="llvm", dtype="float32")
    att = art.manifest["attention"]
    assert att["sites"] == 2 and att["kernel"]["kind"] == kernel and att["seq_q"] == S
    if causal:
        np.testing.assert_array_equal(art.arrays["model_keep.npy"][0, 0], make_mask("causal", S))
    feeds = {k: v.numpy() for k, v in example_inputs(name, 2, S, seed=3).items()}
    if "attention_mask" in feeds:
        feeds["attention_mask"][1, 100:] = 0
    out = art.load()(feeds)["last_hidden_state"]
    ref = reference_outputs(model, make_mask("bigbird", S)[None, None], feeds)["last_hidden_state"]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_lean_padding_option_reaches_the_block_kernel():
    """``lean_padding`` (default on) sets ``BlockConfig.lean_padding`` on the block-wise kernel that applies the
    model's key padding (the CUDA form; the CPU loop nest is the same), ``False`` leaves it off, and the model
    still matches."""
    model = export("tiny-bert", seq_len=S)
    older = front_end(model, mask="bigbird", batch=2, seq_len=S, target="llvm", dtype="float16",
                      kernel="block", lean_padding=False).choice
    assert older.kind == "block" and not older.config["lean_padding"] and "lean_padding" not in older.reason
    art = stof_tvm.compile(model, mask="bigbird", batch=2, seq_len=S, target="llvm", dtype="float16", kernel="block")
    kernel = art.manifest["attention"]["kernel"]
    assert kernel["kind"] == "block" and kernel["config"]["lean_padding"] is True, kernel
    feeds = {k: v.numpy() for k, v in example_inputs("tiny-bert", 2, S, seed=3).items()}
    feeds["attention_mask"][1, 100:] = 0
    out = art.load()(feeds)["last_hidden_state"].astype(np.float64)
    ref = reference_outputs(model, make_mask("bigbird", S)[None, None], feeds)["last_hidden_state"]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    with pytest.raises(TypeError, match="lean_padding"):
        stof_tvm.compile(model, mask="bigbird", batch=2, seq_len=S, target="llvm", lean_padding="yes")


def test_attention_knobs_reach_the_chosen_kernel():
    """``attention_knobs`` merge into the chosen kernel's configuration (the reason says so), tile shapes included
    (the model still matches); a knob the kernel does not have, or a knobs argument that is not a dict, is refused
    before anything is built."""
    model = export("tiny-bert", seq_len=S)
    common = dict(mask="bigbird", batch=2, seq_len=S, target="llvm", dtype="float16", kernel="block")
    plain = front_end(model, **common).choice
    assert config_object("block", plain.config).stages == 2 and not plain.config.get("reverse_full")
    knobbed = front_end(model, **common, attention_knobs={"reverse_full": True, "stages": 3}).choice
    assert config_object("block", knobbed.config) == config_object("block", {**plain.config, "reverse_full": True,
                                                                               "stages": 3})
    assert "attention_knobs" in knobbed.reason
    with pytest.raises(ValueError, match="not all knobs of the block attention kernel"):
        front_end(model, **common, attention_knobs={"warp_count": 4})
    with pytest.raises(TypeError, match="attention_knobs"):
        stof_tvm.compile(model, mask="bigbird", batch=2, seq_len=S, target="llvm", attention_knobs=["stages"])
    # a tile-shape knob: the runtime builds the mask's format at the knobs' tile, and the model still matches
    art = stof_tvm.compile(model, **common, attention_knobs={"block_m": 16, "block_n": 32, "num_warps": 1})
    config = art.manifest["attention"]["kernel"]["config"]
    assert (config["block_m"], config["block_n"]) == (16, 32)
    feeds = {k: v.numpy() for k, v in example_inputs("tiny-bert", 2, S, seed=3).items()}
    feeds["attention_mask"][1, 100:] = 0
    out = art.load()(feeds)["last_hidden_state"].astype(np.float64)
    ref = reference_outputs(model, make_mask("bigbird", S)[None, None], feeds)["last_hidden_state"]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
