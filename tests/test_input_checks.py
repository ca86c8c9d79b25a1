"""stof_tvm/compiler/input_checks.py: ``main``'s out-of-range counts of its checked inputs, on llvm against numpy.
Inputs of one shape (token ids, the attention mask) are counted by one kernel writing the output (on CUDA a block
per input, its threads reducing together: checked by running the lowered kernel on CPU threads); inputs of several
shapes each by their own reduction, stacked."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

from stof_tvm.compiler.input_checks import COUNT_SYMBOL, ValueCheck, add_value_checks, count_outside_primfunc


def _module(shapes: dict[str, tuple]) -> tvm.IRModule:
    """``main(**inputs) -> input_ids * 2`` with int64 inputs of ``shapes``."""
    bb = relax.BlockBuilder()
    params = [relax.Var(name, relax.TensorType(list(shape), "int64")) for name, shape in shapes.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.op.multiply(params[0], relax.const(2, "int64")))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod: tvm.IRModule) -> list[str]:
    """The names of the kernels TVM's default pipeline fuses ``mod``'s ``main`` into."""
    legal = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(mod))
    fused = relax.transform.FuseTIR()(relax.transform.FuseOps()(legal))
    return [gv.name_hint for gv, func in fused.functions_items() if isinstance(func, tvm.tirx.PrimFunc)]


def _run(mod: tvm.IRModule, feeds: dict) -> list[np.ndarray]:
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    outs = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()])
    return [o.numpy() for o in outs]


CHECKS = [ValueCheck("input_ids", 0, 100), ValueCheck("attention_mask", 0, 2)]


@pytest.mark.parametrize("mask_shape", [(2, 8), (2, 1, 8)])
def test_counts_per_input_match_numpy(mask_shape):
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(-5, 105, (2, 8)), "attention_mask": rng.integers(0, 3, mask_shape)}
    mod, position = add_value_checks(_module({k: v.shape for k, v in feeds.items()}), CHECKS, "llvm")
    assert position == 1
    outs = _run(mod, feeds)
    np.testing.assert_array_equal(outs[0], feeds["input_ids"] * 2)
    want = [int(((v < c.low) | (v >= c.high)).sum()) for c, v in zip(CHECKS, feeds.values())]
    assert outs[1].tolist() == want and sum(want) > 2


def test_inputs_of_one_shape_are_counted_by_one_kernel():
    """[B, S] token ids and mask: one kernel (:func:`count_outside_primfunc`) and no comparison or reduction of its
    own per input; inputs of another shape keep one reduction each."""
    same, _ = add_value_checks(_module({"input_ids": (2, 8), "attention_mask": (2, 8)}), CHECKS)
    kernels = _kernels(same)
    assert COUNT_SYMBOL in kernels and not [name for name in kernels if "less" in name or "sum" in name], kernels
    mixed, _ = add_value_checks(_module({"input_ids": (2, 8), "attention_mask": (2, 1, 8)}), CHECKS)
    assert len([name for name in _kernels(mixed) if "less" in name]) == 2, _kernels(mixed)


@pytest.mark.parametrize("size", [16, 1000, 4096])
def test_count_kernel_runs_a_block_per_input_on_cpu_threads(size, tmp_path):
    """The lowered CUDA kernel: one block per input, up to 1024 threads striding over the values and reducing
    their counts together (a single thread per input took 0.35 ms at 8 x 512 tokens on the H200), against numpy."""
    from cuda_emulation import run_on_cpu

    from stof_tvm.compiler.kernel_grids import kernel_grids

    checks = CHECKS + [ValueCheck("token_type_ids", 0, 2)]
    func = count_outside_primfunc(checks, ["int64"] * 3, size, name="main")
    threads = min(1024, max(32, 1 << (size - 1).bit_length()))
    assert [(k.blocks, k.threads) for k in kernel_grids(tvm.IRModule({"main": func}))["main"]] == [(3, threads)]
    rng = np.random.default_rng(size)
    xs = {"x0": rng.integers(-5, 105, size), "x1": rng.integers(-1, 3, size), "x2": rng.integers(0, 3, size)}
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    src = tvm.compile(tvm.IRModule({"main": func}), target=target).mod.imports[0].inspect_source()
    got = run_on_cpu(src, xs, {"counts": (3,)}, 3, (threads, 1), tmp_path, dtype="int64")["counts"]
    want = [int(((x < c.low) | (x >= c.high)).sum()) for c, x in zip(checks, xs.values())]
    assert got.tolist() == want and min(want) > 0
    cpu = tvm.compile(tvm.IRModule({"main": count_outside_primfunc(checks, ["int64"] * 3, size, "llvm", "main")}),
                      target="llvm")
    out = tvm.runtime.empty((3,), "int64")
    cpu["main"](*[tvm.runtime.tensor(x) for x in xs.values()], out)
    assert out.numpy().tolist() == want


def test_a_boolean_padding_input_is_not_checked():
    """A 0/1 check of a boolean attention mask could never fail (and 2 is no bool): only integer and float padding
    inputs are checked."""
    from stof_tvm.compiler import value_checks
    from stof_tvm.compiler.onnx_import import TensorSpec

    for dtype, want in (("bool", []), ("int64", [ValueCheck("attention_mask", 0, 2)]),
                        ("float32", [ValueCheck("attention_mask", 0, 2)])):
        spec = TensorSpec("attention_mask", (2, 8), dtype)
        assert value_checks([spec], onnx.ModelProto(), "attention_mask") == want
