"""Tensor-core building blocks: ldmatrix, mma.sync m16n8k16, fill and store, as TensorIR intrinsics.

Each intrinsic works on one 16x16 tile per warp. A tile held by a warp is a ``warp``-scope buffer of shape
[32, 8] (thread, element); the maps below say where element (row, col) of the 16x16 tile lives, and they
are the *physical* layout that ``ldmatrix.x4`` produces and ``mma.sync.m16n8k16`` consumes, so the
descriptions and the implementations agree element for element:

- A tile (m, k):   thread 4*(m%8) + (k%8)//2, element 4*(k//8) + 2*(m//8) + k%2
- B tile (n, k):   thread 4*(n%8) + (k%8)//2, element 4*(n//8) + 2*(k//8) + k%2
- C tile (m, n):   thread 4*(m%8) + (n%8)//2, element 4*(n//8) + 2*(m//8) + n%2

The schedule moves a warp cache into this layout with ``sch.transform_layout`` (see ``WARP_MAPS``) and
then tensorizes. B may sit in shared memory as [n, k] (k contiguous: the ``nk`` weight layout of
``torch.nn.Linear``) or as [k, n] (n contiguous: the ONNX ``MatMul`` layout); the second uses
``ldmatrix.trans``. Inputs are float16 or bfloat16 and the accumulator is float32.

Names: ``stof_ldmatrix_a_<dt>``, ``stof_ldmatrix_b_<layout>_<dt>``, ``stof_mma_<dt>``,
``stof_mma_fill_f32``, ``stof_mma_store_f32`` with ``<dt>`` in {f16, bf16} and ``<layout>`` in {nk, kn}.
:func:`intrin_names` returns the set a GEMM needs and registers them with TVM on first use (so does
:func:`register_all`, which the tuning records call before a replay). Not at import: a process that imports the
templates but builds no mma.sync GEMM (llvm, wgmma-only builds) does not parse these 20 PrimFuncs (before
:mod:`stof_tvm.tvmscript_macros` made TVMScript's frame walk cheap inside imports, that parse cost ~20 CPU-s).
The block-wise attention kernel can use the same intrinsics for its Q*K^T (B = K as [n, k]) and P*V
(B = V as [k, n]) products.
"""
from __future__ import annotations

from functools import partial

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

WARP = 32
TILE = 16
PER_THREAD = TILE * TILE // WARP  # 8 elements of a 16x16 tile per thread

DTYPES = {"float16": "f16", "bfloat16": "bf16"}
PTX_TYPE = {"float16": "fp16", "bfloat16": "bf16"}
B_LAYOUTS = ("nk", "kn")
SHARED = "shared.dyn"


def a_map(m, k):
    """Thread and element of A tile entry (m, k)."""
    return 4 * (m % 8) + (k % 8) // 2, 4 * (k // 8) + 2 * (m // 8) + k % 2


def b_map(n, k):
    """Thread and element of B tile entry (n, k)."""
    return 4 * (n % 8) + (k % 8) // 2, 4 * (n // 8) + 2 * (k // 8) + k % 2


def c_map(m, n):
    """Thread and element of accumulator tile entry (m, n)."""
    return 4 * (m % 8) + (n % 8) // 2, 4 * (n // 8) + 2 * (m // 8) + n % 2


