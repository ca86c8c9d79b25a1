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
the same where the sum also feeds the next residual     the linear on its own GEMM (below), the sum one 16-bit
add (pre-LN: GPT-2, ViT)                                add, ``layernorm`` of it (folded into the LayerNorm,
                                                        the GEMM would run twice: once more for the sum)
``linear`` + erf GELU / tanh GELU / ReLU (FFN           ``gemm_bias_gelu_erf_kn`` / ``gemm_bias_gelu_tanh_kn``
up-projection)                                          / ``gemm_bias_relu_kn``
any other ``linear``                                    ``gemm_bias_kn``, ``gemm_kn`` without bias
=====================================================  ===================================================

A linear may have no bias (``astype(matmul(X, W))``, T5): the templates with an activation or the QKV projection
then add a zero bias constant.

``X`` is ``[..., K]`` (flattened to ``[M, K]``), ``W`` a ``[K, N]`` weight (parameter or constant), biases,
gamma and beta constants. A chain is rewritten only where its templates accept the shapes (16-bit dtype,
multiples of 16; LayerNorm rows multiples of 64, fused rows of 128; QKV sequence and head size multiples of 16);
anything else keeps TVM's default path. The LayerNorm templates take the model's epsilon; their output is
16-bit, so the residual stream between layers becomes 16-bit (as in a float16 PyTorch model).

