"""Downstream fusion templates: the operators after attention, on tensor cores (design.md 1B, issue 4).

Each template is a TensorIR PrimFunc generator plus a schedule with named knobs. The registry
:data:`TEMPLATES` maps a name to a :class:`Template`:

==================================  ================================================  ======================
name (``_kn``: weight as [k, n])     computes                                          shape keys
==================================  ================================================  ======================
``gemm``                            ``A @ W^T``                                       m, n, k
``gemm_bias``                       ``A @ W^T + bias``                                m, n, k
``gemm_bias_relu`` / ``_gelu_erf``  ``act(A @ W^T + bias)``                           m, n, k
/ ``_gelu_tanh``
``gemm_bias_residual_layernorm``    ``LayerNorm(A @ W^T + bias + residual)``          m, n, k
``bias_residual_layernorm``         ``LayerNorm(x + bias + residual)``                m, n
``layernorm``                       ``LayerNorm(x)``                                  m, n
``rmsnorm``                         ``RMSNorm(x)`` (T5)                               m, n
``residual_rmsnorm``                ``sum = x + residual``, ``RMSNorm(sum)``: both    m, n
``qkv_projection``                  ``x @ W^T + bias`` written as [3, B, H, S, D]     batch, seq, heads, head_dim
``split_heads``                     [B*S, 3*H*D] -> [3, B, H, S, D] (unfused QKV)     batch, seq, heads, head_dim
==================================  ================================================  ======================

Inputs are float16 or bfloat16, accumulation and LayerNorm statistics float32, outputs in the input dtype;
``W`` is [n, k] (``torch.nn.Linear``) unless the name ends in ``_kn``. :data:`.chains.CHAINS` lists each
layer chain's fused and unfused forms; the tuner times both.

The Template API (what the tuner and the compiler use)::

    t = TEMPLATES["gemm_bias_gelu_erf"]                  # or get_template(name)
    func = t.primfunc({"m": 4096, "n": 3072, "k": 768}, "float16")   # unscheduled s_tir PrimFunc
    space = t.knob_space(shape, dtype, hw=H200)         # every feasible configuration, as dicts, ranked
    t.resources(shape, dtype, knobs)                    # threads, shared_bytes, acc/operand registers, grid
    sch = tvm.s_tir.Schedule(func); t.apply(sch, space[0])   # fixed knobs
    t.sample(sch, candidates=space[:8])                 # knobs drawn with sch.sample_categorical
    t.space_generator(shape, dtype, candidates)         # ms.space_generator.ScheduleFn for ms.tune_tir
    t.arguments(shape, dtype)                           # [(name, shape, dtype)] in call order, output last
    t.reference(shape, inputs)                          # float64 numpy outputs; t.flops(shape)
    templates.build.build(sch)                          # compile with the pass config the templates need

Knobs (GEMM families): ``warps_m, frag_m, warps_n, frag_n`` (block tile 16*warps*frag per side, warp tile
16*frag), ``k_frags`` (block_k = 16*k_frags), ``stages`` (cp.async pipeline depth), ``vec`` (epilogue
access width); LayerNorm and RMSNorm: ``rows`` (per block), ``lanes`` (threads per row), ``vec``; split_heads: ``rows``,
``vec``. With :meth:`Template.sample`, each knob is one ``sample_categorical`` whose value feeds the
schedule directly (splits take the random variable), so MetaSchedule's trace replay and evolutionary
search see real decisions; steps needing products of knobs run in the :class:`.registry.Finalize`
postprocessor, after :class:`.registry.KeepCandidates` has dropped combinations outside the candidates.

Opt-in: ``gemm_wgmma`` / ``gemm_bias[_<act>]_wgmma`` (:mod:`.gemm_wgmma`) are the same GEMMs as a
thread-level Hopper kernel on ``wgmma`` (sm_90a); ``primfunc`` is their TensorIR definition, ``kernel(shape,
dtype, knobs)`` the CUDA kernel, and ``apply`` raises. Nothing selects them by default (their numerics await
an H200 run of ``scripts/check_wgmma_gpu.py``).

``ffn_<act>[_bias]_wgmma`` (:mod:`.ffn_wgmma`, same Template API as the wgmma GEMMs): the whole FFN
``act(x @ W1^T + b1) @ W2^T (+ b2)`` in one kernel with the intermediate kept on chip, for hidden 128-256.

Builds must use :data:`.build.BUILD_CONFIG` (``tirx.use_async_copy``): :func:`.build.build`,
:func:`.build.ms_builder` for MetaSchedule, or a PassContext with it around other compiles.
"""
from . import ffn_wgmma, gated_gemm, gemm, gemm_layernorm, gemm_wgmma, layernorm, qkv, rmsnorm  # noqa: F401
from .build import BUILD_CONFIG, cuda_source, cuda_target, ms_builder
from .chains import CHAINS, chain_stages
from .registry import H200, TEMPLATES, Hardware, Template, get_template, register, template_of

__all__ = ["TEMPLATES", "Template", "Hardware", "H200", "get_template", "register", "template_of", "CHAINS",
           "chain_stages", "BUILD_CONFIG", "cuda_source", "cuda_target", "ms_builder"]