# Index maps for sch.transform_layout on warp caches of whole warp tiles: (row, col) of the cached
# buffer -> (row tile, col tile, thread, element).
WARP_MAPS = {
    "a": lambda i, k: (i // TILE, k // TILE, *a_map(i % TILE, k % TILE)),
    "b_nk": lambda n, k: (n // TILE, k // TILE, *b_map(n % TILE, k % TILE)),
    "b_kn": lambda k, n: (k // TILE, n // TILE, *b_map(n % TILE, k % TILE)),
    "c": lambda i, j: (i // TILE, j // TILE, *c_map(i % TILE, j % TILE)),
}


def _c_inverse(thread, elem):
    """Row and column of accumulator element ``elem`` held by ``thread`` (inverse of :func:`c_map`)."""
    return thread // 4 + 8 * (elem % 4 // 2), 2 * (thread % 4) + 8 * (elem // 4) + elem % 2


def _ldmatrix(dtype: str, operand: str):
    """ldmatrix.x4 of one 16x16 tile; operand is 'a', 'b_nk' or 'b_kn'."""
    if operand == "a":
        index = a_map
        transpose = False
    elif operand == "b_nk":
        index = b_map
        transpose = False
    else:
        transpose = True

        def index(k, n):
            return b_map(n, k)

    if operand == "b_nk":
        # matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
        def row_col(tx):
            return 8 * (tx // 16) + tx % 8, 8 * (tx % 16 // 8)
    else:
        # A (m, k): (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15);
        # B as (k, n) with .trans: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
        def row_col(tx):
            return tx % 16, 8 * (tx // 16)

    @T.prim_func(s_tir=True)
    def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
        shared = T.match_buffer(shared_handle, (TILE, TILE), dtype, align=64, offset_factor=TILE, scope=SHARED)
        warp = T.match_buffer(warp_handle, (WARP, PER_THREAD), dtype, align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:WARP, 0:PER_THREAD])
            for r, c in T.grid(TILE, TILE):
                with T.sblock("load"):
                    vr, vc = T.axis.remap("SS", [r, c])
                    thread, elem = T.meta_var(index(vr, vc))
                    T.reads(shared[vr, vc])
                    T.writes(warp[thread, elem])
                    warp[thread, elem] = shared[vr, vc]

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (TILE, TILE), dtype, align=64, offset_factor=TILE, scope=SHARED,
                                strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (WARP, PER_THREAD), dtype, align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:WARP, 0:PER_THREAD])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                row, col = T.meta_var(row_col(tx))
                T.evaluate(T.ptx_legacy.ldmatrix(transpose, 4, ".b16", warp.data, warp.elem_offset + PER_THREAD * tx,
                                                 shared.access_ptr("r"), s0 * row + col, dtype=dtype))

    return desc, impl


def _mma(dtype: str):
    """C[16,16] += A[16,16] * B[16,16]^T (two mma.sync.m16n8k16, float32 accumulator).

    The warp layout of B is the same for both weight layouts, so one description serves both."""
    ptx = PTX_TYPE[dtype]

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, PER_THREAD), dtype, align=64, offset_factor=TILE, scope="warp")
        B = T.match_buffer(b, (WARP, PER_THREAD), dtype, align=64, offset_factor=TILE, scope="warp")
        C = T.match_buffer(c, (WARP, PER_THREAD), "float32", align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:PER_THREAD], A[0:WARP, 0:PER_THREAD], B[0:WARP, 0:PER_THREAD])
            T.writes(C[0:WARP, 0:PER_THREAD])
            for i, j, k in T.grid(TILE, TILE, TILE):
                with T.sblock("mma"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    tc, ec = T.meta_var(c_map(vi, vj))
                    ta, ea = T.meta_var(a_map(vi, vk))
                    tb, eb = T.meta_var(b_map(vj, vk))
                    T.reads(C[tc, ec], A[ta, ea], B[tb, eb])
                    T.writes(C[tc, ec])
                    C[tc, ec] = C[tc, ec] + T.Cast("float32", A[ta, ea]) * T.Cast("float32", B[tb, eb])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, PER_THREAD), dtype, align=64, offset_factor=TILE, scope="warp")
        B = T.match_buffer(b, (WARP, PER_THREAD), dtype, align=64, offset_factor=TILE, scope="warp")
        C = T.match_buffer(c, (WARP, PER_THREAD), "float32", align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:PER_THREAD], A[0:WARP, 0:PER_THREAD], B[0:WARP, 0:PER_THREAD])
            T.writes(C[0:WARP, 0:PER_THREAD])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for half in range(2):  # columns 0-7, then 8-15 of the tile
                    T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", ptx, ptx, "fp32",
                                                A.data, A.elem_offset + tx * PER_THREAD,
                                                B.data, B.elem_offset + tx * PER_THREAD + 4 * half,
                                                C.data, C.elem_offset + tx * PER_THREAD + 4 * half,
                                                False, dtype="float32"))

    return desc, impl


