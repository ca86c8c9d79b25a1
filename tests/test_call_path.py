"""The call users write (``model(input_ids=..., attention_mask=...)``) on the built-in tiny BERT (llvm): the
model's padding applied in the module (ragged right padding of every length and a fully padded row, irregular
padding, all equal to onnx's reference evaluator), no format built on the host for a call with new padding, one
build per new run-time mask, token ids outside the embedding table refused (before any kernel for host inputs,
by the module's own count for device inputs, never read out of bounds), and bad shapes / dtypes / masks refused
before any kernel runs."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import stof_tvm
from stof_tvm import call_inputs, make_mask, mask_formats
from stof_tvm.models.reference import random_inputs, reference_outputs

from attention_reference import relative_error

S = 64
B = S + 1                               # one batch row per padded length 0..S


@pytest.fixture(scope="module")
def row_model(tiny):
    return stof_tvm.compile(tiny, mask="bigbird:window=8,globals=8,block=8", batch=B, seq_len=S, target="llvm",
                            dtype="float32").load()


@pytest.fixture(scope="module")
def block_model(tiny):
    return stof_tvm.compile(tiny, mask="bigbird:window=8,globals=8,block=8", batch=B, seq_len=S, target="llvm",
                            dtype="float16", kernel="block").load()


def feeds_with(tiny, attention_mask, seed=3):
    feeds = random_inputs(tiny, {"input_ids": (B, S), "attention_mask": (B, S)}, seed=seed)
    feeds["attention_mask"] = np.ascontiguousarray(attention_mask, np.int64)
    return feeds


def aligned(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` starting on a 64-byte boundary (what a CPU module binds without copying)."""
    raw = np.empty(array.nbytes + 64, np.uint8)
    start = -raw.__array_interface__["data"][0] % 64
    copy = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def ragged() -> np.ndarray:
    """Right padding: batch row b keeps its first b tokens (row 0: none, row S: all)."""
    return (np.arange(S)[None, :] < np.arange(B)[:, None]).astype(np.int64)


def check_against_reference(tiny, model, feeds, tolerance, where=None):
    """Outputs finite everywhere and equal to the reference ``where`` (default: every position of the batch rows
    that keep a token; a query row keeping no key, as in a fully padded row, gives 0 where the model would
    spread it evenly over the keys it masks)."""
    out = model(feeds)["last_hidden_state"]
    assert np.isfinite(out).all(), "a padded row must stay defined"
    keep = make_mask("bigbird:window=8,globals=8,block=8", S)[None, None]
    ref = reference_outputs(tiny, keep, feeds)["last_hidden_state"]
    where = feeds["attention_mask"].any(axis=1) if where is None else where
    assert relative_error(out[where], ref[where]) < tolerance


@pytest.mark.parametrize("which, tolerance", [("row", 1e-5), ("block", 2e-2)])
def test_ragged_padding_matches_the_reference(tiny, row_model, block_model, which, tolerance):
    model = row_model if which == "row" else block_model
    assert model.manifest["mask"]["padding"] == {"input": "attention_mask", "on": "device"}
    assert model.manifest["attention"]["kernel"]["mask_batch"] == 1
    check_against_reference(tiny, model, feeds_with(tiny, ragged()), tolerance)


def test_irregular_padding_matches_the_reference(tiny, row_model):
    rng = np.random.default_rng(0)
    attention_mask = rng.integers(0, 2, (B, S))          # holes everywhere; some rows left padded
    attention_mask[1, :40] = 0
    attention_mask[2] = 1
    # At the tokens the padding keeps (padded query rows whose window is all padding keep no key: 0 here).
    check_against_reference(tiny, row_model, feeds_with(tiny, attention_mask), 1e-5, attention_mask != 0)


def test_new_padding_builds_no_format(tiny, row_model, monkeypatch):
    builds = []
    for name in ("build_rows", "build_tiled"):
        original = getattr(mask_formats, name)
        monkeypatch.setattr(mask_formats, name, lambda *a, _f=original, **k: builds.append(1) or _f(*a, **k))
    rng = np.random.default_rng(1)
    for seed in range(3):                                # new padding every call
        lengths = rng.integers(0, S + 1, B)
        feeds = feeds_with(tiny, np.arange(S)[None, :] < lengths[:, None], seed)
        row_model(feeds)
    assert builds == []
    row_model(feeds_with(tiny, ragged()), mask="sliding:window=4")    # a new mask: one build ...
    row_model(feeds_with(tiny, ragged()), mask="sliding:window=4")    # ... then cached
    assert builds == [1]


def test_a_new_mask_array_is_built_once_and_kept_by_identity(tiny, row_model):
    mask = make_mask("local:window=5", S)
    feeds = feeds_with(tiny, ragged())
    first = row_model(feeds, mask=mask)["last_hidden_state"]
    tensors = row_model.formats.tensors(mask)
    assert row_model.formats.tensors(mask) is tensors                  # same object: no second build
    assert row_model.formats.tensors(mask.copy()) is not tensors      # another array: built for itself
    ref = reference_outputs(tiny, mask[None, None], feeds)["last_hidden_state"]
    valid = feeds["attention_mask"] != 0             # padded rows far from the tokens keep no key under a window
    assert relative_error(first[valid], ref[valid]) < 1e-5