``gemm="wgmma"`` maps the GEMM stages and the QKV projection (not the fused GEMM + LayerNorm, which exists on
mma.sync only) to the Hopper ``*_wgmma`` templates where m % 128, n % 128 and k % 64 are 0 and the GEMM has at
least ``WGMMA_MIN_TILES`` 128x128 output tiles, with the weight transposed to ``[N, K]``; other shapes stay on
mma.sync with a note. Under ``gemm="wgmma"`` an FFN (an erf-GELU ``linear`` used only by the down-projection of a
residual LayerNorm chain) becomes ``ffn_gelu_erf_wgmma`` (intermediate kept on chip) + ``bias_residual_layernorm``
where :meth:`.template_choice.TemplateChooser.fused_ffn` picks it (hidden 128-256, rows enough to fill the GPU).
Knobs: :mod:`.template_choice`. On CUDA each
PrimFunc is scheduled with its knobs; on the CPU the definitions run unscheduled (TVM's default lowering), which
keeps the rewrite testable without a GPU (a tuning record of the definition, measured on llvm, is applied
there too). The wgmma kernels are thread-level code built per knob set (``template.kernel``), not scheduled.
:func:`use_templates` returns the manifest entry of every site.
"""
from __future__ import annotations

import json
import math

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from .attention_match import resolve, scalar_value, static_shape
from .layout import fold_permute_pairs
from .template_choice import KnobChoice, TemplateChooser

TEMPLATE_DTYPES = ("float16", "bfloat16")
GEMMS = ("mma", "wgmma")
WGMMA_TILES = {"m": 128, "n": 128, "k": 64}
# Fewest 128x128 output tiles for which a GEMM goes to wgmma: half the H200's SMs. Below that the wgmma kernel's
# 128-row tiles leave most SMs idle; measured on the H200 (BENCHMARKS.md, end to end): BERT-Base at 1x128 tokens
# ran 0.76 ms with mma.sync templates and 1.03 ms with wgmma, at 8x512 4.35 ms and 3.35 ms.
WGMMA_MIN_TILES = 66


def wgmma_misfit(m: int, n: int, k: int) -> str | None:
    """Why a GEMM of [m, k] x [k, n] stays on mma.sync under ``gemm="wgmma"`` (None: it goes to wgmma)."""
    shape = {"m": m, "n": n, "k": k}
    misfit = [key for key, tile in WGMMA_TILES.items() if shape[key] % tile]
    if misfit:
        return f"wgmma needs {', '.join(f'{key} % {WGMMA_TILES[key]} == 0' for key in misfit)}: mma.sync"
    tiles = (m // WGMMA_TILES["m"]) * (n // WGMMA_TILES["n"])
    if tiles < WGMMA_MIN_TILES:
        return f"{tiles} wgmma tiles fill too few SMs (< {WGMMA_MIN_TILES}): mma.sync"
    return None
OPAQUE = 8    # relax OpPatternKind kOpaque


_X, _W, _BIAS = wildcard(), wildcard(), is_const()
MATMUL = is_op("relax.astype")(is_op("relax.matmul")(_X, _W))      # a linear without bias (T5)
LINEAR = is_op("relax.add")(MATMUL, _BIAS) | is_op("relax.add")(_BIAS, MATMUL)
ANY_LINEAR = LINEAR | MATMUL                                           # the biased form first: it binds _BIAS
_SQRT2, _ONE, _HALF = is_const(), is_const(), is_const()
_ERF_ADD = is_op("relax.add")(is_op("relax.erf")(is_op("relax.divide")(ANY_LINEAR, _SQRT2)), _ONE)
LINEAR_GELU = is_op("relax.multiply")(is_op("relax.multiply")(ANY_LINEAR, _ERF_ADD), _HALF)
LINEAR_RELU = is_op("relax.nn.relu")(ANY_LINEAR)
# tanh GELU as torch.onnx exports it (GPT-2): 0.5 * (x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x*x*x)))), the
# cube as x * (x * x) once compile's square_powers rewrote pow(x, 2) (Relax's patterns match multiply and add in
# either operand order), or 0.5 * x taken first
_CUBIC, _TANH_SCALE, _TANH_ONE, _TANH_HALF = is_const(), is_const(), is_const(), is_const()
_CUBE = is_op("relax.multiply")(ANY_LINEAR, is_op("relax.multiply")(ANY_LINEAR, ANY_LINEAR))
_INNER_TANH = is_op("relax.tanh")(is_op("relax.multiply")(
    _TANH_SCALE, is_op("relax.add")(ANY_LINEAR, is_op("relax.multiply")(_CUBIC, _CUBE))))
_TANH_ADD = is_op("relax.add")(_TANH_ONE, _INNER_TANH)
LINEAR_GELU_TANH = (is_op("relax.multiply")(_TANH_HALF, is_op("relax.multiply")(ANY_LINEAR, _TANH_ADD))
                    | is_op("relax.multiply")(is_op("relax.multiply")(_TANH_HALF, ANY_LINEAR), _TANH_ADD))
_RES, _GAMMA, _BETA = wildcard(), is_const(), is_const()
_LIN_OUT = is_op("relax.astype")(LINEAR) | LINEAR
_SUM = is_op("relax.add")(_LIN_OUT, _RES) | is_op("relax.add")(_RES, _LIN_OUT)
LINEAR_RESIDUAL_LN = is_op("relax.nn.layer_norm")(_SUM, _GAMMA, _BETA)
_INNER = wildcard()
_INNER_CAST = is_op("relax.astype")(_INNER)
DOUBLE_CAST = is_op("relax.astype")(_INNER_CAST)


def _label(shape: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in shape.items())


class _Templates:
    """Adds one PrimFunc per (template, shape, options) to the module and records every site."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target, database: str | None, gemm: str,
                 schedule: bool = True):
        self.mod = mod
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
            func = template.primfunc(shape, dtype, **options)
            if self.schedule and name.endswith("_wgmma") and choice.knobs is not None:
                func = template.kernel(shape, dtype, choice.knobs)
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
        gv, choice = self.function(name, shape, dtype, eps)
        stage = {"template": name, "shape": shape, "dtype": dtype, **({"eps": eps} if eps is not None else {}),
                 **choice.to_json()}
        return relax.call_tir(gv, args, out_ty=relax.TensorType(list(out_shape), dtype)), stage

    def record(self, chain: str, stages: list[dict], note: str | None = None) -> None:
        key = (chain, json.dumps(stages, sort_keys=True), note)
        if key not in self.sites:
            self.sites[key] = {"chain": chain, "stages": stages, "count": 0, **({"note": note} if note else {})}
        self.sites[key]["count"] += 1

    # ---- GEMM stage (mma.sync or wgmma) ---------------------------------------------------------------------
    def gemm_stage(self, act: str, x2d, w, bias, m: int, n: int, k: int, dtype: str) -> tuple[relax.Expr, dict, str]:
        """One GEMM (+ bias) (+ act) call on [m, k] x [k, n]; returns (call, stage, note)."""
        base = "gemm" + ("_bias" if bias is not None else "") + (f"_{act}" if act != "none" else "")
        shape = {"m": m, "n": n, "k": k}
        args = [x2d] + [None] + ([bias] if bias is not None else [])
        note = wgmma_misfit(m, n, k) if self.gemm == "wgmma" else None
        if self.gemm == "wgmma" and note is None:
            args[1] = _transposed(w)
            call, stage = self.call(base + "_wgmma", shape, dtype, args, (m, n))
            return call, stage, None
        args[1] = w
        call, stage = self.call(base + "_kn", shape, dtype, args, (m, n))
        return call, stage, note


