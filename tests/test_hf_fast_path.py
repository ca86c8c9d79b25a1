"""Real Hugging Face exports on the fast path: compiled for CUDA in float16 (front end only: the template calls and
the coverage report, no build), every standard attention site on a sparse kernel, every linear on a template, QKV
one projection into heads, GELU (erf op, erf arithmetic, tanh formula) and ReLU in the GEMM epilogue, every
LayerNorm / RMSNorm on its template; and the numerics of the forms this adds (GPT-2's Conv1D, ViT's padded rows and
one-GEMM QKV) on llvm, through the templates' definitions, against torch. Skipped without torch / transformers."""
import numpy as np
import pytest
import tvm
from tvm import relax

import stof_tvm
from stof_tvm.compiler import front_end

BATCH, SEQ = 2, 64

# (family, attention, exporter, opset): each exporter form the canonical rules bring to one graph
FORMS = [
    ("bert", "eager", "torchscript", 17),      # the acceptance form of issue 13 (all five families in this list)
    ("bert", "sdpa", "torchscript", 17),       # SDPA decomposed: split scale, -inf where-mask, NaN guard
    ("bert", "eager", "dynamo", 18),
    ("roberta", "eager", "torchscript", 17),
    ("roberta", "eager", "torchscript", 20),   # the ONNX Gelu op
    ("roberta", "sdpa", "dynamo", 18),         # erf arithmetic GELU, K^T over [B*H, S, D]
    ("gpt2", "eager", "torchscript", 17),      # Conv1D (2-D addmm), one linear split in thirds, gelu_new (pow 3)
    ("gpt2", "sdpa", "dynamo", 18),
    ("vit", "eager", "torchscript", 17),       # no-op casts after the softmax; 65 tokens
    ("vit", "sdpa", "dynamo", 18),
    ("t5", "eager", "torchscript", 17),        # RMSNorm, ReLU, bias-free linears, position bias
    ("bigbird", "eager", "torchscript", 17),   # original_full, tanh GELU
]
LAYERS = 2


def _form_id(form) -> str:
    return "-".join(str(part) for part in form)


@pytest.mark.parametrize("form", FORMS, ids=_form_id)
def test_every_chain_of_a_real_export_on_the_fast_path(hf_export, form):
    family, attn, exporter, opset = form
    path = hf_export(family, attn, exporter, opset, False, BATCH, SEQ)
    front = front_end(path, mask="bigbird", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16",
                      schedule=False)
    cov = front.coverage
    assert cov["attention"]["total"] == LAYERS and cov["attention"]["accelerated"] == LAYERS
    assert cov["attention"]["kernel"] in ("block", "row")
    for kind in ("linear", "layernorm", "rmsnorm", "gelu", "relu"):
        assert cov[kind]["accelerated"] == cov[kind]["total"] and not cov[kind]["fallback"], (kind, cov[kind])
    # per layer Q, K, V (GPT-2: one c_attn), the output projection and the FFN's two; ViT's patch embedding (its
    # conv on the image's patches, canonical.layout.PatchEmbedding)
    assert cov["linear"]["total"] == (4 if family == "gpt2" else 6) * LAYERS + (family == "vit")
    norm = "rmsnorm" if family == "t5" else "layernorm"
    assert cov[norm]["total"] == 2 * LAYERS + 1          # two per layer, and the embeddings' or the final one
    act = "relu" if family == "t5" else "gelu"
    assert cov[act]["total"] == LAYERS
    calls = front.template_entry["calls"]
    tanh = family in ("gpt2", "bigbird")
    epilogue = "relu" if family == "t5" else "gelu_tanh" if tanh else "gelu_erf"
    assert sum(count for name, count in calls.items() if epilogue in name) == LAYERS, calls
    assert cov["qkv"] == {"total": LAYERS, "accelerated": LAYERS, "fallback": []}
    if family == "vit":     # 65 tokens: the QKV heads template's flat-row form, its x rows zero-padded to 80
        qkv = [site for site in front.template_entry["sites"] if site["chain"] == "qkv"]
        assert len(qkv) == 1 and qkv[0]["note"].startswith(f"rows padded {BATCH * 65} -> {BATCH * 65 + 14}"), qkv


