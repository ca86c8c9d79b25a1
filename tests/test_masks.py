"""Named masks against straightforward element-by-element constructions, and every accepted mask form."""
import numpy as np
import pytest

from stof_tvm import make_mask, normalize_mask
from stof_tvm.sparse_formats import parse_spec, padding_mask


def by_rule(seq_len, keep):
    return np.array([[keep(i, j) for j in range(seq_len)] for i in range(seq_len)], dtype=bool)


def in_globals(x, seq_len, width, halves=True):
    starts = [0, seq_len // 2] if halves else [0]
    return any(s <= x < s + width for s in starts)


@pytest.mark.parametrize("seq_len", [1, 7, 64, 100, 130])
def test_named_masks_match_element_rules(seq_len):
    rules = {
        "dense": lambda i, j: True,
        "causal": lambda i, j: j <= i,
        "sliding": lambda i, j: abs(i - j) <= 64 and j <= i,
        "local": lambda i, j: abs(i - j) <= 64,
        "longformer": lambda i, j: abs(i - j) <= 32 or in_globals(i, seq_len, 32) or in_globals(j, seq_len, 32),
        "dilated": lambda i, j: j <= i and i - j <= 64 and (i - j) % 2 == 0,
        "sliding:window=5": lambda i, j: 0 <= i - j <= 5,
        "longformer:window=3,globals=2": lambda i, j: (abs(i - j) <= 3 or in_globals(i, seq_len, 2)
                                                       or in_globals(j, seq_len, 2)),
    }
    for spec, rule in rules.items():
        np.testing.assert_array_equal(make_mask(spec, seq_len), by_rule(seq_len, rule), err_msg=spec)


@pytest.mark.parametrize("seq_len", [1, 31, 64, 100, 257])
def test_bigbird_matches_its_definition(seq_len):
    block, n_blocks = 32, -(-seq_len // 32)
    draws = np.random.default_rng(0).random((n_blocks, block, block)) < 0.1

    def keep(i, j):
        if abs(i - j) <= 32 or i < 32 or j < 32:
            return True
        row_block = i // block
        neighbour = row_block + 1 if row_block + 1 < n_blocks else max(n_blocks - 2, 0)
        return j // block == neighbour and bool(draws[row_block, i % block, j % block])

    np.testing.assert_array_equal(make_mask("bigbird", seq_len), by_rule(seq_len, keep))


def test_bigbird_random_part_is_seeded_and_about_ten_percent():
    seq_len = 2048
    band_and_globals = make_mask("bigbird:density=0", seq_len)
    randoms = make_mask("bigbird", seq_len) & ~band_and_globals
    other_seed = make_mask("bigbird:seed=1", seq_len) & ~band_and_globals
    assert not np.array_equal(randoms, other_seed)
    np.testing.assert_array_equal(randoms, make_mask("bigbird:seed=0", seq_len) & ~band_and_globals)
    # each 32-row block draws ~10% of one 32x32 block; the band already covers part of the neighbour block
    share = randoms.sum() / (seq_len * 32)
    assert 0.03 < share < 0.1


def test_blocksparse_expands_tile_bitmap(tmp_path):
    bitmap = np.random.default_rng(3).random((4, 4)) < 0.5
    path = tmp_path / "tiles.npy"
    np.save(path, bitmap)
    mask = make_mask(f"blocksparse:file={path},block=16", 60)
    np.testing.assert_array_equal(mask, by_rule(60, lambda i, j: bool(bitmap[i // 16, j // 16])))


def test_batch_and_heads_give_broadcast_view_without_copy():
    mask = make_mask("causal", 64, batch=3, heads=4)
    assert mask.shape == (3, 4, 64, 64) and mask.strides[:2] == (0, 0)
    assert normalize_mask(mask, batch=3, heads=4, seq_q=64).shape == (1, 1, 64, 64)


def test_normalize_keeps_per_batch_and_per_head_masks():
    rng = np.random.default_rng(0)
    per_head = rng.random((2, 3, 10, 10)) < 0.5
    assert normalize_mask(per_head, batch=2, heads=3, seq_q=10).shape == (2, 3, 10, 10)
    per_batch = rng.random((2, 10, 10)) < 0.5
    out = normalize_mask(per_batch, batch=2, heads=3, seq_q=10)
    assert out.shape == (2, 1, 10, 10)
    np.testing.assert_array_equal(out[:, 0], per_batch)


def test_callable_and_padding_forms():
    out = normalize_mask(lambda b, h, i, j: (j <= i) & (h == 1), batch=2, heads=3, seq_q=9)
    assert out.shape == (1, 3, 9, 9)
    np.testing.assert_array_equal(out[0, 1], make_mask("causal", 9))
    assert not out[0, 0].any()
    padded = normalize_mask(np.array([3, 9]), batch=2, heads=5, seq_q=9)
    assert padded.shape == (2, 1, 9, 9)
    np.testing.assert_array_equal(padded[0, 0], np.broadcast_to(np.arange(9) < 3, (9, 9)))
    np.testing.assert_array_equal(padding_mask([0], 4)[0, 0], np.zeros((4, 4), bool))


@pytest.mark.parametrize("spec, error, words", [
    ("nosuch", ValueError, "unknown mask name"),
    ("sliding:", ValueError, "malformed"),
    ("sliding:window", ValueError, "malformed"),
    ("sliding:window=", ValueError, "malformed"),
    ("sliding:width=3", ValueError, "no parameter 'width'"),
    ("sliding:window=-2", ValueError, ">= 0"),
    ("sliding:window=abc", ValueError, "integer"),
    ("bigbird:density=1.5", ValueError, "[0, 1]"),
    ("blocksparse", ValueError, "tile bitmap"),
    ("causal,window=3", ValueError, "unknown mask name"),
])
def test_bad_specs_raise_clear_errors(spec, error, words):
    with pytest.raises(error, match=None) as info:
        parse_spec(spec)
    assert words in str(info.value)


def test_bad_mask_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="dtype bool"):
        normalize_mask(np.ones((4, 4), dtype=np.float32), seq_q=4)
    for not_a_mask in (None, {"name": "bigbird"}):
        with pytest.raises(TypeError, match=rf"mask: {type(not_a_mask).__name__} is not a mask; give a spec"):
            normalize_mask(not_a_mask, seq_q=4)
    with pytest.raises(ValueError, match=r"last two dimensions must be \(4, 4\)"):
        normalize_mask(np.ones((5, 5), dtype=bool), seq_q=4)
    with pytest.raises(ValueError, match="rank"):
        normalize_mask(np.ones((1, 1, 1, 4, 4), dtype=bool), seq_q=4)
    with pytest.raises(ValueError, match="batch dimension must be 1 or 2"):
        normalize_mask(np.ones((3, 4, 4), dtype=bool), batch=2, seq_q=4)
    with pytest.raises(ValueError, match="one entry per batch"):
        normalize_mask(np.array([1, 2, 3]), batch=2, seq_q=4)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\]"):
        normalize_mask(np.array([1, 7]), batch=2, seq_q=4)
    with pytest.raises(TypeError, match="seq_len must be an integer"):
        make_mask("causal", 4.0)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        make_mask("causal", 0)
    with pytest.raises(TypeError, match="mask spec must be a string"):
        parse_spec(3)
    with pytest.raises(TypeError, match="return booleans"):
        normalize_mask(lambda b, h, i, j: i - j, seq_q=4)
