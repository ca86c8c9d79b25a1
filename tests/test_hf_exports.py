"""The corpus of real exports: Hugging Face transformers models (tiny configs, seeded weights whose attention is
far from uniform, :mod:`stof_tvm.models.hf_export`) exported by torch's own ONNX exporters, compiled for llvm and
checked against the torch model in float32 on inputs with a padded row.

Every family (BERT, RoBERTa, DistilBERT, GPT-2, ViT, T5 encoder, BigBird original_full and block_sparse, Longformer,
DeBERTa-v3; at the tiny size BLOOM, Phi, Gemma, Mistral, GPT-NeoX, the BART encoder, the CLIP text model,
ModernBERT, Gemma 2, which falls back, Qwen2, OPT and Llama) with every attention implementation transformers offers
it (eager, sdpa), through both exporters at the opsets that spell the model differently: TorchScript at 17 (static
axes) and 20 (the ``Gelu`` op; dynamic axes), dynamo at 18 (static; sdpa decomposed into split scales, boolean masks
and NaN guards) and 23 (the ``Attention`` op; dynamic axes). Static exports are compiled at the shape they were
traced at, in float32 and float16 (dynamo 18: float32); dynamic ones at another batch and sequence length (batch 1,
32 tokens instead of 2 x 64). One export per case per session (exports are cached on disk by
:func:`stof_tvm.models.hf_export.cached_export` under pytest's cache dir, keyed by the torch and transformers
versions), one compile per (case, dtype, shape).

Not in the corpus because the exporter cannot export them: BigBird block_sparse and Longformer through dynamo
(torch 2.13: ``ConversionError`` / ``TorchExportError``). Their TorchScript exports are in: their chunked
attention is not the standard one, so they compile through TVM's default pipeline, exact, with a warning
(``test_chunked_attention_falls_back_exactly``). DeBERTa-v3's disentangled attention (the scores plus each layer's
relative-position terms, over flattened heads) runs on the sparse kernels with those terms as a score bias, and so
does BLOOM's ALiBi (a term computed from the attention mask), and ModernBERT's sliding-window layer its window
(the global layer's mask is shared). The rotary families' dynamo-23 exports carry the
``RotaryEmbedding`` operator, rewritten at the ONNX level.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the corpus needs torch (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="the corpus needs transformers (pip install -e '.[test]')")

import stof_tvm                                      # noqa: E402
from stof_tvm.models import hf_export as hx          # noqa: E402

BATCH, SEQ = 2, 64                  # export shape
DYN_BATCH, DYN_SEQ = 1, 32          # where dynamic-axes exports are compiled
FP32_TOL = 1e-4
# float16 activations (unit roundoff 4.9e-4) through 2 layers whose attention is sharp (max prob ~0.3), against
# torch in float32: measured 0.4e-3 (T5) to 1.8e-3 (DistilBERT) relative for the TorchScript-17 exports
FP16_TOL = 5e-3
CHUNKED = ("bigbird-sparse", "longformer")          # attention not standard MHA: TVM's default pipeline
# Standard attention the sparse kernels cannot take, and the reason the warning gives: scores soft-capped by tanh
# (Gemma 2)
NOT_ACCELERATED = {"gemma2": "tanh (logit soft-capping, as Gemma 2's)"}
# Families whose own mask drops a padded query's every key (DeBERTa: the attention mask applied to queries and
# keys; Mistral, ModernBERT: a padded query more than its sliding window past the last kept token): at a padded
# position HF eager averages V uniformly, stof-tvm's kernels give a row with no kept key 0 (as SDPA's NaN guard
# does; on the fallback path the canonical form's finite fill averages where torch's SDPA does not), so only the
# positions the attention mask keeps are compared there
QUERY_MASKED = ("deberta", "mistral", "modernbert")


def _cases() -> list[tuple]:
    """(family, attn, exporter, opset, dynamic) of every export in the corpus."""
    cases = []
    for family in hx.FAMILIES:
        kinds = hx.attention_kinds(family)
        sdpa = "sdpa" if "sdpa" in kinds else "eager"
        for attn in kinds:
            cases.append((family, attn, "torchscript", 17, False))
            if family not in CHUNKED:
                cases.append((family, attn, "torchscript", 20, True))
        if family not in CHUNKED:
            cases.append((family, sdpa, "dynamo", 18, False))
            cases.append((family, sdpa, "dynamo", 23, True))
    return cases


CASES = _cases()


def case_id(case) -> str:
    family, attn, exporter, opset, dynamic = case
    return f"{family}-{attn}-{exporter}{opset}-{'dyn' if dynamic else 'static'}"


@pytest.fixture(scope="module")
def hf_corpus(hf_export):
    """``hf_corpus(case) -> path``: the ONNX file of a corpus case (exported at 2 x 64)."""
    return lambda case: hf_export(*case, batch=BATCH, seq_len=SEQ)


@functools.lru_cache(maxsize=None)
def _torch_reference(family: str, attn: str, batch: int, seq_len: int) -> tuple[dict, np.ndarray]:
    inputs = hx.example_inputs(family, batch, seq_len)
    return inputs, hx.torch_outputs(hx.build_model(family, "tiny", attn), inputs)


@functools.lru_cache(maxsize=None)
def _compiled(path: str, family: str, dtype: str, batch: int, seq_len: int, mask: str = "dense",
              kernel: str = "auto"):
    seq = hx.sequence_length(family, "tiny", seq_len)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        art = stof_tvm.compile(path, mask=mask, batch=batch, seq_len=seq, target="llvm", dtype=dtype,
                               kernel=kernel)
    fallbacks = [str(w.message) for w in caught if "TVM's default pipeline" in str(w.message)]
    return art, art.load(), fallbacks


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# The TorchScript export of HF Longformer does not compute what torch does: onnx's own reference evaluator of the
# exported graph differs from the torch model by 0.61 / 0.44 relative (rows 0 / 1), so the compiled module cannot
# match torch either (it compiles, falls back as it should, and runs; 0.53 relative to torch)
UNFAITHFUL_EXPORT = pytest.mark.xfail(strict=True, reason="the TorchScript export of HF Longformer differs from "
                                      "torch itself (onnx reference evaluator: 0.4-0.6 relative)")


def _compile_params():
    params = []
    for case in CASES:
        family, _, exporter, opset, dynamic = case
        shape = (DYN_BATCH, DYN_SEQ) if dynamic else (BATCH, SEQ)
        dtypes = ("float32",) if dynamic or opset == 18 or family in CHUNKED else ("float32", "float16")
        marks = [UNFAITHFUL_EXPORT] if family == "longformer" else []
        params += [pytest.param(case, dtype, shape, id=f"{case_id(case)}-{dtype}", marks=marks) for dtype in dtypes]
    return params


@pytest.mark.parametrize("case, dtype, shape", _compile_params())
def test_export_compiles_and_matches_torch(hf_corpus, case, dtype, shape):
    """mask="dense" on llvm: the compiled module equals the torch model in float32, padded row included (the
    padded row's error is checked on its own: a mask applied wrongly shows there first)."""
    family, attn = case[:2]
    batch, seq_len = shape
    art, model, fallbacks = _compiled(hf_corpus(case), family, dtype, batch, seq_len)
    inputs, expected = _torch_reference(family, attn, batch, seq_len)
    out = model(inputs)["last_hidden_state"]
    assert np.isfinite(out).all()
    tol = FP32_TOL if dtype == "float32" else FP16_TOL
    kept = inputs["attention_mask"].astype(bool) if family in QUERY_MASKED else np.ones(out.shape[:2], bool)
    assert _rel(out[kept], expected[kept]) < tol
    if family != "vit":
        valid = inputs["attention_mask"][-1].astype(bool)           # the last row is the padded one
        assert not valid.all() and _rel(out[-1][valid], expected[-1][valid]) < tol
    if family in CHUNKED or family in NOT_ACCELERATED:
        assert art.manifest["attention"]["kernel"]["kind"] == "none" and fallbacks
        assert NOT_ACCELERATED.get(family, "") in fallbacks[-1]
    else:
        assert art.manifest["attention"]["sites"] == 2 and not fallbacks       # both layers on a stof-tvm kernel


@pytest.mark.parametrize("family, export_dtype", [("vit", "float16"), ("mistral", "float16"), ("gpt2", "float16"),
                                                  ("bert", "bfloat16"), ("mistral", "bfloat16")])
def test_an_export_made_after_model_to_16_bits_keeps_its_attention_on_the_kernels(hf_export, family, export_dtype):
    """Exported after ``model.to(float16 or bfloat16)`` (TorchScript 17, as users export for GPU inference). ViT's
    and Mistral's eager attention asks for its softmax in float32, which comes out as Softmax -> Cast(float) ->
    Cast(back); a bfloat16 model (TVM builds no bfloat16 LayerNorm) is widened to float32 with a warning. Both
    layers still reach stof-tvm's attention kernel, and the float16 module matches the torch model of the same
    16-bit weights computed in float32."""
    path = hf_export(family, "eager", "torchscript", 17, False, dtype=export_dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        art = stof_tvm.compile(path, mask="dense", batch=BATCH, seq_len=SEQ, target="llvm", dtype="float16")
    messages = [str(w.message) for w in caught]
    assert sum("bfloat16 tensors are widened to float32" in m for m in messages) == (export_dtype == "bfloat16")
    assert art.manifest["attention"]["sites"] == 2 and not any("default pipeline" in m for m in messages)
    inputs = hx.example_inputs(family, BATCH, SEQ)
    expected = hx.torch_outputs(hx.build_model(family).to(getattr(torch, export_dtype)).float(), inputs)
    out = art.load()(inputs)["last_hidden_state"]
    kept = inputs["attention_mask"].astype(bool) if family in QUERY_MASKED else np.ones(out.shape[:2], bool)
    assert np.isfinite(out).all() and _rel(out[kept], expected[kept]) < FP16_TOL


SPARSE_MASK = "bigbird:window=8,globals=8,block=8,density=0.2"
SPARSE_CASES = [("bert", "eager", "torchscript", 17, False), ("gpt2", "sdpa", "dynamo", 18, False),
                ("t5", "sdpa", "torchscript", 17, False), ("roberta", "sdpa", "dynamo", 23, True),
                ("deberta", "eager", "dynamo", 18, False), ("bloom", "eager", "torchscript", 17, False),
                ("phi", "sdpa", "dynamo", 23, True), ("modernbert", "sdpa", "torchscript", 17, False),
                ("qwen2", "sdpa", "dynamo", 23, True), ("opt", "eager", "torchscript", 17, False),
                ("llama", "sdpa", "dynamo", 18, False)]


@pytest.mark.parametrize("case", SPARSE_CASES, ids=case_id)
def test_sparse_mask_matches_the_dense_kernel(hf_corpus, case):
    """A sparse mask: the sparse kernel equals kernel="dense" (TVM's dense attention with the same mask as an
    input), padding and the model's own masking (GPT-2's causality, T5's position bias, DeBERTa's relative-position
    terms, BLOOM's ALiBi, ModernBERT's sliding-window layer) included."""
    family, attn, _, _, dynamic = case
    batch, seq_len = (DYN_BATCH, DYN_SEQ) if dynamic else (BATCH, SEQ)
    path = hf_corpus(case)
    sparse, sparse_model, _ = _compiled(path, family, "float32", batch, seq_len, SPARSE_MASK)
    dense, dense_model, _ = _compiled(path, family, "float32", batch, seq_len, SPARSE_MASK, "dense")
    assert sparse.manifest["attention"]["kernel"]["kind"] in ("row", "block")
    assert dense.manifest["attention"]["kernel"]["kind"] == "dense"
    inputs, unmasked = _torch_reference(family, attn, batch, seq_len)
    out, ref = sparse_model(inputs)["last_hidden_state"], dense_model(inputs)["last_hidden_state"]
    kept = inputs["attention_mask"].astype(bool) if family in QUERY_MASKED else np.ones(out.shape[:2], bool)
    assert _rel(out[kept], ref[kept]) < FP32_TOL
    assert _rel(ref, unmasked) > 1e-2                  # the mask changed the result: the comparison means something


@pytest.mark.parametrize("family", CHUNKED)
def test_chunked_attention_falls_back_exactly(hf_corpus, family):
    """HF BigBird block_sparse and Longformer: no standard attention site, so TVM's default pipeline with one
    warning that says why (the manifest records it); the module takes no mask input and refuses a run-time mask
    by name. (The same compile as the corpus test's: exact against torch there.)"""
    case = (family, "eager", "torchscript", 17, False)
    art, model, fallbacks = _compiled(hf_corpus(case), family, "float32", BATCH, SEQ)
    assert len(fallbacks) == 1 and "without stof-tvm's sparse attention kernels" in fallbacks[0]
    assert art.manifest["attention"]["fallback"] in fallbacks[0]
    assert art.manifest["mask_inputs"] == []
    inputs, _ = _torch_reference(family, "eager", BATCH, SEQ)
    with pytest.raises(ValueError, match="takes no mask"):
        model(inputs, mask="sliding")


def test_head_dim_32_compiles_and_matches_torch(hf_export):
    """BERT with 4 heads of 32 (small BERTs, Swin): exact on llvm, under a sparse mask too; where the sparse kernels
    lack the head size, dense attention takes the mask, with a warning naming the head size."""
    path = hf_export("bert", "eager", "torchscript", 17, False, size="tiny-d32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        art = stof_tvm.compile(path, mask="dense", batch=BATCH, seq_len=SEQ, target="llvm", dtype="float32")
    kernel = art.manifest["attention"]["kernel"]
    assert art.manifest["attention"]["head_dim"] == 32
    if kernel["kind"] == "dense":
        assert "head_dim 32" in kernel["reason"] and any("head_dim 32" in str(w.message) for w in caught)
    inputs = hx.example_inputs("bert", BATCH, SEQ, size="tiny-d32")
    expected = hx.torch_outputs(hx.build_model("bert", "tiny-d32"), inputs)
    assert _rel(art.load()(inputs)["last_hidden_state"], expected) < FP32_TOL


def test_chunked_attention_in_float16_runs_in_float32_with_a_warning(hf_corpus):
    """HF BigBird block_sparse asked for float16: TVM's mixed-precision pass refuses its graph (Relax functions
    held as values: an internal error before), so it compiles in float32 with a warning saying why, exact."""
    case = ("bigbird-sparse", "eager", "torchscript", 17, False)
    art, model, fallbacks = _compiled(hf_corpus(case), "bigbird-sparse", "float16", BATCH, SEQ)
    assert any("mixed-precision pass cannot convert" in text for text in fallbacks)
    assert "computes in float32" in art.manifest["attention"]["fallback"]
    inputs, expected = _torch_reference("bigbird-sparse", "eager", BATCH, SEQ)
    assert _rel(model(inputs)["last_hidden_state"], expected) < FP32_TOL


def _cuda_build_cases() -> list:
    """Each family's dynamic dynamo-23 export, the form users most often bring (chunked attention aside); and Phi-3's
    TorchScript export, whose rotary embedding concatenates an empty part (the dynamo exporter drops it), which TVM's
    GPU schedules cannot take as a zero-length loop (canonical.layout.SingleConcat drops it)."""
    return [pytest.param((family, "sdpa" if "sdpa" in hx.attention_kinds(family) else "eager", "dynamo", 23, True),
                         id=family) for family in hx.FAMILIES if family not in CHUNKED] + [
        pytest.param(("phi3", "eager", "torchscript", 20, True), id="phi3-torchscript")]


@pytest.mark.parametrize("case", _cuda_build_cases())
def test_every_family_builds_for_cuda(hf_corpus, case):
    """The whole CUDA build (float16, a sparse mask; no GPU needed): every schedule rule meets every family's
    kernels and TVM generates their code. The llvm corpus does not schedule for the GPU: BLOOM's export, which holds
    a 0-d tensor, once crashed the elementwise rule here. A family the sparse kernels cannot take builds dense."""
    family = case[0]
    mask = "dense" if family in NOT_ACCELERATED else SPARSE_MASK
    seq = hx.sequence_length(family, "tiny", DYN_SEQ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = stof_tvm.compile(hf_corpus(case), mask=mask, batch=DYN_BATCH, seq_len=seq, target="cuda",
                               dtype="float16")
    assert art.manifest["target"]["kind"] == "cuda" and art.manifest["dtype"] == "float16"
    attention = art.manifest["coverage"]["attention"]
    if family in NOT_ACCELERATED:
        assert attention["accelerated"] == 0 < attention["total"], attention
    else:
        assert attention["accelerated"] == attention["total"] > 0, attention


@pytest.mark.parametrize("family", ["roberta", "vit"])
@pytest.mark.parametrize("export_dtype", ["float16", "bfloat16"])
def test_a_16_bit_export_gets_the_templates_of_the_float32_export(hf_export, family, export_dtype):
    """The CUDA build of an export made after ``model.to(float16 / bfloat16)`` calls the same fusion templates
    as the float32 export's: GELU fused into its GEMM although its constants are 16-bit (sqrt(2) as 1.4141), and
    each residual sum's LayerNorm on the GEMM + bias + residual + LayerNorm chain (the QKV projection once
    computed its input LayerNorm a second time, from the sum, which then had two readers). On the H100 the
    float16 RoBERTa-base at 8 x 512 ran 1.745 ms against the float32 export's 1.499 before both fixes."""
    calls = {}
    for dtype in ("float32", export_dtype):
        path = hf_export(family, "eager", "torchscript", 17, False, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            art = stof_tvm.compile(path, mask=SPARSE_MASK, batch=BATCH, seq_len=hx.sequence_length(family, "tiny", SEQ),
                                   target="cuda", dtype="float16")
        calls[dtype] = art.manifest["templates"]["calls"]
    assert calls[export_dtype] == calls["float32"]
    assert any(name.startswith("gemm_bias_gelu") for name in calls["float32"])


@pytest.mark.parametrize("names", [("input_ids_dynamic_axes_1", "input_ids_dynamic_axes_2"), ("s72", "s53")],
                         ids=["torchscript-list-axes", "dynamo-dim-auto"])
def test_dynamic_axes_named_by_the_exporter_resolve_by_position(hf_export, tmp_path, names):
    """Dynamic axes the user did not name: TorchScript names a list of axes ``<input>_dynamic_axes_<n>``, dynamo
    names ``Dim.AUTO`` dims ``s<n>``. Dim 0 is the batch and dim 1 the sequence, as for unnamed dims; before,
    these exports were refused ("cannot resolve dim 0")."""
    import onnx

    model = onnx.load(hf_export("bert", "eager", "torchscript", 20, True))
    renamed = dict(zip(("batch", "sequence"), names))
    for value in list(model.graph.input) + list(model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renamed:
                dim.dim_param = renamed[dim.dim_param]
    assert {d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim} == set(names)
    compiled = stof_tvm.compile(model, mask="dense", batch=DYN_BATCH, seq_len=DYN_SEQ, target="llvm",
                                dtype="float32").load()
    inputs, expected = _torch_reference("bert", "eager", DYN_BATCH, DYN_SEQ)
    assert _rel(compiled(inputs)["last_hidden_state"], expected) < FP32_TOL
