"""The canonical-form rules (stof_tvm/compiler/canonical): one small hand-built Relax graph per exporter form; each
test asserts the rewritten form and that the rewrite computes the same values on llvm."""
import math

import numpy as np
import pytest
import tvm
from tvm import relax

from stof_tvm.compiler import canonical
from stof_tvm.compiler.attention_match import find_attention_sites
from stof_tvm.compiler.canonical import activations, attention, layout

B, H, S, D = 2, 2, 16, 8
F32 = "float32"
FMIN = float(np.finfo(np.float32).min)


def _tensor(name, shape, dtype=F32):
    return relax.Var(name, relax.TensorType(list(shape), dtype))


def _function(params, body) -> relax.Function:
    """A Relax function of ``params`` whose bindings ``body(bb, *params)`` emits (returns the output)."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()["main"]


def _ops(func) -> list[str]:
    return [b.value.op.name for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def _run(func, args):
    vm = relax.VirtualMachine(tvm.compile(tvm.IRModule({"main": func}), target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _inputs(func, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p in func.params:
        shape, dtype = [int(d) for d in p.ty.shape.values], str(p.ty.dtype)
        out.append(rng.random(shape) < 0.7 if dtype == "bool" else (2 * rng.standard_normal(shape)).astype(dtype))
    return out


def _check(rule, func, expect_ops, absent_ops=(), rtol=1e-5):
    """``rule`` rewrites ``func`` so that it has ``expect_ops`` and none of ``absent_ops``, computing the same;
    applied once more it finds nothing to do (the fixed point)."""
    out = rule.apply(func)
    assert out is not None, f"{rule.name} did not fire"
    ops = _ops(out)
    assert all(op in ops for op in expect_ops), ops
    assert not any(op in ops for op in absent_ops), ops
    assert rule.apply(out) is None
    args = _inputs(func)
    want, got = _run(func, args), _run(out, args)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    return out


# ---- activations ------------------------------------------------------------------------------------------

def test_integer_powers_become_products():
    """pow(x, 2) and pow(x, 3) (T5's RMSNorm, gelu_new's cube) -> products; pow(x, 2.5) stays (fast-math powf is
    NaN for negative bases on CUDA)."""
    def body(bb, x):
        sq = bb.emit(relax.op.power(x, relax.const(2.0, F32)))
        cube = bb.emit(relax.op.power(x, relax.const(3.0, F32)))
        odd = bb.emit(relax.op.power(relax.op.abs(x), relax.const(2.5, F32)))
        return relax.op.add(relax.op.add(sq, cube), odd)

    out = _check(activations.IntegerPowers(), _function([_tensor("x", (4, 8))], body), ["relax.multiply"])
    assert _ops(out).count("relax.power") == 1


def _erf_torchscript(bb, x):          # x * (erf(x / sqrt2) + 1) * 0.5
    erf = bb.emit(relax.op.erf(relax.op.divide(x, relax.const(1.4142135381698608, F32))))
    return relax.op.multiply(relax.op.multiply(x, relax.op.add(erf, relax.const(1.0, F32))), relax.const(0.5, F32))


def _erf_dynamo(bb, x):               # x * (0.5 * (erf(x / sqrt2) + 1))
    erf = bb.emit(relax.op.erf(relax.op.divide(x, relax.const(1.4142135381698608, F32))))
    return relax.op.multiply(x, relax.op.multiply(relax.const(0.5, F32), relax.op.add(erf, relax.const(1.0, F32))))


def _erf_scaled(bb, x):               # 0.5 * x * (1 + erf(x * (1 / sqrt2)))
    erf = bb.emit(relax.op.erf(relax.op.multiply(x, relax.const(1 / math.sqrt(2), F32))))
    half_x = bb.emit(relax.op.multiply(relax.const(0.5, F32), x))
    return relax.op.multiply(half_x, relax.op.add(relax.const(1.0, F32), erf))


def _tanh_gelu_new(bb, x):            # 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))
    cube = bb.emit(relax.op.power(x, relax.const(3.0, F32)))
    inner = relax.op.add(x, relax.op.multiply(relax.const(0.044715, F32), cube))
    t = bb.emit(relax.op.tanh(relax.op.multiply(relax.const(math.sqrt(2 / math.pi), F32), inner)))
    return relax.op.multiply(relax.op.multiply(relax.const(0.5, F32), x), relax.op.add(relax.const(1.0, F32), t))


def _tanh_fast(bb, x):                # 0.5 * x * (1 + tanh(c1 * x + c2 * x * x * x)) (onnxruntime's FastGelu)
    cube = bb.emit(relax.op.multiply(relax.op.multiply(x, x), x))
    c1, c2 = math.sqrt(2 / math.pi), 0.044715 * math.sqrt(2 / math.pi)
    arg = relax.op.add(relax.op.multiply(x, relax.const(c1, F32)), relax.op.multiply(cube, relax.const(c2, F32)))
    t = bb.emit(relax.op.tanh(arg))
    return relax.op.multiply(x, relax.op.multiply(relax.op.add(t, relax.const(1.0, F32)), relax.const(0.5, F32)))


def _biased(form):
    """The GELU of a linear layer's output: the bias add must stay outside the recognised GELU."""
    def body(bb, x, w):
        y = bb.emit(relax.op.add(relax.op.matmul(x, w), relax.const(np.linspace(-1, 1, 16).astype(F32))))
        return form(bb, y)
    return body