def _constant(expr, var2val=None):
    expr = resolve(expr, var2val) if var2val is not None else expr
    return expr if isinstance(expr, Constant) else None


def _transposed(w: relax.Expr) -> relax.Expr:
    """``W^T`` of a [K, N] weight: folded here for a constant, else a weight-only op lifted into the transform."""
    if isinstance(w, Constant):
        return relax.const(np.ascontiguousarray(w.value.numpy().T), str(w.ty.dtype))
    return relax.op.permute_dims(w, [1, 0])


def _cast_const(const: Constant, dtype: str) -> Constant:
    return relax.const(const.value.numpy().astype(dtype), dtype)


def _bias(matches):
    """The bias constant of a matched linear layer, None for one without (:data:`MATMUL`)."""
    return matches[_BIAS] if _BIAS in matches else None


def _zero_bias(n: int, dtype: str) -> Constant:
    """A [n] zero bias: the GEMM + activation templates always add one (a bias-free linear + ReLU, T5's FFN)."""
    return relax.const(np.zeros(n, dtype), dtype)


def _linear_dims(matches, out_dtype: str):
    """(x shape, m, n, k, dtype) of a matched linear layer (with or without bias), or None when a template
    cannot take it."""
    x, w, bias = matches[_X], matches[_W], _bias(matches)
    x_shape, w_shape = static_shape(x), static_shape(w)
    dtype = str(x.ty.dtype)
    if (x_shape is None or w_shape is None or len(w_shape) != 2 or dtype not in TEMPLATE_DTYPES
            or str(w.ty.dtype) != dtype or out_dtype != dtype or (bias is not None and str(bias.ty.dtype) != dtype)):
        return None
    k, n = w_shape
    m = int(np.prod(x_shape[:-1]))
    if x_shape[-1] != k or m % 16 or n % 16 or k % 16:
        return None
    if bias is not None and tuple(static_shape(bias) or ()) != (n,):
        return None
    return x_shape, m, n, k, dtype


def _is(matches, pattern, value: float, var2val) -> bool:
    found = scalar_value(matches[pattern], var2val)
    return found is not None and math.isclose(found, value, rel_tol=1e-3)


# ---- the chains -----------------------------------------------------------------------------------------------

