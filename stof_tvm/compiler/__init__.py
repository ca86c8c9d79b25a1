"""ONNX transformer + sparse attention mask -> compiled TVM module (:func:`compile`).

Steps, data flowing one way:

1. load the ONNX model, refuse unsupported operators by name, import it to Relax with static shapes
   (:mod:`.onnx_import`); bring every exporter's spelling to one canonical form (:mod:`.canonical`); float16
   runs through Relax's mixed-precision pass (float32 accumulation);
2. find every attention site with Relax dataflow patterns (:mod:`.attention_match`) and work out what the
   model's own masking means (:mod:`.mask_sources`);
3. normalise the user's mask, combine it with the model's constant masks, and choose the kernel and its
   configuration from the combined mask (:mod:`.kernels`);
4. rewrite the sites into calls of that kernel, the mask's format arrays becoming module inputs
   (:mod:`.rewrite`); move weight-only work (casts) into ``main_transform_params``, run once at load;
5. optionally replace the chains around attention (QKV projection, output projection + residual + LayerNorm,
   FFN) with the fusion templates (:mod:`.downstream`, knobs from :mod:`.template_choice`), before the weight
   transform is lifted so that weight concatenations and transposes run once at load;
6. fuse, apply tuning records (read through :mod:`stof_tvm.records`; tuning first is :mod:`stof_tvm.workflow`'s,
   above this package), schedule the rest with dlight, build (:mod:`.pipeline`); with ``gemm="wgmma"``
   or the wgmma attention kernel the CUDA code is also compiled here by nvcc for sm_90a and the cubins travel
   in the artifact (:mod:`.cubins`).

The result is an :class:`~stof_tvm.artifact.Artifact`: the executable plus a JSON manifest.
"""
from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import tvm
from tvm import relax

from stof_tvm.sparse_formats.masks import normalize_mask

from .attention_match import find_attention_sites, shared_kv_heads, unmatched_score_ops
from .bias_precision import NARROW_DTYPES, narrows_exactly_enough
from .canonical import IntegerPowers, canonicalize
from .coverage import coverage
from .downstream import use_templates
from .gather_index import narrow_gather_indices
from .graph_inputs import whole_graph
from .input_checks import ValueCheck, add_value_checks, clip_gathers
from .kernels import KERNELS, TILED, KernelChoice, choose_kernel, config_object, kernel_primfunc
from .mask_sources import plan_masks, score_bias
from .onnx_import import TensorSpec, embedding_rows, import_onnx, load_model, output_names
from stof_tvm.schedules.dependent_launch import supports as dependent_launch_supported

from .pipeline import build, fold_constant_casts, make_target, optimize, target_dict
from .layout import fold_permute_pairs
from .numpy_fold import fold_numpy
from .record_calls import record_calls
from .relative_bias_match import TiledAttention, fuse_relative_biases
from .rewrite import rewrite_attention
from .weight_storage import store_weights_float16, stored_values
from .widen_floats import BFLOAT16, NAMES as FLOAT_NAMES, types_to_widen, widen

DTYPES = ("float32", "float16")
TRANSFORM_PARAMS = "main_transform_params"


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def _output_specs(func: relax.Function, names: list[str]) -> list[TensorSpec]:
    fields = list(func.ret_ty.fields) if isinstance(func.ret_ty, relax.TupleType) else [func.ret_ty]
    if len(fields) != len(names):
        raise ValueError(f"model: {len(names)} graph outputs but the imported function returns {len(fields)}")
    specs = []
    for name, ty in zip(names, fields):
        shape = tuple(int(d) for d in ty.shape.values)
        specs.append(TensorSpec(name, shape, str(ty.dtype)))
    return specs


def _input_entry(spec: TensorSpec, model) -> dict:
    """Manifest entry of a model input; integer inputs that index an embedding record its row count."""
    entry = spec.to_json()
    rows = embedding_rows(model, spec.name)
    if rows is not None:
        entry["index_range"] = rows
    return entry


def value_checks(inputs, onnx_model, padding: str | None) -> list[ValueCheck]:
    """The value ranges ``main`` checks on the device: token ids within their embedding table, the padding
    input (applied by the kernels as ``!= 0``) 0 or 1 like the probes that proved it is key padding (a boolean one
    has no other values)."""
    checks = []
    for spec in inputs:
        rows = embedding_rows(onnx_model, spec.name)
        if rows is not None and np.dtype(spec.dtype).kind in "iu":
            checks.append(ValueCheck(spec.name, 0, int(rows)))
        elif spec.name == padding and spec.dtype != "bool":
            checks.append(ValueCheck(spec.name, 0, 2))
    return checks