@pytest.mark.parametrize("form", [_erf_torchscript, _erf_dynamo, _erf_scaled])
def test_erf_gelu_spellings_become_nn_gelu(form):
    func = _function([_tensor("x", (4, 8)), _tensor("w", (8, 16))], _biased(form))
    out = _check(activations.GeluErf(), func, ["relax.nn.gelu", "relax.matmul", "relax.add"], ["relax.erf"])
    assert activations.GeluTanh().apply(out) is None


@pytest.mark.parametrize("form", [_tanh_gelu_new, _tanh_fast])
def test_tanh_gelu_spellings_become_nn_gelu_tanh(form):
    func = _function([_tensor("x", (4, 8)), _tensor("w", (8, 16))], _biased(form))
    assert activations.GeluErf().apply(func) is None          # 4.7e-4 apart from the exact GELU: not confused
    _check(activations.GeluTanh(), func, ["relax.nn.gelu_tanh"], ["relax.tanh", "relax.power"])


def test_near_gelu_is_left_alone():
    """A formula that only resembles GELU (0.4 instead of 0.5; two different tensors) is not rewritten."""
    def wrong_half(bb, x):
        erf = bb.emit(relax.op.erf(relax.op.divide(x, relax.const(math.sqrt(2), F32))))
        return relax.op.multiply(relax.op.multiply(x, relax.op.add(erf, relax.const(1.0, F32))), relax.const(0.4, F32))

    def two_inputs(bb, x, y):
        erf = bb.emit(relax.op.erf(relax.op.divide(y, relax.const(math.sqrt(2), F32))))
        return relax.op.multiply(relax.op.multiply(x, relax.op.add(erf, relax.const(1.0, F32))), relax.const(0.5, F32))

    assert activations.GeluErf().apply(_function([_tensor("x", (4, 8))], wrong_half)) is None
    assert activations.GeluErf().apply(_function([_tensor("x", (4, 8)), _tensor("y", (4, 8))], two_inputs)) is None


def test_no_op_casts_removed():
    """ViT's TorchScript Cast(float) after Softmax; a real cast stays."""
    def body(bb, x):
        p = bb.emit(relax.op.nn.softmax(x, axis=-1))
        same = bb.emit(relax.op.astype(relax.op.astype(p, F32), F32))
        return relax.op.astype(relax.op.astype(same, "float16"), F32)

    out = _check(activations.NoOpCasts(), _function([_tensor("x", (4, 8))], body), ["relax.astype"])
    assert _ops(out).count("relax.astype") == 2


def test_round_trip_casts_through_a_wider_type_removed():
    """A float16 model's softmax asked for in float32: ``Softmax`` (float16) -> float32 -> float16 is the softmax
    itself; a narrowing round trip (float32 -> float16 -> float32 rounds) and a trip into another type (float16 ->
    float32 -> bfloat16) stay."""
    def exact(bb, x):
        p = bb.emit(relax.op.nn.softmax(x, axis=-1))
        return relax.op.astype(bb.emit(relax.op.astype(p, F32)), "float16")

    out = _check(activations.RoundTripCasts(), _function([_tensor("x", (4, 8), "float16")], exact),
                 ["relax.nn.softmax"], ["relax.astype"])
    assert _ops(out) == ["relax.nn.softmax"]

    def kept(bb, x, h):
        rounded = relax.op.astype(bb.emit(relax.op.astype(x, "float16")), F32)
        other = relax.op.astype(bb.emit(relax.op.astype(h, F32)), "bfloat16")
        return relax.Tuple([bb.emit(rounded), bb.emit(other)])

    func = _function([_tensor("x", (4, 8)), _tensor("h", (4, 8), "float16")], kept)
    assert activations.RoundTripCasts().apply(func) is None


