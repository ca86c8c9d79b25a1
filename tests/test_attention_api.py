"""The public attention API: sparse_attention and AttentionPlan, through both kernels, on the CPU (llvm).

Outputs are compared with a float64 dense reference; the API allocates its outputs, so the poisoned-output
checks use ``AttentionPlan.run(out=...)`` with NaN-filled arrays.
"""
import math

import numpy as np
import pytest
import tvm

import stof_tvm
from attention_reference import assert_attention_close, numpy_dtype, random_qkv, reference_attention
from stof_tvm import AttentionPlan, normalize_mask, sparse_attention
from stof_tvm import attention as attention_api
from stof_tvm.sparse_formats import mask_stats, stof_rule


def check(out, q, k, v, mask, dtype, scale=None):
    batch, heads, seq_q, head_dim = q.shape
    mask4 = normalize_mask(mask, batch=batch, heads=heads, seq_q=seq_q, seq_k=k.shape[2])
    ref = reference_attention(q, k, v, mask4, 1 / math.sqrt(head_dim) if scale is None else scale)
    assert out.shape == q.shape and str(out.dtype) == dtype
    assert_attention_close(out, ref, mask4, dtype)


@pytest.mark.parametrize("kernel", ["row", "block"])
@pytest.mark.parametrize("dtype,head_dim", [("float16", 64), ("bfloat16", 128)])
def test_both_kernels_match_reference(kernel, dtype, head_dim):
    q, k, v = random_qkv(2, 2, 100, 100, head_dim, dtype)
    check(sparse_attention(q, k, v, "bigbird", kernel=kernel), q, k, v, "bigbird", dtype)


@pytest.mark.parametrize("kernel", ["auto", "row", "block"])
@pytest.mark.parametrize("dtype,head_dim", [("float16", 32), ("bfloat16", 80), ("float16", 96), ("float16", 256)])
def test_head_dims_of_real_models(kernel, dtype, head_dim):
    """Head dims other than 64 and 128 (small BERTs and Swin: 32, Phi: 80, 96, Gemma: 256) through the plan."""
    q, k, v = random_qkv(1, 2, 50, 50, head_dim, dtype)
    plan = AttentionPlan("sliding:window=8", q.shape, dtype, kernel=kernel)
    check(plan.run(q, k, v), q, k, v, "sliding:window=8", dtype)


def test_head_dims_agree_with_the_kernels():
    from stof_tvm.schedules import attention_blockwise, attention_rowwise
    assert attention_api._HEAD_DIMS == attention_blockwise.SUPPORTED_HEAD_DIMS == attention_rowwise.SUPPORTED_HEAD_DIMS


@pytest.mark.parametrize("kernel", ["row", "block"])
@pytest.mark.parametrize("seq,mask", [(1, "causal"), (7, "sliding:window=2"), (64, "longformer:window=4,globals=2"),
                                      (100, "dilated:window=16"), (128, "bigbird:window=8,globals=8,block=16")])
def test_sequence_lengths_through_the_plan(kernel, seq, mask):
    plan = AttentionPlan(mask, (1, 2, seq, 64), "float16", kernel=kernel)
    q, k, v = random_qkv(1, 2, seq, seq, 64, "float16", seed=seq)
    out = np.full(q.shape, np.nan, np.float16)
    assert plan.run(q, k, v, out=out) is out
    check(out, q, k, v, mask, "float16")


@pytest.mark.parametrize("kernel", ["row", "block"])
def test_every_mask_form(kernel):
    batch, heads, seq = 2, 3, 48
    rng = np.random.default_rng(9)
    forms = {
        "spec": "sliding:window=5",
        "2d": rng.random((seq, seq)) < 0.2,
        "per-batch": rng.random((batch, seq, seq)) < 0.2,
        "per-head": rng.random((batch, heads, seq, seq)) < 0.05,
        "callable": lambda b, h, i, j: (j <= i) & ((i - j) % (h + 2) == 0),
        "padding": np.array([48, 5]),
        "broadcast view": stof_tvm.make_mask("causal", seq, batch=batch, heads=heads),
    }
    q, k, v = random_qkv(batch, heads, seq, seq, 64, "float16")
    for name, mask in forms.items():
        out = sparse_attention(q, k, v, mask, kernel=kernel)
        check(out, q, k, v, mask, "float16")


@pytest.mark.parametrize("kernel", ["row", "block"])
def test_cross_attention_and_scale(kernel):
    q, _, _ = random_qkv(1, 2, 30, 30, 64, "float16", seed=1)
    _, k, v = random_qkv(1, 2, 75, 75, 64, "float16", seed=2)
    mask = np.random.default_rng(5).random((30, 75)) < 0.3
    check(sparse_attention(q, k, v, mask, kernel=kernel, scale=0.05), q, k, v, mask, "float16", scale=0.05)


