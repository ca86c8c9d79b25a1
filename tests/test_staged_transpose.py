"""The staged-transpose rule (stof_tvm.schedules.staged_transpose): an injective function that reads one of its own
intermediates transposed computes that intermediate through shared memory, tile by tile.

It takes DeBERTa's relative-position bias as FuseOps builds it (two takes by flat int32 tables, the second one
transposed, their sum reshaped onto [B, H, S, S] float32): the lowered CUDA kernel has a padded ``__shared__`` tile,
reads the second table along its rows, runs on the CPU (tests/cuda_emulation.py) equal to numpy, full and partial
tiles, and nvcc builds it for sm_90 without spills. It takes a transposed elementwise intermediate, and declines
functions without a transposed intermediate (an elementwise sum, a transpose of an input, a reduction), one whose
loads are contiguous in the output's order (BLOOM's keys, transposed twice), and targets other than CUDA. On a tiny
DeBERTa export the pipeline's bias kernel is the rule's, and equals the unscheduled function built for llvm on the
model's own tables."""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

from stof_tvm.compiler.gathers import gathers_injective
from stof_tvm.compiler.pipeline import CUDA_DEFAULTS, make_target
from stof_tvm.schedules.staged_transpose import StagedTranspose

CUDA = make_target(dict(CUDA_DEFAULTS))
FUSION = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), gathers_injective,
          relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()]


def _fused(mod: tvm.IRModule, target) -> tvm.IRModule:
    """``mod`` legalized and fused as :func:`stof_tvm.compiler.pipeline.optimize` does, before any schedule."""
    with target, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(FUSION)(mod)