# ---- attention --------------------------------------------------------------------------------------------

def _attention(scale_form="scores", mask_form=None, fill=FMIN, guard=False):
    """softmax(Q K^T * s (+ mask)) V over [B, H, S, D] with the exporters' spellings of the scale and the mask."""
    q, k, v = _tensor("q", (B, H, S, D)), _tensor("k", (B, H, S, D)), _tensor("v", (B, H, S, D))
    keep = _tensor("keep", (B, 1, 1, S), "bool")
    root = math.sqrt(1 / math.sqrt(D))

    def body(bb, q, k, v, keep):
        k_t = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
        if scale_form == "split":      # SDPA decomposed: Q * sqrt(s), K^T * sqrt(s)
            scores = relax.op.matmul(bb.emit(relax.op.multiply(q, relax.const(root, F32))),
                                     bb.emit(relax.op.multiply(k_t, relax.const(root, F32))))
        else:
            scores = relax.op.multiply(relax.op.matmul(q, k_t), relax.const(1 / math.sqrt(D), F32))
        scores = bb.emit(scores)
        if mask_form == "additive_where":
            scores = bb.emit(relax.op.add(scores, bb.emit(relax.op.where(keep, relax.const(0.0, F32),
                                                                         relax.const(fill, F32)))))
        elif mask_form == "additive_where_swapped":
            neg = relax.op.logical_not(keep)
            scores = bb.emit(relax.op.add(bb.emit(relax.op.where(neg, relax.const(fill, F32),
                                                                 relax.const(0.0, F32))), scores))
        elif mask_form == "select":
            scores = bb.emit(relax.op.where(keep, scores, relax.const(fill, F32)))
        probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
        if guard:
            probs = bb.emit(relax.op.where(relax.op.isnan(probs), relax.const(0.0, F32), probs))
        return relax.op.matmul(probs, v)

    return _function([q, k, v, keep], body)


def test_split_scale_moves_onto_the_scores():
    func = _attention("split")
    assert not find_attention_sites(func) or find_attention_sites(func)[0].scale == 1.0
    out = _check(attention.SplitScale(), func, ["relax.matmul"])
    sites = find_attention_sites(out)
    assert len(sites) == 1 and math.isclose(sites[0].scale, 1 / math.sqrt(D), rel_tol=1e-6)


def test_split_scale_leaves_linear_layers():
    """A weight product (rank 2) keeps its scaled input: only products of two activations are scores."""
    def body(bb, x, w):
        return relax.op.matmul(bb.emit(relax.op.multiply(x, relax.const(0.5, F32))), w)

    assert attention.SplitScale().apply(_function([_tensor("x", (4, 8)), _tensor("w", (8, 8))], body)) is None


@pytest.mark.parametrize("form", ["additive_where", "additive_where_swapped"])
def test_additive_boolean_mask_becomes_a_select(form):
    out = _check(attention.SelectMask(), _attention(mask_form=form), ["relax.where"], ["relax.add"])
    (site,) = find_attention_sites(out)
    assert [t.kind for t in site.terms] == ["where"]


def test_select_mask_keeps_an_added_bias_apart():
    """T5's ``position_bias + where(keep, 0, min)`` added as one term is not the softmax's input: left alone."""
    def body(bb, s, bias, keep):
        term = bb.emit(relax.op.add(bias, bb.emit(relax.op.where(keep, relax.const(0.0, F32), relax.const(FMIN, F32)))))
        return relax.op.nn.softmax(bb.emit(relax.op.add(s, term)), axis=-1)

    func = _function([_tensor("s", (B, H, S, S)), _tensor("bias", (1, H, S, S)), _tensor("keep", (B, 1, 1, S), "bool")],
                     body)
    assert attention.SelectMask().apply(func) is None


