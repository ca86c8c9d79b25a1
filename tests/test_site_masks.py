"""Attention layers whose masks differ (stof_tvm/compiler/mask_sources.py): ModernBERT's global and sliding-window
layers. Where each differing term is key padding of one input with a constant part and one site's keeps all the
others keep, that site's mask is shared and each stricter site adds its own as a score bias; otherwise the plan
is refused with the reason. (The exactness of the compiled model: the ModernBERT cases of tests/test_hf_exports.py.)
"""
import numpy as np
import pytest
from tvm import relax

from stof_tvm.compiler.attention_match import find_attention_sites
from stof_tvm.compiler.mask_sources import SITE_MASK_FILL, plan_masks

B, H, S, D = 2, 2, 16, 8
FMIN = float(np.finfo(np.float32).min)
WINDOW = np.abs(np.arange(S)[:, None] - np.arange(S)[None, :]) <= 3


def _layers(windows: list) -> relax.Function:
    """Attention layers on one Q/K/V, each keeping the keys the [B, S] ``mask`` input keeps, and-ed with its
    window (a [S, S] keep, or None)."""
    mask = relax.Var("mask", relax.TensorType([B, S], "int64"))
    q, k, v = (relax.Var(n, relax.TensorType([B, H, S, D], "float32")) for n in "qkv")
    bb = relax.BlockBuilder()
    with bb.function("main", [mask, q, k, v]):
        with bb.dataflow():
            keys = bb.emit(relax.op.reshape(bb.emit(relax.op.not_equal(mask, relax.const(0, "int64"))),
                                            [B, 1, 1, S]))
            x = q
            for window in windows:
                keep = keys if window is None else bb.emit(relax.op.logical_and(
                    keys, relax.const(window.reshape(1, 1, S, S))))
                scores = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
                masked = bb.emit(relax.op.where(keep, scores, relax.const(FMIN, "float32")))
                x = bb.emit(relax.op.matmul(bb.emit(relax.op.nn.softmax(masked, axis=-1)), v))
            out = bb.emit_output(x)
        bb.emit_func_output(out)
    return bb.get()["main"].with_attr("num_input", 4)


def test_a_sliding_window_layer_beside_a_global_one():
    """The global layer's padding is the shared mask (on the device), the window layer's mask its score bias."""
    func = _layers([None, WINDOW])
    sites = find_attention_sites(func)
    plan = plan_masks(func, sites)
    assert plan.padding == "mask" and plan.const_keep is None and not plan.runtime
    assert plan.site_bias is not None and plan.site_bias[0] is None and plan.site_bias[1] is not None
    assert [int(d) for d in plan.site_bias[1].ty.shape.values][-2:] == [S, S]
    assert SITE_MASK_FILL > float(np.finfo(np.float16).min)


def test_layers_with_the_same_mask_have_no_site_bias():
    func = _layers([WINDOW, WINDOW])
    plan = plan_masks(func, find_attention_sites(func))
    assert plan.site_bias is None and plan.const_keep is not None


def test_masks_neither_of_which_holds_the_other_are_refused():
    """A window layer and a layer keeping only the keys outside it: no mask to share, the reason says so."""
    func = _layers([WINDOW, ~WINDOW])
    with pytest.raises(ValueError, match="no site's mask keeps every key the others keep"):
        plan_masks(func, find_attention_sites(func))