@pytest.fixture
def kernel_calls(row_model, monkeypatch):
    """Counts the module's invocations (raised before any kernel runs: the count stays 0)."""
    calls = []
    main = row_model._main
    monkeypatch.setattr(row_model, "_main", lambda *args: calls.append(1) or main(*args))
    return calls


@pytest.mark.parametrize("bad", [-1, -1000000, 1000, 1000000])
def test_token_ids_outside_the_table_raise_before_any_kernel(tiny, row_model, kernel_calls, bad):
    feeds = feeds_with(tiny, ragged())
    feeds["input_ids"][3, 7] = bad
    with pytest.raises(ValueError, match=r"input 'input_ids': token ids must be in \[0, 1000\)"):
        row_model(feeds)
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="token ids must be in"):
        row_model({name: torch.from_numpy(value) for name, value in feeds.items()})
    assert kernel_calls == []


def test_the_module_counts_and_clamps_out_of_range_ids(tiny, row_model):
    """Inputs on the device are checked by the module itself: its count output says which input is out of range,
    and the clamped gather reads no memory outside the table (no crash even for -1000000 / 1000000)."""
    feeds = {name: aligned(value) for name, value in feeds_with(tiny, ragged()).items()}    # bound without copies
    feeds["input_ids"][0, 0], feeds["input_ids"][5, 9] = -1000000, 1000000
    feeds["attention_mask"][2, 3] = 7
    given = {name: value.copy() for name, value in feeds.items()}
    bound = call_inputs.bind_inputs(row_model.inputs, feeds, row_model.device)
    assert np.shares_memory(np.from_dlpack(bound.args[0]), feeds["input_ids"])
    outs = row_model._invoke(bound.args + row_model.mask_tensors())
    counts = outs[row_model.manifest["value_checks"]["output"]]
    assert counts.numpy().tolist() == [2, 1]
    assert np.isfinite(outs[0].numpy()).all()
    for name, value in given.items():                               # the module clamps a copy, never its inputs
        np.testing.assert_array_equal(feeds[name], value)
    bound.on_device = {"input_ids", "attention_mask"}                     # as a CUDA tensor would be
    message = call_inputs.value_error(row_model.manifest["value_checks"]["inputs"], counts, bound)
    assert message.startswith("input 'input_ids': token ids must be in [0, 1000)") and "2 value(s)" in message


@pytest.mark.parametrize("change, error, match", [
    (lambda f: {**f, "input_ids": f["input_ids"][:, :32]}, ValueError, r"'input_ids': expected shape \[65, 64\]"),
    (lambda f: {**f, "attention_mask": f["attention_mask"][None]}, ValueError, r"'attention_mask': expected shape"),
    (lambda f: {**f, "attention_mask": f["attention_mask"].astype(np.float32)}, TypeError, "expected dtype int64"),
    (lambda f: {**f, "attention_mask": f["attention_mask"] * 2}, ValueError, r"must be in \[0, 2\)"),
    (lambda f: {"input_ids": f["input_ids"]}, ValueError, r"missing \['attention_mask'\]"),
])
def test_bad_inputs_raise_before_any_kernel(tiny, row_model, kernel_calls, change, error, match):
    with pytest.raises(error, match=match):
        row_model(change(feeds_with(tiny, ragged())))
    assert kernel_calls == []


def test_bad_torch_inputs_raise_before_any_kernel(tiny, row_model, kernel_calls):
    torch = pytest.importorskip("torch")
    feeds = {name: torch.from_numpy(value) for name, value in feeds_with(tiny, ragged()).items()}
    with pytest.raises(TypeError, match="'attention_mask': expected dtype int64, got int32"):
        row_model({**feeds, "attention_mask": feeds["attention_mask"].int()})
    with pytest.raises(ValueError, match=r"'input_ids': expected shape \[65, 64\], got \[65, 63\]"):
        row_model({**feeds, "input_ids": feeds["input_ids"][:, 1:]})
    out = row_model(feeds)["last_hidden_state"]                      # torch in, torch out
    assert isinstance(out, torch.Tensor) and out.shape == (B, S, 128)
    assert kernel_calls == [1]


@pytest.mark.parametrize("mask, match", [
    (np.ones((32, 32), bool), r"mask: .*\(64, 64\)"),
    ("nosuch", "mask: .*unknown mask name"),
    (np.ones((B, 1, S, S), bool), "compiled for a mask of 1 batch x 1 head groups"),
])
def test_bad_masks_raise_before_any_kernel(tiny, row_model, kernel_calls, mask, match):
    with pytest.raises(ValueError, match=match):
        row_model(feeds_with(tiny, ragged()), mask=mask)
    assert kernel_calls == []


