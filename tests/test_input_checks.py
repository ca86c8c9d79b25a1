"""stof_tvm/compiler/input_checks.py: ``main``'s out-of-range counts of its checked inputs, on llvm against numpy.
Inputs of one shape (token ids, the attention mask) are counted by one fused kernel writing the output; inputs of
several shapes each by their own reduction, stacked."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from stof_tvm.compiler.input_checks import ValueCheck, add_value_checks


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
    mod, position = add_value_checks(_module({k: v.shape for k, v in feeds.items()}), CHECKS)
    assert position == 1
    outs = _run(mod, feeds)
    np.testing.assert_array_equal(outs[0], feeds["input_ids"] * 2)
    want = [int(((v < c.low) | (v >= c.high)).sum()) for c, v in zip(CHECKS, feeds.values())]
    assert outs[1].tolist() == want and sum(want) > 2


def test_inputs_of_one_shape_are_counted_by_one_kernel():
    """[B, S] token ids and mask: one kernel (the comparisons, the stack and the reduction fused) instead of a
    reduction per input and a stack; inputs of another shape keep one reduction each."""
    same, _ = add_value_checks(_module({"input_ids": (2, 8), "attention_mask": (2, 8)}), CHECKS)
    counting = [name for name in _kernels(same) if "less" in name]
    assert len(counting) == 1 and "stack" in counting[0] and "sum" in counting[0], _kernels(same)
    mixed, _ = add_value_checks(_module({"input_ids": (2, 8), "attention_mask": (2, 1, 8)}), CHECKS)
    assert len([name for name in _kernels(mixed) if "less" in name]) == 2, _kernels(mixed)