def _fill():
    """Zero a float32 accumulator tile."""

    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (WARP, PER_THREAD), "float32", scope="warp")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:PER_THREAD])
            for i, j in T.grid(TILE, TILE):
                with T.sblock("fill"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    tc, ec = T.meta_var(c_map(vi, vj))
                    T.reads()
                    T.writes(C[tc, ec])
                    C[tc, ec] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        C = T.match_buffer(c, (WARP, PER_THREAD), "float32", scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:PER_THREAD])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.cuda.mma_fill_legacy(PER_THREAD, C.data, C.elem_offset, dtype="float32"))

    return desc, impl


def _store():
    """Write a float32 accumulator tile to a shared-memory staging tile (pairs of adjacent columns)."""

    @T.prim_func(s_tir=True)
    def desc(c_warp: T.handle, c_shared: T.handle) -> None:
        W = T.match_buffer(c_warp, (WARP, PER_THREAD), "float32", scope="warp")
        S = T.match_buffer(c_shared, (TILE, TILE), "float32", scope=SHARED)
        with T.sblock("root"):
            T.reads(W[0:WARP, 0:PER_THREAD])
            T.writes(S[0:TILE, 0:TILE])
            for i, j in T.grid(TILE, TILE):
                with T.sblock("store"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    tc, ec = T.meta_var(c_map(vi, vj))
                    T.reads(W[tc, ec])
                    T.writes(S[vi, vj])
                    S[vi, vj] = W[tc, ec]

    @T.prim_func(s_tir=True)
    def impl(c_warp: T.handle, c_shared: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        W = T.match_buffer(c_warp, (WARP, PER_THREAD), "float32", scope="warp", offset_factor=1)
        S = T.match_buffer(c_shared, (TILE, TILE), "float32", scope=SHARED, offset_factor=1, strides=[s0, s1])
        with T.sblock("root"):
            T.reads(W[0:WARP, 0:PER_THREAD])
            T.writes(S[0:TILE, 0:TILE])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for e in T.serial(PER_THREAD):
                    row, col = T.meta_var(_c_inverse(tx, e))
                    S[row, col] = W[tx, e]

    return desc, impl


def _register(name: str, build) -> None:
    """Register intrinsic ``name`` from ``build()``'s (desc, impl), built only if it is not registered yet."""
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *build())


def intrin_names(dtype: str, b_layout: str) -> dict[str, str]:
    """The intrinsic names a GEMM with this input dtype and weight layout tensorizes with."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"b_layout must be one of {B_LAYOUTS}, got {b_layout!r}")
    register_all()
    dt = DTYPES[dtype]
    return {
        "load_a": f"stof_ldmatrix_a_{dt}",
        "load_b": f"stof_ldmatrix_b_{b_layout}_{dt}",
        "compute": f"stof_mma_{dt}",
        "init": "stof_mma_fill_f32",
        "store": "stof_mma_store_f32",
    }


def register_all() -> None:
    """Register every intrinsic of this module with TVM (safe to call more than once: built once)."""
    for dtype, dt in DTYPES.items():
        _register(f"stof_ldmatrix_a_{dt}", partial(_ldmatrix, dtype, "a"))
        for layout in B_LAYOUTS:
            _register(f"stof_ldmatrix_b_{layout}_{dt}", partial(_ldmatrix, dtype, f"b_{layout}"))
        _register(f"stof_mma_{dt}", partial(_mma, dtype))
    _register("stof_mma_fill_f32", _fill)
    _register("stof_mma_store_f32", _store)