def test_float32_runs_on_the_cpu_with_the_row_kernel():
    q, k, v = random_qkv(1, 2, 33, 33, 64, "float32")
    plan = AttentionPlan("causal", q.shape, "float32")
    assert plan.kernel == "row"
    check(plan.run(q, k, v), q, k, v, "causal", "float32")


@pytest.mark.parametrize("spec", ["dense", "sliding:window=2", "sliding:window=0"])
def test_auto_uses_the_kernel_choice(spec):
    seq = 512
    mask4 = normalize_mask(spec, seq_q=seq)
    plan = AttentionPlan(spec, (1, 1, seq, 64), "float16", kernel="auto")
    assert plan.kernel == stof_rule(mask_stats(mask4)) == attention_api.choose_kernel(
        mask4, batch=1, heads=1, head_dim=64, dtype="float16", target_kind="llvm")
    q, k, v = random_qkv(1, 1, seq, seq, 64, "float16")
    check(plan.run(q, k, v), q, k, v, spec, "float16")


def test_kernel_choice_covers_both_kernels():
    choose = attention_api.choose_kernel
    sparse = normalize_mask(np.eye(1024, dtype=bool), seq_q=1024)      # rho = 1/64 < tau = 1/36
    dense = normalize_mask("dense", seq_q=1024)
    args = dict(batch=1, heads=1, head_dim=64, dtype="float16", target_kind="cuda")
    assert choose(sparse, **args) == "row" and choose(dense, **args) == "block"


@pytest.mark.parametrize("spec, seq, head_dim", [("longformer", 8192, 64), ("bigbird", 8192, 128),
                                                  ("longformer", 16384, 128)])
def test_cuda_choice_splits_the_global_rows_of_one_long_sequence(spec, seq, head_dim):
    """B=1 with global rows (Longformer/BigBird at S >= 8192): each head's global tile row would run alone long
    after the rest of the grid; the automatic CUDA choice shares it between split-KV blocks (heavy-first). At
    B=16, S=4096 the grid is long enough, and the same mask is walked unsplit."""
    mask4 = normalize_mask(spec, seq_q=seq)
    kind, config = attention_api.choose_kernel_config(mask4, batch=1, heads=16, head_dim=head_dim,
                                                      dtype="float16", target_kind="cuda")
    assert kind == "block" and config.heavy_first and config.kv_splits > 1 and config.split_rows >= 1
    short = normalize_mask(spec, seq_q=4096)
    kind, config = attention_api.choose_kernel_config(short, batch=16, heads=16, head_dim=head_dim,
                                                      dtype="float16", target_kind="cuda")
    assert kind == "row" or config.kv_splits == 1


def test_compiled_kernels_are_cached(monkeypatch):
    attention_api.clear_kernel_cache()
    builds = []
    real_compile = tvm.compile
    monkeypatch.setattr(tvm, "compile", lambda *a, **kw: builds.append(1) or real_compile(*a, **kw))
    shape = (1, 2, 40, 64)
    q, k, v = random_qkv(*shape[:3], 40, 64, "float16")
    first = AttentionPlan("causal", shape, "float16", kernel="row")
    second_mask = np.random.default_rng(0).random((40, 40)) < 0.5
    second = AttentionPlan(second_mask, shape, "float16", kernel="row")
    assert len(builds) == 1                           # same shape, dtype, group layout: one build, any mask
    for _ in range(3):
        sparse_attention(q, k, v, "sliding:window=3", kernel="row")
    assert len(builds) == 1
    AttentionPlan("causal", shape, "float16", kernel="row", scale=0.5)
    AttentionPlan(np.ones((1, 2, 40, 40), bool), shape, "float16", kernel="row")  # per-head layout
    assert len(builds) == 3
    check(first.run(q, k, v), q, k, v, "causal", "float16")
    check(second.run(q, k, v), q, k, v, second_mask, "float16")


def test_plan_runs_many_inputs_and_saves(tmp_path):
    plan = AttentionPlan(np.array([20, 9]), (2, 2, 20, 64), "float16", kernel="row")
    for seed in range(3):
        q, k, v = random_qkv(2, 2, 20, 20, 64, "float16", seed=seed)
        check(plan.run(q, k, v), q, k, v, np.array([20, 9]), "float16")
    loaded = AttentionPlan.load(plan.save(tmp_path / "plan"))
    assert loaded.kernel == "row" and loaded.problem == plan.problem
    np.testing.assert_array_equal(loaded.run(q, k, v), plan.run(q, k, v))
    with pytest.raises(FileNotFoundError, match="AttentionPlan"):
        AttentionPlan.load(tmp_path)