def _mask_entry(mask) -> dict:
    """Manifest entry for the user's mask: a spec string is kept as is, any other form as mask.npy."""
    if isinstance(mask, str):
        return {"spec": mask}
    return {"spec": None, "array": "mask.npy", "from": "callable" if callable(mask) else "array"}


def _mask_groups(user_mask: np.ndarray, const_keep, runtime) -> tuple[int, int]:
    """(batch, head) groups of the combined mask: per batch/head wherever any of its parts varies."""
    shapes = [user_mask.shape] + ([const_keep.shape] if const_keep is not None else [])
    for source in runtime:
        dims = tuple(int(d) for d in source.function.ret_ty.shape.values)
        shapes.append((1,) * (4 - len(dims)) + dims)
    return max(s[0] for s in shapes), max(s[1] for s in shapes)


def _manifest(*, source: dict, onnx_model, inputs, weights, outputs, format_inputs, mask_entry: dict,
              user_mask: np.ndarray, model_keep: str | None, plan, sites, choice, batch: int,
              transform_params: str | None, tspec: dict, dtype: str, tuning: dict, fallback: str | None) -> dict:
    """The JSON manifest the runtime reads (see :mod:`stof_tvm.artifact`)."""
    if fallback is not None:    # compiled by TVM's default pipeline (:func:`front_end`'s fallback): no mask input
        mask = {"spec": "dense", "batch": 1, "heads": 1, "seq_q": None, "seq_k": None, "model_keep": None,
                "model_terms": []}
        attention = {"sites": 0, "batch": batch, "kernel": {"kind": "none"}, "fallback": fallback}
    else:
        mask, attention = _attention_entries(mask_entry, user_mask, model_keep, plan, sites, choice, batch)
    return {
        "format_version": 1,
        "source": source,
        "inputs": [_input_entry(s, onnx_model) for s in inputs],
        "weights": [w.to_json() for w in weights],
        "transform_params": transform_params,
        "outputs": [s.to_json() for s in outputs],
        "mask_inputs": [f.to_json() for f in format_inputs],
        "mask": mask,
        "attention": attention,
        "target": tspec,
        "dtype": dtype,
        "tuning": tuning,
        "tvm_version": tvm.__version__,
    }


def _attention_entries(mask_entry: dict, user_mask: np.ndarray, model_keep: str | None, plan, sites, choice,
                       batch: int) -> tuple[dict, dict]:
    """The manifest's ``mask`` and ``attention`` entries of a model whose attention runs on a stof-tvm kernel."""
    site = sites[0]
    sparse = choice.kind != "dense"
    mask = {**mask_entry, "batch": int(user_mask.shape[0]), "heads": int(user_mask.shape[1]),
            "seq_q": site.seq_q, "seq_k": site.seq_k, "model_keep": model_keep,
            "model_terms": [s.to_json() for s in plan.runtime] if sparse else [],
            "padding": {"input": plan.padding, "on": "device"} if choice.padding else None}
    attention = {"sites": len(sites), "batch": batch, "heads": site.heads, "seq_q": site.seq_q,
                 "seq_k": site.seq_k, "head_dim": site.head_dim, "dtype": site.dtype, "scale": site.scale,
                 "kernel": choice.to_json()}
    return mask, attention


@dataclasses.dataclass
class FrontEnd:
    """The model after steps 1-5 (imported, attention rewritten, chains on templates), before the build.

    ``template_entry`` is the manifest's ``templates`` entry: the template calls the build will make (the
    tuner plans exactly these, :func:`stof_tvm.tuning.plan_model`).

    ``coverage``: the manifest's ``coverage`` entry (:func:`.coverage.coverage`): per operator kind, how many run
    on stof-tvm's kernels and templates and why the others fell back.

    ``fallback``: why the model's attention is not on a stof-tvm kernel, when it is not (then ``sites`` is empty,
    ``plan`` and ``choice`` are None and the module is the imported model, for TVM's default pipeline)."""

    onnx_model: object
    mod: tvm.IRModule
    inputs: list
    weights: list
    outputs: list
    sites: list
    plan: object
    user_mask: np.ndarray
    combined: np.ndarray
    choice: object
    format_inputs: list
    template_entry: dict
    tspec: dict
    gemm: str
    target: tvm.target.Target
    fallback: str | None = None
    coverage: dict = dataclasses.field(default_factory=dict)
    checks: list = dataclasses.field(default_factory=list)      # the ValueChecks main reports (input_checks)
    checks_output: int | None = None                            # position of stof_value_errors in main's outputs