def relative_bias(batch: int, heads: int, length: int, buckets: int) -> tvm.tirx.PrimFunc:
    """DeBERTa's score bias as the compiler fuses it: ``c2p_flat[n, t1[i, j]] + p2c_flat[n, t2[j, i]]`` (float16
    products cast to float32, the second take transposed), reshaped onto [B, H, S, S]."""
    n, width = batch * heads, 2 * buckets
    c2p, p2c = (relax.Var(name, relax.TensorType([n, length, width], "float16")) for name in ("c2p", "p2c"))
    t1, t2 = (relax.Var(name, relax.TensorType([length, length], "int32")) for name in ("t1", "t2"))
    bb = relax.BlockBuilder()
    with bb.function("main", [c2p, p2c, t1, t2]):
        with bb.dataflow():
            first, second = (relax.op.astype(relax.op.take(relax.op.reshape(x, (n, length * width)), t, axis=1),
                                             "float32") for x, t in ((c2p, t1), (p2c, t2)))
            total = relax.op.add(first, relax.op.permute_dims(second, [0, 2, 1]))
            out = bb.emit_output(relax.op.reshape(total, (batch, heads, length, length)))
        bb.emit_func_output(out)
    funcs = [f for _, f in _fused(bb.get(), CUDA).functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(funcs) == 1
    return funcs[0]


def bucket_tables(length: int, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat int32 tables of DeBERTa-v3's log-bucketed relative positions: ``t1[i, j] = i * 2B + c2p position`` and
    ``t2[j, i] = j * 2B + p2c position``, exact where |i - j| < B / 2, log buckets beyond."""
    mid = buckets // 2
    distance = np.arange(length)[:, None] - np.arange(length)[None, :]
    far = np.abs(distance) > mid
    logs = np.ceil(np.log(np.maximum(np.abs(distance), 1) / mid) / np.log((length - 1) / mid) * (mid - 1)) + mid
    relative = np.where(far, np.sign(distance) * logs, distance).astype(np.int64)
    width = 2 * buckets
    rows = (np.arange(length) * width)[:, None]
    c2p = np.clip(relative + buckets, 0, width - 1) + rows
    p2c = np.clip(-relative + buckets, 0, width - 1) + rows
    return c2p.astype(np.int32), p2c.astype(np.int32)


def _cuda_source(func) -> str:
    sch = StagedTranspose().apply(func, CUDA, False)
    assert sch is not None
    scheduled = sch.mod["main"].with_attr("global_symbol", "main")
    return tvm.compile(tvm.IRModule({"main": scheduled}), target=CUDA).mod.imports[0].inspect_source()


def _emulated(src: str, func, arrays: dict[str, np.ndarray], tmp_path) -> np.ndarray:
    """``src``'s kernel run on the CPU threads with ``arrays`` (by parameter name); the output of ``func``."""
    from cuda_emulation import run_on_cpu

    rule = StagedTranspose()
    out = func.params[-1]
    shape = [int(e) for e in out.shape]
    tiles = -(-shape[-2] // rule.tile) * -(-shape[-1] // rule.tile)
    grid = int(np.prod(shape[:-2])) * tiles
    dtypes = {**{name: str(a.dtype) for name, a in arrays.items()}, out.name: str(out.dtype)}
    return run_on_cpu(src, arrays, {out.name: shape}, grid, (rule.tile, rule.rows), tmp_path, dtype=dtypes)[out.name]


@pytest.mark.parametrize("batch, heads, length, buckets", [(1, 2, 64, 16), (2, 1, 40, 16)])
def test_bias_kernel_stages_the_transposed_take_and_is_exact(batch, heads, length, buckets, tmp_path):
    """64: full 32 x 32 tiles; 40: partial tiles on both axes."""
    func = relative_bias(batch, heads, length, buckets)
    src = _cuda_source(func)
    assert re.search(r"__shared__ alignas\(\d+\) float \w+\[1056\];", src)      # 32 rows of 33 floats
    assert "__syncthreads()" in src
    rng = np.random.default_rng(length)
    n, width = batch * heads, 2 * buckets
    c2p, p2c = (rng.standard_normal((n, length, width)).astype(np.float16) for _ in range(2))
    t1, t2 = bucket_tables(length, buckets)
    got = _emulated(src, func, {"c2p": c2p, "p2c": p2c, "t1": t1, "t2": t2}, tmp_path)
    first = c2p.reshape(n, -1)[:, t1].astype(np.float32)
    second = p2c.reshape(n, -1)[:, t2].astype(np.float32).transpose(0, 2, 1)
    np.testing.assert_array_equal(got, (first + second).reshape(batch, heads, length, length))


def test_bias_kernel_builds_for_sm90_without_spills(tmp_path):
    from hopper_checks import sm90_ptxas_report

    report = sm90_ptxas_report(_cuda_source(relative_bias(2, 12, 512, 256)), tmp_path)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and spills.groups() == ("0", "0"), report
    assert re.search(r"0 bytes stack frame", report), report


@T.prim_func(private=True, s_tir=True)
def elementwise_sum(a: T.Buffer((4, 64, 64), "float32"), b: T.Buffer((4, 64, 64), "float32"),
                    c: T.Buffer((4, 64, 64), "float32")):
    for n, i, j in T.grid(4, 64, 64):
        with T.sblock("sum"):
            vn, vi, vj = T.axis.remap("SSS", [n, i, j])
            c[vn, vi, vj] = a[vn, vi, vj] + b[vn, vi, vj]


@T.prim_func(private=True, s_tir=True)
def input_transposed(a: T.Buffer((4, 64, 64), "float32"), b: T.Buffer((4, 64, 64), "float32"),
                     c: T.Buffer((4, 64, 64), "float32")):
    t = T.sblock_alloc_buffer((4, 64, 64))
    for n, i, j in T.grid(4, 64, 64):
        with T.sblock("transpose"):
            vn, vi, vj = T.axis.remap("SSS", [n, i, j])
            t[vn, vi, vj] = b[vn, vj, vi]
    for n, i, j in T.grid(4, 64, 64):
        with T.sblock("sum"):
            vn, vi, vj = T.axis.remap("SSS", [n, i, j])
            c[vn, vi, vj] = a[vn, vi, vj] + t[vn, vi, vj]


@T.prim_func(private=True, s_tir=True)
def transposed_row_sums(a: T.Buffer((64, 64), "float32"), b: T.Buffer((64,), "float32")):
    t = T.sblock_alloc_buffer((64, 64))
    for i, j in T.grid(64, 64):
        with T.sblock("double"):
            vi, vj = T.axis.remap("SS", [i, j])
            t[vi, vj] = a[vi, vj] * T.float32(2)
    for i, j in T.grid(64, 64):
        with T.sblock("sums"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                b[vi] = T.float32(0)
            b[vi] = b[vi] + t[vj, vi]


@T.prim_func(private=True, s_tir=True)
def transposed_twice(a: T.Buffer((2, 64, 4, 64), "float32"), c: T.Buffer((2, 4, 64, 64), "float16")):
    t = T.sblock_alloc_buffer((2, 4, 64, 64), "float16")
    for n, h, d, s in T.grid(2, 4, 64, 64):
        with T.sblock("keys_transposed"):
            vn, vh, vd, vs = T.axis.remap("SSSS", [n, h, d, s])
            t[vn, vh, vd, vs] = T.Cast("float16", a[vn, vs, vh, vd])
    for n, h, s, d in T.grid(2, 4, 64, 64):
        with T.sblock("keys"):
            vn, vh, vs, vd = T.axis.remap("SSSS", [n, h, s, d])
            c[vn, vh, vs, vd] = t[vn, vh, vd, vs]


@T.prim_func(private=True, s_tir=True)
def transposed_product(a: T.Buffer((4, 64, 64), "float32"), b: T.Buffer((4, 64, 64), "float32"),
                       c: T.Buffer((4, 64, 64), "float32")):
    t = T.sblock_alloc_buffer((4, 64, 64))
    for n, i, j in T.grid(4, 64, 64):
        with T.sblock("double"):
            vn, vi, vj = T.axis.remap("SSS", [n, i, j])
            t[vn, vi, vj] = b[vn, vi, vj] * T.float32(2)
    for n, i, j in T.grid(4, 64, 64):
        with T.sblock("sum"):
            vn, vi, vj = T.axis.remap("SSS", [n, i, j])
            c[vn, vi, vj] = a[vn, vi, vj] + t[vn, vj, vi]


def test_takes_a_transposed_intermediate_read_along_its_rows():
    """``a + transpose(2 b)``: ``2 b`` read along its rows in its own order, a row per thread in the output's."""
    assert StagedTranspose().apply(transposed_product, CUDA, False) is not None


@pytest.mark.parametrize("func", [elementwise_sum, input_transposed, transposed_row_sums, transposed_twice])
def test_declines_where_staging_would_not_help(func):
    """No intermediate read transposed (a sum; a transpose of an input, dlight's), a reduction, or one cheaper in the
    output's order (HF BLOOM's keys: laid [B, H, D, S] from its fused QKV projection [B, S, H, D], then read back
    transposed, so the output reads the projection along its rows)."""
    assert StagedTranspose().apply(func, CUDA, False) is None


def test_declines_off_the_gpu():
    assert StagedTranspose().apply(relative_bias(1, 2, 64, 16), make_target({"kind": "llvm"}), False) is None


def _tiny_deberta(tmp_path) -> tuple[tvm.IRModule, dict]:
    """The tiny DeBERTa of scripts/e2e_models.py exported at 1 x 64, through stof-tvm's front end for CUDA (float16,
    BigBird), its weights lifted as :func:`stof_tvm.compiler.lower` does; returns it and its feeds. The graph's own
    bias kernel is kept (``fuse_relative_bias=False``; by default one fused kernel computes the bias,
    tests/test_relative_bias.py)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import e2e_models

    from stof_tvm.compiler import front_end

    spec = e2e_models.spec("deberta-tiny")
    feeds = e2e_models.inputs(spec, 1, 64, seed=0)
    path = e2e_models.export(e2e_models.build(spec, "eager", seed=0, length=64), feeds, str(tmp_path / "d.onnx"))
    front = front_end(path, mask="bigbird", batch=1, seq_len=64, target="cuda", dtype="float16",
                      fuse_relative_bias=False)
    return relax.transform.LiftTransformParams()(relax.transform.FuseTransposeMatmul()(front.mod)), front


def _bias_call(mod: tvm.IRModule):
    """The first call of ``main`` to a function the rule takes, and that function."""
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", "") == "relax.call_tir" else None)
    for call in calls:
        func = mod[call.args[0]]
        if StagedTranspose().apply(func, CUDA, False) is not None:
            return call, func
    raise AssertionError("no function of the model reads an intermediate transposed")


def test_tiny_deberta_bias_kernel_is_staged_and_equals_llvm(tmp_path):
    """In the CUDA pipeline the bias kernel gets the shared tile; its lowered kernel, run on the CPU on the model's
    own (constant) tables and random products, equals the unscheduled function built for llvm."""
    from stof_tvm.compiler.pipeline import optimize

    mod, front = _tiny_deberta(tmp_path)
    call, func = _bias_call(_fused(mod, CUDA))
    scheduled = optimize(mod, front.target, None)[call.args[0].name_hint]
    assert 'scope="shared"' in scheduled.script()        # the pipeline's bias kernel is the rule's

    rng = np.random.default_rng(3)
    arrays = {}
    for param, arg in zip(func.params[:-1], call.args[1]):
        if isinstance(arg, tvm.ir.expr.Constant):
            arrays[param.name] = arg.value.numpy()
        else:
            arrays[param.name] = rng.standard_normal([int(e) for e in param.shape]).astype(param.dtype)
    assert any(a.dtype == np.int32 for a in arrays.values())        # the flat position tables
    out = func.params[-1]
    reference = tvm.runtime.empty([int(e) for e in out.shape], out.dtype, tvm.cpu())
    built = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    built["main"](*[tvm.runtime.tensor(arrays[p.name]) for p in func.params[:-1]], reference)
    got = _emulated(_cuda_source(func), func, arrays, tmp_path)
    np.testing.assert_array_equal(got, reference.numpy())