def test_infinite_fill_becomes_finite_and_the_nan_guard_goes():
    """SDPA's where(mask, 0, -inf) + isnan guard -> finite fill, no guard; equal wherever a row keeps a key."""
    func = _attention("split", "additive_where", fill=-np.inf, guard=True)
    out, applied = canonical.canonicalize_function(func)
    assert {"split_scale", "select_mask", "finite_fill", "nan_guard"} <= set(applied)
    ops = _ops(out)
    assert "relax.isnan" not in ops and ops.count("relax.where") == 1
    fills = [b.value.args[2] for block in out.body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.where"]
    assert float(fills[0].value.numpy()) == FMIN
    args = _inputs(func)
    args[3][:, :, :, 0] = True       # every row keeps a key
    np.testing.assert_allclose(_run(out, args), _run(func, args), rtol=1e-5, atol=1e-5)
    (site,) = find_attention_sites(out)
    assert [t.kind for t in site.terms] == ["where"]


def test_nan_guard_of_something_else_stays():
    def body(bb, x):
        y = bb.emit(relax.op.log(x))
        return relax.op.where(relax.op.isnan(y), relax.const(0.0, F32), y)

    assert attention.NanGuard().apply(_function([_tensor("x", (4, 8))], body)) is None


# ---- layout -----------------------------------------------------------------------------------------------

def test_single_concat_removed():
    def body(bb, x):
        return relax.op.nn.softmax(bb.emit(relax.op.concat([x], axis=-2)), axis=-1)

    _check(layout.SingleConcat(), _function([_tensor("x", (B, H, S, D))], body), ["relax.nn.softmax"],
           ["relax.concat"])


@pytest.mark.parametrize("others", [0, 1])
def test_concat_parts_with_no_element_dropped(others):
    """Phi-3's rotary embedding: ``concat([rotated, x[..., D:]])`` with an empty pass-through part (the whole head
    rotates) -> the rotated part alone (or a concat of the parts left); the empty slice goes with it."""
    def body(bb, x):
        rotated = bb.emit(relax.op.negative(x))
        empty = bb.emit(relax.op.strided_slice(x, axes=[3], begin=[D], end=[D]))
        parts = [rotated, empty] + [x] * others
        return relax.op.nn.softmax(bb.emit(relax.op.concat(parts, axis=-1)), axis=-1)

    absent = ["relax.strided_slice"] + (["relax.concat"] if not others else [])
    _check(layout.SingleConcat(), _function([_tensor("x", (B, H, S, D))], body), ["relax.nn.softmax"], absent)


def test_transpose_through_3d_becomes_one_permute():
    """The dynamo exporter's K^T: reshape to [B*H, S, D], transpose, reshape to [B, H, D, S]."""
    def body(bb, k):
        flat = bb.emit(relax.op.reshape(k, [B * H, S, D]))
        return relax.op.reshape(bb.emit(relax.op.permute_dims(flat, [0, 2, 1])), [B, H, D, S])

    out = _check(layout.TransposeThrough3D(), _function([_tensor("k", (B, H, S, D))], body), ["relax.permute_dims"],
                 ["relax.reshape"])
    assert [int(a) for a in out.body.blocks[0].bindings[-1].value.attrs.axes] == [0, 1, 3, 2]


def _flat_heads_attention(bb, q, k, v, bias):
    """HF DeBERTa's attention: both products over [B*H, S, D] views, a flat [B*H, S, S] term added to the scaled
    scores, reshaped to [B, H, S, S] for the softmax, the output reshaped back."""
    flat = lambda x: bb.emit(relax.op.reshape(x, [B * H, S, D]))  # noqa: E731
    k_t = bb.emit(relax.op.permute_dims(flat(k), [0, 2, 1]))
    scores = bb.emit(relax.op.multiply(bb.emit(relax.op.matmul(flat(q), k_t)), relax.const(0.125, F32)))
    scores = bb.emit(relax.op.reshape(bb.emit(relax.op.add(scores, bias)), [B, H, S, S]))
    probs = bb.emit(relax.op.reshape(bb.emit(relax.op.nn.softmax(scores, axis=-1)), [B * H, S, S]))
    return relax.op.reshape(bb.emit(relax.op.matmul(probs, flat(v))), [B, H, S, D])


def test_flat_heads_products_move_onto_the_heads():
    """The reshapes back to [B, H, ...] move down to the products, which then take the 4-D heads: the attention
    matcher finds the site (scale 0.125, the flat term as an additive bias), and the values are the same."""
    params = [_tensor(n, (B, H, S, D)) for n in "qkv"] + [_tensor("bias", (B * H, S, S))]
    func = _function(params, _flat_heads_attention)
    assert find_attention_sites(func) == []
    out, applied = canonical.canonicalize_function(func, [layout.FlatHeads()])
    assert set(applied) == {"flat_heads"}
    (site,) = find_attention_sites(out)
    assert (site.batch, site.heads, site.seq_q, site.head_dim) == (B, H, S, D) and site.scale == pytest.approx(0.125)
    assert [term.kind for term in site.terms] == ["add"]
    args = _inputs(func)
    np.testing.assert_allclose(_run(out, args), _run(func, args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(B * H, 1, S), (B * H, S, 1), (1, 1, S), (S, S), ()])
def test_flat_heads_takes_a_broadcast_term(shape):
    """A term added to the flat scores that broadcasts over queries or heads (HF BLOOM's ALiBi: ``baddbmm`` of a
    [B*H, 1, Sk] tensor) is reshaped onto the heads with them; a lower-rank one stays as it is (before, a [B*H, 1,
    Sk] term was added to the [B, H, S, Sk] scores as it was: broadcast wrongly, or an error at B > 1)."""
    params = [_tensor(n, (B, H, S, D)) for n in "qkv"] + [_tensor("bias", shape)]
    func = _function(params, _flat_heads_attention)
    out, applied = canonical.canonicalize_function(func, [layout.FlatHeads()])
    (site,) = find_attention_sites(out)
    assert [term.kind for term in site.terms] == ["add"] and len(site.terms[0].expr.ty.shape) in (len(shape), 4)
    args = _inputs(func)
    np.testing.assert_allclose(_run(out, args), _run(func, args), rtol=1e-5, atol=1e-5)


def test_flat_heads_leaves_other_flat_reshapes():
    """A reshape of a flat product whose operands are not views of heads (a weight) is left alone."""
    def body(bb, x, w):
        return relax.op.reshape(bb.emit(relax.op.matmul(x, w)), [B, H, S, D])

    func = _function([_tensor("x", (B * H, S, D)), _tensor("w", (B * H, D, D))], body)
    assert layout.FlatHeads().apply(func) is None


def test_permute_pairs_fold_into_the_head_split():
    def body(bb, x):
        heads = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(x, [B, S, H, D])), [0, 2, 1, 3]))
        return relax.op.permute_dims(heads, [0, 1, 3, 2])

    out = _check(layout.PermutePairs(), _function([_tensor("x", (B, S, H * D))], body), ["relax.permute_dims"])
    assert _ops(out).count("relax.permute_dims") == 1