def test_masking_that_is_not_key_padding_takes_the_exact_host_path():
    """A mask input meaning 1 = drop (the inverse of HF's) fails the key padding probes: the runtime evaluates the
    term on every call and builds the format on the host, and the result stays exact."""
    from onnx import numpy_helper
    from test_compile_patterns import B as PB, S as PS, _attention_model

    model = _attention_model("div", "direct", "hf_pad")
    sub = next(n for n in model.graph.node if n.op_type == "Sub")
    sub.input[:] = [sub.input[1], "stof_test_zero"]                 # ext = mask * lowest: 1 drops the key
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "stof_test_zero"))
    art = stof_tvm.compile(model, mask="bigbird", batch=PB, seq_len=PS, target="llvm", dtype="float32")
    assert art.manifest["mask"]["padding"] is None and len(art.manifest["mask"]["model_terms"]) == 1
    compiled = art.load()
    rng = np.random.default_rng(2)
    for dropped in (40, 50):
        feeds = {"x": rng.standard_normal((PB, PS, 128)).astype(np.float32),
                 "attention_mask": np.zeros((PB, PS), np.int64)}
        feeds["attention_mask"][1, dropped:] = 1
        out = compiled(feeds)["y"]
        ref = reference_outputs(model, make_mask("bigbird", PS)[None, None], feeds)["y"]
        assert relative_error(out, ref) < 1e-5
    torch = pytest.importorskip("torch")                        # the term's output comes back as torch here
    out_torch = compiled({name: torch.tensor(value) for name, value in feeds.items()})["y"]
    np.testing.assert_allclose(out_torch.numpy(), out, rtol=1e-6, atol=1e-6)


@given(values=hnp.arrays(st.sampled_from([np.int8, np.int32, np.int64]), hnp.array_shapes(max_dims=3, max_side=5))
       | hnp.arrays(np.float32, hnp.array_shapes(max_dims=2), elements=st.floats(-10, 300, width=32)),
       high=st.integers(1, 200), low=st.sampled_from([0, -3, 5]))
@settings(max_examples=200, deadline=None)
def test_out_of_range_equals_min_max(values, high, low):
    """The host check's one-reduction form (integers as unsigned) agrees with min < low or max >= high."""
    if low >= high:
        high = low + 1
    expected = bool(values.min() < low or values.max() >= high)
    assert call_inputs._out_of_range(values, low, high) == expected


def test_torch_tensors_reach_the_module_as_they_are(tiny, row_model, monkeypatch):
    """Torch tensors on the module's device go to the module itself (TVM's FFI converts them in C and returns
    torch outputs): no Python-side DLPack conversion per call, and the outputs equal the numpy call's."""
    torch = pytest.importorskip("torch")
    feeds = feeds_with(tiny, ragged())
    expected = row_model(feeds)["last_hidden_state"]
    prepared = row_model.prepare({name: torch.tensor(value) for name, value in feeds.items()})
    np.testing.assert_allclose(row_model.run(prepared)[0].numpy(), expected, rtol=1e-6, atol=1e-6)  # TVM tensors
    seen = []
    main = row_model._main
    monkeypatch.setattr(row_model, "_main", lambda *args: seen.append([type(a) for a in args[:2]]) or main(*args))
    monkeypatch.setattr(call_inputs.tvm.runtime, "from_dlpack", None)           # any use would fail
    out = row_model({name: torch.tensor(value) for name, value in feeds.items()})["last_hidden_state"]
    assert seen == [[torch.Tensor, torch.Tensor]]
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_strided_misaligned_and_readonly_inputs_are_bound_right(tiny, row_model):
    """Inputs the kernels cannot take as they are (not contiguous, not 64-byte aligned, read-only numpy) are
    copied, numpy and torch alike, and give the same result as a plain contiguous call."""
    torch = pytest.importorskip("torch")
    feeds = feeds_with(tiny, ragged())
    expected = row_model(feeds)["last_hidden_state"]
    ids = feeds["input_ids"]
    strided = np.asfortranarray(ids)                                       # same values, not C-contiguous
    buffer = np.empty(ids.size + 1, ids.dtype)
    shifted = buffer[1:].reshape(ids.shape)                                # 8 bytes off any 64-byte boundary
    shifted[...] = ids
    readonly = ids.copy()
    readonly.flags.writeable = False
    for given in (strided, shifted, readonly):
        np.testing.assert_array_equal(row_model({**feeds, "input_ids": given})["last_hidden_state"], expected)
    tids = torch.tensor(ids)
    for given in (tids.t().contiguous().t(), torch.from_numpy(shifted)):
        assert not given.is_contiguous() or given.data_ptr() % call_inputs.ALIGNMENT
        out = row_model(input_ids=given, attention_mask=torch.tensor(feeds["attention_mask"]))["last_hidden_state"]
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_numpy_outputs_survive_the_next_call(tiny, row_model):
    """A CPU module's numpy outputs are its own output memory (no copy): the next call must not overwrite them."""
    first_feeds = feeds_with(tiny, ragged(), seed=4)
    first = row_model(first_feeds)["last_hidden_state"]
    kept = first.copy()
    second = row_model(feeds_with(tiny, np.ones((B, S), np.int64), seed=5))["last_hidden_state"]
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, second)
