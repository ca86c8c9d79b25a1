"""Where stof-tvm finds no attention it can take, the layers around attention still run on the fusion templates: the
attention goes through TVM's default pipeline as the model computes it, with a warning that says so. The compile's
attention matcher is made to find nothing in a real HF BERT export (the situation of any model whose attention is
not matched), which is then checked on llvm through the templates' definitions against torch. HF DeBERTa-v3's
export is built for CUDA through nvcc (the vectorised elementwise rule once gave its embeddings a ``make_ulonglong4``
of eight floats). Skipped without torch / transformers."""
import warnings

import numpy as np
import pytest

import stof_tvm
import stof_tvm.compiler as compiler
from stof_tvm.compiler.cubins import find_nvcc

pytest.importorskip("torch", reason="needs torch (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[test]')")

from stof_tvm.models import hf_export as hx          # noqa: E402

BATCH, SEQ = 2, 64
LAYER_LINEARS = 6 * 2     # Q, K, V, the output projection and the FFN's two, in each of the two layers


def _compile(path, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        art = stof_tvm.compile(path, mask="dense", batch=BATCH, seq_len=SEQ, dtype="float16", **options)
    return art, [str(w.message) for w in caught if "TVM's default pipeline" in str(w.message)]


@pytest.fixture
def unmatched(monkeypatch):
    """The compile finds no attention site (as in a model whose attention it cannot read)."""
    monkeypatch.setattr(compiler, "find_attention_sites", lambda func: [])


def test_templates_around_an_attention_left_to_tvm(hf_export, unmatched):
    """float16 on llvm with templates: every linear, GELU and LayerNorm on a template, the attention on none of
    stof-tvm's kernels, the warning naming both, and the output within float16's error of torch."""
    path = hf_export("bert", "eager", "torchscript", 17, False, BATCH, SEQ)
    art, fallbacks = _compile(path, target="llvm", templates=True)
    cov = art.manifest["coverage"]
    assert cov["attention"]["accelerated"] == 0 and art.manifest["attention"]["kernel"]["kind"] == "none"
    assert len(fallbacks) == 1 and "fusion templates" in fallbacks[0] and "without" not in fallbacks[0]
    for kind in ("linear", "layernorm", "gelu"):
        assert cov[kind]["accelerated"] == cov[kind]["total"] > 0, (kind, cov[kind])
    inputs = hx.example_inputs("bert", BATCH, SEQ)
    expected = hx.torch_outputs(hx.build_model("bert", "tiny", "eager"), inputs)
    out = art.load()(inputs)["last_hidden_state"]
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 5e-3


def test_without_templates_the_warning_says_so(hf_export, unmatched):
    """Templates off (llvm's default): the same fallback, and the warning says the templates are not used."""
    art, fallbacks = _compile(hf_export("bert", "eager", "torchscript", 17, False, BATCH, SEQ), target="llvm")
    assert art.manifest["coverage"]["linear"]["accelerated"] == 0
    assert len(fallbacks) == 1 and "without stof-tvm's sparse attention kernels or fusion templates" in fallbacks[0]


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc")
def test_deberta_builds_for_cuda(hf_export):
    """DeBERTa-v3 for CUDA (sm_90): nvcc builds the module, attention on a sparse kernel with its relative-position
    terms as the score bias, every layer linear on a template."""
    art, fallbacks = _compile(hf_export("deberta", "eager", "torchscript", 17, False, BATCH, SEQ), target="cuda")
    assert not fallbacks and art.manifest["attention"]["kernel"]["kind"] in ("block", "row")
    assert art.manifest["attention"]["kernel"]["bias"][:2] == [BATCH, 2]
    assert art.manifest["coverage"]["linear"]["accelerated"] >= LAYER_LINEARS


def test_sites_found_but_not_taken_carry_the_fallbacks_reason(hf_export, monkeypatch):
    """Attention sites the compile finds but cannot take (their masking, as an encoder-decoder's causal and cross
    attention) are reported under that reason in the coverage, not as sites that are no attention at all."""
    def refuse(func, sites):
        raise ValueError("model: attention sites differ in their own masking")

    monkeypatch.setattr(compiler, "plan_masks", refuse)
    art, fallbacks = _compile(hf_export("bert", "eager", "torchscript", 17, False, BATCH, SEQ), target="llvm")
    attention = art.manifest["coverage"]["attention"]
    assert len(fallbacks) == 1 and attention["accelerated"] == 0
    assert [(f["reason"].split(";")[0], f["count"]) for f in attention["fallback"]] == [
        ("attention sites differ in their own masking", 2)]
