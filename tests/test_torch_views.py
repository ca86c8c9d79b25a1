"""Torch tensors into TVM kernels (stof_tvm.torch_views): views into a larger allocation at 16-byte offsets are read
in place by the kernels whose Q/K/V buffers take an element offset, as the compile path's views are; other
misaligned or strided tensors are copied. On the CPU (llvm), through the call users write: AttentionPlan.run.

Session 9's H200 run failed two TMA checks with ``FromDLPack: Data is not aligned to 64 bytes``: Q/K/V as views
16 bytes into one packed allocation, handed to ``tvm.runtime.from_dlpack`` as torch exports them (the offset in
the data pointer)."""
import math

import numpy as np
import pytest
import tvm

from attention_reference import assert_attention_close, reference_attention
from stof_tvm import AttentionPlan, normalize_mask
from stof_tvm import attention as attention_api
from stof_tvm.torch_views import ALIGNMENT, tvm_tensor

torch = pytest.importorskip("torch")

B, H, S, D = 2, 3, 100, 64          # B*H*S*D*2 bytes is a multiple of 64: only the start offset misaligns


def packed_qkv(offset: int, dtype=torch.float16):
    """Q, K, V as consecutive views into one flat allocation, starting ``offset`` elements into it."""
    n = B * H * S * D
    packed = torch.randn(offset + 3 * n, generator=torch.Generator().manual_seed(offset), dtype=torch.float32)
    packed = packed.to(dtype)
    return packed, [packed[offset + i * n:offset + (i + 1) * n].view(B, H, S, D) for i in range(3)]


def test_a_view_at_16_bytes_is_the_same_memory_passed_with_an_aligned_pointer():
    packed, (q, _, _) = packed_qkv(8)
    assert packed.data_ptr() % ALIGNMENT == 0 and q.data_ptr() % ALIGNMENT == 16
    with pytest.raises(Exception, match="not aligned to 64 bytes"):
        tvm.runtime.from_dlpack(q)                       # what the H200 run hit
    shared, owner = tvm_tensor(q, 16)
    assert owner is q and shared.data_ptr() == q.data_ptr() and tuple(shared.shape) == tuple(q.shape)
    np.testing.assert_array_equal(shared.numpy(), q.numpy())


@pytest.mark.parametrize("offset, allowed", [(8, 0), (1, 16), (4, 16)])
def test_offsets_the_kernel_does_not_take_are_copied(offset, allowed):
    _, (q, _, _) = packed_qkv(offset)
    shared, owner = tvm_tensor(q, allowed)
    assert owner is not q and owner.data_ptr() % ALIGNMENT == 0 and shared.data_ptr() == owner.data_ptr()
    np.testing.assert_array_equal(shared.numpy(), q.numpy())


def test_aligned_tensors_are_shared_and_strided_ones_copied():
    x = torch.randn(B, H, S, D).to(torch.float16)
    shared, owner = tvm_tensor(x, 16)
    assert owner is x and shared.data_ptr() == x.data_ptr()
    strided = x.transpose(1, 2)
    shared, owner = tvm_tensor(strided, 16)
    assert owner.is_contiguous() and owner.data_ptr() != x.data_ptr()
    np.testing.assert_array_equal(shared.numpy(), strided.contiguous().numpy())


def test_view_offsets_match_the_kernels_buffers():
    """The offsets AttentionPlan passes views at are the kernels' ``offset_factor`` (VIEW_ALIGN elements of a
    16-bit dtype); the row-wise kernel's buffers take none."""
    from stof_tvm.schedules import attention_blockwise, attention_wgmma

    assert attention_api._VIEW_BYTES == {"block": 2 * attention_blockwise.VIEW_ALIGN,
                                         "wgmma": 2 * attention_wgmma.VIEW_ALIGN}


@pytest.mark.parametrize("kernel", ["block", "row"])
@pytest.mark.parametrize("offset", [8, 1])
def test_attention_plan_runs_packed_views(kernel, offset, monkeypatch):
    """Q/K/V sliced from one packed projection, through ``AttentionPlan.run`` on llvm: exact against float64 in
    every case; the block-wise kernel reads the 16-byte-offset views in place (no copy of Q, K or V is made)."""
    _, qkv = packed_qkv(offset)
    copies = []
    original = attention_api.tvm_tensor

    def counting(t, offset_bytes=0):
        shared, owner = original(t, offset_bytes)
        copies.append(owner is not t)
        return shared, owner

    monkeypatch.setattr(attention_api, "tvm_tensor", counting)
    plan = AttentionPlan("causal", (B, H, S, D), "float16", kernel=kernel, target="llvm")
    out = torch.full((B, H, S, D), float("nan"), dtype=torch.float16)
    assert plan.run(*qkv, out=out) is out
    assert copies[:3] == [kernel == "row" or offset != 8] * 3 and copies[3] is False
    q, k, v = (t.numpy() for t in qkv)
    mask4 = normalize_mask("causal", batch=B, heads=H, seq_q=S, seq_k=S)
    assert_attention_close(out.numpy(), reference_attention(q, k, v, mask4, 1 / math.sqrt(D)), mask4, "float16")
