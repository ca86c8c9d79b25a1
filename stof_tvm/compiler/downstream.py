"""Replace the chains around attention with stof-tvm's fusion templates (schedules/templates).

Matched on the mixed-precision graph (16-bit inputs, float32 accumulation and LayerNorm) before the weight
transform is lifted, so that weight-only work this rewrite adds (concatenating Q/K/V weights, transposing a
weight for the wgmma GEMMs) moves into ``main_transform_params`` and runs once at load. Per encoder layer:

=====================================================  ===================================================
chain (as exporters emit it)                            templates
=====================================================  ===================================================
Q, K, V = three ``add(astype(matmul(X, W)), b)`` on     ``qkv_projection_kn`` into ``[3, B, H, S, D]``, then
the same ``X``, each ``reshape [B, S, H, D]`` +         views of it at Q's, K's and V's offsets when only the
``permute_dims``; or one such linear to                 block-wise attention kernel reads them, else one split
``[.., 3 * H * D]`` split into thirds (GPT-2)
``layer_norm(astype(linear) + residual)`` (output       ``gemm_kn`` + ``bias_residual_layernorm`` (unfused,
projection, FFN down-projection; either add order)      measured faster), or ``gemm_bias_residual_layernorm_kn``
                                                        when :mod:`.template_choice` ranks it faster
the same where the sum also feeds the next residual     the linear on its own GEMM (below), then
add (pre-LN: GPT-2, ViT)                                ``residual_layernorm``: the sum (16-bit, written for
                                                        the next residual add) and its LayerNorm in one kernel
                                                        (folded into the LayerNorm, the GEMM would run twice:
                                                        once more for the sum)
RMSNorm ``w * (X * rsqrt(mean(X * X) + eps))`` (T5,     ``residual_rmsnorm`` (the sum also written, 16-bit) where
pre-norm; :mod:`.rmsnorm_match`)                        ``X`` is a residual add, else ``rmsnorm``
``linear`` + erf GELU / tanh GELU / ReLU (FFN           ``gemm_bias_gelu_erf_kn`` / ``gemm_bias_gelu_tanh_kn``
up-projection)                                          / ``gemm_bias_relu_kn``
any other ``linear``                                    ``gemm_bias_kn``, ``gemm_kn`` without bias
=====================================================  ===================================================

A linear may have no bias (``astype(matmul(X, W))``, T5): the templates with an activation or the QKV projection
then add a zero bias constant.

``X`` is ``[..., K]`` (flattened to ``[M, K]``), ``W`` a ``[K, N]`` weight (parameter or constant), biases,
gamma and beta constants. A chain is rewritten only where its templates accept the shapes (16-bit dtype,
multiples of 16; LayerNorm rows multiples of 64, fused rows of 128; QKV head size a multiple of 16, any sequence);
anything else keeps TVM's default path. The LayerNorm templates take the model's epsilon; their output is
16-bit, so the residual stream between layers becomes 16-bit (as in a float16 PyTorch model).

``gemm="wgmma"`` maps the GEMM stages and the QKV projection to the Hopper ``*_wgmma`` templates where n % 128 and
k % 64 are 0 and the GEMM has at least ``WGMMA_MIN_TILES`` 128x128 output tiles (a partial last row tile counted
whole: any m, no padding) or enough split-K blocks, with the weight transposed to ``[N, K]``; other shapes stay on
mma.sync with a note. Under
``gemm="wgmma"`` an FFN (an erf-GELU ``linear`` used only by the down-projection of a residual LayerNorm chain)
becomes ``ffn_gelu_erf_wgmma`` (intermediate kept on chip) + ``bias_residual_layernorm`` where
:meth:`.template_choice.TemplateChooser.fused_ffn` picks it (hidden 128-256, rows enough to fill the GPU).
Under ``gemm="wgmma"`` a ``layer_norm(linear + residual)`` whose sum has no other user (post-LN: BERT, RoBERTa) becomes
one ``gemm_bias_residual_layernorm_wgmma`` call (the row tile's blocks one cluster sharing the row sums, so the sum
never leaves the SMs) where :meth:`.template_choice.TemplateChooser.fused_norm_wgmma` picks it, when ``norm_fusion``
is on (off by default: measured slower than the pair, BENCHMARKS.md session 19).
Knobs: :mod:`.template_choice`. On CUDA each PrimFunc is scheduled with its knobs; on the CPU the definitions run
unscheduled (TVM's default lowering), which keeps the rewrite testable without a GPU (a tuning record of the
definition, measured on llvm, is applied there too). The wgmma kernels are thread-level code built per knob set
(``template.kernel``), not scheduled.
:func:`use_templates` returns the manifest entry of every site. The linear-layer patterns live in
:mod:`.linear_match`, the QKV projection and its heads in :mod:`.qkv_heads`.
"""
from __future__ import annotations

