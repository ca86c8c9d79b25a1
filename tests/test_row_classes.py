"""Property tests of the dense / sparse query-row classes (sparse_formats/row_classes.py) and of the CPU breakdown
of issue 16's sparse masks (scripts/sparse_breakdown.py)."""
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stof_tvm import normalize_mask
from stof_tvm.sparse_formats.row_classes import (dense_key_columns, dense_query_rows, pack_dense_rows, pair_classes,
                                                 split_dense_rows)


@st.composite
def masks_with_dense_rows(draw):
    """Random [Bm, Hm, Sq, Sk] masks, some query rows set dense and some key columns set dense, per group."""
    bm_, hm_ = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    seq_q, seq_k = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    mask = rng.random((bm_, hm_, seq_q, seq_k)) < draw(st.sampled_from([0.0, 0.1, 0.5, 0.95]))
    rows = rng.random((bm_, hm_, seq_q)) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    cols = rng.random((bm_, hm_, seq_k)) < draw(st.sampled_from([0.0, 0.1]))
    mask |= rows[..., None] | cols[..., None, :]
    return mask


@settings(max_examples=120, deadline=None)
@given(masks_with_dense_rows())
def test_dense_rows_and_columns_are_the_all_true_ones(mask):
    rows, cols = dense_query_rows(mask), dense_key_columns(mask)
    for g in np.ndindex(*mask.shape[:2]):
        for i in range(mask.shape[2]):
            assert rows[g][i] == all(mask[g][i])
        for j in range(mask.shape[3]):
            assert cols[g][j] == all(mask[g][:, j])


@settings(max_examples=120, deadline=None)
@given(masks_with_dense_rows())
def test_split_is_an_exact_partition_by_rows(mask):
    dense, sparse = split_dense_rows(mask)
    np.testing.assert_array_equal(dense | sparse, mask)
    assert not (dense.any(axis=3) & sparse.any(axis=3)).any()          # no row holds pairs of both
    held = dense.any(axis=3)
    assert dense.all(axis=3)[held].all()                               # a dense row keeps every key
    assert not dense_query_rows(sparse).any() or mask.shape[3] == 0


@settings(max_examples=120, deadline=None)
@given(masks_with_dense_rows())
def test_packed_rows_scatter_back_to_the_dense_part(mask):
    row_ids, packed = pack_dense_rows(mask)
    dense, _ = split_dense_rows(mask)
    assert row_ids.dtype == np.int32 and row_ids.shape[:2] == mask.shape[:2] and row_ids.shape[2] >= 1
    assert packed.shape == row_ids.shape + (mask.shape[3],)
    rebuilt = np.zeros_like(mask)
    for g in np.ndindex(*mask.shape[:2]):
        ids = row_ids[g]
        real = ids[ids >= 0]
        assert list(real) == sorted(set(real)) and (ids[len(real):] == -1).all()   # ascending, pads last
        assert not packed[g][ids < 0].any()                                            # pads keep nothing
        rebuilt[g][real] = packed[g][ids >= 0]
    np.testing.assert_array_equal(rebuilt, dense)


@settings(max_examples=80, deadline=None)
@given(masks_with_dense_rows())
def test_pair_classes_count_every_kept_pair_once(mask):
    counts = pair_classes(mask)
    rows, cols = dense_query_rows(mask), dense_key_columns(mask)
    want_rows = sum(int(mask[g][rows[g]].sum()) for g in np.ndindex(*mask.shape[:2]))
    want_cols = sum(int(mask[g][~rows[g]][:, cols[g]].sum()) for g in np.ndindex(*mask.shape[:2]))
    assert counts["dense_rows"] == want_rows and counts["dense_columns"] == want_cols
    assert counts["total"] == int(mask.sum()) == want_rows + want_cols + counts["other"]
    assert counts["other"] >= 0


def test_longformer_and_bigbird_global_queries_are_the_dense_rows():
    seq = 512
    longformer = normalize_mask("longformer", batch=1, heads=1, seq_q=seq)
    bigbird = normalize_mask("bigbird", batch=1, heads=1, seq_q=seq)
    globals_ = np.zeros(seq, bool)
    globals_[:32] = globals_[seq // 2:seq // 2 + 32] = True
    np.testing.assert_array_equal(dense_query_rows(longformer)[0, 0], globals_)
    np.testing.assert_array_equal(dense_key_columns(longformer)[0, 0], globals_)
    assert dense_query_rows(bigbird)[0, 0].sum() == 32 and dense_query_rows(bigbird)[0, 0][:32].all()
    assert not dense_query_rows(normalize_mask("sliding", batch=1, heads=1, seq_q=seq)).any()


def test_a_mask_without_dense_rows_packs_one_empty_slot():
    mask = np.zeros((1, 2, 5, 7), bool)
    mask[0, 1, 2, :3] = True
    row_ids, packed = pack_dense_rows(mask)
    assert row_ids.shape == (1, 2, 1) and (row_ids == -1).all() and not packed.any()


def test_wrong_inputs_are_refused():
    with pytest.raises(TypeError):
        dense_query_rows(np.ones((4, 4), bool))
    with pytest.raises(TypeError):
        pack_dense_rows(np.ones((1, 1, 4, 4), np.float32))


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_breakdown_counts_match_the_tiled_format_and_the_fit_is_close():
    import sparse_breakdown as sb

    rows = [sb.breakdown(name) for name in sb.MASKS]
    t0, per_tile = sb.fit_block(rows)
    for r in rows:
        tiles = r["tiles_32x32"]
        assert tiles["all"]["full"] + tiles["all"]["partial"] == \
            sum(tiles[k]["full"] + tiles[k]["partial"] for k in ("dense_rows", "sparse_rows"))
        fit = t0 + per_tile * (tiles["all"]["full"] + tiles["all"]["partial"])
        assert abs(fit - sb.MEASURED_BLOCK[r["mask"]]) < 0.1 * sb.MEASURED_BLOCK[r["mask"]]
    by_name = {r["mask"]: r for r in rows}
    assert by_name["sliding"]["pairs"]["dense_rows"] == 0
    # Longformer: 64 global queries a head keep all 4096 keys; 2 of its 128 32-row tile rows are all dense
    assert by_name["longformer"]["pairs"]["dense_rows"] == 64 * 4096
    assert by_name["longformer"]["tiles_32x32"]["dense_rows"] == {"full": 256, "partial": 0}
    assert by_name["bigbird"]["wgmma_tile_rows"] == 1