@pytest.mark.parametrize("batch, qkv_template, rows", [
    (1, "qkv_projection_kn", 80),          # 65 rows padded to 16 for mma.sync
    (64, "qkv_projection_wgmma", 4160),    # 4160 rows: enough tiles for wgmma, as they are (a partial last tile)
])
def test_vit_qkv_into_heads_at_any_batch(hf_export, batch, qkv_template, rows):
    """ViT's 65 tokens (197 at base size) at batch 1 and 64 (one export with a dynamic batch): QKV still one
    projection into heads, on mma.sync (rows zero-padded to 16) or on wgmma (no padding) by the GEMM's size, and
    every other chain on its template."""
    path = hf_export("vit", "eager", "torchscript", 17, True, BATCH, SEQ)
    front = front_end(path, mask="bigbird", batch=batch, seq_len=SEQ, target="cuda", dtype="float16",
                      schedule=False)
    cov = front.coverage
    for kind in ("attention", "qkv", "linear", "layernorm", "gelu"):
        assert cov[kind]["accelerated"] == cov[kind]["total"] > 0 and not cov[kind]["fallback"], (kind, cov[kind])
    (qkv,) = [site for site in front.template_entry["sites"] if site["chain"] == "qkv"]
    assert qkv["count"] == LAYERS and [stage["template"] for stage in qkv["stages"]] == [qkv_template]
    if rows == batch * 65:
        assert "rows padded" not in qkv.get("note", ""), qkv
    else:
        assert qkv["note"].startswith(f"rows padded {batch * 65} -> {rows}"), qkv["note"]


@pytest.mark.parametrize("form", [("gpt2", "eager", "torchscript", 17), ("vit", "eager", "torchscript", 17),
                                  ("opt", "eager", "torchscript", 17)], ids=_form_id)
def test_templates_on_real_exports_match_torch(hf_export, form):
    """float16 on llvm with the templates' definitions (the same rewrite as for CUDA) against torch float32."""
    from stof_tvm.models import hf_export as hx

    family, attn, exporter, opset = form
    path = hf_export(family, attn, exporter, opset, False, BATCH, SEQ)
    inputs = hx.example_inputs(family, BATCH, SEQ)
    expected = hx.torch_outputs(hx.build_model(family, "tiny", attn), inputs)
    art = stof_tvm.compile(path, mask="dense", batch=BATCH, seq_len=SEQ, target="llvm", dtype="float16",
                           templates=True)
    assert art.manifest["coverage"]["linear"]["accelerated"] == art.manifest["coverage"]["linear"]["total"]
    out = art.load()(inputs)["last_hidden_state"]
    assert not np.isnan(out).any()
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 5e-3


def test_deberta_qkv_one_projection_with_keys_permuted_twice(hf_export):
    """HF DeBERTa-v3 permutes K's heads twice (for the scores and for the position-to-content product), before its
    V projection: QKV is still one projection into heads, on CUDA and through the templates' definitions on llvm,
    where the output matches torch."""
    from stof_tvm.models import hf_export as hx

    path = hf_export("deberta", "eager", "torchscript", 17, False, BATCH, SEQ)

    def ops_of(fuse_relative_bias: bool) -> list:
        front = front_end(path, mask="bigbird", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16",
                          kernel="block", schedule=False, fuse_relative_bias=fuse_relative_bias)
        assert front.coverage["qkv"] == {"total": LAYERS, "accelerated": LAYERS, "fallback": []}
        found = []
        relax.analysis.post_order_visit(front.mod["main"], lambda e: found.append(e.op.name)
                                        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
        return found

    # With the fused relative-position bias, which takes views too, Q, K and V are views into the projection's
    # output (Q and K twice: as the attention kernel's heads and the bias kernel's [B * H, S, D]); with the graph's
    # own products, which need offset 0, Q and K are a copy each and V alone is a view
    for fuse, views, copies in ((True, 5 * LAYERS, 0), (False, LAYERS, 2 * LAYERS)):
        ops = ops_of(fuse)
        assert ops.count("relax.memory.view") == views and ops.count("relax.strided_slice") == copies, [
            (op, ops.count(op)) for op in ("relax.memory.view", "relax.strided_slice", "relax.split")]
        assert "relax.split" not in ops
    inputs = hx.example_inputs("deberta", BATCH, SEQ)
    expected = hx.torch_outputs(hx.build_model("deberta", "tiny", "eager"), inputs)
    art = stof_tvm.compile(path, mask="dense", batch=BATCH, seq_len=SEQ, target="llvm", dtype="float16",
                           templates=True)
    assert art.manifest["coverage"]["qkv"]["accelerated"] == LAYERS
    out = art.load()(inputs)["last_hidden_state"]
    kept = inputs["attention_mask"].astype(bool)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out[kept] - expected[kept]) / np.linalg.norm(expected[kept]) < 5e-3