def front_end(model, *, mask, batch: int, seq_len: int, target="cuda", dtype: str = "float16",
              kernel: str = "auto", templates: bool | None = None, gemm: str = "auto",
              database: str | None = None, schedule: bool = True, lean_padding: bool = True,
              gemm_knobs: dict | None = None, norm_fusion: bool = False,
              attention_knobs: dict | None = None, narrow_bias: bool = True,
              fuse_relative_bias: bool = True, gated_epilogue: bool = False) -> FrontEnd:
    """Steps 1-5 of :func:`compile` (same arguments): import, attention kernel choice and rewrite, templates.

    ``schedule=False`` leaves the template PrimFuncs unscheduled (the tuner only reads which calls are made)."""
    batch, seq_len = _check_positive("batch", batch), _check_positive("seq_len", seq_len)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    tspec = target_dict(target)
    if templates is None:
        templates = tspec["kind"] == "cuda" and dtype == "float16"
    gemm, tspec = check_gemm(gemm, templates, tspec)
    if templates and dtype == "float32":
        raise ValueError("templates: the fusion templates need dtype='float16'")
    tvm_target = make_target(tspec)

    onnx_model = load_model(model)
    onnx_model, widened = widen(onnx_model, types_to_widen(onnx_model, dtype))
    if widened:
        kinds = " and ".join(FLOAT_NAMES[t] for t in sorted(widened))
        why = ("TVM builds no bfloat16 LayerNorm" if widened == {BFLOAT16} else
               "to compute in dtype float32; dtype='float16' computes in 16 bits")
        warnings.warn(f"model: its {kinds} tensors are widened to float32 ({why}) and computed in {dtype}; a "
                      f"{kinds} input is taken as float32, and its float outputs are not {kinds}", stacklevel=2)
    mod, inputs, weights = import_onnx(onnx_model, batch, seq_len)
    outputs = _output_specs(mod["main"], output_names(onnx_model))
    # one form of every exporter's spelling; the folds TVM would build a kernel for each are done in numpy first.
    # Integer powers become products and input-indexed gathers clamp before FoldConstant, which legalizes every
    # call it visits: TVM warned of pow(x, n >= 3) (GPT-2's gelu_new) and of "fast" gathers on every compile, for
    # forms no kernel of the module computes (tests/test_compile_warnings.py).
    mod = canonicalize(clip_gathers(fold_numpy(narrow_gather_indices(mod))), [IntegerPowers()])
    mod = canonicalize(relax.transform.FoldConstant()(mod))
    precision_note = None
    if dtype == "float16":
        mod, precision_note = _to_float16(mod)
        templates = templates and precision_note is None

    canonical = mod["main"]
    sites = find_attention_sites(canonical)
    plan, reason = None, None
    if not sites:
        reason = "no attention subgraph (matmul -> softmax -> matmul over [B, H, S, D]) was found"
        stops = unmatched_score_ops(canonical)
        if stops:
            named = ", ".join(f"{op} (logit soft-capping, as Gemma 2's)" if op == "tanh" else op for op in stops)
            reason += f": the softmax scores pass through {named}, which stof-tvm's attention kernels do not compute"
    elif len({s.scale for s in sites}) != 1:
        reason = "attention sites use different score scales"
    else:
        try:
            plan = plan_masks(mod["main"], sites)
        except ValueError as err:       # the model's own masking is not one a sparse format can take
            reason = str(err).removeprefix("model: ")
    if reason is not None:
        reason += f"; {precision_note}" if precision_note else ""
        _check_fallback_mask(mask, batch, seq_len, reason)
        # the chains around attention (linears, GELU, LayerNorm) do not depend on how attention is computed
        template_entry = {}
        if templates:
            mod, template_entry = use_templates(mod, tvm_target, database, gemm, schedule=schedule,
                                                gemm_knobs=gemm_knobs, norm_fusion=norm_fusion,
                                                gated_epilogue=gated_epilogue)
            mod["main"] = relax.analysis.remove_all_unused(mod["main"])
        around = ("the layers around it on stof-tvm's fusion templates" if templates
                  else "without stof-tvm's sparse attention kernels or fusion templates")
        warnings.warn(f"model: {reason}; compiling its attention through TVM's default pipeline (as the model "
                      f"computes it), {around}", stacklevel=2)
        report = coverage(canonical, mod["main"], attention_kernel=None, attention_sites=len(sites),
                          attention_reason=reason, templates=None if templates else f"TVM's default pipeline ({reason})",
                          template_entry=template_entry)
        checks = value_checks(inputs, onnx_model, None)
        mod, checks_output = add_value_checks(mod, checks, tspec["kind"])
        if dtype == "float16" and precision_note is None:
            mod, weights = store_weights_float16(mod, weights, onnx_model)
        return FrontEnd(onnx_model, mod, inputs, weights, outputs, [], None, None, None, None, [], template_entry,
                        tspec, gemm, tvm_target, fallback=reason, coverage=report, checks=checks,
                        checks_output=checks_output)
    site = sites[0]

    user_mask = normalize_mask(mask, batch=batch, heads=site.heads, seq_q=site.seq_q, seq_k=site.seq_k)
    combined = user_mask if plan.const_keep is None else user_mask & plan.const_keep
    mask_batch, mask_heads = _mask_groups(user_mask, plan.const_keep, plan.runtime)
    bias = score_bias(site, plan.bias_terms, plan)
    if narrow_bias and bias is not None and bias[1][2] == "float32" and site.dtype in NARROW_DTYPES:
        var2val = relax.analysis.get_var2val(mod["main"])
        if all(narrows_exactly_enough(score_bias(s, plan.bias_terms, plan, i)[0], var2val)
               for i, s in enumerate(sites)):
            bias = score_bias(site, plan.bias_terms, plan, dtype=site.dtype)
    kv_heads = shared_kv_heads(sites)      # grouped-query attention: K and V before the graph's repeat
    choice = choose_kernel(kernel, combined, batch=batch, heads=site.heads, head_dim=site.head_dim,
                           dtype=site.dtype, seq_q=site.seq_q, target_kind=tspec["kind"], mask_batch=mask_batch,
                           mask_heads=mask_heads, bias=bias[1] if bias else None, dense_only=plan.dense_only,
                           database=database, target_arch=tspec.get("arch"), padding=plan.padding is not None,
                           kv_heads=kv_heads)
    if choice.kind == "wgmma" and tspec["arch"] != "sm_90a":   # wgmma exists on sm_90a only: the module is built so
        tspec = {**tspec, "arch": "sm_90a"}
        tvm_target = make_target(tspec)
    if choice.kind == "dense":      # the model's own masking stays in the dense graph: only the user's mask is input
        choice = dataclasses.replace(choice, mask_batch=user_mask.shape[0], mask_heads=user_mask.shape[1])
    elif plan.padding is not None:  # the model's key padding, applied by the sparse kernel from its input
        choice = dataclasses.replace(choice, padding=True)
        if lean_padding and choice.kind == "block":
            choice = dataclasses.replace(choice, config={**choice.config, "lean_padding": True},
                                         reason=choice.reason + "; lean_padding")
    if attention_knobs and choice.kind != "dense":
        choice = _with_attention_knobs(choice, attention_knobs)
    if choice.kind != "dense" and kv_heads < site.heads:
        choice = dataclasses.replace(choice, reason=choice.reason + f"; K and V read from their {kv_heads} key/value "
                                     f"heads (grouped-query attention, {site.heads // kv_heads} query heads each)")
    primfunc = None
    if choice.kind != "dense":
        primfunc = kernel_primfunc(choice, batch=batch, heads=site.heads, seq_q=site.seq_q, seq_k=site.seq_k,
                                   head_dim=site.head_dim, dtype=site.dtype, scale=site.scale,
                                   target_kind=tspec["kind"], kv_heads=kv_heads)
    for source in plan.runtime if choice.kind != "dense" else []:
        mod[source.name] = source.function
    mod, format_inputs = rewrite_attention(mod, sites, choice, primfunc, plan.bias_terms, plan=plan,
                                           padding=plan.padding if choice.padding else None, target_kind=tspec["kind"],
                                           grouped_kv=kv_heads < site.heads)
    if fuse_relative_bias:
        tiled = (TiledAttention(*choice.tile, choice.mask_batch, choice.mask_heads) if choice.kind in TILED
                 else None)
        mod, _ = fuse_relative_biases(mod, tspec["kind"], tiled)
    template_entry = {}
    if templates:
        mod, template_entry = use_templates(mod, tvm_target, database, gemm, schedule=schedule, gemm_knobs=gemm_knobs,
                                            norm_fusion=norm_fusion, gated_epilogue=gated_epilogue)
    mod["main"] = relax.analysis.remove_all_unused(fold_permute_pairs(mod["main"]))  # transposes around attention
    report = coverage(canonical, mod["main"], attention_kernel=choice.kind, attention_sites=len(sites),
                      attention_reason=f"dense kernel: {choice.reason}",
                      templates=None if templates else _templates_off(tspec, dtype), template_entry=template_entry)
    checks = value_checks(inputs, onnx_model, plan.padding if choice.padding else None)
    mod, checks_output = add_value_checks(mod, checks, tspec["kind"])
    if dtype == "float16" and precision_note is None:
        mod, weights = store_weights_float16(mod, weights, onnx_model)
    return FrontEnd(onnx_model, mod, inputs, weights, outputs, sites, plan, user_mask, combined, choice,
                    format_inputs, template_entry, tspec, gemm, tvm_target, coverage=report, checks=checks,
                    checks_output=checks_output)