def _rewrite_linear(t: _Templates, chain: str, act: str, expr, matches, lin_call):
    dims = _linear_dims(matches, str(lin_call.ty.dtype))
    if dims is None:
        return expr
    x_shape, m, n, k, dtype = dims
    x2d = relax.op.reshape(matches[_X], [m, k])
    bias = _bias(matches)
    if bias is None and act != "none":
        bias = _zero_bias(n, dtype)
    call, stage, note = t.gemm_stage(act, x2d, matches[_W], bias, m, n, k, dtype)
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

    lin = matches[LINEAR]
    dims = _linear_dims(matches, str(lin.ty.dtype))
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
    x2d = relax.op.reshape(matches[_X], [m, k])
    gemm_shape, ln_shape = {"m": m, "n": n, "k": k}, {"m": m, "n": n}
    total = expr.args[0]
    if len(users.get(total, [])) > 1:
        # pre-LN (GPT-2, ViT): the sum is also the next block's residual, which needs the linear's output anyway;
        # folding that GEMM into the LayerNorm would run it twice, so it stays a GEMM of its own (the linear
        # pass) and the LayerNorm template reads the sum
        _note_shared_sum(shared_sums, total, matches[_LIN_OUT], var2val, dtype)
        s2d = relax.op.reshape(total if str(total.ty.dtype) == dtype else relax.op.astype(total, dtype), [m, n])
        call, stage = t.call("layernorm", ln_shape, dtype, [s2d, g16, b16], (m, n), eps)
        t.record("residual_sum_ln", [stage])
        out = relax.op.reshape(call, out_shape)
        return out if str(expr.ty.dtype) == dtype else relax.op.astype(out, str(expr.ty.dtype))
    ffn = _fused_ffn(t, matches[_X], matches[_W], var2val, users, m, n, k, dtype)
    if ffn is not None:
        y, ffn_stage, why = ffn
        call, ln_stage = t.call("bias_residual_layernorm", ln_shape, dtype, [y, matches[_BIAS], r2d, g16, b16],
                                (m, n), eps)
        t.record("ffn_ln", [ffn_stage, ln_stage], why)
        out = relax.op.reshape(call, out_shape)
        return out if str(expr.ty.dtype) == dtype else relax.op.astype(out, str(expr.ty.dtype))
    fused, why = t.chooser.fused_layernorm(
        get_template("gemm_bias_residual_layernorm_kn"), get_template("gemm_kn"),
        get_template("bias_residual_layernorm"), gemm_shape, ln_shape, dtype, None if eps is None else {"eps": eps})
    if fused:
        call, stage = t.call("gemm_bias_residual_layernorm_kn", gemm_shape, dtype,
                             [x2d, matches[_W], matches[_BIAS], r2d, g16, b16], (m, n), eps)
        stages, note = [stage], why
    else:
        y, gemm_stage, gemm_note = t.gemm_stage("none", x2d, matches[_W], None, m, n, k, dtype)
        call, ln_stage = t.call("bias_residual_layernorm", ln_shape, dtype, [y, matches[_BIAS], r2d, g16, b16],
                                (m, n), eps)
        stages, note = [gemm_stage, ln_stage], why + (f"; {gemm_note}" if gemm_note else "")
    t.record(chain, stages, note)
    out = relax.op.reshape(call, out_shape)
    return out if str(expr.ty.dtype) == dtype else relax.op.astype(out, str(expr.ty.dtype))


def _note_shared_sum(shared_sums: dict, total, lin_out, var2val, dtype: str) -> None:
    """Note ``total`` = ``astype(linear) + residual`` (float32; ``lin_out`` the matched ``astype(linear)``) as
    ``total -> (linear var, residual var, dtype)`` for :func:`_narrow_sums`; nothing when the sum is 16-bit."""
    value = var2val.get(total)
    if str(total.ty.dtype) == dtype or value is None or not _is_call(lin_out, "relax.astype"):
        return
    casts = [arg for arg in value.args if isinstance(arg, relax.Var) and var2val.get(arg) is not None
             and var2val[arg].same_as(lin_out)]
    linear = lin_out.args[0]
    if len(casts) == 1 and isinstance(linear, relax.Var) and str(linear.ty.dtype) == dtype:
        residual = value.args[1] if value.args[0].same_as(casts[0]) else value.args[0]
        shared_sums[total] = (linear, residual, dtype)