@pytest.mark.parametrize("form", [("opt", "eager", "torchscript", 17), ("opt", "sdpa", "dynamo", 23)], ids=_form_id)
def test_opts_scaled_query_still_makes_one_qkv_projection(hf_export, form):
    """OPT scales Q right after its projection (``q_proj(h) * scaling``, before the head split): the scale is moved
    past the head split onto the scores (canonical.layout.ScaleAfterHeadSplit), so Q, K and V are one projection
    into heads; the FFN's ReLU rides its GEMM's epilogue."""
    family, attn, exporter, opset = form
    path = hf_export(family, attn, exporter, opset, False, BATCH, SEQ)
    front = front_end(path, mask="bigbird", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16",
                      schedule=False)
    cov = front.coverage
    assert cov["attention"]["accelerated"] == cov["attention"]["total"] == LAYERS
    assert cov["qkv"] == {"total": LAYERS, "accelerated": LAYERS, "fallback": []}
    assert cov["relu"]["accelerated"] == cov["relu"]["total"] == LAYERS
    assert cov["linear"]["accelerated"] == cov["linear"]["total"] == 6 * LAYERS


@pytest.mark.parametrize("form", [("llama", "eager", "dynamo", 18), ("qwen2", "sdpa", "torchscript", 17)],
                         ids=_form_id)
def test_grouped_query_projections_make_one_gemm(hf_export, form):
    """Grouped-query attention (the tiny Llama: 4 query heads on 2 key/value heads; the tiny Qwen2: 2 on 1, with
    Q/K/V biases): K and V are narrower than Q, so no heads template takes them, but Q, K and V are still one GEMM
    on the concatenated weights per layer (the graph's head splits, rotary embedding and key/value repeat after it);
    the report says why they are not one projection into heads; the MLP's gate and up projections are one GEMM
    too. On llvm through the templates' definitions the output matches torch."""
    family, attn, exporter, opset = form
    path = hf_export(family, attn, exporter, opset, False, BATCH, SEQ)
    front = front_end(path, mask="bigbird", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16",
                      schedule=False)
    cov = front.coverage
    assert cov["linear"]["accelerated"] == cov["linear"]["total"] == 7 * LAYERS
    (reason,) = cov["qkv"]["fallback"]
    assert reason["count"] == LAYERS and "share" in reason["reason"] and "key/value heads" in reason["reason"]
    gemms = [site for site in front.template_entry["sites"] if site["chain"] == "qkv_gemm"]
    assert sum(site["count"] for site in gemms) == LAYERS
    # the GEMM's parts are slices that fuse into their readers, not a split of its own
    ops = []
    relax.analysis.post_order_visit(front.mod["main"], lambda e: ops.append(e.op.name)
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    assert "relax.split" not in ops and ops.count("relax.strided_slice") >= 5 * LAYERS
    # per layer one QKV GEMM, the output projection, the MLP's gate and up as one GEMM (sibling_linears), down
    assert sum(front.template_entry["calls"].values()) - cov["rmsnorm"]["total"] == 4 * LAYERS
    merged = [site for site in front.template_entry["sites"] if site.get("note", "").startswith("2 linear layers")]
    assert sum(site["count"] for site in merged) == LAYERS

    _assert_llvm_float16_matches_torch(path, family, attn, templates=True)


def _assert_llvm_float16_matches_torch(path, family: str, attn: str, **options) -> None:
    """The export compiled for llvm in float16 (``options``: compile's knobs), called as users call it, against
    the torch model in float32 on the kept positions."""
    from stof_tvm.models import hf_export as hx

    inputs = hx.example_inputs(family, BATCH, SEQ)
    expected = hx.torch_outputs(hx.build_model(family, "tiny", attn), inputs)
    art = stof_tvm.compile(path, mask="dense", batch=BATCH, seq_len=SEQ, target="llvm", dtype="float16", **options)
    out = art.load()(inputs)["last_hidden_state"]
    kept = inputs["attention_mask"].astype(bool)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out[kept] - expected[kept]) / np.linalg.norm(expected[kept]) < 5e-3


