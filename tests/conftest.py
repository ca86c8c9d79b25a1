"""Fixtures shared by several test modules."""
import functools
import warnings

import pytest

from stof_tvm.models import builtin_model


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny BERT as an ONNX model."""
    return builtin_model("tiny-bert")


@pytest.fixture(scope="session")
def hf_export(pytestconfig):
    """``hf_export(family, attn, exporter, opset, dynamic, batch=2, seq_len=64, size="tiny") -> path``: a Hugging
    Face model exported by torch (:func:`stof_tvm.models.hf_export.cached_export`), once per session and cached
    on disk under pytest's cache dir (keyed by the torch and transformers versions and the export parameters).
    Skips where torch or transformers is missing (they are test extras)."""
    pytest.importorskip("torch", reason="exports need torch (pip install -e '.[test]')")
    pytest.importorskip("transformers", reason="exports need transformers (pip install -e '.[test]')")
    from stof_tvm.models import hf_export as hx

    cache = pytestconfig.cache.mkdir("hf_exports")

    @functools.lru_cache(maxsize=None)
    def export(family, attn, exporter, opset, dynamic, batch=2, seq_len=64, size="tiny") -> str:
        with warnings.catch_warnings():                 # the exporters' deprecation and tracer warnings
            warnings.simplefilter("ignore")
            return hx.cached_export(cache, family, size=size, attn=attn, exporter=exporter, opset=opset,
                                    batch=batch, seq_len=seq_len, dynamic=dynamic)

    return export