def test_bad_inputs_raise_clear_errors():
    q, k, v = random_qkv(1, 2, 16, 16, 64, "float16")
    with pytest.raises(ValueError, match="k must have shape"):
        sparse_attention(q, k[..., :32], v, "causal")
    # K with fewer heads is grouped-query attention (V must then have as many), with heads it does not divide an error
    with pytest.raises(ValueError, match=r"v must have shape \(1, 1, 16, 64\)"):
        sparse_attention(q, k[:, :1], v, "causal")
    with pytest.raises(ValueError, match="kv_heads must be a positive divisor of the 2 heads, got 3"):
        sparse_attention(q, np.concatenate([k, k[:, :1]], axis=1), v, "causal")
    with pytest.raises(ValueError, match="v must have shape"):
        sparse_attention(q, k, v[..., :32], "causal")
    with pytest.raises(TypeError, match="v must have dtype float16"):
        sparse_attention(q, k, v.astype(np.float32), "causal")
    with pytest.raises(TypeError, match="dtype must be one of"):
        sparse_attention(q.astype(np.int16), k.astype(np.int16), v.astype(np.int16), "causal")
    q72, k72, v72 = random_qkv(1, 1, 8, 8, 72, "float16")
    with pytest.raises(ValueError, match="head dimension D must be a multiple of 16 from 32 to 256, got 72"):
        sparse_attention(q72, k72, v72, "causal")
    with pytest.raises(ValueError, match=r"last two dimensions must be \(16, 16\)"):
        sparse_attention(q, k, v, np.ones((16, 17), bool))
    with pytest.raises(ValueError, match="heads dimension must be 1 or 2"):
        sparse_attention(q, k, v, np.ones((1, 3, 16, 16), bool))
    with pytest.raises(ValueError, match="kernel must be one of"):
        sparse_attention(q, k, v, "causal", kernel="flash")
    with pytest.raises(ValueError, match="scale"):
        sparse_attention(q, k, v, "causal", scale=-1.0)
    with pytest.raises(ValueError, match="target kind"):
        sparse_attention(q, k, v, "causal", target="rocm")
    with pytest.raises(ValueError, match="k must be a"):
        sparse_attention(q, k.tolist(), v, "causal")
    with pytest.raises(ValueError, match="q must be a"):
        sparse_attention(q[0], k, v, "causal")
    plan = AttentionPlan("causal", q.shape, "float16", kernel="row")
    with pytest.raises(TypeError, match="all be numpy arrays"):
        plan.run(q, k.tolist(), v)
    with pytest.raises(ValueError, match="out must have"):
        plan.run(q, k, v, out=np.empty((1, 2, 16, 32), np.float16))
    with pytest.raises(TypeError, match="float16 and bfloat16"):
        AttentionPlan("causal", (1, 2, 16, 64), "float32", kernel="block")


@pytest.mark.skipif(tvm.cuda(0).exist, reason="checks the error raised when no GPU is present")
def test_cuda_target_without_gpu_is_an_error():
    q, k, v = random_qkv(1, 1, 8, 8, 64, "float16")
    with pytest.raises(ValueError, match="no GPU is present"):
        sparse_attention(q, k, v, "causal", target="cuda")
    with pytest.raises(ValueError, match="no GPU is present"):
        sparse_attention(q, k, v, "causal", target={"kind": "cuda", "arch": "sm_90"})
    plan = AttentionPlan("causal", q.shape, "float16", kernel="row", target={"kind": "cuda", "arch": "sm_90"})
    with pytest.raises(ValueError, match="no GPU is present"):
        plan.run(q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["row", "block"])
def test_torch_cuda_tensors_without_copies(kernel):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 3, 200, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = np.random.default_rng(1).random((2, 3, 200, 200)) < 0.1
    plan = AttentionPlan(mask, q.shape, q.dtype, kernel=kernel)
    out = torch.full_like(q, float("nan"))
    assert plan.run(q, k, v, out=out).data_ptr() == out.data_ptr()
    result = sparse_attention(q, k, v, mask, kernel=kernel)
    assert result.is_cuda and result.dtype == torch.bfloat16
    as_numpy = [t.float().cpu().numpy().astype(numpy_dtype("bfloat16")) for t in (q, k, v)]
    for got in (out, result):
        check(got.float().cpu().numpy().astype(numpy_dtype("bfloat16")), *as_numpy, mask, "bfloat16")


def test_sparse_attention_plans_once_per_mask(monkeypatch):
    """Repeated calls reuse the plan (no format build, no kernel choice per call); a new array is a new plan."""
    attention_api.clear_kernel_cache()
    builds = []
    original = attention_api._format_arrays
    monkeypatch.setattr(attention_api, "_format_arrays", lambda *a: builds.append(1) or original(*a))
    q, k, v = random_qkv(1, 2, 40, 40, 64, "float16", seed=7)
    mask = stof_tvm.make_mask("local:window=6", 40)
    first = stof_tvm.sparse_attention(q, k, v, mask, target="llvm")
    for _ in range(3):
        np.testing.assert_array_equal(stof_tvm.sparse_attention(q, k, v, mask, target="llvm"), first)
        stof_tvm.sparse_attention(q, k, v, "causal", target="llvm")
    assert len(builds) == 2
    stof_tvm.sparse_attention(q, k, v, mask.copy(), target="llvm")
    assert len(builds) == 3