def test_rules_reach_a_fixed_point_on_every_form():
    """All rules together: the decomposed-SDPA form ends in the canonical one, and a canonical graph is left as it
    is (no rule fires)."""
    out, applied = canonical.canonicalize_function(_attention("split", "additive_where", fill=-np.inf, guard=True))
    assert applied
    assert canonical.canonicalize_function(out)[1] == {}
    assert canonical.canonicalize_function(_attention("scores", "select"))[1] == {}


@pytest.mark.parametrize("bias", [True, False])
def test_flat_linear_runs_on_the_inputs_shape(bias):
    """HF Conv1D (GPT-2): reshape to [M, K], matmul (+ bias), reshape back; also through a head merge."""
    def body(bb, x, w):
        flat = bb.emit(relax.op.reshape(x, [B * S, H * D]))
        y = bb.emit(relax.op.matmul(flat, w))
        if bias:
            y = bb.emit(relax.op.add(y, relax.const(np.arange(3 * H * D, dtype=F32) / 10)))
        return relax.op.reshape(y, [B, S, 3 * H * D])

    func = _function([_tensor("x", (B, S, H, D)), _tensor("w", (H * D, 3 * H * D))], body)
    out = _check(layout.FlatLinear(), func, ["relax.matmul"])
    matmul = next(b.value for block in out.body.blocks for b in block.bindings
                  if isinstance(b.value, relax.Call) and b.value.op.name == "relax.matmul")
    assert [int(v) for v in matmul.args[0].ty.shape.values] == [B, S, H * D]


