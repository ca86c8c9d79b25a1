"""Programmatic dependent launch (schedules/dependent_launch.py): every sm_90 kernel of a build waits on the grid
before it does any work and then lets the next kernel launch, and the library it builds tells TVM's runtime to
launch each kernel with the attribute; other targets are left alone, and asking for it there is a clear error."""
from __future__ import annotations

import re
import warnings

import pytest
import tvm
from tvm.script import tirx as T

from stof_tvm.compiler.cubins import cuda_sources
from stof_tvm.schedules import dependent_launch as dl

WAIT = "tvm_builtin_ptx_griddepcontrol_wait();"
SIGNAL = "tvm_builtin_ptx_griddepcontrol_launch_dependents();"


def kernel_bodies(src: str) -> dict[str, str]:
    """Each ``__global__`` kernel's body in a CUDA source, by name."""
    bodies = {}
    for match in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^)]*\) \{', src):
        bodies[match.group(1)] = src[match.end():src.index("\n}\n", match.end())]
    return bodies


def starts_with_the_grid_wait(body: str) -> bool:
    """The wait, then the signal, before any statement but shared-memory declarations."""
    lines = [line.strip() for line in body.strip().splitlines() if line.strip()]
    lines = [line for line in lines if "__shared__" not in line]
    return lines[:2] == [WAIT, SIGNAL]


@T.prim_func(s_tir=True)
def two_kernels(a: T.Buffer((1024,), "float32"), b: T.Buffer((1024,), "float32"), c: T.Buffer((1024,), "float32")):
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for bx in T.thread_binding(8, thread="blockIdx.x"):
        for tx in T.thread_binding(128, thread="threadIdx.x"):
            with T.sblock("double"):
                b[bx * 128 + tx] = a[bx * 128 + tx] * T.float32(2)
    for bx in T.thread_binding(4, thread="blockIdx.x"):
        for ty in T.thread_binding(2, thread="threadIdx.y"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                with T.sblock("add"):
                    c[bx * 256 + ty * 128 + tx] = b[bx * 256 + ty * 128 + tx] + a[bx * 256 + ty * 128 + tx]


def build(arch: str, pipeline: str):
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm")
    return tvm.compile(tvm.IRModule({"main": two_kernels}), target=target, tir_pipeline=pipeline)


def test_every_kernel_waits_first_and_the_library_carries_the_launch_tag(tmp_path):
    executable = build("sm_90a", dl.PIPELINE)
    (src,) = cuda_sources(executable)
    bodies = kernel_bodies(src)
    assert len(bodies) == 2, list(bodies)
    for name, body in bodies.items():
        assert starts_with_the_grid_wait(body), (name, body[:400])
        assert body.count(WAIT) == 1 and body.count(SIGNAL) == 1
    library = tmp_path / "lib.so"
    executable.export_library(str(library))
    assert library.read_bytes().count(dl.LAUNCH_TAG.encode()) >= 2


def test_the_default_pipeline_and_older_gpus_are_unchanged():
    for arch, pipeline in (("sm_90a", "default"), ("sm_80", dl.PIPELINE)):
        (src,) = cuda_sources(build(arch, pipeline))
        assert "griddepcontrol" not in src, arch


def test_launch_tags_keep_dynamic_shared_memory_last():
    assert dl.launch_tags(["blockIdx.x", "threadIdx.x", dl.DYNAMIC_SHARED_TAG]) == [
        "blockIdx.x", "threadIdx.x", dl.LAUNCH_TAG, dl.DYNAMIC_SHARED_TAG]
    assert dl.launch_tags(["blockIdx.x"]) == ["blockIdx.x", dl.LAUNCH_TAG]
    assert dl.launch_tags(["blockIdx.x", dl.LAUNCH_TAG]) == ["blockIdx.x", dl.LAUNCH_TAG]


@pytest.mark.parametrize("target, expected", [({"kind": "cuda", "arch": "sm_90"}, True),
                                              ({"kind": "cuda", "arch": "sm_90a"}, True),
                                              ({"kind": "cuda", "arch": "sm_100a"}, True),
                                              ({"kind": "cuda", "arch": "sm_80"}, False),
                                              ("llvm", False)])
def test_supported_targets(target, expected):
    assert dl.supports(tvm.target.Target(target)) is expected


def test_a_model_build_launches_every_kernel_dependently(hf_export):
    """A real export (tiny HF BERT, TorchScript, opset 17) built for sm_90 with CUDA graphs: every kernel of the
    module, templates, attention and TVM's default schedules alike, starts with the wait; the manifest says so,
    and ``dependent_launch=False`` builds it without."""
    from stof_tvm.compiler import front_end, lower, uses_dependent_launch

    path = hf_export("bert", "eager", "torchscript", 17, False, batch=1, seq_len=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        front = front_end(path, mask="bigbird", batch=1, seq_len=64, target="cuda", dtype="float16", gemm="mma")
    assert uses_dependent_launch(front.target, None)
    _, executable = lower(front, None, cuda_graph=True)
    bodies = {name: body for src in cuda_sources(executable) for name, body in kernel_bodies(src).items()}
    assert len(bodies) >= 8 and any("attention" in name for name in bodies), list(bodies)
    late = [name for name, body in bodies.items() if not starts_with_the_grid_wait(body)]
    assert not late, late
    _, plain = lower(front, None, cuda_graph=True, dependent_launch=False)
    assert not any("griddepcontrol" in src for src in cuda_sources(plain))


def test_asking_for_it_on_a_target_without_it_is_a_clear_error():
    from stof_tvm.compiler import uses_dependent_launch

    with pytest.raises(ValueError, match="sm_90"):
        uses_dependent_launch(tvm.target.Target("llvm"), True)
    with pytest.raises(TypeError, match="dependent_launch"):
        uses_dependent_launch(tvm.target.Target("llvm"), "yes")
    assert uses_dependent_launch(tvm.target.Target("llvm"), None) is False


@T.prim_func
def waits_after_a_weight_read(w: T.Buffer((1024,), "float32"), a: T.Buffer((1024,), "float32"),
                              b: T.Buffer((1024,), "float32")):
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for bx in T.thread_binding(8, thread="blockIdx.x"):
        for tx in T.thread_binding(128, thread="threadIdx.x"):
            weight: T.let = w[bx * 128 + tx]
            T.evaluate(T.ptx["griddepcontrol.wait"]())
            b[bx * 128 + tx] = a[bx * 128 + tx] * weight


def test_a_kernel_with_its_own_wait_keeps_it_and_gets_the_tag(tmp_path):
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    executable = tvm.compile(tvm.IRModule({"main": waits_after_a_weight_read}), target=target,
                             tir_pipeline=dl.PIPELINE)
    (body,) = kernel_bodies(cuda_sources(executable)[0]).values()
    assert body.count(WAIT) == 1 and SIGNAL not in body
    assert body.index("w_ptr[") < body.index(WAIT) < body.index("a_ptr[")
    library = tmp_path / "lib.so"
    executable.export_library(str(library))
    assert dl.LAUNCH_TAG.encode() in library.read_bytes()