import dataclasses
import json
import math

import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from .attention_match import resolve, static_shape
from .layout import fold_permute_pairs
from .linear_match import (ANY_LINEAR, LINEAR, LINEAR_BIAS, LINEAR_W, LINEAR_X, MATMUL, TEMPLATE_DTYPES, is_call,
                           ROW_MULTIPLE, linear_bias, linear_dims, padded_rows, transposed, users_of, wgmma_misfit,
                           zero_bias)
from .op_patterns import OPAQUE
from .qkv_heads import rewrite_qkv
from .sibling_linears import merge_sibling_linears
from .rmsnorm_match import compute_dtype, rewrite_rmsnorms
from .template_choice import KnobChoice, TemplateChooser

GEMMS = ("mma", "wgmma")


# GELU and its tanh approximation as operators: every exporter's spelling of them was brought to nn.gelu /
# nn.gelu_tanh by the canonical form (:mod:`.canonical.activations`)
LINEAR_GELU = is_op("relax.nn.gelu")(ANY_LINEAR)
LINEAR_GELU_TANH = is_op("relax.nn.gelu_tanh")(ANY_LINEAR)
LINEAR_RELU = is_op("relax.nn.relu")(ANY_LINEAR)
_RES, _GAMMA, _BETA = wildcard(), is_const(), is_const()
_LIN_OUT = is_op("relax.astype")(ANY_LINEAR) | ANY_LINEAR      # a linear with or without bias (GPT-2 dynamo: none)
_SUM = is_op("relax.add")(_LIN_OUT, _RES) | is_op("relax.add")(_RES, _LIN_OUT)
LINEAR_RESIDUAL_LN = is_op("relax.nn.layer_norm")(_SUM, _GAMMA, _BETA)
LN_INPUT = wildcard()
PLAIN_LN = is_op("relax.nn.layer_norm")(LN_INPUT, _GAMMA, _BETA)
_INNER = wildcard()
_INNER_CAST = is_op("relax.astype")(_INNER)
DOUBLE_CAST = is_op("relax.astype")(_INNER_CAST)


def _label(shape: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in shape.items())


def _merged_gemm_knobs(chosen: dict, knobs: dict, template: str = "") -> dict:
    """The ``gemm_knobs`` a chosen wgmma knob set of ``template`` takes: every plain knob, except that ``gelu_form``
    (a form of the ``fast_gelu`` epilogue) goes only to sets with ``fast_gelu``, so that one option can change a
    model's GELU GEMMs and leave its other GEMMs as chosen; then the knobs of an entry named after the template
    itself (``{"qkv_projection_wgmma": {"block_n": 256}}``: that template's calls alone)."""
    plain = {key: value for key, value in knobs.items()
             if not isinstance(value, dict) and (key != "gelu_form" or chosen.get("fast_gelu"))}
    return {**plain, **knobs.get(template, {})}


