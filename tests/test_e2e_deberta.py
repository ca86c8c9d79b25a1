"""The end-to-end harness's DeBERTa row (scripts/bench_e2e.py with scripts/e2e_torch.py, scripts/e2e_models.py):
DeBERTa's own disentangled attention under the sparse keep-mask is the float32 reference stof-tvm's output must
match, its dense form is untouched by the mask machinery (also in a deep copy), FlexAttention is refused with the
reason the row records, the work count takes the c2p / p2c terms, and (slow) the row runs end to end on the CPU."""
import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_e2e  # noqa: E402
import e2e_models  # noqa: E402

LENGTH = 128


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def tiny_deberta(tmp_path_factory):
    """The tiny DeBERTa of the harness, its export at 1 x 128, its inputs and BigBird's keep-mask (registered)."""
    pytest.importorskip("transformers")
    import e2e_torch
    import stof_tvm

    model = e2e_models.spec("deberta-tiny")
    feeds = e2e_models.inputs(model, 1, LENGTH, seed=4)
    torch_model = e2e_models.build(model, "eager", seed=0, length=LENGTH)
    path = e2e_models.export(torch_model, feeds, str(tmp_path_factory.mktemp("deberta") / "deberta.onnx"))
    keep = np.asarray(stof_tvm.make_mask("bigbird", LENGTH), bool)
    assert not keep.all() and keep.any(axis=1).all()        # sparse, and no query row loses every key
    e2e_torch.register()
    e2e_torch.set_mask(keep, causal=False, device="cpu", flex_mask=False)
    return torch_model, feeds, path, keep


def _forward(torch_model, feeds, attention: str) -> np.ndarray:
    import torch

    import e2e_torch

    e2e_torch.use_attention(torch_model, attention)
    args = tuple(torch.from_numpy(feeds[n]) for n in torch_model.input_names)
    return e2e_torch.forward(torch_model, args)().numpy()


def test_sparse_reference_is_what_stof_tvm_computes(tiny_deberta):
    """The reference (DeBERTa's attention, keep ANDed into its mask) matches stof-tvm's llvm build of the export
    under the same mask, and differs from the dense model, which the mask machinery leaves exact: switched off,
    and in a deep copy taken while it was on (as bench_e2e copies the float32 model into float16)."""
    import e2e_torch
    import stof_tvm

    torch_model, feeds, path, keep = tiny_deberta
    dense = _forward(torch_model, feeds, e2e_torch.dense_attention("deberta"))
    sparse = _forward(torch_model, feeds, e2e_torch.MASKED_SDPA)
    copied = copy.deepcopy(torch_model)
    assert np.array_equal(_forward(copied, feeds, e2e_torch.MASKED_SDPA), sparse)
    assert np.array_equal(_forward(copied, feeds, "eager"), dense)
    assert np.array_equal(_forward(torch_model, feeds, "eager"), dense)
    assert _rel(sparse, dense) > 1e-2

    artifact = stof_tvm.compile(path, mask="bigbird", batch=1, seq_len=LENGTH, target="llvm", dtype="float32")
    ours = artifact.load()(**feeds)[e2e_models.OUTPUT]
    assert _rel(ours, sparse) < 1e-5


def test_keep_mask_reaches_every_attention_module_and_flex_is_refused(tiny_deberta):
    """Each DisentangledSelfAttention gets the hook once (switching twice does not stack hooks), and asking for
    FlexAttention fails with the reason the harness records for the skipped stage."""
    import e2e_torch

    torch_model = tiny_deberta[0]
    for _ in range(2):
        e2e_torch.use_attention(torch_model, e2e_torch.MASKED_SDPA)
    modules = [m for m in torch_model.modules() if type(m).__name__ == "DisentangledSelfAttention"]
    assert len(modules) == 2 and all(len(m._forward_pre_hooks) == 1 for m in modules)
    assert all(getattr(m, e2e_torch.KEEP_FLAG) for m in modules)
    with pytest.raises(ValueError, match="FlexAttention"):
        e2e_torch.use_attention(torch_model, e2e_torch.FLEX)
    assert e2e_torch.dense_attention("deberta") == "eager" and e2e_torch.dense_attention("bert") == "sdpa"


def test_work_counts_the_disentangled_terms(tiny_deberta):
    """shape_info finds c2p and p2c and the relative table's rows (2 x 32 buckets); work adds one head_dim dot
    product per kept pair and term, and the table's projections as matrix FLOPs; other models are unchanged."""
    info = e2e_models.shape_info(tiny_deberta[0])
    assert (info["score_terms"], info["relative_rows"]) == (2, 64)
    assert info["layers"] == 2 and info["heads"] == 2 and info["head_dim"] == 64
    got = e2e_models.work(info, batch=2, length=LENGTH, kept_pairs=100)
    assert got["attention_flops"] == (4 + 2 * 2) * 2 * 2 * 100 * 64 * 2
    assert got["gemm_flops"] == 2 * 2 * LENGTH * info["matmul_weights"] + 2 * 64 * 128 ** 2 * 2 * 2
    plain = dict(info, score_terms=0, relative_rows=0)
    assert e2e_models.work(plain, 2, LENGTH, 100)["attention_flops"] == 4 * 2 * 2 * 100 * 64 * 2
    base = e2e_models.config(e2e_models.spec("deberta-v3-base"), "eager", 2048)
    assert base.initializer_range == 0.02 and not base.position_biased_input     # no position table to grow
    e2e_models.check_length(e2e_models.spec("deberta-v3-base"), base, 2048)
    assert "deberta-v3-base" in e2e_models.GPU_MODELS


def test_a_stage_the_model_cannot_run_is_skipped_with_its_reason(tmp_path):
    row = bench_e2e.Row(tmp_path / "row.json", deadline=1e12, skip={"torch-flex": "no score_mod"}, base={})
    assert row.stage("torch-flex", pytest.fail, "must not run") is None
    assert row.data["torch-flex_skipped"] == "no score_mod"


@pytest.mark.slow
def test_the_deberta_row_on_the_cpu(tmp_path):
    """deberta-tiny through the harness (llvm, float32): ours and torch-eager (DeBERTa's own attention) checked
    against their float32 references and timed; torch-flex not run, with its reason in the JSON."""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_e2e.py"), "--device", "cpu",
                           "--rows", f"deberta-tiny:2x{LENGTH}", "--skip", "torch-compile", "ort", "tvm-default",
                           "--samples", "3", "--warmup", "1", "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["status"] == "ok", row
    for label in ("ours", "ours-call", "torch-eager"):
        assert row[f"{label}_ok"] and row[f"{label}_err"]["rel"] < 1e-4, label
    assert row["ours_attention_sites"] == "2/2" and row["dense_attention"] == "eager"
    assert "FlexAttention" in row["torch-flex_skipped"] and "torch-flex_ms" not in row
    assert row["sparse_vs_dense_rel"] > 1e-2 and row["mask_applied"] == "bigbird + bias"
