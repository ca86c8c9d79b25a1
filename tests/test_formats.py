"""Property tests of the tiled (BSR + bitmap) and row-compressed formats, and of the mask statistics."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stof_tvm import make_mask, normalize_mask
from stof_tvm.sparse_formats import build_rows, build_tiled, mask_stats, stof_rule
from stof_tvm.sparse_formats.bitmaps import subtile_words, words_to_mask

tile_sides = st.sampled_from([8, 16, 24, 32, 64, 128])


@st.composite
def random_masks(draw):
    """Random [Bm, Hm, Sq, Sk] masks of random density; S often not a multiple of any tile side."""
    bm_, hm_ = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    seq_q, seq_k = draw(st.integers(1, 150)), draw(st.integers(1, 150))
    density = draw(st.sampled_from([0.0, 0.01, 0.2, 0.5, 0.9, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    mask = np.random.default_rng(seed).random((bm_, hm_, seq_q, seq_k)) < density
    if draw(st.booleans()):                       # padding: keys past each batch's length are masked
        lengths = draw(st.lists(st.integers(0, seq_k), min_size=bm_, max_size=bm_))
        mask &= np.arange(seq_k)[None, None, None, :] < np.array(lengths)[:, None, None, None]
    return mask


@settings(max_examples=150, deadline=None)
@given(random_masks(), tile_sides, tile_sides)
def test_tiled_round_trips_and_classifies_every_tile(mask, block_m, block_n):
    fmt = build_tiled(mask, block_m, block_n)
    np.testing.assert_array_equal(fmt.to_dense(), mask)
    tr, tc = fmt.n_tile_rows, fmt.n_tile_cols
    padded = np.zeros(mask.shape[:2] + (tr * block_m, tc * block_n), dtype=bool)
    padded[..., :mask.shape[2], :mask.shape[3]] = mask
    tiles = padded.reshape(fmt.groups * tr, block_m, tc, block_n)
    kept = tiles.sum(axis=(1, 3))
    for indptr, indices, want in ((fmt.full_indptr, fmt.full_indices, kept == block_m * block_n),
                                  (fmt.part_indptr, fmt.part_indices, (kept > 0) & (kept < block_m * block_n))):
        assert indptr.dtype == np.int32 and indices.dtype == np.int32 and indptr[0] == 0
        got = np.zeros_like(want)
        for row in range(fmt.groups * tr):
            cols = indices[indptr[row]:indptr[row + 1]]
            assert np.all(np.diff(cols) > 0)      # ascending, no duplicates
            got[row, cols] = True
        np.testing.assert_array_equal(got, want)
    assert fmt.part_bitmaps.dtype == np.uint64
    assert fmt.part_bitmaps.shape == (len(fmt.part_indices), block_m // 8, block_n // 8)


@settings(max_examples=150, deadline=None)
@given(random_masks())
def test_rows_round_trip_with_sorted_indices(mask):
    fmt = build_rows(mask)
    np.testing.assert_array_equal(fmt.to_dense(), mask)
    assert fmt.indptr.shape == (mask.shape[0] * mask.shape[1] * mask.shape[2] + 1,)
    assert fmt.nnz == mask.sum()
    for row in range(len(fmt.indptr) - 1):
        assert np.all(np.diff(fmt.indices[fmt.indptr[row]:fmt.indptr[row + 1]]) > 0)


@settings(max_examples=100, deadline=None)
@given(random_masks())
def test_subtile_words_round_trip(mask):
    words = subtile_words(mask)
    assert words.shape == mask.shape[:2] + (-(-mask.shape[2] // 8), -(-mask.shape[3] // 8))
    np.testing.assert_array_equal(words_to_mask(words, *mask.shape[2:]), mask)


def test_bitmap_bit_layout_is_row_major_within_subtile():
    mask = np.zeros((1, 1, 16, 16), dtype=bool)
    mask[0, 0, 8 + 2, 3] = True                   # sub-tile (1, 0), row 2, column 3 -> bit 19
    fmt = build_tiled(mask, 16, 16)
    assert fmt.part_bitmaps[0, 1, 0] == np.uint64(1 << 19) and fmt.part_bitmaps[0, 0, 0] == 0


def test_edge_tiles_are_never_full():
    fmt = build_tiled(normalize_mask("dense", seq_q=100), 64, 64)
    assert list(fmt.full_indices) == [0] and len(fmt.part_indices) == 3


def test_shared_mask_is_stored_once():
    mask = normalize_mask(make_mask("bigbird", 256, batch=16, heads=12), batch=16, heads=12, seq_q=256)
    fmt = build_tiled(mask, 64, 64)
    assert (fmt.mask_batch, fmt.mask_heads) == (1, 1) and fmt.full_indptr.shape == (4 + 1,)


def test_group_rule():
    fmt = build_tiled(np.ones((3, 1, 8, 8), dtype=bool), 8, 8)
    assert [fmt.group(b, h) for b in range(3) for h in range(2)] == [0, 0, 1, 1, 2, 2]
    fmt = build_tiled(np.ones((1, 4, 8, 8), dtype=bool), 8, 8)
    assert [fmt.group(b, h) for b in range(2) for h in range(4)] == [0, 1, 2, 3] * 2


@pytest.mark.parametrize("block_m, block_n, error", [(12, 8, ValueError), (8, 0, ValueError),
                                                    (8.0, 8, TypeError)])
def test_bad_tile_shapes(block_m, block_n, error):
    with pytest.raises(error, match="block_"):
        build_tiled(np.ones((1, 1, 16, 16), dtype=bool), block_m, block_n)


def test_builders_reject_unnormalised_masks():
    with pytest.raises(TypeError, match="normalize_mask"):
        build_tiled(np.ones((16, 16), dtype=bool), 8, 8)
    with pytest.raises(TypeError, match="normalize_mask"):
        build_rows(np.ones((1, 1, 16, 16), dtype=np.uint8))


def test_stats_of_causal_mask():
    stats = mask_stats(normalize_mask("causal", seq_q=64), tile_shapes=[(16, 16), (32, 32)])
    assert stats.kept == 64 * 65 // 2 and stats.density == pytest.approx(65 / 128)
    assert (stats.keys_min, stats.keys_max, stats.empty_rows) == (1, 64, 0)
    t16 = stats.tiles[(16, 16)]
    assert (t16.full, t16.partial, t16.empty) == (6, 4, 6)
    assert t16.nonempty_ratio == pytest.approx(10 / 16) and t16.partial_share == pytest.approx(0.4)


def test_stof_rule_threshold():
    # S=4096: tau = 1/8^2 = 1/64 = 1.56%. A window of 16 keeps 2 of 256 16x16 blocks per block row (0.78%) ->
    # row-wise; a window of 64 keeps 5 (1.95%) -> block-wise; causal -> block-wise.
    assert stof_rule(mask_stats(normalize_mask("causal", seq_q=4096), [(16, 16)])) == "block"
    assert stof_rule(mask_stats(normalize_mask("sliding:window=16", seq_q=4096), [(16, 16)])) == "row"
    assert stof_rule(mask_stats(normalize_mask("sliding", seq_q=4096), [(16, 16)])) == "block"
    with pytest.raises(ValueError, match="16x16"):
        stof_rule(mask_stats(normalize_mask("causal", seq_q=64), [(32, 32)]))