class _Templates:
    """Adds one PrimFunc per (template, shape, options) to the module and records every site."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target, database: str | None, gemm: str,
                 schedule: bool = True, gemm_knobs: dict | None = None, norm_fusion: bool = False,
                 gated_epilogue: bool = False):
        self.mod = mod
        self.norm_fusion = norm_fusion
        self.gated_epilogue = gated_epilogue
        self.gemm_knobs = dict(gemm_knobs or {})
        self.target = target
        self.cuda = target.kind.name == "cuda"
        self.schedule = schedule
        self.gemm = gemm
        self.chooser = TemplateChooser(target, database)
        self.functions: dict[tuple, tuple[tvm.ir.GlobalVar, KnobChoice]] = {}
        self.sites: dict[tuple, dict] = {}
        self.notes: list[str] = []

    # ---- functions ---------------------------------------------------------------------------------------
    def function(self, name: str, shape: dict, dtype: str, eps: float | None = None):
        from stof_tvm.schedules.templates import get_template

        options = {} if eps is None else {"eps": eps}
        key = (name, json.dumps(shape, sort_keys=True), dtype, eps)
        if key not in self.functions:
            template = get_template(name)
            choice = self.chooser.knobs(template, shape, dtype, options)
            if self.gemm_knobs and name.endswith("_wgmma") and choice.knobs is not None:
                choice = dataclasses.replace(choice, knobs={**choice.knobs, **_merged_gemm_knobs(
                    choice.knobs, self.gemm_knobs, name)})
            func = template.primfunc(shape, dtype, **options)
            if self.schedule and name.endswith("_wgmma") and choice.knobs is not None:
                func = template.kernel(shape, dtype, choice.knobs, **options)
            elif self.schedule and (choice.knobs is not None or choice.trace is not None):
                func = self._scheduled(template, func, choice)
            symbol = f"stof_{name}_{_label(shape)}" + (f"_{len(self.functions)}" if options else "")
            # Opaque to FuseOps: a scheduled template must not absorb its neighbours (reshapes, casts).
            func = (func.with_attr("global_symbol", symbol).with_attr("tirx.is_scheduled", True)
                    .with_attr("op_pattern", OPAQUE))
            builder = relax.BlockBuilder(self.mod)
            gv = builder.add_func(func, symbol)
            self.mod = builder.get()
            self.functions[key] = (gv, choice)
        return self.functions[key]

    @staticmethod
    def _scheduled(template, func, choice: KnobChoice) -> tvm.tirx.PrimFunc:
        sch = tvm.s_tir.Schedule(func)
        if choice.knobs is not None:
            template.apply(sch, choice.knobs)
        else:
            choice.trace.apply_to_schedule(sch, remove_postproc=False)
        return sch.mod["main"]

    def call(self, name, shape, dtype, args, out_shape, eps=None) -> tuple[relax.Expr, dict]:
        """A call of template ``name``; ``out_shape`` its output's shape, or a list of shapes for a template with
        several outputs (the call returns a tuple)."""
        gv, choice = self.function(name, shape, dtype, eps)
        stage = {"template": name, "shape": shape, "dtype": dtype, **({"eps": eps} if eps is not None else {}),
                 **choice.to_json()}
        out_ty = ([relax.TensorType(list(s), dtype) for s in out_shape] if isinstance(out_shape, list)
                  else relax.TensorType(list(out_shape), dtype))
        return relax.call_tir(gv, args, out_ty=out_ty), stage

    def record(self, chain: str, stages: list[dict], note: str | None = None) -> None:
        key = (chain, json.dumps(stages, sort_keys=True), note)
        if key not in self.sites:
            self.sites[key] = {"chain": chain, "stages": stages, "count": 0, **({"note": note} if note else {})}
        self.sites[key]["count"] += 1

    # ---- GEMM stage (mma.sync or wgmma) ---------------------------------------------------------------------
    def gemm_stage(self, act: str, x2d, w, bias, m: int, n: int, k: int, dtype: str) -> tuple[relax.Expr, dict, str]:
        """One GEMM (+ bias) (+ act) call on [m, k] x [k, n]; returns (call, stage, note). Rows are zero-padded to
        :func:`.linear_match.padded_rows` (mma.sync's multiple of 16; wgmma takes m as it is) and the padding sliced
        off the result."""
        rows = padded_rows(m, n, k, self.gemm)
        if rows != m:
            x2d = relax.op.nn.pad(x2d, [0, rows - m, 0, 0])
        base = "gemm" + ("_bias" if bias is not None else "") + (f"_{act}" if act != "none" else "")
        shape = {"m": rows, "n": n, "k": k}
        args = [x2d] + [None] + ([bias] if bias is not None else [])
        note = wgmma_misfit(rows, n, k) if self.gemm == "wgmma" else None
        if self.gemm == "wgmma" and note is None:
            args[1] = transposed(w)
            call, stage = self.call(base + "_wgmma", shape, dtype, args, (rows, n))
        else:
            args[1] = w
            call, stage = self.call(base + "_kn", shape, dtype, args, (rows, n))
        if rows != m:
            call = relax.op.strided_slice(call, axes=[0], begin=[0], end=[m])
            note = f"rows padded {m} -> {rows}" + (f"; {note}" if note else "")
        return call, stage, note


def _cast_const(const: Constant, dtype: str) -> Constant:
    return relax.const(const.value.numpy().astype(dtype), dtype)


# ---- the chains -----------------------------------------------------------------------------------------------

def _rewrite_linear(t: _Templates, chain: str, act: str, expr, matches, lin_call):
    dims = linear_dims(matches, str(lin_call.ty.dtype))
    if dims is None:
        return expr
    x_shape, m, n, k, dtype = dims
    x2d = relax.op.reshape(matches[LINEAR_X], [m, k])
    bias = linear_bias(matches)
    if bias is None and act != "none":
        bias = zero_bias(n, dtype)
    call, stage, note = t.gemm_stage(act, x2d, matches[LINEAR_W], bias, m, n, k, dtype)
    t.record(chain, [stage], note)
    out = relax.op.reshape(call, list(x_shape[:-1]) + [n])
    return out if str(expr.ty.dtype) == dtype else relax.op.astype(out, str(expr.ty.dtype))


def _rewrite_residual_ln(t: _Templates, expr, matches, var2val, users, shared_sums: dict):
    """layer_norm(linear + residual): unfused gemm + bias_residual_layernorm, or the fused template; when the
    linear's input is an erf-GELU linear used only there (the FFN), the fused FFN + bias_residual_layernorm where
    :meth:`.template_choice.TemplateChooser.fused_ffn` picks it. A sum with other users (pre-LN) is left to the
    linear pass and the ``layernorm`` template; it is noted in ``shared_sums`` for :func:`_narrow_sums`."""
    from stof_tvm.schedules.templates import get_template
    from stof_tvm.schedules.templates.epilogue import LN_EPS

    lin = matches[LINEAR] if LINEAR in matches else matches[MATMUL]
    dims = linear_dims(matches, str(lin.ty.dtype))
    attrs = expr.attrs
    axes = [int(a) for a in attrs.axes]
    if dims is None or len(axes) != 1 or not (attrs.center and attrs.scale):
        return expr
    x_shape, m, n, k, dtype = dims
    residual, gamma, beta = matches[_RES], matches[_GAMMA], matches[_BETA]
    out_shape = list(x_shape[:-1]) + [n]
    if (axes[0] not in (-1, len(out_shape) - 1) or static_shape(residual) != tuple(out_shape)
            or str(residual.ty.dtype) not in (dtype, "float32") or static_shape(gamma) != (n,)
            or static_shape(beta) != (n,) or n % 64):
        return expr
    eps = float(attrs.epsilon)
    eps = None if math.isclose(eps, LN_EPS, rel_tol=1e-6) else eps
    chain = "attn_out_ln" if k == n else "ffn_down_ln"
    r2d = relax.op.reshape(residual if str(residual.ty.dtype) == dtype else relax.op.astype(residual, dtype), [m, n])
    g16, b16 = _cast_const(gamma, dtype), _cast_const(beta, dtype)
    bias = linear_bias(matches) if linear_bias(matches) is not None else zero_bias(n, dtype)
    x2d = relax.op.reshape(matches[LINEAR_X], [m, k])
    gemm_shape, ln_shape = {"m": m, "n": n, "k": k}, {"m": m, "n": n}
    total = expr.args[0]
    if len(users.get(total, [])) > 1:
        # pre-LN (GPT-2, ViT): the sum is also the next block's residual, which needs the linear's output anyway;
        # folding that GEMM into the LayerNorm would run it twice, so it stays a GEMM of its own (the linear
        # pass); residual_layernorm makes the 16-bit sum and its LayerNorm at the sum's place (_narrow_sums), this
        # LayerNorm stays as it is until then (rewrite_call offers it again: it is noted already)
        noted = shared_sums.get(total)
        gemm = {"x": x2d, "w": matches[LINEAR_W], "bias": bias, "k": k}
        if (noted is not None and noted[3]["ln"].same_as(expr)) or _note_shared_sum(
                shared_sums, total, matches[_LIN_OUT], var2val, dtype,
                {"ln": expr, "gamma": g16, "beta": b16, "eps": eps, "m": m, "n": n, "gemm": gemm}):
            return expr
        s2d = relax.op.reshape(total if str(total.ty.dtype) == dtype else relax.op.astype(total, dtype), [m, n])
        call, stage = t.call("layernorm", ln_shape, dtype, [s2d, g16, b16], (m, n), eps)
        t.record("residual_sum_ln", [stage])
        out = relax.op.reshape(call, out_shape)
        return out if str(expr.ty.dtype) == dtype else relax.op.astype(out, str(expr.ty.dtype))
    if t.gemm == "wgmma" and t.norm_fusion and wgmma_misfit(m, n, k) is None:
        fused, why = t.chooser.fused_norm_wgmma(get_template("gemm_bias_residual_layernorm_wgmma"), gemm_shape, dtype)
        if fused:
            call, stage = t.call("gemm_bias_residual_layernorm_wgmma", gemm_shape, dtype,
                                 [x2d, transposed(matches[LINEAR_W]), bias, r2d, g16, b16], (m, n), eps)
            t.record(chain, [stage], why)
            out = relax.op.reshape(call, out_shape)
            return out if str(expr.ty.dtype) == dtype else relax.op.astype(out, str(expr.ty.dtype))
    whole_tiles = m % ROW_MULTIPLE == 0     # the fused forms take no padded rows
    ffn = _fused_ffn(t, matches[LINEAR_X], matches[LINEAR_W], var2val, users, m, n, k, dtype) if whole_tiles else None
    if ffn is not None:
        y, ffn_stage, why = ffn
        call, ln_stage = t.call("bias_residual_layernorm", ln_shape, dtype, [y, bias, r2d, g16, b16],
                                (m, n), eps)
        t.record("ffn_ln", [ffn_stage, ln_stage], why)
        out = relax.op.reshape(call, out_shape)
        return out if str(expr.ty.dtype) == dtype else relax.op.astype(out, str(expr.ty.dtype))
    fused, why = (False, f"{m} rows, not a multiple of {ROW_MULTIPLE}: unfused") if not whole_tiles else \
        t.chooser.fused_layernorm(get_template("gemm_bias_residual_layernorm_kn"), get_template("gemm_kn"),
                                  get_template("bias_residual_layernorm"), gemm_shape, ln_shape, dtype,
                                  None if eps is None else {"eps": eps})
    if fused:
        call, stage = t.call("gemm_bias_residual_layernorm_kn", gemm_shape, dtype,
                             [x2d, matches[LINEAR_W], bias, r2d, g16, b16], (m, n), eps)
        stages, note = [stage], why
    else:
        y, gemm_stage, gemm_note = t.gemm_stage("none", x2d, matches[LINEAR_W], None, m, n, k, dtype)
        call, ln_stage = t.call("bias_residual_layernorm", ln_shape, dtype, [y, bias, r2d, g16, b16],
                                (m, n), eps)
        stages, note = [gemm_stage, ln_stage], why + (f"; {gemm_note}" if gemm_note else "")
    t.record(chain, stages, note)
    out = relax.op.reshape(call, out_shape)
    return out if str(expr.ty.dtype) == dtype else relax.op.astype(out, str(expr.ty.dtype))


def _rewrite_plain_ln(t: _Templates, expr, matches, dtype: str | None):
    """A LayerNorm of anything but a linear + residual sum (the embeddings' LayerNorm in BERT, and pre-LN models'
    first and final ones: GPT-2's ``ln_1`` of layer 0 and ``ln_f``, ViT's) -> the ``layernorm`` template of a 16-bit
    cast of its input; ``dtype`` is the model's 16-bit dtype (None: no rewrite)."""
    from stof_tvm.schedules.templates.epilogue import LN_EPS

    attrs = expr.attrs
    x, gamma, beta = matches[LN_INPUT], matches[_GAMMA], matches[_BETA]
    shape = static_shape(x)
    if dtype is None or shape is None or len(shape) < 2 or not (attrs.center and attrs.scale):
        return expr
    n, axes = shape[-1], [int(a) for a in attrs.axes]
    if axes not in ([-1], [len(shape) - 1]) or static_shape(gamma) != (n,) or static_shape(beta) != (n,) or n % 64:
        return expr
    eps = float(attrs.epsilon)
    eps = None if math.isclose(eps, LN_EPS, rel_tol=1e-6) else eps
    m = math.prod(shape[:-1])
    x2d = relax.op.reshape(x if str(x.ty.dtype) == dtype else relax.op.astype(x, dtype), [m, n])
    call, stage = t.call("layernorm", {"m": m, "n": n}, dtype, [x2d, _cast_const(gamma, dtype), _cast_const(beta, dtype)],
                         (m, n), eps)
    t.record("layernorm", [stage])
    out = relax.op.reshape(call, list(shape))
    return out if str(expr.ty.dtype) == dtype else relax.op.astype(out, str(expr.ty.dtype))


def _note_shared_sum(shared_sums: dict, total, lin_out, var2val, dtype: str, norm: dict) -> bool:
    """Note ``total`` = ``astype(linear) + residual`` (float32; ``lin_out`` the matched ``astype(linear)``) as
    ``total -> (linear var, residual var, dtype, norm)`` for :func:`_narrow_sums`, ``norm`` its LayerNorm (the
    ``layer_norm`` call ``ln``, 16-bit ``gamma`` / ``beta``, ``eps``, rows ``m`` of ``n``); returns whether it was
    noted: not when the sum is 16-bit or already noted (a second LayerNorm of it reads it through its own
    ``layernorm`` call)."""
    value = var2val.get(total)
    if (str(total.ty.dtype) == dtype or value is None or not is_call(lin_out, "relax.astype")
            or total in shared_sums):
        return False
    casts = [arg for arg in value.args if isinstance(arg, relax.Var) and var2val.get(arg) is not None
             and var2val[arg].same_as(lin_out)]
    linear = lin_out.args[0]
    if len(casts) != 1 or not isinstance(linear, relax.Var) or str(linear.ty.dtype) != dtype:
        return False
    residual = value.args[1] if value.args[0].same_as(casts[0]) else value.args[0]
    shared_sums[total] = (linear, residual, dtype, norm)
    return True


def _narrow_sums(t: _Templates, func: relax.Function, shared_sums: dict, users: dict) -> relax.Function:
    """Compute each noted pre-LN residual sum in 16 bits (``linear + astype(residual)``, as a 16-bit PyTorch model
    does) together with its LayerNorm, as one ``residual_layernorm`` call at the sum's place: its float32 users read
    a cast of the 16-bit sum (the residual stream's float32 round trips fold away, :func:`_simplify`) and the
    LayerNorm's binding (the ``layer_norm`` left reading the sum) reads the normalised rows. Under ``gemm="wgmma"``
    the linear itself joins them where it has no other reader and
    :meth:`.template_choice.TemplateChooser.fused_norm_wgmma` picks it: one ``gemm_bias_residual_sum_layernorm_wgmma``
    call makes the sum (from float32, rounded once) and its LayerNorm, the linear's own GEMM left unused."""
    if not shared_sums:
        return func
    from stof_tvm.schedules.templates import get_template

    def fused_gemm(linear, norm, dtype: str) -> tuple[dict | None, str]:
        """The linear's GEMM operands where the fused sum + LayerNorm template takes it, else None; and why."""
        gemm, m, n = norm["gemm"], norm["m"], norm["n"]
        if not (t.gemm == "wgmma" and t.norm_fusion) or wgmma_misfit(m, n, gemm["k"]) is not None:
            return None, ""
        if len(users.get(linear, [])) != 1:
            return None, "unfused: the linear has other readers"
        fused, why = t.chooser.fused_norm_wgmma(get_template("gemm_bias_residual_sum_layernorm_wgmma"),
                                                {"m": m, "n": n, "k": gemm["k"]}, dtype)
        return (gemm if fused else None), why

    @relax.expr_functor.mutator
    class Narrow(relax.PyExprMutator):
        def __init__(self):
            super().__init__()
            self.normed = {}     # sum var -> its LayerNorm (16-bit [m, n]), made at the sum

        def visit_var_binding_(self, binding):
            if binding.var in shared_sums:
                self.fuse(binding.var)
            elif is_call(binding.value, "relax.nn.layer_norm") and binding.value.args[0] in self.normed:
                out = relax.op.reshape(self.normed[binding.value.args[0]], list(binding.var.ty.shape))
                dtype = str(binding.var.ty.dtype)
                value = out if dtype == shared_sums[binding.value.args[0]][2] else relax.op.astype(out, dtype)
                self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))
            else:
                super().visit_var_binding_(binding)

        def fuse(self, total):
            linear, residual, dtype, norm = shared_sums[total]
            m, n = norm["m"], norm["n"]
            residual = self.visit_expr(residual)
            if str(residual.ty.dtype) != dtype:
                residual = relax.op.astype(residual, dtype)
            gemm, why = fused_gemm(linear, norm, dtype)
            if gemm is not None:
                args = [self.visit_expr(gemm["x"]), transposed(gemm["w"]), gemm["bias"],
                        relax.op.reshape(residual, [m, n]), norm["gamma"], norm["beta"]]
                call, stage = t.call("gemm_bias_residual_sum_layernorm_wgmma", {"m": m, "n": n, "k": gemm["k"]},
                                     dtype, args, [(m, n), (m, n)], norm["eps"])
                t.record("linear_residual_sum_ln", [stage], why)
            else:
                args = [relax.op.reshape(self.visit_expr(linear), [m, n]), relax.op.reshape(residual, [m, n]),
                        norm["gamma"], norm["beta"]]
                call, stage = t.call("residual_layernorm", {"m": m, "n": n}, dtype, args, [(m, n), (m, n)],
                                     norm["eps"])
                t.record("residual_sum_ln", [stage], why or None)
            pair = self.builder_.emit(call)
            narrow = relax.op.reshape(self.builder_.emit(relax.TupleGetItem(pair, 0)), list(total.ty.shape))
            self.normed[total] = self.builder_.emit(relax.TupleGetItem(pair, 1))
            self.set_var_remap(total, self.builder_.emit(relax.op.astype(narrow, str(total.ty.dtype))))

    return Narrow().visit_expr(func)