def _narrow_sums(func: relax.Function, shared_sums: dict) -> relax.Function:
    """Compute each noted pre-LN residual sum in 16 bits (``linear + astype(residual)``, as a 16-bit PyTorch model
    does), its float32 users reading a cast of it: with the LayerNorm template reading the 16-bit sum, the
    residual stream's float32 round trips fold away (:func:`_simplify`), leaving one 16-bit add per sum."""
    if not shared_sums:
        return func

    @relax.expr_functor.mutator
    class Narrow(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var not in shared_sums:
                super().visit_var_binding_(binding)
                return
            linear, residual, dtype = shared_sums[binding.var]
            residual = self.visit_expr(residual)
            if str(residual.ty.dtype) != dtype:
                residual = relax.op.astype(residual, dtype)
            narrow = self.builder_.emit(relax.op.add(self.visit_expr(linear), residual))
            self.set_var_remap(binding.var, self.builder_.emit(relax.op.astype(narrow, str(binding.var.ty.dtype))))

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
    if up is None or not all(_is(up, pattern, value, var2val)
                             for pattern, value in ((_SQRT2, math.sqrt(2.0)), (_ONE, 1.0), (_HALF, 0.5))):
        return None
    dims = _linear_dims(up, str(up[ANY_LINEAR].ty.dtype))
    if dims is None or dims[1:] != (m, ffn, hidden, dtype) or _bias(up) is None:
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
    x0 = relax.op.reshape(up[_X], [m, hidden])
    call, stage = t.call("ffn_gelu_erf_wgmma", shape, dtype, [x0, _transposed(up[_W]), up[_BIAS], _transposed(w2)],
                         (m, hidden))
    return call, stage, why


class _QKVGroup:
    """Three linear layers on one X whose outputs are split into heads (reshape + permute_dims)."""

    def __init__(self, x, linears: list, permutes: list, axes: list, heads: int, head_dim: int):
        self.x, self.linears, self.permutes, self.axes = x, linears, permutes, axes
        self.heads, self.head_dim = heads, head_dim
        self.shape: dict = {}


_HEAD_PERMS = {(0, 2, 1, 3): None, (0, 2, 3, 1): [0, 1, 3, 2]}   # Q/V form, K^T form (from [B, H, S, D])


def _users(func: relax.Function) -> dict:
    users: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                users.setdefault(var, []).append(binding)
    if isinstance(func.body.body, relax.Var):
        users.setdefault(func.body.body, []).append(None)
    return users


def _find_qkv(func: relax.Function) -> list[_QKVGroup]:
    """Groups of three head-split linears (with or without bias) sharing X, in program order (their permutes
    after the third), and single linears whose [..., 3 * H * D] output is split into thirds that are each split
    into heads (GPT-2's ``c_attn``: its weight already is the concatenated one)."""
    var2val = relax.analysis.get_var2val(func)
    users = _users(func)
    order, by_x, fused = {}, [], []
    for block in func.body.blocks:
        for binding in block.bindings:
            order[binding.var] = len(order)
            matches = ANY_LINEAR.extract_matched_expr(binding.value, var2val)
            if matches is None or _linear_dims(matches, str(binding.value.ty.dtype)) is None:
                continue
            split = _head_split(binding.var, users)
            if split is None:
                thirds = _split_thirds(binding.var, users)
                if thirds is not None and len({(s[0], s[1]) for s in thirds}) == 1:
                    fused.append(_QKVGroup(matches[_X], [(binding.var, matches)], [s[3] for s in thirds],
                                           [s[4] for s in thirds], thirds[0][0], thirds[0][1]))
                continue
            x = matches[_X]
            group = next((g for g in by_x if g[0].same_as(x)), None)
            if group is None:
                by_x.append((x, []))
                group = by_x[-1]
            group[1].append((binding.var, matches, *split))
    groups = []
    for x, members in by_x:
        if len(members) != 3:
            continue
        heads = {(s[2], s[3]) for s in members}
        last = max(order[m[0]] for m in members)
        # the permutes are replaced by the template's heads, emitted after the last linear (the reshapes die)
        if len(heads) != 1 or any(order[m[5]] < last for m in members):
            continue
        h, d = heads.pop()
        groups.append(_QKVGroup(x, [(m[0], m[1]) for m in members], [m[5] for m in members],
                                [m[6] for m in members], h, d))
    return groups + fused


def _split_thirds(var, users):
    """The :func:`_head_split` of each third when ``var`` ([..., N]) is only split into three equal parts along
    its last axis (Q, K, V in this order), each part used once, by its head split; else None."""
    first = users.get(var, [])
    shape = static_shape(var)
    if len(first) != 1 or first[0] is None or not _is_call(first[0].value, "relax.split") or shape is None:
        return None
    split = first[0]
    n, attrs = shape[-1], split.value.attrs
    sections = attrs.indices_or_sections
    cuts = [int(sections)] if isinstance(sections, (int, tvm.tirx.IntImm)) else [int(i) for i in sections]
    if int(attrs.axis) not in (-1, len(shape) - 1) or n % 3 or cuts not in ([3], [n // 3, 2 * n // 3]):
        return None
    parts = {}
    for use in users.get(split.var, []):
        value = None if use is None else use.value
        if not isinstance(value, relax.TupleGetItem) or value.index in parts:
            return None
        parts[value.index] = _head_split(use.var, users)
    if sorted(parts) != [0, 1, 2] or any(part is None for part in parts.values()):
        return None
    return [parts[i] for i in range(3)]


def _head_split(var, users):
    """(heads, head_dim, reshape var, permute var, permute axes) when ``var`` is only reshaped to [B, S, H, D]
    and permuted into heads."""
    first = users.get(var, [])
    if len(first) != 1 or first[0] is None or not _is_call(first[0].value, "relax.reshape"):
        return None
    reshape = first[0]
    shape = static_shape(reshape.var)
    second = users.get(reshape.var, [])
    if shape is None or len(shape) != 4 or len(second) != 1 or second[0] is None:
        return None
    permute = second[0]
    if not _is_call(permute.value, "relax.permute_dims") or permute.value.attrs.axes is None:
        return None
    axes = tuple(int(a) for a in permute.value.attrs.axes)
    if axes not in _HEAD_PERMS:
        return None
    return shape[2], shape[3], reshape.var, permute.var, axes


def _is_call(expr, op: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == op


def _concat_weights(ws: list, axis: int) -> relax.Expr:
    if len(ws) == 1:
        return ws[0]
    consts = [w if isinstance(w, Constant) else None for w in ws]
    if all(c is not None for c in consts):
        value = np.concatenate([c.value.numpy() for c in consts], axis=axis)
        return relax.const(value, str(ws[0].ty.dtype))
    return relax.op.concat(ws, axis=axis)


def _rewrite_qkv(t: _Templates, func: relax.Function) -> relax.Function:
    """Replace every :class:`_QKVGroup` the QKV template fits by one template call and a split into heads."""
    groups = []
    for group in _find_qkv(func):
        x_shape = static_shape(group.x)
        if x_shape is None or len(x_shape) != 3 or x_shape[2] != group.heads * group.head_dim:
            continue
        group.shape = {"batch": x_shape[0], "seq": x_shape[1], "heads": group.heads, "head_dim": group.head_dim}
        if _qkv_fits(group.shape, str(group.x.ty.dtype)):
            groups.append(group)
    if not groups:
        return func
    emit_at = {group.linears[-1][0]: group for group in groups}
    replace: dict = {}
    users = _users(func)

    @relax.expr_functor.mutator
    class QKV(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var in replace:
                self.set_var_remap(binding.var, replace[binding.var])
                return
            super().visit_var_binding_(binding)
            if binding.var in emit_at:
                self._emit_group(emit_at[binding.var])

        def _emit_group(self, group: _QKVGroup):
            matches = [m for _, m in group.linears]
            dtype = str(group.x.ty.dtype)
            b, s, h, d = (group.shape[key] for key in ("batch", "seq", "heads", "head_dim"))
            w = _concat_weights([self.visit_expr(m[_W]) for m in matches], 1)
            bias = _concat_weights([m[_BIAS] if _BIAS in m else _zero_bias(static_shape(m[_W])[1], dtype)
                                    for m in matches], 0)
            x2d = relax.op.reshape(self.visit_expr(group.x), [b * s, h * d])
            note = wgmma_misfit(b * s, 3 * h * d, h * d) if t.gemm == "wgmma" else None
            if t.gemm == "wgmma" and note is None:
                call, stage = t.call("qkv_projection_wgmma", group.shape, dtype, [x2d, _transposed(w), bias],
                                     (3, b, h, s, d))
            else:
                call, stage = t.call("qkv_projection_kn", group.shape, dtype, [x2d, w, bias], (3, b, h, s, d))
            t.record("qkv", [stage], note)
            qkv = self.builder_.emit(call)
            if all(_reads_views(permute, users) for permute in group.permutes):
                # zero copy: Q, K and V are views at their offsets into the [3, B, H, S, D] output
                part_bytes = b * h * s * d * tvm.runtime.DataType(dtype).bits // 8
                heads_of = [relax.op.memory.view(qkv, [b, h, s, d], dtype,
                                                 relax.prim_value(tvm.tirx.IntImm("int64", i * part_bytes)))
                            for i in range(3)]
            else:
                parts = self.builder_.emit(relax.op.split(qkv, 3, axis=0))
                heads_of = [relax.op.reshape(relax.TupleGetItem(parts, i), [b, h, s, d]) for i in range(3)]
            for heads, permute, axes in zip(heads_of, group.permutes, group.axes):
                back = _HEAD_PERMS[axes]
                replace[permute] = self.builder_.emit(heads if back is None else relax.op.permute_dims(heads, back))

    return QKV(t.mod).visit_expr(func)


# Kernels whose Q/K/V buffers accept a view at an offset into a larger allocation (TVM's own kernels assume
# offset 0): the block-wise attention kernel (schedules/attention_blockwise.py, VIEW_ALIGN).
VIEW_READERS = ("stof_attention_block",)


def _reads_views(var, users) -> bool:
    """Whether every use of the head-split ``var`` (directly, or through one ``permute_dims``, the K^T form) is
    an input of a :data:`VIEW_READERS` kernel call."""
    def kernel_call(binding) -> bool:
        value = None if binding is None else binding.value
        return (_is_call(value, "relax.call_tir") and isinstance(value.args[0], tvm.ir.GlobalVar)
                and value.args[0].name_hint in VIEW_READERS)

    uses = users.get(var, [])
    if not uses:
        return False
    for use in uses:
        if kernel_call(use):
            continue
        if use is None or not _is_call(use.value, "relax.permute_dims"):
            return False
        further = users.get(use.var, [])
        if not further or not all(kernel_call(u) for u in further):
            return False
    return True


def _qkv_fits(shape: dict, dtype: str) -> bool:
    from stof_tvm.schedules.templates import get_template

    try:
        return bool(get_template("qkv_projection_kn").knob_space(shape, dtype))
    except ValueError:
        return False


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


def use_templates(mod: tvm.IRModule, target: tvm.target.Target, database: str | None = None,
                  gemm: str = "mma", schedule: bool = True) -> tuple[tvm.IRModule, dict]:
    """Rewrite ``main``'s downstream chains into template calls; returns the module and the manifest entry
    ``{"gemm", "calls": {template: count}, "sites": [...], "notes": [...]}``. Each site's stages name the
    template, shape, dtype (and ``eps`` where it is not the default) of one call: what the tuner plans.
    ``schedule=False``: leave every PrimFunc unscheduled (for planning only; the module is not for building)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm: expected one of {GEMMS}, got {gemm!r}")
    t = _Templates(mod, target, database, gemm, schedule)
    func = mod["main"]
    var2val = relax.analysis.get_var2val(func)

    def gelu(expr, matches):
        if not (_is(matches, _SQRT2, math.sqrt(2.0), var2val) and _is(matches, _ONE, 1.0, var2val)
                and _is(matches, _HALF, 0.5, var2val)):
            return expr
        return _rewrite_linear(t, "linear_gelu", "gelu_erf", expr, matches, matches[ANY_LINEAR])

    def gelu_tanh(expr, matches):
        if not all(_is(matches, pattern, value, var2val) for pattern, value in (
                (_CUBIC, 0.044715), (_TANH_SCALE, math.sqrt(2.0 / math.pi)), (_TANH_ONE, 1.0), (_TANH_HALF, 0.5))):
            return expr
        return _rewrite_linear(t, "linear_gelu_tanh", "gelu_tanh", expr, matches, matches[ANY_LINEAR])

    func = _rewrite_qkv(t, func)
    func = relax.analysis.remove_all_unused(func)
    var2val, users = relax.analysis.get_var2val(func), _users(func)
    shared_sums: dict = {}
    func = rewrite_call(LINEAR_RESIDUAL_LN, lambda e, m: _rewrite_residual_ln(t, e, m, var2val, users, shared_sums),
                        func)
    func = _narrow_sums(func, shared_sums)
    func = relax.analysis.remove_all_unused(func)   # the GELU linears a fused FFN took over
    func = rewrite_call(LINEAR_GELU, gelu, func)
    func = rewrite_call(LINEAR_GELU_TANH, gelu_tanh, func)
    func = rewrite_call(LINEAR_RELU, lambda e, m: _rewrite_linear(t, "linear_relu", "relu", e, m, m[ANY_LINEAR]),
                        func)
    func = rewrite_call(LINEAR, lambda e, m: _rewrite_linear(t, "linear", "none", e, m, e), func)
    # after the biased pass: matched first, MATMUL would take the matmul out of a biased linear
    func = rewrite_call(MATMUL, lambda e, m: _rewrite_linear(t, "linear", "none", e, m, e), func)
    func = relax.analysis.remove_all_unused(_simplify(func))
    out = t.mod
    out["main"] = func
    calls: dict[str, int] = {}
    for site in t.sites.values():
        for stage in site["stages"]:
            calls[stage["template"]] = calls.get(stage["template"], 0) + site["count"]
    return out, {"gemm": gemm, "calls": dict(sorted(calls.items())), "sites": list(t.sites.values()),
                 "notes": t.notes}
