"""Boolean masks in the CUDA kernels TVM schedules for us (:mod:`stof_tvm.compiler.bool_access`).

TVM 0.27 prints a vectorised access to two one-byte bools as ``*(ushort2*)(mask + i)``: 4 bytes for 2 elements,
wrong values and cudaErrorMisalignedAddress where ``i`` is 2 mod 4 (the H200 crash of a ``kernel="dense"`` RoBERTa
build). Dense attention fuses the model's ``where(keep, scores, fill)`` into dlight's vectorised QK^T epilogue, so
every dense CUDA build had such loads. Checked here: the detector finds them in that code, the fix leaves none in
real Hugging Face exports (RoBERTa: padding; GPT-2: causality and padding), the rewritten loop computes exactly
what the vectorised one did, and the dense path still equals torch.

(Measured with the same builds before the fix: 8 such loads in the RoBERTa and GPT-2 builds, eager and sdpa,
templates on or off, float16 and float32; none in the ``kernel="none"`` fallback builds of BigBird block_sparse and
Longformer, whose masks never meet a GEMM epilogue.)
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, tirx
from tvm.script import tirx as T

import stof_tvm
from stof_tvm.compiler import pipeline
from stof_tvm.compiler.bool_access import scalar_bool_primfunc
from stof_tvm.compiler.cubins import cuda_sources

_KERNEL = re.compile(r'extern "C" __global__ void(?: __launch_bounds__\(\d+\))? (\w+)\(([^)]*)\)\s*\{')
_BOOL_PARAM = re.compile(r"\bbool\s*\*\s*(?:__restrict__\s+)?(\w+)")
_BOOL_ARRAY = re.compile(r"\bbool\s+(\w+)\s*\[")
_BOOL_CAST = re.compile(r"\(\(bool\s*\*\)\s*(\w+)\)")
# *(T*)(name + ...) or *(T*)(((bool*)name) + ...): a T-typed access at a buffer's address
_TYPED_ACCESS = re.compile(r"\*\(\s*([A-Za-z_][\w ]*?)\s*\*\s*\)\s*\(\s*(?:\(\(bool\s*\*\)\s*)?(\w+)\b")


def bool_vector_accesses(source: str) -> list[tuple[str, str]]:
    """``(kernel, access)`` for every access through a non-bool type (``ushort2``, ``int``, ...) to a bool buffer
    (a kernel's ``bool*`` parameter, a ``bool`` array, a pointer cast to ``bool*``) in CUDA ``source``."""
    starts = list(_KERNEL.finditer(source))
    found = []
    for i, head in enumerate(starts):
        body = source[head.end():starts[i + 1].start() if i + 1 < len(starts) else len(source)]
        names = set(_BOOL_PARAM.findall(head.group(2))) | set(_BOOL_ARRAY.findall(body)) | \
            set(_BOOL_CAST.findall(body))
        found += [(head.group(1), m.group(0)) for m in _TYPED_ACCESS.finditer(body)
                  if m.group(2) in names and m.group(1).strip() != "bool"]
    return found


# Lines of the kernel TVM generated for a kernel="dense" RoBERTa build (helper H4's reading of the H200 crash)
H4_EXCERPT = """
extern "C" __global__ void __launch_bounds__(128) fused_matmul1_cast4_multiply1_cast5_where1_add6_kernel(\
float* __restrict__ T_add_intermediate_ptr, bool* __restrict__ lv52_ptr, half* __restrict__ lv62_ptr, \
half* __restrict__ lv63_ptr, float* __restrict__ param_0_ptr, float* __restrict__ stof_bias_ptr) {
      ushort2 v__523 = *(ushort2*)(lv52_ptr + ((((int)blockIdx.x) * 4096) + (((int)threadIdx.y) * 4)) + 2));
      float2 v__524 = *(float2*)(stof_bias_ptr + ((((int)blockIdx.x) * 4096) + (((int)threadIdx.y) * 4)) + 2));
}
extern "C" __global__ void __launch_bounds__(1024) other_kernel(half* __restrict__ lv52_ptr) {
      half2 v__1 = *(half2*)(lv52_ptr + (((int)threadIdx.x) * 2));
}
"""


def test_detector_flags_the_crashing_load_only():
    """The H200 crash's load is found; the float bias load of the same kernel and a half2 load of a buffer that
    has the same name in another kernel are not."""
    found = bool_vector_accesses(H4_EXCERPT)
    assert found == [("fused_matmul1_cast4_multiply1_cast5_where1_add6_kernel", "*(ushort2*)(lv52_ptr")]


def _masked_scores_module(mask_dtype: str = "bool") -> tvm.IRModule:
    """``softmax(where(mask, Q @ K^T, fill))`` at [2, 2, 128, 64]: the dense attention epilogue in miniature."""
    b, h, s, d = 2, 2, 128, 64
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([b, h, s, d], "float16"))
    k = relax.Var("k", relax.TensorType([b, h, d, s], "float16"))
    mask = relax.Var("mask", relax.TensorType([b, 1, s, s], mask_dtype))
    with bb.function("main", [q, k, mask]):
        with bb.dataflow():
            scores = bb.emit(relax.op.matmul(q, k, out_dtype="float32"))
            masked = bb.emit(relax.op.where(mask, scores, relax.const(-3.0e38, "float32")))
            out = bb.emit_output(relax.op.nn.softmax(masked, axis=-1))
        bb.emit_func_output(out)
    return bb.get()


