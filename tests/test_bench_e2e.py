"""scripts/bench_e2e.py, the end-to-end harness: its pure parts (shapes, rows, compile options, comparisons, work
counts, kernel classes), its torch attention under the sparse mask against the exported graph under the same mask,
and (slow) the whole flow on the CPU: export, background compiles, torch baseline, checks, JSON and table."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_e2e  # noqa: E402
import e2e_models  # noqa: E402


def test_parse_shape_and_rows():
    assert bench_e2e.parse_shape("8x512") == (8, 512)
    for bad in ("8", "0x128", "ax2"):
        with pytest.raises(Exception, match="shape"):
            bench_e2e.parse_shape(bad)
    rows = bench_e2e.rows_to_run(["vit-base", "bert-base"], [(8, 512), (8, 128), (1, 128)])
    # ViT's length is its patch grid + class token: 8x512 and 8x128 are one row
    assert rows == [("vit-base", 8, 197), ("vit-base", 1, 197), ("bert-base", 8, 512), ("bert-base", 8, 128),
                    ("bert-base", 1, 128)]
    assert e2e_models.seq_len(e2e_models.spec("vit-base-384"), 128) == 577
    # --rows: exactly the rows given, in order (ViT's length replaced, duplicates dropped), models x shapes ignored
    picked = [bench_e2e.parse_row(t) for t in ("bert-base:8x512", "vit-base-384:8x512", "gpt2:16x2048",
                                               "bert-base:8x512")]
    assert bench_e2e.rows_to_run(["t5-base"], [(1, 128)], picked) == [("bert-base", 8, 512), ("vit-base-384", 8, 577),
                                                                      ("gpt2", 16, 2048)]
    for bad in ("bert-base", "bert-huge:8x512", "gpt2:8"):
        with pytest.raises(Exception, match="row|shape"):
            bench_e2e.parse_row(bad)
    args = bench_e2e.parser().parse_args(["--rows", "roberta-base:1x128", "t5-base:16x2048"])
    assert args.rows == [("roberta-base", (1, 128)), ("t5-base", (16, 2048))]
    with pytest.raises(ValueError, match="model"):
        e2e_models.spec("bert-huge")


def test_compile_options_of_each_stage():
    args = bench_e2e.parser().parse_args(["--ours-options", '{"gemm": "mma"}'])
    args.target, args.dtype = "cuda", "float16"
    assert bench_e2e.compile_options("ours", args) == {"target": "cuda", "dtype": "float16", "cuda_graph": True,
                                                       "gemm": "mma"}
    assert bench_e2e.compile_options("ours-nograph", args)["cuda_graph"] is False
    assert bench_e2e.compile_options("tvm-default", args) == {"target": "cuda", "dtype": "float16"}
    args.target = "llvm"
    assert bench_e2e.compile_options("ours", args)["cuda_graph"] is False


def test_ours_variants_add_their_options_on_top_of_ours():
    args = bench_e2e.parser().parse_args(["--ours-options", '{"gemm": "wgmma"}', "--ours-variants",
                                          'lean={"lean_padding": true}', 'mma={"gemm": "mma"}'])
    args.target, args.dtype = "cuda", "float16"
    assert bench_e2e.variant_stages(args) == ("ours:lean", "ours:mma")
    assert bench_e2e.compile_options("ours:lean", args) == {"target": "cuda", "dtype": "float16", "cuda_graph": True,
                                                            "gemm": "wgmma", "lean_padding": True}
    assert bench_e2e.compile_options("ours:mma", args)["gemm"] == "mma"
    assert bench_e2e.compile_options("ours", args)["gemm"] == "wgmma"
    assert bench_e2e.artifact_dir(Path("w"), "ours:lean") == Path("w") / "ours-lean"
    for bad in ("lean", "a b={}", 'x=[1]', "x={oops"):
        with pytest.raises(SystemExit):
            bench_e2e.parser().parse_args(["--ours-variants", bad])
    row = bench_e2e.summarise({"ours_ms": 2.0, "ours_ok": True, "ours:lean_ms": 1.6, "ours:lean_wall_ms": 1.7,
                               "ours:lean_ok": True}, 2e-3)
    assert row["ours:lean_vs_ours"] == pytest.approx(1.25)
    assert bench_e2e.variant_labels(row) == ["ours:lean"]
    row = bench_e2e.summarise({"ours_ms": 2.0, "ours_ok": True, "ours:lean_ms": 1.6, "ours:lean_ok": True,
                               "ours_interleaved_ms": 1.9, "ours:lean_interleaved_ms": 2.0}, 2e-3)
    assert row["ours:lean_interleaved_vs_ours"] == pytest.approx(0.95)
    assert bench_e2e.variant_labels(row) == ["ours:lean"]


def test_summarise_gives_the_interleaved_ratio_against_the_best_baseline_where_it_was_interleaved():
    base = {"ours_ms": 1.5, "ours_ok": True, "ours_interleaved_ms": 1.6, "ort_ms": 2.1, "ort_ok": True,
            "torch-flex_ms": 2.2, "torch-flex_ok": True}
    row = bench_e2e.summarise(dict(base, ort_interleaved_ms=2.2), 2e-3)
    assert row["best_baseline"] == "ort" and row["ours_vs_best_interleaved"] == pytest.approx(2.2 / 1.6)
    assert "ours_vs_best_interleaved" not in bench_e2e.summarise(dict(base, ort_ms=2.3), 2e-3)   # flex best: none
    assert bench_e2e.variant_labels(row) == []


def test_summarise_counts_only_checked_baselines():
    row = {"device": "cuda", "flops": 790e9, "bytes": 0.0,
           "torch-eager_ms": 2.0, "torch-eager_ok": True, "torch-compile_ms": 1.0, "torch-compile_ok": False,
           "ort_ms": 1.6, "ort_ok": True, "tvm-default_ms": 4.0, "tvm-default_ok": True,
           "ours_ms": 0.8, "ours_ok": True, "ours-call_ms": 1.0, "ours-call_ok": True, "torch-flex_failed": "boom",
           "ours_compile": {"coverage": {"linear": {"total": 72, "accelerated": 70, "fallback": []},
                                         "attention": {"total": 12, "accelerated": 12, "fallback": []}}}}
    got = bench_e2e.summarise(row, 2e-3)
    assert got["best_baseline"] == "ort" and got["best_baseline_ms"] == 1.6      # compile was wrong: not counted
    assert got["ours_vs_best"] == pytest.approx(2.0) and got["ours-call_vs_best"] == pytest.approx(1.6)
    assert got["ours_vs_tvm"] == pytest.approx(5.0) and got["ours-call_vs_tvm"] == pytest.approx(4.0)
    assert got["limit_ms"] == pytest.approx(1.0) and got["ours_fraction"] == pytest.approx(1.25)
    # 790 GFLOP in 0.8 ms is 987.5 TFLOP/s: 1.25 of the peak; no bytes: memory fraction 0
    assert got["ours_compute_fraction"] == pytest.approx(1.25) and got["ours_memory_fraction"] == 0.0
    assert got["ours-call_compute_fraction"] == pytest.approx(1.0)
    assert got["ours_linears"] == "70/72" and got["ours_attention_sites"] == "12/12"
    text = bench_e2e.bl.format_table([{**got, "shape": "8x512"}], bench_e2e.TABLE)
    assert "70/72" in text and "12/12" in text
    assert got["status"] == "wrong:torch-compile error:torch-flex"
    cpu = bench_e2e.summarise({"device": "cpu", "flops": 1.0, "bytes": 1.0, "ours_ms": 1.0, "ours_ok": True}, 2e-3)
    assert "limit_ms" not in cpu and cpu["status"] == "ok" and "ours_vs_best" not in cpu
    assert bench_e2e.summarise({"child_exit": -9}, 2e-3)["status"] == "exit:-9"


def test_work_counts_weights_tokens_and_kept_pairs():
    info = {"hidden": 8, "heads": 2, "head_dim": 4, "layers": 3, "matmul_weights": 100, "dense_weights": 150}
    got = e2e_models.work(info, batch=2, length=5, kept_pairs=7)
    assert got["gemm_flops"] == 2 * 10 * 100
    assert got["attention_flops"] == 4 * 2 * 2 * 7 * 4 * 3
    assert got["flops"] == got["gemm_flops"] + got["attention_flops"]
    assert got["bytes"] == 2 * (150 + 2 * 10 * 8 * 4)


def test_kernel_classes_fold_the_profile():
    rows = [{"symbol": "fused_gemm_wgmma_bias_gelu", "ms": 2.0, "calls": 12, "share": 0.4},
            {"symbol": "blockwise_attention", "ms": 1.0, "calls": 12, "share": 0.2},
            {"symbol": "residual_layernorm", "ms": 0.5, "calls": 24, "share": 0.1},
            {"symbol": "vm.builtin.alloc_tensor", "ms": 0.25, "calls": 50, "share": 0.05},
            {"symbol": "qkv_projection_kn", "ms": 1.0, "calls": 12, "share": 0.2},
            {"symbol": "fused_add_tanh", "ms": 0.25, "calls": 1, "share": 0.05}]
    got = bench_e2e.class_breakdown(rows)
    assert [r["class"] for r in got] == ["gemm", "attention", "norm", "vm/memory", "other"]
    assert got[0]["ms"] == 3.0 and got[0]["calls"] == 24 and got[0]["share"] == pytest.approx(0.6)


def test_timeline_text_names_each_class_and_kernel():
    summary = {"calls": 20, "kernels_per_call": 3, "span_us": 20.5, "idle_us": 0.5, "kernel_us": 22.0,
               "classes": [{"class": "gemm", "us": 10.5, "kernels": 1.0, "share": 0.51}],
               "kernels": [{"kernel": "stof_gemm_wgmma_m128_kernel", "us": 10.5, "kernels": 1.0, "share": 0.51}]}
    text = bench_e2e.timeline_text(summary)
    assert "3 kernels a call, span 20.5 us (idle 0.5)" in text and "22.0 us (they overlap)" in text
    assert "gemm" in text and "stof_gemm_wgmma_m128_kernel" in text and "51.0%" in text


# ------------------------------------------------------------------------------------------ with torch
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_masked_attention_matches_the_exported_graph_under_the_same_mask(tmp_path, name):
    """The harness's float32 reference (the HF model with ``stof_masked_sdpa``) computes what stof-tvm computes:
    the exported graph with the sparse mask ANDed into its attention (GPT-2 and Llama: causal AND BigBird; Llama's
    K and V with fewer heads than Q), by onnx's reference evaluator; and the mask changes the result (it is not
    dense at this length)."""
    pytest.importorskip("transformers")
    import onnx
    import torch

    import e2e_torch
    import stof_tvm
    from stof_tvm.models.reference import reference_outputs

    model = e2e_models.spec(name)
    assert model.family in e2e_models.CAUSAL_FAMILIES
    feeds = e2e_models.inputs(model, 1, 256, seed=3)
    torch_model = e2e_models.build(model, "eager", seed=0)
    path = e2e_models.export(torch_model, feeds, str(tmp_path / f"{name}.onnx"))
    keep = np.asarray(stof_tvm.make_mask("bigbird", 256), bool)
    assert not keep.all()
    e2e_torch.register()
    e2e_torch.set_mask(keep, causal=True, device="cpu", flex_mask=False)
    args = tuple(torch.from_numpy(feeds[n]) for n in torch_model.input_names)
    e2e_torch.use_attention(torch_model, e2e_torch.MASKED_SDPA)
    sparse = e2e_torch.forward(torch_model, args)().numpy()
    e2e_torch.use_attention(torch_model, "sdpa")
    dense = e2e_torch.forward(torch_model, args)().numpy()
    graph = reference_outputs(onnx.load(path), keep[None, None], feeds)["last_hidden_state"]
    rel = np.linalg.norm(sparse - graph) / np.linalg.norm(graph)
    assert rel < 1e-5
    assert np.linalg.norm(dense - graph) / np.linalg.norm(graph) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("model, linears, mask_applied", [("roberta-tiny", "0/12", "bigbird"),
                                                          ("llama-tiny", "0/14", "bigbird AND causal")])
def test_the_whole_flow_on_the_cpu(tmp_path, model, linears, mask_applied):
    """A CPU run of the harness (llvm, float32): ours (call path and module), TVM's default pipeline and eager SDPA
    each checked against float32 and timed; the JSON has every figure (ours' coverage from its manifest included),
    the table prints. RoBERTa, and a grouped-query decoder (Llama: 4 query heads on 2 key/value heads, causal AND
    the sparse mask; its reference reads K and V with their own heads)."""
    pytest.importorskip("transformers")
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_e2e.py"), "--device", "cpu",
                           "--models", model, "--shapes", "2x256", "--skip", "torch-compile", "torch-flex",
                           "ort", "--samples", "3", "--warmup", "1", "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["status"] == "ok", row
    for label in ("ours", "ours-call", "tvm-default", "torch-eager"):
        assert row[f"{label}_ok"] and row[f"{label}_ms"] > 0, label
        assert row[f"{label}_err"]["rel"] < 1e-4, label
    assert row["ours_kernel"] in ("block", "row") and row["tvm-default_compile"]["seconds"]["compile"] > 0
    assert row["ours_linears"] == linears         # llvm: the templates are CUDA kernels; 2 layers x 6 or 7 linears
    assert row["ours_attention_sites"] == "2/2" and row["mask_applied"] == mask_applied
    assert row["torch-compile_skipped"] == "--skip"
    assert row["ours_vs_best"] > 0 and row["mask_density"] < 1
    assert f"{model}  2x256" in proc.stdout


def test_benchmark_configs_use_published_init_and_hold_the_shape():
    """Base sizes: initializer_range 0.02 and position tables long enough for the shape (RoBERTa: L + 2); a
    length the table cannot hold is refused with a ValueError naming it, before any export or device work."""
    pytest.importorskip("transformers")
    roberta = e2e_models.config(e2e_models.spec("roberta-base"), "eager", 2048)
    assert roberta.initializer_range == 0.02 and roberta.max_position_embeddings == 2050
    gpt2 = e2e_models.config(e2e_models.spec("gpt2"), "eager", 512)
    assert gpt2.initializer_range == 0.02 and gpt2.n_positions == 1024
    tiny = e2e_models.spec("bert-tiny")
    with pytest.raises(ValueError, match="position embeddings"):
        e2e_models.check_length(tiny, e2e_models.config(tiny, "eager", 1024), 1024)
    e2e_models.check_length(tiny, e2e_models.config(tiny, "eager", 512), 512)


def test_the_decoder_rows_are_published_shapes_and_their_sizes_their_families_only():
    """``smollm2-360m``: a Llama decoder at SmolLM2-360M's published shape (15 query heads of 64 on 5 key/value
    heads, 362M weights); ``qwen2.5-0.5b``: Qwen2 at Qwen2.5-0.5B's (14 on 2); both causal; each size belongs to its
    family alone."""
    pytest.importorskip("transformers")
    from stof_tvm.models import hf_export

    model = e2e_models.spec("smollm2-360m")
    assert model.family in e2e_models.CAUSAL_FAMILIES and model.name in e2e_models.GPU_MODELS
    cfg = e2e_models.config(model, "sdpa", 2048)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (960, 32, 15, 5, 2560, 49152)
    assert cfg.initializer_range == 0.02 and cfg.max_position_embeddings >= 2048 and not cfg.use_cache
    qwen = e2e_models.spec("qwen2.5-0.5b")
    assert qwen.family in e2e_models.CAUSAL_FAMILIES and qwen.name in e2e_models.GPU_MODELS
    cfg = e2e_models.config(qwen, "sdpa", 2048)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (896, 24, 14, 2, 4864, 151936)
    for family, size in (("bert", "360m"), ("llama", "base"), ("llama", "large"), ("qwen2", "360m"),
                         ("llama", "500m")):
        with pytest.raises(ValueError, match="size"):
            hf_export.make_config(family, size)


def test_tvm_default_pipeline_baseline_matches_torch(tmp_path):
    """scripts/e2e_tvm.py: plain TVM (from_onnx of the same export, default pipeline; llvm here) matches the HF
    model in float32 at batch 1 with a padded row; without the shape folding TVM's importer rejects the export
    (why the baseline folds it first)."""
    pytest.importorskip("transformers")
    import onnx
    import torch
    from tvm.relax.frontend.onnx import from_onnx

    import e2e_tvm
    from stof_tvm.models import hf_export

    model = e2e_models.spec("bert-tiny")
    feeds = hf_export.example_inputs("bert", 1, 64, padded_rows=1, seed=5, size="tiny")
    assert feeds["attention_mask"].min() == 0
    torch_model = e2e_models.build(model, "eager", seed=0)
    path = e2e_models.export(torch_model, feeds, str(tmp_path / "bert.onnx"))
    with torch.no_grad():
        ref = torch_model(*(torch.from_numpy(feeds[n]) for n in torch_model.input_names)).numpy()
    with pytest.raises(Exception, match="broadcast_to"):
        from_onnx(onnx.load(path), shape_dict={k: list(v.shape) for k, v in feeds.items()},
                  dtype_dict={k: str(v.dtype) for k, v in feeds.items()})
    report = e2e_tvm.build(path, str(tmp_path / "tvm"), 1, 64, target="llvm", dtype="float32")
    assert [i["name"] for i in report["inputs"]] == list(torch_model.input_names)
    runner = e2e_tvm.TvmRunner(str(tmp_path / "tvm"), "cpu")
    out = runner.run(runner.prepare(feeds)).numpy()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
    with pytest.raises(ValueError, match="input_ids"):
        runner.prepare({"attention_mask": feeds["attention_mask"]})