def _to_float16(mod: tvm.IRModule) -> tuple[tvm.IRModule, str | None]:
    """TVM's mixed precision (float16 compute, float32 accumulation and outputs), brought back to the canonical
    form (it adds no-op casts); returns the module unchanged and the reason where TVM's pass cannot convert it
    (HF BigBird block_sparse and Longformer: their imports hold Relax functions as values, which the pass refuses
    with an internal error), so such a model runs in float32 with a warning instead of failing."""
    try:
        mixed = relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
    except tvm.error.InternalError as err:
        detail = str(err).strip().splitlines()[-1][:160]
        note = f"TVM's mixed-precision pass cannot convert this graph ({detail}), so it computes in float32"
        warnings.warn(f"dtype: {note}", stacklevel=3)
        return mod, note
    return canonicalize(fold_constant_casts(mixed)), None


def _templates_off(tspec: dict, dtype: str) -> str:
    """Why the fusion templates did not run (the coverage report's reason for every chain)."""
    if tspec["kind"] != "cuda":
        return f"fusion templates off: target {tspec['kind']} (they are CUDA kernels)"
    if dtype != "float16":
        return f"fusion templates off: dtype {dtype} (they are 16-bit)"
    return "fusion templates off (templates=False)"


def _check_fallback_mask(mask, batch: int, seq_len: int, reason: str) -> None:
    """A model compiled without stof-tvm's attention kernels cannot take a mask: refuse any mask that drops a
    pair (it would be ignored), naming why the kernels do not apply."""
    try:
        keeps_all = bool(normalize_mask(mask, batch=batch, heads=1, seq_q=seq_len, seq_k=seq_len).all())
    except (ValueError, TypeError):
        keeps_all = False
    if not keeps_all:
        raise ValueError(f"mask: stof-tvm cannot apply a sparse mask to this model ({reason}); compile it with "
                         f"mask='dense' to run it through TVM's default pipeline")


