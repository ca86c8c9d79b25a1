"""Token ids are range-checked wherever they index an embedding table, also after reshapes (HF GPT-2 flattens
``input_ids`` with ``view(-1, S)`` before its ``wte`` Gather; without following the reshape its ids went
unchecked and out-of-range ids were silently clamped)."""
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
import numpy as np

from stof_tvm.compiler.onnx_import import embedding_rows


def _graph_with(nodes, table_rows=50):
    table = numpy_helper.from_array(np.zeros((table_rows, 4), np.float32), "table")
    shape = numpy_helper.from_array(np.array([-1, 8], np.int64), "shape")
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [2, 8])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph(nodes, "g", [ids], [out], [table, shape]))


def test_a_direct_gather_gives_the_table_rows():
    model = _graph_with([helper.make_node("Gather", ["table", "input_ids"], ["out"])])
    assert embedding_rows(model, "input_ids") == 50


def test_a_gather_after_reshapes_gives_the_table_rows():
    model = _graph_with([helper.make_node("Reshape", ["input_ids", "shape"], ["flat"]),
                         helper.make_node("Unsqueeze", ["flat"], ["wide"], axes=[0]),
                         helper.make_node("Gather", ["table", "wide"], ["out"])], table_rows=77)
    assert embedding_rows(model, "input_ids") == 77


def test_arithmetic_on_the_ids_is_not_followed():
    model = _graph_with([helper.make_node("Add", ["input_ids", "input_ids"], ["twice"]),
                         helper.make_node("Gather", ["table", "twice"], ["out"])])
    assert embedding_rows(model, "input_ids") is None


def test_hf_gpt2_input_ids_are_checked(hf_export):
    model = onnx.load(hf_export("gpt2", "eager", "torchscript", 17, False))
    assert embedding_rows(model, "input_ids") is not None


def test_hf_gpt2_refuses_out_of_range_ids_before_any_kernel(hf_export, tmp_path):
    import stof_tvm
    from stof_tvm import runtime

    path = hf_export("gpt2", "eager", "torchscript", 17, False)
    stof_tvm.compile(path, mask="dense", batch=2, seq_len=64, target="llvm", dtype="float32").save(tmp_path / "gpt2")
    model = runtime.load(tmp_path / "gpt2")
    ids = np.zeros((2, 64), np.int64)
    ids[1, 5] = 10 ** 6
    with pytest.raises(ValueError, match="input 'input_ids'"):
        model(input_ids=ids, attention_mask=np.ones((2, 64), np.int64))
