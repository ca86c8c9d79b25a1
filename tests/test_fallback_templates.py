"""A model whose attention stof-tvm cannot take (HF DeBERTa-v3: disentangled attention, the scores plus relative
position terms gathered per query and key) still runs its linears, GELU and LayerNorms on the fusion templates: the
attention goes through TVM's default pipeline as the model computes it, with a warning that says so. Checked on llvm
through the templates' definitions against torch, and built for CUDA through nvcc (the vectorised elementwise rule
once gave that build a ``make_ulonglong4`` of eight floats). Skipped without torch / transformers."""
import warnings

import numpy as np
import pytest

import stof_tvm
from stof_tvm.compiler.cubins import find_nvcc

pytest.importorskip("torch", reason="needs torch (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[test]')")

from stof_tvm.models import hf_export as hx          # noqa: E402

BATCH, SEQ = 2, 64
# Q, K, V, the output projection and the FFN's two in each of the two layers (the relative embeddings' projections,
# whose weights are computed, stay in TVM's default pipeline)
LAYER_LINEARS = 6 * 2


def _compile(path, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        art = stof_tvm.compile(path, mask="dense", batch=BATCH, seq_len=SEQ, dtype="float16", **options)
    return art, [str(w.message) for w in caught if "TVM's default pipeline" in str(w.message)]


@pytest.fixture(scope="module")
def deberta(hf_export):
    return hf_export("deberta", "eager", "torchscript", 17, False, BATCH, SEQ)


def test_templates_around_an_attention_left_to_tvm(deberta):
    """float16 on llvm with templates: every layer linear, both GELUs and every LayerNorm on a template, the attention
    on none of stof-tvm's kernels, the warning naming both, and the output within float16's error of torch."""
    art, fallbacks = _compile(deberta, target="llvm", templates=True)
    cov = art.manifest["coverage"]
    assert cov["attention"]["accelerated"] == 0 and art.manifest["attention"]["kernel"]["kind"] == "none"
    assert len(fallbacks) == 1 and "fusion templates" in fallbacks[0] and "without" not in fallbacks[0]
    assert cov["linear"]["accelerated"] >= LAYER_LINEARS
    for kind in ("layernorm", "gelu"):
        assert cov[kind]["accelerated"] == cov[kind]["total"] > 0, (kind, cov[kind])
    inputs = hx.example_inputs("deberta", BATCH, SEQ)
    expected = hx.torch_outputs(hx.build_model("deberta", "tiny", "eager"), inputs)
    out = art.load()(inputs)["last_hidden_state"]
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 5e-3


def test_without_templates_the_warning_says_so(deberta):
    """Templates off (llvm's default): the same fallback, and the warning says the templates are not used."""
    art, fallbacks = _compile(deberta, target="llvm")
    assert art.manifest["coverage"]["linear"]["accelerated"] == 0
    assert len(fallbacks) == 1 and "without stof-tvm's sparse attention kernels or fusion templates" in fallbacks[0]


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc")
def test_the_cuda_build_compiles(deberta):
    """For CUDA (sm_90): nvcc builds the module, the templates in it."""
    art, fallbacks = _compile(deberta, target="cuda")
    assert fallbacks and art.manifest["coverage"]["linear"]["accelerated"] >= LAYER_LINEARS
