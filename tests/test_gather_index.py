"""narrow_gather_indices (stof_tvm/compiler/gather_index.py): a gather by a table broadcast over the leading axis
(HF DeBERTa's relative-position gathers, with the importer's negative-index arithmetic on top) becomes a take by one
flattened table, computing the same values; a gather whose index varies along the leading axis is left alone."""
import numpy as np
import tvm
from tvm import relax

from stof_tvm.compiler.gather_index import narrow_gather_indices

N, S, K = 6, 5, 7


def _module(index_body) -> tvm.IRModule:
    x, table = relax.Var("x", relax.TensorType([N, S, K], "float32")), relax.Var("t", relax.TensorType([1, S, S],
                                                                                                           "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, table]):
        with bb.dataflow():
            index = index_body(bb, table)
            out = bb.emit_output(relax.op.gather_elements(x, index, axis=-1))
        bb.emit_func_output(out)
    return bb.get()


def _importer_index(bb, table):
    """broadcast_to, then where(i < 0, i + K, i) on the broadcast tensor, as TVM's ONNX importer writes it."""
    index = bb.emit(relax.op.broadcast_to(table, [N, S, S]))
    wrapped = bb.emit(relax.op.add(index, relax.const(K, "int64")))
    return bb.emit(relax.op.where(bb.emit(relax.op.less(index, relax.const(0, "int64"))), wrapped, index))


def _run(mod, args):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _ops(mod) -> list[str]:
    return [b.value.op.name for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def test_broadcast_table_gather_becomes_a_take():
    mod = _module(_importer_index)
    out = narrow_gather_indices(mod)
    assert "relax.gather_elements" not in _ops(out) and "relax.take" in _ops(out)
    assert "relax.broadcast_to" not in _ops(out)          # no index of N x S x S elements is computed
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, S, K)).astype("float32")
    table = rng.integers(-K, K, (1, S, S)).astype("int64")      # negative entries count from the end
    np.testing.assert_array_equal(_run(out, [x, table]), _run(mod, [x, table]))


def test_an_index_that_varies_by_row_stays():
    def per_row(bb, table):
        index = bb.emit(relax.op.broadcast_to(table, [N, S, S]))
        rows = relax.const(np.arange(N, dtype=np.int64).reshape(N, 1, 1) % 2, "int64")
        return bb.emit(relax.op.add(index, rows))          # adds a different value in each leading row

    mod = _module(per_row)
    assert "relax.gather_elements" in _ops(narrow_gather_indices(mod))