def _with_attention_knobs(choice: KernelChoice, knobs: dict) -> KernelChoice:
    """``choice`` with ``knobs`` merged into its kernel's configuration (``compile``'s ``attention_knobs``)."""
    config = {**choice.config, **knobs}
    try:
        config_object(choice.kind, config)
    except TypeError as err:
        raise ValueError(f"attention_knobs: {sorted(knobs)} are not all knobs of the {choice.kind} attention kernel "
                         f"({err})") from None
    return dataclasses.replace(choice, config=config, reason=f"{choice.reason}; attention_knobs {knobs}")


def compile(model, *, mask, batch: int, seq_len: int, target="cuda", dtype: str = "float16",
            kernel: str = "auto", templates: bool | None = None, gemm: str = "auto", cuda_graph: bool = False,
            dependent_launch: bool | None = None, database: str | None = None, progress=None,
            lean_padding: bool = True, gemm_knobs: dict | None = None, norm_fusion: bool = False,
            attention_knobs: dict | None = None, narrow_bias: bool = True, fuse_relative_bias: bool = True,
            gated_epilogue: bool = False):
    """Compile an ONNX transformer for a sparse attention ``mask``; return an :class:`Artifact`.

    ``model``: path or ``onnx.ModelProto``. ``mask``: any form :func:`stof_tvm.make_mask` /
    ``normalize_mask`` accept (it becomes the module's default mask; any mask of the same kind can be passed
    at run time). ``target``: ``"cuda"`` (sm_90), ``"llvm"`` or a TVM target dict. ``dtype``: compute dtype of
    the model (``"float16"`` or ``"float32"``). ``kernel``: ``"auto"``, ``"block"``, ``"row"``, ``"wgmma"`` (Hopper;
    ``auto`` picks it on an sm_90 target where the model predicts it faster, building the module for sm_90a with
    nvcc) or ``"dense"``.
    ``templates``: replace the chains around attention (QKV projection into heads, GEMM + bias + residual +
    LayerNorm, GEMM + bias + GELU, other linear layers) with stof-tvm's fusion templates (``dtype="float16"``;
    see :mod:`.downstream`) instead of TVM's default schedules; the manifest's ``templates`` entry lists each
    site's templates and knobs. ``None`` (default): on for a CUDA target in float16, off otherwise.
    ``gemm``: the templates' GEMM kernel, ``"mma"`` (mma.sync, any sm_80+ GPU), ``"wgmma"`` (Hopper: CUDA
    sm_90a, needs nvcc here to prebuild the cubins the artifact carries; for the GEMM and QKV stages whose
    shapes it tiles) or ``"auto"`` (default: ``"wgmma"`` for templates on an sm_90 / sm_90a target when nvcc is
    found, else ``"mma"``; wgmma ran 1.1-2.1x faster than mma.sync on the H200, BENCHMARKS.md; GEMMs too small to
    fill half the GPU with 128-row tiles stay on mma.sync, see :func:`.linear_match.wgmma_misfit`).
    ``cuda_graph``: capture the module's static
    regions in CUDA graphs (Relax's ``RewriteCUDAGraph``; CUDA only; see :mod:`.pipeline`), the whole forward pass
    made one region first (:mod:`.graph_inputs`).
    ``dependent_launch``: launch every kernel as a programmatic dependent launch, so its start overlaps the end of
    the kernel before it (:mod:`stof_tvm.schedules.dependent_launch`; sm_90 and later). ``None`` (default): on
    where the target supports it.
    ``database``: a tuning work dir (``stof-tvm tune``; :func:`stof_tvm.compile` can tune into it first) whose
    records are applied; the manifest's ``tuning`` entry counts them (``applied``), names the calls that found
    none (``missing``) and the database's measured jobs no call asked for (``unused``).
    ``progress``: called with a short line as each long step starts (the CLI prints them; a large model spends
    most of a minute in TVM's build).
    ``lean_padding`` (default on): where the block-wise kernel applies the model's key padding, its
    ``BlockConfig.lean_padding`` form (span tests only in batch rows that drop a key; the predicate's pad_bits words
    loaded once a tile): on the H200, RoBERTa-base 16x2048's BigBird attention 0.1049 -> 0.1004 ms under an all-ones
    mask, 0.1442 -> 0.1246 under mixed padding, the same under right padding (BENCHMARKS.md, session 13);
    ``False`` keeps the older form.
    ``gemm_knobs``: knobs merged into every wgmma GEMM's chosen knob set, e.g. ``{"early_weights": False}`` (to
    measure a kernel knob across a whole model; a combination the kernel cannot take is refused when it builds;
    ``gelu_form`` goes only to the GELU GEMMs' ``fast_gelu`` sets); an entry named after a wgmma template holds knobs
    for that template's calls alone, e.g. ``{"qkv_projection_wgmma": {"block_n": 256, "persistent": False}}``.
    ``attention_knobs``: knobs merged into the chosen sparse attention kernel's configuration, e.g.
    ``{"stages": 3}`` for the block-wise kernel (``BlockConfig``; to measure a knob across a whole model); a name the
    chosen kernel does not have is a ValueError.
    ``norm_fusion`` (default off): under ``gemm="wgmma"``, a layer's GEMM + bias + residual + LayerNorm runs as one
    wgmma kernel (a cluster of blocks per row tile) where it launches half the GPU's SMs (:mod:`.downstream`). Off by
    default: every fused kernel measured slower than the unfused pair (0.57-0.88x on an H100, BENCHMARKS.md session
    19: its clusters of 3-4 blocks leave SMs idle or run in two waves, and its epilogue is not overlapped).
    ``narrow_bias`` (default on): a float32 score bias made only of values already rounded to 16 bits (DeBERTa's
    relative-position terms) reaches the sparse kernel in the model's 16-bit dtype, halving the bytes the graph
    writes and the kernel reads (:mod:`.bias_precision`); ``False`` keeps it in float32.
    ``fuse_relative_bias`` (default on): such a 16-bit bias made of two gathered products (DeBERTa-v3's content-to-
    position and position-to-content terms) is computed by one kernel that forms each 64 x 64 tile from windows of
    the products in shared memory, never writing the products, and only at the tiles the attention's runtime mask
    visits (:mod:`.relative_bias_match`; checked against float32 at DeBERTa-v3-base's shapes and timed by
    ``scripts/check_relative_bias_gpu.py`` and ``scripts/bench_e2e.py``, BENCHMARKS.md session 31); ``False`` keeps
    the graph's product and gather kernels.
    ``gated_epilogue`` (default off): under ``gemm="wgmma"``, a gated MLP's gate and up projections and their
    ``silu(gate) * up`` run as one GEMM whose epilogue writes the product (:mod:`.gated_units`; HF Llama, Qwen2,
    Mistral). Off until an H100 / H200 run of ``scripts/check_wgmma_gpu.py --suite gated`` has checked its kernel.
    """
    from stof_tvm.artifact import Artifact
    from stof_tvm.records import open_database, record_usage

    report = progress if progress is not None else (lambda line: None)

    if cuda_graph not in (False, True):
        raise TypeError(f"cuda_graph: expected a bool, got {cuda_graph!r}")
    for name, flag in (("lean_padding", lean_padding), ("norm_fusion", norm_fusion), ("narrow_bias", narrow_bias),
                       ("fuse_relative_bias", fuse_relative_bias), ("gated_epilogue", gated_epilogue)):
        if flag not in (False, True):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    for name, knobs in (("gemm_knobs", gemm_knobs), ("attention_knobs", attention_knobs)):
        if knobs is not None and not (isinstance(knobs, dict) and all(isinstance(k, str) for k in knobs)):
            raise TypeError(f"{name}: expected a dict of knob names to values, got {knobs!r}")
    if cuda_graph and target_dict(target)["kind"] != "cuda":
        raise ValueError(f"cuda_graph: CUDA graphs need target 'cuda', got {target_dict(target)['kind']!r}")
    records = None
    if database is not None:
        report(f"reading the tuning records in {database}")
        records = open_database(database)
    report("importing the ONNX graph, matching attention and the chains after it")
    with record_usage() as usage:
        front = front_end(model, mask=mask, batch=batch, seq_len=seq_len, target=target, dtype=dtype,
                          kernel=kernel, templates=templates, gemm=gemm, database=database,
                          lean_padding=lean_padding, gemm_knobs=gemm_knobs, norm_fusion=norm_fusion,
                          attention_knobs=attention_knobs, narrow_bias=narrow_bias,
                          fuse_relative_bias=fuse_relative_bias, gated_epilogue=gated_epilogue)
        tspec, choice = front.tspec, front.choice
        report(f"building for {tspec['kind']}{' ' + tspec['arch'] if 'arch' in tspec else ''} "
               f"(attention kernel {choice.kind if choice else 'none: ' + front.fallback}, "
               f"templates {front.gemm if front.template_entry else 'off'})")
        dependent_launch = uses_dependent_launch(front.target, dependent_launch)
        mod, executable = lower(front, database, cuda_graph, dependent_launch)
    user_mask = front.user_mask
    binaries = {}
    if front.gemm == "wgmma" or (choice is not None and choice.kind == "wgmma"):
        from .cubins import prebuild_cubins

        report(f"compiling the CUDA module for {tspec['arch']} with nvcc (the artifact carries the cubin)")
        binaries = prebuild_cubins(executable, tspec["arch"])

    mask_entry = _mask_entry(mask)
    arrays = {}
    if mask_entry.get("array") and front.fallback is None:
        arrays["mask.npy"] = np.ascontiguousarray(user_mask)
    if front.plan is not None and front.plan.const_keep is not None and choice.kind != "dense":
        arrays["model_keep.npy"] = np.ascontiguousarray(front.plan.const_keep)
    has_transform = any(gv.name_hint == TRANSFORM_PARAMS for gv, _ in mod.functions_items())
    manifest = _manifest(
        source={"path": os.path.abspath(os.fspath(model))} if isinstance(model, (str, os.PathLike)) else {},
        onnx_model=front.onnx_model, inputs=front.inputs, weights=front.weights, outputs=front.outputs,
        format_inputs=front.format_inputs, mask_entry=mask_entry, user_mask=user_mask,
        model_keep="model_keep.npy" if "model_keep.npy" in arrays else None,
        plan=front.plan, sites=front.sites, choice=choice, batch=batch,
        transform_params=TRANSFORM_PARAMS if has_transform else None, tspec=tspec, dtype=dtype,
        tuning={"database": records.work_dir if records else None,
                **(usage.summary(record_calls(front.template_entry, choice, front.sites), records)
                   if records else {})}, fallback=front.fallback)
    manifest["templates"] = front.template_entry
    manifest["coverage"] = front.coverage
    manifest["value_checks"] = {"output": front.checks_output, "inputs": [c.to_json() for c in front.checks]} \
        if front.checks else None
    manifest["cuda_graph"] = cuda_graph
    manifest["dependent_launch"] = dependent_launch
    # the runtime keeps the format arrays of each size at one address (the CUDA graphs read them there)
    manifest["static_mask_inputs"] = cuda_graph and static_mask_inputs(front)
    if binaries:
        manifest["cuda_binaries"] = {"arch": tspec["arch"], "files": sorted(binaries)}
    return Artifact(executable, manifest, arrays, stored_values(front.onnx_model, front.weights), binaries)