def _attention_kv_shapes(mod) -> list:
    """The shapes of K and V that each sparse attention kernel call of ``mod["main"]`` passes."""
    found = []

    def visit(expr):
        if (isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get("relax.call_tir"))
                and expr.args[0].name_hint.startswith("stof_attention_")):
            found.append([tuple(int(x) for x in arg.ty.shape.values) for arg in expr.args[1].fields[1:3]])

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


@pytest.mark.parametrize("form, kv_heads, heads", [(("llama", "eager", "dynamo", 18), 2, 4),
                                                   (("mistral", "sdpa", "torchscript", 17), 1, 2),
                                                   (("qwen2", "sdpa", "dynamo", 18), 1, 2)], ids=str)
@pytest.mark.parametrize("kernel", ["block", "row"])
def test_grouped_query_attention_reads_unrepeated_kv_heads(hf_export, form, kv_heads, heads, kernel):
    """The sparse kernels read grouped-query K and V as the projections wrote them ([B, Hkv, S, D]: the graph's
    key/value repeat, canonical.layout.RepeatedKVHeads, is left out), and the model still matches torch float32 (the
    kernel on every pair, float16 on llvm)."""
    family, attn, exporter, opset = form
    path = hf_export(family, attn, exporter, opset, False, BATCH, SEQ)
    front = front_end(path, mask="dense", batch=BATCH, seq_len=SEQ, target="llvm", dtype="float16",
                      kernel=kernel, schedule=False)
    head_dim = front.sites[0].head_dim
    assert front.sites[0].heads == heads and front.sites[0].kv_heads == kv_heads
    assert _attention_kv_shapes(front.mod) == [[(BATCH, kv_heads, SEQ, head_dim)] * 2] * LAYERS
    assert f"read from their {kv_heads} key/value heads" in front.choice.reason
    _assert_llvm_float16_matches_torch(path, family, attn, kernel=kernel)


def test_grouped_query_attention_on_wgmma_reads_unrepeated_kv_heads(hf_export):
    """The same on the Hopper kernel, compiled for CUDA (front end: the kernel call and its K and V)."""
    path = hf_export("llama", "eager", "dynamo", 18, False, BATCH, SEQ)
    front = front_end(path, mask="causal", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16",
                      kernel="wgmma", schedule=False)
    assert front.choice.kind == "wgmma"
    assert _attention_kv_shapes(front.mod) == [[(BATCH, 2, SEQ, 32)] * 2] * LAYERS


