"""narrow_gather_indices (stof_tvm/compiler/gather_index.py): a gather by a table broadcast over the leading axis
(HF DeBERTa's relative-position gathers, with the importer's negative-index arithmetic on top) becomes a take by one
flattened table, computing the same values, also where the export folded the broadcast index into a constant; one
whose last two axes are then swapped (DeBERTa's position-to-content term) is taken in its own layout and then
transposed; a gather whose index varies along the leading axis is left alone."""
import numpy as np
import tvm
from tvm import relax

from stof_tvm.compiler.gather_index import narrow_gather_indices

N, S, K = 6, 5, 7


def _module(index_body, transposed: bool = False, from_matmul: bool = False) -> tvm.IRModule:
    """``gather_elements(x, index, -1)`` (then its last two axes swapped, ``transposed``), ``x`` an input or, with
    ``from_matmul``, the product of two inputs [N, S, 3] x [N, 3, K]."""
    operands = ([relax.Var("a", relax.TensorType([N, S, 3], "float32")),
                 relax.Var("b", relax.TensorType([N, 3, K], "float32"))] if from_matmul
                else [relax.Var("x", relax.TensorType([N, S, K], "float32"))])
    table = relax.Var("t", relax.TensorType([1, S, S], "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [*operands, table]):
        with bb.dataflow():
            x = bb.emit(relax.op.matmul(*operands)) if from_matmul else operands[0]
            gathered = bb.emit(relax.op.gather_elements(x, index_body(bb, table), axis=-1))
            out = bb.emit_output(relax.op.permute_dims(gathered, [0, 2, 1]) if transposed else gathered)
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


def test_a_transposed_gather_is_taken_in_its_own_layout_then_transposed():
    """The take reads ``x`` (or the matmul's product) as it is laid: the kernel that fuses the transpose stages it
    (stof_tvm/schedules/staged_transpose.py)."""
    rng = np.random.default_rng(1)
    table = rng.integers(-K, K, (1, S, S)).astype("int64")
    for from_matmul in (False, True):
        mod = _module(_importer_index, transposed=True, from_matmul=from_matmul)
        out = narrow_gather_indices(mod)
        ops = _ops(out)
        assert "relax.gather_elements" not in ops and ops.count("relax.take") == 1
        assert ops.count("relax.permute_dims") == 1 and ops.index("relax.take") < ops.index("relax.permute_dims")
        takes = [b.value for block in out["main"].body.blocks for b in block.bindings
                 if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.take"]
        assert takes[0].args[1].ty.dtype == "int32"          # 4 bytes of index per gathered element
        args = ([rng.standard_normal((N, S, 3)), rng.standard_normal((N, 3, K))] if from_matmul
                else [rng.standard_normal((N, S, K))])
        args = [a.astype("float32") for a in args] + [table]
        np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-6, atol=1e-6)


def test_an_index_folded_into_a_constant_becomes_a_take():
    """A fixed-shape export folds the broadcast: the index is one [N, S, S] constant whose slices are the same
    table, used three times by the importer's arithmetic (one source: each use is the same table)."""
    table = np.random.default_rng(2).integers(-K, K, (1, S, S)).astype("int64")

    def folded(bb, _table):
        index = relax.const(np.broadcast_to(table, (N, S, S)).copy(), "int64")
        wrapped = bb.emit(relax.op.add(index, relax.const(K, "int64")))
        return bb.emit(relax.op.where(bb.emit(relax.op.less(index, relax.const(0, "int64"))), wrapped, index))

    mod = _module(folded)
    out = narrow_gather_indices(mod)
    assert "relax.gather_elements" not in _ops(out) and "relax.take" in _ops(out)
    x = np.random.default_rng(3).standard_normal((N, S, K)).astype("float32")
    np.testing.assert_array_equal(_run(out, [x, table]), _run(mod, [x, table]))


def test_an_index_that_varies_by_row_stays():
    def per_row(bb, table):
        index = bb.emit(relax.op.broadcast_to(table, [N, S, S]))
        rows = relax.const(np.arange(N, dtype=np.int64).reshape(N, 1, 1) % 2, "int64")
        return bb.emit(relax.op.add(index, rows))          # adds a different value in each leading row

    mod = _module(per_row)
    assert "relax.gather_elements" in _ops(narrow_gather_indices(mod))