def _fused_ffn(t: _Templates, x, w2, var2val, users, m: int, hidden: int, ffn: int, dtype: str):
    """``(call, stage, why)`` of ``GELU(x0 @ W1 + b1) @ w2`` as one ``ffn_gelu_erf_wgmma`` call when ``x`` (the
    down-projection's [m, ffn] input, ``w2`` its [ffn, hidden] weight) is an erf-GELU linear of ``x0`` used only
    there and the chooser picks the fused form; else None (the GELU linear and the GEMM then run unfused)."""
    from stof_tvm.schedules.templates import get_template

    # the pattern hands over the bound expression; its variable must have no other user
    var = x if isinstance(x, relax.Var) else next((v for v, value in var2val.items() if value.same_as(x)), None)
    if var is None or len(users.get(var, [])) != 1:
        return None
    up = LINEAR_GELU.extract_matched_expr(resolve(var, var2val), var2val)
    if up is None:
        return None
    dims = linear_dims(up, str(up[ANY_LINEAR].ty.dtype))
    if dims is None or dims[1:] != (m, ffn, hidden, dtype) or linear_bias(up) is None:
        return None
    shape = {"m": m, "hidden": hidden, "ffn": ffn}
    pair = [("gemm_bias_gelu_erf", {"m": m, "n": ffn, "k": hidden}), ("gemm", {"m": m, "n": hidden, "k": ffn})]
    names = [base + ("_wgmma" if t.gemm == "wgmma" and wgmma_misfit(**gemm) is None else "_kn") for base, gemm in pair]
    fused, why = t.chooser.fused_ffn(get_template("ffn_gelu_erf_wgmma"), [get_template(name) for name in names],
                                     shape, [gemm for _, gemm in pair], dtype)
    if t.gemm == "wgmma" and f"ffn {shape}: {why}" not in t.notes:
        t.notes.append(f"ffn {shape}: {why}")
    if not fused:
        return None
    x0 = relax.op.reshape(up[LINEAR_X], [m, hidden])
    call, stage = t.call("ffn_gelu_erf_wgmma", shape, dtype, [x0, transposed(up[LINEAR_W]), up[LINEAR_BIAS], transposed(w2)],
                         (m, hidden))
    return call, stage, why