def _cuda_source(mod: tvm.IRModule) -> str:
    target = pipeline.make_target(pipeline.target_dict("cuda"))
    return "\n".join(cuda_sources(pipeline.build(pipeline.optimize(mod, target, None), target)))


def test_fused_where_epilogue_loads_its_mask_one_element_at_a_time(monkeypatch):
    """Without :func:`scalar_bool_access`, TVM's schedule + codegen give the epilogue vector mask loads (the
    bug, reproduced); with it, scalar loads of the same buffer; the GEMM itself keeps its vector accesses."""
    mod = _masked_scores_module()
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "scalar_bool_access", lambda m: m)
        broken = _cuda_source(mod)
    # ushort2 under dlight's CUDA-core matmul, ushort4 under the tensor-core form (k = 64: SmallKTensorCoreMatmul)
    assert any(access.endswith("*)(mask_ptr") for _, access in bool_vector_accesses(broken))
    fixed = _cuda_source(mod)
    assert bool_vector_accesses(fixed) == []
    assert re.search(r"\bmask_ptr\[", fixed) and re.search(r"\*\(half[24]\*\)", fixed)   # the GEMM's own stay


@T.prim_func(s_tir=True)
def _select(keep: T.Buffer((4, 16), "bool"), x: T.Buffer((4, 16), "float32"), out: T.Buffer((4, 16), "float32")):
    for i, j in T.grid(4, 16):
        with T.sblock("select"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.if_then_else(keep[vi, vj], x[vi, vj], T.float32(-1.0e30))


@T.prim_func(s_tir=True)
def _scale(x: T.Buffer((4, 16), "float32"), out: T.Buffer((4, 16), "float32")):
    for i, j in T.grid(4, 16):
        with T.sblock("scale"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = x[vi, vj] * T.float32(2.0)


def _vectorised(func: tirx.PrimFunc) -> tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    block = sch.get_child_blocks(sch.get_sblock("root"))[0]
    _, j = sch.get_loops(block)
    sch.vectorize(sch.split(j, [None, 2])[1])
    return sch.mod["main"].with_attr("global_symbol", "main")


def _loop_kinds(func: tirx.PrimFunc) -> list:
    sch = s_tir.Schedule(func)
    block = sch.get_child_blocks(sch.get_sblock("root"))[0]
    return [sch.get(loop).kind for loop in sch.get_loops(block)]


def test_unrolled_loop_computes_the_same_values():
    """The vectorised loop around the bool read becomes an unrolled one (exactly the same values on llvm, against
    numpy and the vectorised original); a function without bool buffers is left as it is."""
    vectorised = _vectorised(_select)
    fixed = scalar_bool_primfunc(vectorised)
    assert _loop_kinds(vectorised)[-1] == tirx.ForKind.VECTORIZED
    assert _loop_kinds(fixed)[-1] == tirx.ForKind.UNROLLED
    assert fixed.attrs["global_symbol"] == "main"
    assert scalar_bool_primfunc(_vectorised(_scale)) is None
    rng = np.random.default_rng(0)
    keep, x = rng.random((4, 16)) < 0.5, rng.standard_normal((4, 16)).astype(np.float32)
    expected = np.where(keep, x, np.float32(-1.0e30))
    for func in (vectorised, fixed):
        run = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
        dev = tvm.cpu()
        out = tvm.runtime.empty((4, 16), "float32", dev)
        run(tvm.runtime.tensor(keep, dev), tvm.runtime.tensor(x, dev), out)
        np.testing.assert_array_equal(out.numpy(), expected)


HF_CASES = [("roberta", "eager", "torchscript", 17), ("gpt2", "eager", "torchscript", 17)]


def _compile(path: str, target: str, dtype: str, templates: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return stof_tvm.compile(path, mask="dense", batch=2, seq_len=64, target=target, dtype=dtype,
                                kernel="dense", templates=templates)


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: c[0])
def test_dense_cuda_build_has_no_vector_access_to_bool_masks(hf_export, case):
    """kernel="dense", templates=False for CUDA: the model's boolean mask is still read by the fused QK^T kernel,
    one element at a time (float32: the same 8 bool vector loads before the fix as float16, without float16's
    one-time tensor-core intrinsic import of ~80 s)."""
    art = _compile(hf_export(*case, False), "cuda", "float32", templates=False)
    assert art.manifest["attention"]["kernel"]["kind"] == "dense"
    source = "\n".join(cuda_sources(art.executable))
    assert bool_vector_accesses(source) == []
    mask_readers = [m.group(1) for m in _KERNEL.finditer(source) if "matmul" in m.group(1) and "where" in m.group(1)
                    and _BOOL_PARAM.search(m.group(2))]
    assert mask_readers, "the fused QK^T + mask kernel this test is about is gone: check what it covers"


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: c[0])
def test_dense_path_matches_torch(hf_export, case):
    """The dense path on llvm, float32: equal to the torch model, its padded row on its own too."""
    from stof_tvm.models import hf_export as hx

    family, attn = case[:2]
    art = _compile(hf_export(*case, False), "llvm", "float32", templates=False)
    inputs = hx.example_inputs(family, 2, 64)
    expected = hx.torch_outputs(hx.build_model(family, "tiny", attn), inputs)
    out = np.asarray(art.load()(inputs)["last_hidden_state"], np.float64)
    valid = inputs["attention_mask"][-1].astype(bool)
    assert not valid.all()
    for got, ref in ((out, expected), (out[-1][valid], expected[-1][valid])):
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-4