def _patch_conv(weight_param: bool, bias: bool, strides=(4, 4), padding=(0, 0, 0, 0), image=(8, 12)):
    """ViT's patch embedding: ``conv2d(x, W)`` (+ a [1, O, 1, 1] bias), flattened to [B, O, P] and transposed."""
    out_channels, channels, p = 16, 3, 4
    weight = (np.random.default_rng(1).standard_normal((out_channels, channels, p, p)) / 4).astype(F32)
    params = [_tensor("x", (B, channels) + image)] + ([_tensor("w", weight.shape)] if weight_param else [])

    def body(bb, x, w=None):
        w = relax.const(weight) if w is None else w
        y = bb.emit(relax.op.nn.conv2d(x, w, strides=list(strides), padding=list(padding)))
        if bias:
            y = bb.emit(relax.op.add(y, relax.const(np.arange(out_channels, dtype=F32).reshape(1, -1, 1, 1) / 8)))
        rows, cols = [int(d) for d in y.ty.shape.values[2:]]
        return relax.op.permute_dims(relax.op.reshape(y, [B, out_channels, rows * cols]), [0, 2, 1])

    return _function(params, body)


@pytest.mark.parametrize("weight_param, bias", [(False, True), (True, True), (True, False)])
def test_patch_embedding_becomes_a_linear_on_patches(weight_param, bias):
    """A stride-4 4x4 conv of an 8x12 image (6 patches) -> matmul of the [B, 6, 48] patch rows by the [48, 16]
    weight (+ the [16] bias), the form the linear matcher takes; the same values on llvm."""
    out = _check(layout.PatchEmbedding(), _patch_conv(weight_param, bias), ["relax.matmul"], ["relax.nn.conv2d"])
    matmul = next(b.value for block in out.body.blocks for b in block.bindings
                  if isinstance(b.value, relax.Call) and b.value.op.name == "relax.matmul")
    assert [int(v) for v in matmul.args[0].ty.shape.values] == [B, 6, 48]
    assert [int(v) for v in matmul.args[1].ty.shape.values] == [48, 16]
    assert ("relax.add" in _ops(out)) == bias


@pytest.mark.parametrize("conv", [{"strides": (2, 2)}, {"padding": (1, 1, 1, 1)}, {"image": (8, 10)}])
def test_overlapping_or_padded_conv_stays(conv):
    """A conv whose windows overlap, that pads, or whose image is not whole patches is not a patch embedding."""
    assert layout.PatchEmbedding().apply(_patch_conv(False, True, **conv)) is None


# ---- constants ---------------------------------------------------------------------------------------------

def test_repeated_constant_becomes_one_slice():
    """BERT without token_type_ids: folding leaves ``add(words, C)`` with C the one token-type row repeated over
    [B, S]; the rule keeps one [1, 1, hidden] row, the values stay the same on llvm."""
    from stof_tvm.compiler.canonical import constants

    row = np.random.default_rng(3).standard_normal(128).astype(F32)
    full = np.broadcast_to(row, (4, 256, 128)).copy()

    def body(bb, x):
        return relax.op.add(x, relax.const(full))

    out = _check(constants.RepeatedConstant(), _function([_tensor("x", (4, 256, 128))], body), ["relax.add"])
    (add,) = [b.value for block in out.body.blocks for b in block.bindings]
    assert tuple(add.args[1].value.shape) == (1, 1, 128)


def test_constant_that_varies_or_sets_the_shape_stays():
    """A constant whose slices differ, and one whose repeats give the output its shape, are left as they are."""
    from stof_tvm.compiler.canonical import constants

    varied = np.random.default_rng(4).standard_normal((4, 256, 128)).astype(F32)
    repeated = np.broadcast_to(varied[:1, :1], varied.shape).copy()
    for x_shape, value in (((4, 256, 128), varied), ((1, 1, 128), repeated)):
        func = _function([_tensor("x", x_shape)], lambda bb, x, value=value: relax.op.add(x, relax.const(value)))
        assert constants.RepeatedConstant().apply(func) is None