def uses_dependent_launch(target: tvm.target.Target, requested: bool | None) -> bool:
    """Whether the build launches its kernels as programmatic dependent launches: ``requested``, or where
    ``None`` whether ``target`` supports them; a clear error where it was asked for on a target without them."""
    if requested not in (None, False, True):
        raise TypeError(f"dependent_launch: expected a bool or None, got {requested!r}")
    supported = dependent_launch_supported(target)
    if requested and not supported:
        raise ValueError(f"dependent_launch: programmatic dependent launch needs a CUDA sm_90+ target, got "
                         f"{target.kind.name} {target.attrs.get('arch', '')}".rstrip())
    return supported if requested is None else requested


def lower(front: FrontEnd, database: str | None, cuda_graph: bool,
          dependent_launch: bool | None = None) -> tuple[tvm.IRModule, object]:
    """Step 6 of :func:`compile`: lift the weight-only work into ``main_transform_params`` (run once at load),
    fuse, schedule and build; returns (the optimised module, the executable). The launch census
    (``scripts/count_launches.py``) reads both. ``dependent_launch``: see :func:`compile`.

    A matmul by a transposed operand becomes one function reading that operand transposed (``FuseTransposeMatmul``)
    before the lifting: lifted, the transpose of a weight-only operand would be a stored weight laid [k, n], which
    the tensor-core matmul loads one element at a 1 KB stride (HF DeBERTa-v3's content-to-position products, 79
    against 44.5 us fused at 8 x 512 on an H100; BENCHMARKS.md, session 26)."""
    mod = relax.transform.LiftTransformParams()(relax.transform.FuseTransposeMatmul()(front.mod))
    if cuda_graph:
        mod = whole_graph(mod, len(front.inputs), static_mask_inputs(front), front.tspec["kind"])
    optimized = optimize(mod, front.target, database)
    executable = build(optimized, front.target, templates=bool(front.template_entry), cuda_graph=cuda_graph,
                       dependent_launch=uses_dependent_launch(front.target, dependent_launch))
    return optimized, executable


