"""TMA tensor-map parameters (schedules/tensor_maps.py): the driver's rules, and a box copied by an emulation of
the copy engine (coordinates, out-of-bounds zero fill, the 128-byte swizzle on shared-memory address bits) landing
exactly where the wgmma kernels read their 128-byte-swizzled panels, for compact operands and views into a packed
QKV projection at multiples of 8 elements, and where the wgmma GEMM reads its A and W tiles (2-D maps)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stof_tvm.schedules.tensor_maps import PANEL_COLS, SWIZZLE_128B, TensorMapParams, matrix_map, panel_map


def test_panel_map_of_a_bhsd_operand():
    params = panel_map(batch_heads=6, rows=300, head_dim=128, box_rows=192, dtype="bfloat16")
    assert params.dims == (128, 300, 6)                  # innermost first: head dim, rows, batch x head
    assert params.strides == (256, 300 * 256)            # bytes of one row, of one head
    assert params.box == (64, 192, 1) and params.element_strides == (1, 1, 1)
    assert params.swizzle == SWIZZLE_128B and params.rank == 3
    assert params.box_bytes == 64 * 192 * 2


@pytest.mark.parametrize("change, error", [
    (dict(strides=(120, 38400)), "multiple of 16"),
    (dict(strides=(128, 0)), "multiple of 16"),
    (dict(box=(64, 257, 1)), "box dimension 1"),
    (dict(box=(128, 128, 1)), "128-byte swizzle"),     # 256 bytes a row: more than one swizzle span
    (dict(box=(4, 128, 1), swizzle=0), "multiple of 16 bytes"),
    (dict(dims=(64, 0, 6)), "dimension 1"),
    (dict(element_strides=(1, 9, 1)), "element stride 1"),
    (dict(dims=(64,) * 6, strides=(128,) * 5, box=(64,) * 6, element_strides=(1,) * 6), "1 to 5"),
    (dict(strides=(128,)), "rank - 1 strides"),
    (dict(dtype="float32"), "dtype"),
    (dict(swizzle=7), "swizzle"),
])
def test_maps_the_driver_would_refuse_are_refused(change, error):
    fields = dict(dtype="float16", dims=(64, 300, 6), strides=(128, 38400), box=(64, 128, 1),
                  element_strides=(1, 1, 1))
    TensorMapParams(**fields).validate()
    with pytest.raises(ValueError, match=error):
        TensorMapParams(**dict(fields, **change)).validate()


def test_panel_map_refuses_what_no_panel_holds():
    with pytest.raises(ValueError, match="multiple of 64"):
        panel_map(6, 300, 96, 128, "float16")
    with pytest.raises(ValueError, match="dtype"):
        panel_map(6, 300, 64, 128, "float32")
    with pytest.raises(ValueError, match="box dimension 1"):
        panel_map(6, 300, 64, 320, "float16")


def tma_box(memory: np.ndarray, base: int, params: TensorMapParams, coords: tuple) -> np.ndarray:
    """Bytes a tiled TMA copy writes to a 1024-aligned shared destination: box element (x, y, z) is read at
    ``base + x * esize + y * stride1 + z * stride2`` bytes from coordinates ``coords + (x, y, z)`` (zero where a
    coordinate reaches its dimension), stored densely (x fastest), then every 16-byte chunk of byte offset ``o``
    moved by the 128-byte swizzle: ``o ^ ((o >> 7) & 7) << 4``."""
    esize = 2
    # a 2-D map is the 3-D one with a single outer slice
    bx, by, bz = (*params.box, 1)[:3]
    dims, strides, coords = (*params.dims, 1)[:3], (*params.strides, 0)[:2], (*coords, 0)[:3]
    out = np.zeros(bx * by * bz * esize, np.uint8)
    for z in range(bz):
        for y in range(by):
            for x in range(bx):
                gx, gy, gz = coords[0] + x, coords[1] + y, coords[2] + z
                offset = ((z * by + y) * bx + x) * esize
                swizzled = offset ^ (((offset >> 7) & 7) << 4)
                if gx < dims[0] and gy < dims[1] and gz < dims[2]:
                    src = base + gx * esize + gy * strides[0] + gz * strides[1]
                    out[swizzled:swizzled + esize] = memory[src:src + esize]
    return out


def kernel_panel_bytes(operand: np.ndarray, bh: int, row0: int, box_rows: int, head_dim: int) -> np.ndarray:
    """The shared bytes the wgmma kernel reads for rows ``row0 ..`` of head ``bh``: 64-column panels of
    ``box_rows`` rows, panel p at ``p * box_rows * 128``, chunk c of row r at ``r * 128 + (c ^ r % 8) * 16``;
    rows past the operand's end are zeros."""
    rows = operand.shape[1]
    out = np.zeros(box_rows * head_dim * 2, np.uint8)
    for p in range(head_dim // PANEL_COLS):
        for r in range(box_rows):
            for c in range(8):
                dst = p * box_rows * 128 + r * 128 + (c ^ r % 8) * 16
                if row0 + r < rows:
                    chunk = operand[bh, row0 + r, p * 64 + c * 8:p * 64 + c * 8 + 8]
                    out[dst:dst + 16] = np.ascontiguousarray(chunk).view(np.uint8)
    return out


@settings(max_examples=12, deadline=None)
@given(heads=st.integers(1, 3), rows=st.integers(1, 200), head_dim=st.sampled_from([64, 128]),
       box_rows=st.sampled_from([64, 128, 192]), which=st.integers(0, 2), tile=st.integers(0, 3), data=st.data())
def test_a_box_lands_where_the_kernel_reads_its_panels(heads, rows, head_dim, box_rows, which, tile, data):
    """Q, K or V (``which``) as a view into a packed [3, B*H, rows, D] projection that itself starts 8 elements
    into its allocation; box ``tile`` of a head (rows past the end zero-filled) matches the kernel's layout."""
    rng = np.random.default_rng(rows * 7 + head_dim)
    packed = rng.integers(0, 1 << 16, size=8 + 3 * heads * rows * head_dim, dtype=np.uint16)
    memory = packed.view(np.uint8)
    view_offset = 8 + which * heads * rows * head_dim          # elements: a multiple of 8, so 16-byte aligned
    operand = packed[view_offset:view_offset + heads * rows * head_dim].reshape(heads, rows, head_dim)
    params = panel_map(heads, rows, head_dim, box_rows, "float16")
    assert (view_offset * 2) % 16 == 0 and all(s % 16 == 0 for s in params.strides)
    bh = data.draw(st.integers(0, heads - 1))
    row0 = tile * box_rows
    got = np.concatenate([tma_box(memory, view_offset * 2, params, (p * PANEL_COLS, row0, bh))
                          for p in range(head_dim // PANEL_COLS)])
    assert np.array_equal(got, kernel_panel_bytes(operand, bh, row0, box_rows, head_dim))


def test_matrix_map_of_a_row_major_operand():
    params = matrix_map(rows=32768, cols=3072, box_rows=256, dtype="float16")
    assert params.dims == (3072, 32768) and params.strides == (3072 * 2,)      # innermost first: k, then rows
    assert params.box == (64, 256) and params.element_strides == (1, 1) and params.rank == 2
    assert params.swizzle == SWIZZLE_128B and params.box_bytes == 256 * 128   # one 128-byte row per tile row
    with pytest.raises(ValueError, match="multiple of 64"):
        matrix_map(256, 100, 128, "float16")
    with pytest.raises(ValueError, match="box dimension 1"):
        matrix_map(512, 768, 320, "float16")
    with pytest.raises(ValueError, match="dtype"):
        matrix_map(512, 768, 128, "float32")


def gemm_tile_bytes(matrix: np.ndarray, row0: int, col0: int, tile_rows: int) -> np.ndarray:
    """The shared bytes the wgmma GEMM's cp.async producer writes for rows ``row0 ..`` and the 64 columns from
    ``col0`` (schedules/templates/wgmma_kernel.py, ``swizzled``): chunk c of row r at ``r * 128 + (c ^ r % 8) * 16``."""
    out = np.zeros(tile_rows * 128, np.uint8)
    for r in range(tile_rows):
        for c in range(8):
            chunk = matrix[row0 + r, col0 + c * 8:col0 + c * 8 + 8]
            out[r * 128 + (c ^ r % 8) * 16:r * 128 + (c ^ r % 8) * 16 + 16] = chunk.view(np.uint8)
    return out


@settings(max_examples=10, deadline=None)
@given(tiles=st.integers(1, 3), k_steps=st.integers(1, 4), tile_rows=st.sampled_from([64, 128, 192, 256]),
       data=st.data())
def test_a_matrix_box_lands_where_the_gemm_reads_its_tile(tiles, k_steps, tile_rows, data):
    """Box (k step t, tile i) of A [rows, k] or W [n, k] through :func:`matrix_map` is byte for byte the tile the
    cp.async producer writes, so the TMA kernel's wgmma descriptors read the same operands."""
    rows, cols = tiles * tile_rows, k_steps * 64
    matrix = np.random.default_rng(rows + cols).integers(0, 1 << 16, size=(rows, cols), dtype=np.uint16)
    params = matrix_map(rows, cols, tile_rows, "bfloat16")
    i, t = data.draw(st.integers(0, tiles - 1)), data.draw(st.integers(0, k_steps - 1))
    got = tma_box(matrix.view(np.uint8).reshape(-1), 0, params, (t * 64, i * tile_rows))
    assert np.array_equal(got, gemm_tile_bytes(matrix, i * tile_rows, t * 64, tile_rows))