def test_soft_capped_scores_are_named_as_why_no_site():
    """Gemma 2's logit soft-capping (``tanh(scores / c) * c`` before the softmax) is no attention site, and the
    operator that stopped the match is named for the fallback's warning; a mask term's own operators are not."""
    from stof_tvm.compiler.attention_match import unmatched_score_ops

    def body(bb, q, k, v, keep):
        scores = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
        capped = bb.emit(relax.op.tanh(bb.emit(relax.op.divide(scores, relax.const(50.0, F32)))))
        capped = bb.emit(relax.op.multiply(capped, relax.const(50.0, F32)))
        masked = bb.emit(relax.op.where(bb.emit(relax.op.logical_not(keep)), relax.const(FMIN, F32), capped))
        return relax.op.matmul(bb.emit(relax.op.nn.softmax(masked, axis=-1)), v)

    params = [_tensor(n, (B, H, S, D)) for n in "qkv"] + [_tensor("keep", (1, 1, S, S), "bool")]
    func = _function(params, body)
    assert find_attention_sites(func) == [] and unmatched_score_ops(func) == ["tanh"]
    plain = _function([_tensor(n, (B, H, S, D)) for n in "qkv"], lambda bb, q, k, v: relax.op.matmul(
        bb.emit(relax.op.nn.softmax(bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2])))),
                                    axis=-1)), v))
    assert len(find_attention_sites(plain)) == 1 and unmatched_score_ops(plain) == []


def _scaled_head_split(bb, x, w, b, linear=True):
    """OPT's Q: ``q_proj(x) * scaling`` (or, with ``linear=False``, ``x * scaling``), then the head split."""
    y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, w)), b)) if linear else x
    scaled = bb.emit(relax.op.multiply(y, relax.const(np.float32(D ** -0.5))))
    return relax.op.permute_dims(bb.emit(relax.op.reshape(scaled, [B, S, H, D])), [0, 2, 1, 3])


def test_a_scale_after_a_linear_moves_past_the_head_split():
    """The scale ends after the permute: the head split reads the linear layer directly (what the QKV matcher
    takes), and the result is unchanged."""
    params = [_tensor("x", (B, S, H * D)), _tensor("w", (H * D, H * D)), _tensor("b", (H * D,))]
    func = _function(params, _scaled_head_split)
    out, applied = canonical.canonicalize_function(func, [layout.ScaleAfterHeadSplit()])
    assert applied == {"scale_after_head_split": 1} and layout.ScaleAfterHeadSplit().apply(out) is None
    assert _ops(out) == ["relax.matmul", "relax.add", "relax.reshape", "relax.permute_dims", "relax.multiply"]
    args = _inputs(func)
    np.testing.assert_allclose(_run(out, args), _run(func, args), rtol=1e-6, atol=1e-6)


def test_a_scale_of_something_else_than_a_linear_stays():
    params = [_tensor("x", (B, S, H * D)), _tensor("w", (H * D, H * D)), _tensor("b", (H * D,))]
    func = _function(params, lambda bb, x, w, b: _scaled_head_split(bb, x, w, b, linear=False))
    assert layout.ScaleAfterHeadSplit().apply(func) is None


def _repeat_kv(bb, x, out_shape):
    """HF's ``repeat_kv`` as exporters write it: expand_dims at 2, broadcast over the group, reshape."""
    b, kv, s, d = (int(n) for n in x.ty.shape.values)
    spread = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(x, 2)), [b, kv, 3, s, d]))
    return relax.op.reshape(spread, out_shape)


@pytest.mark.parametrize("out_shape", [(B, 6, S, D), (B * 6, S, D)], ids=["heads", "flat"])
def test_repeated_kv_heads_become_one_repeat(out_shape):
    """Two key/value heads each repeated for three query heads, onto [B, 6, S, D] or SDPA's flat [B * 6, S, D]:
    one ``repeat`` along the heads (a reshape after it for the flat form), the same values."""
    func = _function([_tensor("k", (B, 2, S, D))], lambda bb, k: _repeat_kv(bb, k, out_shape))
    out = _check(layout.RepeatedKVHeads(), func, ["relax.repeat"], ["relax.broadcast_to", "relax.expand_dims"])
    assert _ops(out) == ["relax.repeat"] + (["relax.reshape"] if len(out_shape) == 3 else [])


def test_a_broadcast_that_is_not_a_head_repeat_stays():
    """expand_dims at another axis: a different order of the elements, left as it is."""
    def body(bb, k):
        spread = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(k, 1)), [B, 3, 2, S, D]))
        return relax.op.reshape(spread, [B, 6, S, D])

    assert layout.RepeatedKVHeads().apply(_function([_tensor("k", (B, 2, S, D))], body)) is None
