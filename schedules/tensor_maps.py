"""TMA tensor maps (``CUtensorMap``) of the Hopper kernels: their parameters, checked against the CUDA driver's
rules before a kernel is built, and the host call that encodes one from the real device pointer at run time.

A kernel reads a compact ``[B, H, rows, D]`` operand (Q, K or V, possibly a view into the QKV projection at any
multiple of 8 elements) as 64-column *panels*: one TMA box is ``box_rows`` rows x 64 head-dim columns (128 bytes a
row) of one (batch, head), placed in shared memory in the 128-byte swizzle of the wgmma descriptors (chunk ``c`` of
row ``r`` at ``r * 128 + (c ^ r % 8) * 16`` in a 1024-aligned panel). The map is three-dimensional, innermost
first: (head dim, rows, batch x head), so rows past ``rows`` (keys past Sk, queries past Sq) are zero-filled by the
copy engine instead of reading the next head. A head dim of 128 is two boxes, at columns 0 and 64. Head dims that
are not multiples of 64 take narrower panels in the swizzle of their row (``panel_cols``: 32 columns in the 64-byte
swizzle for head dims 32 and 96, 16 columns in the 32-byte swizzle for 80; chunk ``c`` of row ``r`` then at
``r * row_bytes + (c ^ (r * row_bytes >> 7) % chunks_per_row) * 16``).

The wgmma GEMMs read a row-major ``[rows, k]`` operand (the activations A and the ``torch.nn.Linear`` weight W)
as K-major tiles of ``box_rows`` rows x 64 columns in the same swizzle: :func:`matrix_map` is its two-dimensional
map (k, rows), one box per ``block_k = 64`` step of a tile.

TVM 0.27 does the rest: ``T.tvm_stack_alloca("tensormap", 1)`` is a 64-byte-aligned 128-byte ``CUtensorMap`` on
the host stack, ``T.tensormap_encode_tiled`` calls the runtime's ``runtime.cuTensorMapEncodeTiled`` (in
``libtvm_runtime_cuda.so``, so a runtime-only install encodes too), and a map used in device code becomes a
``const __grid_constant__ CUtensorMap`` kernel parameter (``arg_extra_tags`` kTensorMap in the module's function
table: the launcher passes the 128 bytes by value)."""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

__all__ = ["TensorMapParams", "panel_map", "matrix_map", "encode_tensor_map", "PANEL_COLS", "PANEL_SWIZZLE",
           "SWIZZLE_128B"]

PANEL_COLS = 64                  # head-dim columns of one 128-byte row
ELEMENT_BYTES = {"float16": 2, "bfloat16": 2}
# CUDA driver enums (cuda.h): CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapInterleave, OOB fill
SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}   # CU_TENSOR_MAP_SWIZZLE_{NONE, 32B, 64B, 128B}
SWIZZLE_128B = 3
# the swizzle whose span is a panel's row, by panel columns (16-bit elements): 128, 64 or 32 bytes
PANEL_SWIZZLE = {64: SWIZZLE_128B, 32: 2, 16: 1}
L2_PROMOTION_128B = 2
INTERLEAVE_NONE = 0
OOB_FILL_ZERO = 0                # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zeros
MAX_BOX = 256


@dataclass(frozen=True)
class TensorMapParams:
    """The arguments of ``cuTensorMapEncodeTiled`` besides the pointer, innermost dimension first: ``dims``
    (elements), ``strides`` (bytes, of every dimension but the innermost), ``box`` (elements per copy),
    ``element_strides``, the swizzle and L2 promotion enums."""

    dtype: str
    dims: tuple
    strides: tuple
    box: tuple
    element_strides: tuple
    swizzle: int = SWIZZLE_128B
    l2_promotion: int = L2_PROMOTION_128B

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def box_bytes(self) -> int:
        """Bytes one copy writes to shared memory (and counts on its mbarrier, out-of-bounds rows included)."""
        total = ELEMENT_BYTES[self.dtype]
        for extent in self.box:
            total *= extent
        return total

    def validate(self) -> None:
        """The driver's rules (cuTensorMapEncodeTiled), so a kernel that could not encode its map is refused
        when it is built rather than when it is first called."""
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"tensor map dtype must be one of {tuple(ELEMENT_BYTES)}, got {self.dtype!r}")
        if not 1 <= self.rank <= 5:
            raise ValueError(f"a tensor map has 1 to 5 dimensions, got {self.rank}")
        if not (len(self.strides) == self.rank - 1 and len(self.box) == len(self.element_strides) == self.rank):
            raise ValueError(f"{self}: needs rank - 1 strides and rank box dims and element strides")
        for i, dim in enumerate(self.dims):
            if not 1 <= dim <= 1 << 32:
                raise ValueError(f"tensor map dimension {i} must be in 1 .. 2^32, got {dim}")
        for i, stride in enumerate(self.strides):
            if stride % 16 or not 0 < stride < 1 << 40:
                raise ValueError(f"tensor map stride {i + 1} must be a positive multiple of 16 bytes below 2^40, "
                                 f"got {stride}")
        for i, (box, step) in enumerate(zip(self.box, self.element_strides)):
            if not 1 <= box <= MAX_BOX:
                raise ValueError(f"tensor map box dimension {i} must be in 1 .. {MAX_BOX}, got {box}")
            if not 1 <= step <= 8:
                raise ValueError(f"tensor map element stride {i} must be in 1 .. 8, got {step}")
        inner = self.box[0] * ELEMENT_BYTES[self.dtype]
        if inner % 16:
            raise ValueError(f"a tensor map box's inner dimension must be a multiple of 16 bytes, got {inner}")
        if self.swizzle not in SWIZZLE_BYTES:
            raise ValueError(f"unknown swizzle {self.swizzle!r}")
        if self.swizzle and inner > SWIZZLE_BYTES[self.swizzle]:
            raise ValueError(f"a {SWIZZLE_BYTES[self.swizzle]}-byte swizzle takes boxes of at most that many bytes "
                             f"a row, got {inner}")


