"""Fixtures shared by several test modules."""
import pytest

from stof_tvm.models import builtin_model


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny BERT as an ONNX model."""
    return builtin_model("tiny-bert")