def test_grouped_qkv_gemm_gains_zero_columns_to_run_on_wgmma(llama_export):
    """A grouped-query model whose Q, K and V together are no whole number of wgmma tiles (9 query heads of 64 on
    one key/value head: 704 columns, as SmolLM2-360M's 1600) still gets its one GEMM on wgmma: the weight gains 64
    zero columns (768) and each part is sliced from the columns it had, so the extra ones are never read."""
    batch, seq = 2, 768                   # 1536 rows: 72 tiles of 128 x 128 once padded
    _, path = llama_export(576, 9, 1, batch, seq)
    front = front_end(path, mask="bigbird", batch=batch, seq_len=seq, target="cuda", dtype="float16",
                      schedule=False)
    (site,) = [site for site in front.template_entry["sites"] if site["chain"] == "qkv_gemm"]
    (stage,) = site["stages"]
    assert stage["template"] == "gemm_wgmma" and stage["shape"] == {"m": batch * seq, "n": 768, "k": 576}
    assert "64 zero columns let it run on wgmma" in site["note"]
    slices = []
    relax.analysis.post_order_visit(front.mod["main"], lambda e: slices.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.strided_slice"
                                    and int(e.args[0].ty.shape[-1]) == 768 else None)
    bounds = sorted((int(s.args[2][0]), int(s.args[3][0])) for s in slices)
    assert bounds == [(0, 576), (576, 640), (640, 704)]          # Q, K, V: none reaches the zero columns


def test_gate_and_up_weights_imported_as_parameters_still_make_one_gemm(llama_export):
    """Weights of 64K elements or more are imported as parameters, not constants (every real-size model's: HF Llama's
    gate and up at hidden 256 and 512 features here), and a float16 compile casts the RMSNorm output once per
    reader: gate and up are still one GEMM (the weights concatenated in the weight transform), and the model, called
    as users call it on llvm through the templates' definitions, still matches torch float32."""
    from stof_tvm.models import hf_export as hx

    model, path = llama_export(256, 4, 2, BATCH, SEQ)
    front = front_end(path, mask="dense", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16", schedule=False)
    merged = [site for site in front.template_entry["sites"] if site.get("note", "").startswith("2 linear layers")]
    assert [site["stages"][0]["shape"]["n"] for site in merged] == [2 * 512]
    inputs = hx.example_inputs("llama", BATCH, SEQ)
    expected = hx.torch_outputs(model, inputs)
    art = stof_tvm.compile(path, mask="dense", batch=BATCH, seq_len=SEQ, target="llvm", dtype="float16",
                           templates=True)
    assert any(site.get("note", "").startswith("2 linear layers") for site in art.manifest["templates"]["sites"])
    out = art.load()(inputs)["last_hidden_state"]
    kept = inputs["attention_mask"].astype(bool)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out[kept] - expected[kept]) / np.linalg.norm(expected[kept]) < 5e-3


@pytest.mark.parametrize("form", [("bert", "sdpa", "torchscript", 17), ("gpt2", "eager", "torchscript", 17),
                                  ("t5", "eager", "torchscript", 17), ("deberta", "eager", "torchscript", 17),
                                  ("llama", "eager", "dynamo", 18), ("qwen2", "sdpa", "torchscript", 17)],
                         ids=_form_id)
def test_weights_imported_as_parameters_take_the_same_templates_as_constants(hf_export, form, monkeypatch):
    """A real-size model's weights are parameters (initializers of 64K elements or more), a tiny model's constants:
    every rewrite must take both, or the tiny corpus hides what real models miss (it hid that gate and up stayed two
    GEMMs). With the threshold at 4K elements the tiny models' weight matrices become parameters (biases, gammas and
    tables stay constants, as at real size); the template calls and the coverage must not change."""
    from stof_tvm.compiler import onnx_shapes

    family, attn, exporter, opset = form
    path = hf_export(family, attn, exporter, opset, False, BATCH, SEQ)

    def templates_and_coverage():
        front = front_end(path, mask="bigbird", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16",
                          schedule=False)
        params = len(front.mod["main"].params) - int(front.mod["main"].attrs["num_input"])
        return dict(front.template_entry["calls"]), front.coverage, params

    calls, coverage, constant_params = templates_and_coverage()
    monkeypatch.setattr(onnx_shapes, "WEIGHT_MIN_ELEMENTS", 4096)
    as_parameters = templates_and_coverage()
    assert as_parameters[2] > constant_params          # the weight matrices did become parameters
    assert as_parameters[:2] == (calls, coverage)