def _simplify(func: relax.Function) -> relax.Function:
    """Fold the layout and cast round trips the rewrite leaves: permute_dims of permute_dims, and a 16-bit value
    cast to float32 and back (exact)."""
    def casts(expr, matches):
        inner = matches[_INNER]
        mid = str(matches[_INNER_CAST].ty.dtype)
        if str(inner.ty.dtype) == str(expr.ty.dtype) and str(inner.ty.dtype) in TEMPLATE_DTYPES and mid == "float32":
            return inner
        return expr

    return rewrite_call(DOUBLE_CAST, casts, fold_permute_pairs(func))


def use_templates(mod: tvm.IRModule, target: tvm.target.Target, database: str | None = None, gemm: str = "mma",
                  schedule: bool = True, gemm_knobs: dict | None = None, norm_fusion: bool = False,
                  gated_epilogue: bool = False) -> tuple[tvm.IRModule, dict]:
    """Rewrite ``main``'s downstream chains into template calls; returns the module and the manifest entry
    ``{"gemm", "calls": {template: count}, "sites": [...], "notes": [...]}``. Each site's stages name the
    template, shape, dtype (and ``eps`` where it is not the default) of one call: what the tuner plans.
    ``schedule=False``: leave every PrimFunc unscheduled (for planning only; the module is not for building).
    ``gemm_knobs``: knobs merged into every wgmma GEMM's chosen set (to measure a knob across a model).
    ``norm_fusion``: offer the wgmma GEMM + bias + residual + LayerNorm templates (default ``False``: the unfused
    pair, measured faster). ``gated_epilogue``: a gated MLP's gate, up and SiLU product as one wgmma GEMM
    (:mod:`.gated_units`; default ``False``)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm: expected one of {GEMMS}, got {gemm!r}")
    t = _Templates(mod, target, database, gemm, schedule, gemm_knobs, norm_fusion, gated_epilogue)
    func = mod["main"]
    var2val = relax.analysis.get_var2val(func)

    func = rewrite_qkv(t, func)
    func = relax.analysis.remove_all_unused(func)
    var2val, users = relax.analysis.get_var2val(func), users_of(func)
    shared_sums: dict = {}
    func = rewrite_call(LINEAR_RESIDUAL_LN, lambda e, m: _rewrite_residual_ln(t, e, m, var2val, users, shared_sums),
                        func)
    func = _narrow_sums(t, func, shared_sums, users)
    func = relax.analysis.remove_all_unused(func)   # the GELU linears a fused FFN took over
    func = rewrite_call(LINEAR_GELU, lambda e, m: _rewrite_linear(t, "linear_gelu", "gelu_erf", e, m, m[ANY_LINEAR]),
                        func)
    func = rewrite_call(LINEAR_GELU_TANH,
                        lambda e, m: _rewrite_linear(t, "linear_gelu_tanh", "gelu_tanh", e, m, m[ANY_LINEAR]), func)
    func = rewrite_call(LINEAR_RELU, lambda e, m: _rewrite_linear(t, "linear_relu", "relu", e, m, m[ANY_LINEAR]),
                        func)
    func = merge_sibling_linears(t, relax.analysis.remove_all_unused(func))   # a gated MLP's gate and up
    func = rewrite_call(LINEAR, lambda e, m: _rewrite_linear(t, "linear", "none", e, m, e), func)
    # after the biased pass: matched first, MATMUL would take the matmul out of a biased linear
    func = rewrite_call(MATMUL, lambda e, m: _rewrite_linear(t, "linear", "none", e, m, e), func)
    dtype = compute_dtype(func)
    func = rewrite_call(PLAIN_LN, lambda e, m: _rewrite_plain_ln(t, e, m, dtype), func)
    func = rewrite_rmsnorms(t, relax.analysis.remove_all_unused(func))
    func = relax.analysis.remove_all_unused(_simplify(func))
    out = t.mod
    out["main"] = func
    calls: dict[str, int] = {}
    for site in t.sites.values():
        for stage in site["stages"]:
            calls[stage["template"]] = calls.get(stage["template"], 0) + site["count"]
    return out, {"gemm": gemm, "calls": dict(sorted(calls.items())), "sites": list(t.sites.values()),
                 "notes": t.notes}