def panel_map(batch_heads: int, rows: int, head_dim: int, box_rows: int, dtype: str,
              panel_cols: int = PANEL_COLS, padded: bool = False) -> TensorMapParams:
    """The map of a compact ``[B, H, rows, head_dim]`` operand (``batch_heads = B * H``) copied as boxes of
    ``box_rows`` rows x ``panel_cols`` columns into swizzled panels: 64 columns (128-byte rows, the 128-byte
    swizzle), 32 (64-byte rows, 64-byte swizzle: head dims 32 and 96) or 16 (32-byte rows, 32-byte swizzle: head
    dim 80), the swizzle span being the row, as the wgmma descriptors of that layout read it. ``padded``: the head
    dim need not fill whole panels; the last box reaches past the row and the copy engine writes zeros for the
    columns past ``head_dim`` (the wgmma attention kernel's ``pad_panels``). Checked
    (:meth:`TensorMapParams.validate`)."""
    if panel_cols not in PANEL_SWIZZLE:
        raise ValueError(f"panel_cols must be one of {tuple(PANEL_SWIZZLE)}, got {panel_cols!r}")
    if head_dim % panel_cols and not padded:
        raise ValueError(f"head_dim must be a multiple of {panel_cols} for {panel_cols * 2}-byte panels, "
                         f"got {head_dim}")
    size = ELEMENT_BYTES.get(dtype)
    if size is None:
        raise ValueError(f"tensor map dtype must be one of {tuple(ELEMENT_BYTES)}, got {dtype!r}")
    params = TensorMapParams(dtype=dtype, dims=(head_dim, rows, batch_heads),
                             strides=(head_dim * size, rows * head_dim * size), box=(panel_cols, box_rows, 1),
                             element_strides=(1, 1, 1), swizzle=PANEL_SWIZZLE[panel_cols])
    params.validate()
    return params


def matrix_map(rows: int, cols: int, box_rows: int, dtype: str) -> TensorMapParams:
    """The map of a compact row-major ``[rows, cols]`` matrix copied as boxes of ``box_rows`` rows x 64 columns
    (one 128-byte row each) into a 128-byte-swizzled tile: dims (cols, rows), the row stride ``cols`` elements.
    Checked (:meth:`TensorMapParams.validate`); ``cols`` must be a multiple of 64 (whole boxes)."""
    if cols % PANEL_COLS:
        raise ValueError(f"cols must be a multiple of {PANEL_COLS} for 128-byte tile rows, got {cols}")
    size = ELEMENT_BYTES.get(dtype)
    if size is None:
        raise ValueError(f"tensor map dtype must be one of {tuple(ELEMENT_BYTES)}, got {dtype!r}")
    params = TensorMapParams(dtype=dtype, dims=(cols, rows), strides=(cols * size,), box=(PANEL_COLS, box_rows),
                             element_strides=(1, 1))
    params.validate()
    return params


def encode_tensor_map(tensor_map, base, params: TensorMapParams):
    """The host-side call encoding ``params`` with global address ``base`` (the operand's first element, its view
    offset included) into ``tensor_map`` (a ``T.tvm_stack_alloca("tensormap", 1)``)."""
    return T.tensormap_encode_tiled(tensor_map, base, *params.dims, *params.strides, *params.box,
                                    *params.element_strides, descriptor_dtype=params.dtype, rank=params.rank,
                                    interleave=INTERLEAVE_NONE, swizzle=params.swizzle,
                                    l2_promotion=params.l2_promotion, oob_fill=OOB_FILL_ZERO)
