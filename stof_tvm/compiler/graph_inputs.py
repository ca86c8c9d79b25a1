"""Make the whole forward pass one static region, so ``cuda_graph=True`` captures it in one CUDA graph.

Relax's ``RewriteCUDAGraph`` captures only launches whose arguments are all statically planned buffers, constants
or *fixed* parameters (those after ``main``'s ``num_input``: the weights). A model's inputs change their
address every call, so every kernel that reads one stays outside the graphs; the mask's format arrays were inputs
too, so each attention call split the graph (RoBERTa-base at 1x128: 14 graph launches and 21 kernels outside
them per forward; with the rewrites below 1 and 3). Two rewrites make the region whole:

- :func:`stage_inputs`: ``main`` first copies its model inputs (token ids, the padding mask: a few hundred bytes
  at batch 1) into buffers of its own with one small kernel, and every later kernel reads the copies. Only that
  copy, and the kernels that write ``main``'s outputs (their storage is the caller's, fresh every call), run
  outside the graph.
- :func:`fix_mask_inputs`: ``num_input`` counts the model inputs only, so the mask's format arrays count as fixed
  parameters like the weights, and their symbolic lengths key the graph (one capture per format size, TVM's own
  mechanism for weights of symbolic shape). The runtime keeps one device buffer set per format size and copies a
  new mask of a size already seen into it (:class:`stof_tvm.mask_formats.MaskFormats` with ``static=True``), so a
  graph never reads a freed or stale buffer.

And the position ids' scan that TVM would leave to its own multi-kernel GPU cumsum, outside the graphs,
runs on one kernel inside (:mod:`.row_scan`).
"""
from __future__ import annotations

import math

import tvm
from tvm import relax, tirx

from .op_patterns import OPAQUE
from .row_scan import rewrite_row_scans

COPY_SYMBOL = "stof_stage_inputs"
COPY_THREADS = 256
STAGE_MAX_BYTES = 4 << 20   # inputs up to this size are copied (token ids: 8 bytes each, 64 x 4096 is 2 MiB)


def copy_primfunc(specs: list[tuple[tuple[int, ...], str]], target_kind: str) -> tirx.PrimFunc:
    """``(in_0, ..., in_{n-1}, out_0, ..., out_{n-1})``: ``out_i = in_i`` for tensors of the given (shape, dtype),
    in one kernel on CUDA (one thread per element of the largest, each thread copying its element of every input),
    a loop per tensor on the CPU."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    if not specs:
        raise ValueError("specs: expected at least one (shape, dtype)")
    if target_kind not in ("cuda", "llvm"):
        raise ValueError(f"target_kind must be 'cuda' or 'llvm', got {target_kind!r}")
    sizes = [math.prod(shape) for shape, _ in specs]
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name(COPY_SYMBOL)
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE})
            ins = [T.arg(f"in{i}", T.Buffer(shape, dtype)) for i, (shape, dtype) in enumerate(specs)]
            outs = [T.arg(f"out{i}", T.Buffer(shape, dtype)) for i, (shape, dtype) in enumerate(specs)]
            if target_kind == "cuda":
                with T.thread_binding(-(-max(sizes) // COPY_THREADS), thread="blockIdx.x") as bx:
                    with T.thread_binding(COPY_THREADS, thread="threadIdx.x") as tx:
                        for src, dst, size in zip(ins, outs, sizes):
                            with T.If(bx * COPY_THREADS + tx < size):
                                with T.Then():
                                    _store(T, src, dst, bx * COPY_THREADS + tx)
            else:
                for src, dst, size in zip(ins, outs, sizes):
                    with T.serial(size) as flat:
                        _store(T, src, dst, flat)
    return builder.get()


def _store(T, src, dst, flat) -> None:
    """``dst[idx] = src[idx]`` at the row-major multi-index of flat position ``flat``."""
    index, rest = [], flat
    for extent in reversed([int(d) for d in src.shape]):
        index.append(tirx.floormod(rest, extent))
        rest = tirx.floordiv(rest, extent)
    index.reverse()
    T.buffer_store(dst, tirx.BufferLoad(src, index), index)


def stage_inputs(mod: tvm.IRModule, count: int, target_kind: str) -> tvm.IRModule:
    """``main`` with those of its first ``count`` parameters (the model inputs) of at most :data:`STAGE_MAX_BYTES`
    copied once at its start by :func:`copy_primfunc`, every use reading the copies (see the module docstring).
    A larger input (ViT's pixels at a large batch) is read where it is: copying it would cost more than the launch
    outside the graph that its first reader (the patch embedding, the forward pass's first kernel) then takes."""
    func = mod["main"]
    staged, specs = [], []
    for var in func.params[:count]:
        ty = var.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise ValueError(f"stage_inputs: input {var.name} is not a tensor of known shape")
        shape = tuple(int(d) for d in ty.shape.values)
        if math.prod(shape) * tvm.runtime.DataType(str(ty.dtype)).bits // 8 <= STAGE_MAX_BYTES:
            staged.append(var)
            specs.append((shape, str(ty.dtype)))
    if not staged:
        return mod
    builder = relax.BlockBuilder(mod)
    gv = builder.add_func(copy_primfunc(specs, target_kind), COPY_SYMBOL)
    mod = builder.get()
    fresh = {var: relax.Var(var.name, var.ty) for var in staged}
    out_ty = [relax.TensorType(list(shape), dtype) for shape, dtype in specs]
    # the original parameter variables are now bound to the copies, so the body reads them unchanged
    if len(staged) == 1:        # call_tir of one output returns the tensor itself
        bindings = [relax.VarBinding(staged[0], relax.call_tir(gv, list(fresh.values()), out_ty[0]))]
    else:
        copied = relax.Var("staged_inputs", relax.TupleType(out_ty))
        bindings = [relax.VarBinding(copied, relax.call_tir(gv, list(fresh.values()), out_ty))]
        bindings += [relax.VarBinding(var, relax.TupleGetItem(copied, i)) for i, var in enumerate(staged)]
    body = func.body
    params = [fresh.get(var, var) for var in func.params]
    new = relax.Function(params, relax.SeqExpr([relax.BindingBlock(bindings)] + list(body.blocks), body.body),
                         func.ret_ty, func.is_pure, func.attrs)
    mod["main"] = new
    return mod


def fix_mask_inputs(mod: tvm.IRModule, model_inputs: int) -> tvm.IRModule:
    """``main``'s ``num_input`` set to the model inputs alone: the mask's format arrays that follow them count as
    fixed parameters for ``RewriteCUDAGraph`` (see the module docstring). Weights stay where they are."""
    func = mod["main"]
    if int(func.attrs["num_input"]) < model_inputs:
        raise ValueError(f"main: num_input {int(func.attrs['num_input'])} < {model_inputs} model inputs")
    mod["main"] = func.with_attr("num_input", model_inputs)
    return mod


def whole_graph(mod: tvm.IRModule, model_inputs: int, static_masks: bool, target_kind: str) -> tvm.IRModule:
    """The rewrites for a ``cuda_graph`` build: the model inputs staged; where ``static_masks`` (the runtime can
    keep the format arrays at fixed addresses: no host-path mask terms) the mask inputs fixed; the row
    scans (RoBERTa's position ids) on a kernel the graph captures (:mod:`.row_scan`)."""
    mod = rewrite_row_scans(stage_inputs(mod, model_inputs, target_kind), target_kind)
    return fix_mask_inputs(mod, model_inputs) if static_masks else mod