def static_mask_inputs(front: FrontEnd) -> bool:
    """Whether a CUDA-graph build may treat the mask's format arrays as fixed parameters (:mod:`.graph_inputs`):
    there are some, and the runtime builds them once per mask, not per call (no host-path mask terms)."""
    host_terms = front.choice is not None and front.choice.kind != "dense" and bool(front.plan.runtime)
    return bool(front.format_inputs) and not host_terms


def check_gemm(gemm: str, templates: bool, tspec: dict) -> tuple[str, dict]:
    """Validate the ``gemm`` choice against ``templates`` and the target; returns the GEMM kernel to use
    (``"auto"`` resolved) and the target dict to build for (``"wgmma"`` turns CUDA ``sm_90`` into ``sm_90a``,
    the only architecture with wgmma)."""
    from .cubins import find_nvcc
    from .downstream import GEMMS

    if gemm not in GEMMS + ("auto",):
        raise ValueError(f"gemm: expected one of {GEMMS + ('auto',)}, got {gemm!r}")
    if gemm == "auto":
        hopper = tspec["kind"] == "cuda" and str(tspec.get("arch")) in ("sm_90", "sm_90a")
        gemm = "wgmma" if templates and hopper and find_nvcc() is not None else "mma"
    if gemm == "mma":
        return gemm, tspec
    if not templates:
        raise ValueError("gemm: 'wgmma' selects the fusion templates' GEMM kernel; it needs templates=True")
    if tspec["kind"] != "cuda" or str(tspec.get("arch")) not in ("sm_90", "sm_90a"):
        raise ValueError(f"gemm: 'wgmma' needs a CUDA sm_90 / sm_90a (Hopper) target, got "
                         f"{tspec['kind']} {tspec.get('arch', '')}".rstrip())
    return gemm, {**tspec, "arch": "sm_90a"}


__all__ = ["compile", "front_end", "lower", "uses_dependent_launch", "FrontEnd", "check_gemm", "DTYPES"]
