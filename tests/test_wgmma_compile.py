"""The wgmma attention kernel in the compile path, on a real export: a tiny Hugging Face GPT-2 (head dim 64, causal,
the model's own key padding) built for CUDA sm_90 takes it where the model predicts it faster (once its key padding is checked on a GPU: until
then ``auto`` keeps padded models on mma.sync, tests/test_wgmma_choice.py), builds the module for
sm_90a with nvcc (the artifact carries the cubin; ptxas: no spills in the attention kernel), and the llvm path of
the same model stays exact against torch through ``model(input_ids=..., attention_mask=...)`` at batch 1 and 2."""
from __future__ import annotations

import re
import shutil
import warnings

import numpy as np
import pytest

pytest.importorskip("torch", reason="the exports need torch (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="the exports need transformers (pip install -e '.[test]')")

import stof_tvm                                      # noqa: E402
from stof_tvm.compiler.cubins import cuda_sources    # noqa: E402
from stof_tvm.mask_formats import format_arrays      # noqa: E402
from stof_tvm.models import hf_export as hx          # noqa: E402
from stof_tvm.sparse_formats import normalize_mask   # noqa: E402

from hopper_checks import kernel_alone, sm90_ptxas_report      # noqa: E402

# 16 x 512 tokens: the smallest tiny-GPT-2 shape here at which the model predicts wgmma faster (0.013 ms against
# 0.015 for the best mma.sync kernel); at 2 x 64 the mma.sync kernels win and are chosen
BATCH, SEQ = 16, 512


def test_gpt2_export_builds_the_wgmma_kernel_for_sm90a(hf_export, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed (the wgmma kernel is prebuilt for sm_90a by nvcc)")
    path = hf_export("gpt2", "eager", "torchscript", 17, False, batch=BATCH, seq_len=SEQ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = stof_tvm.compile(path, mask="dense", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16")
    kernel = art.manifest["attention"]["kernel"]
    assert kernel["kind"] == "wgmma" and kernel["reason"].startswith("analytical model: wgmma predicted faster")
    assert kernel["padding"] and kernel["config"]["consumers"] == 2 and kernel["tile"] == [128, 128]
    assert art.manifest["target"]["arch"] == "sm_90a" and art.manifest["cuda_binaries"]["files"]
    assert art.manifest["coverage"]["attention"]["accelerated"] == 2
    # the runtime builds the format at the kernel's tile (GPT-2's causal mask: partial diagonal tiles, 16 x 16 words)
    combined = normalize_mask("causal", seq_q=SEQ)
    arrays = format_arrays(art.manifest, combined)
    assert arrays[4].shape[1:] == (16, 16) and arrays[0].shape == (SEQ // 128 + 1,)
    (src,) = cuda_sources(art.executable)
    start = re.search(r"void __launch_bounds__\(384\) stof_attention_wgmma_kernel\([^)]*\) \{", src).end()
    body = src[start:src.index("\n}\n", start)]
    assert "setmaxnreg" in body and "pad_bits_ptr" in body and "mbarrier" in body
    # the P V product's wgmma takes P from four registers ({a0, a1, a2, a3}): the attention kernel's own form
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.f16\.f16 \{[^}]+\}, \{%\d+, %\d+, %\d+, "
                     r"%\d+\}", src)
    # ptxas on the attention kernel alone (its figures are per kernel; the module's ~20 others add 5 s of nvcc)
    report = sm90_ptxas_report(kernel_alone(src, "stof_attention_wgmma_kernel"), tmp_path, arch="sm_90a")
    props = re.search(r"Function properties for stof_attention_wgmma_kernel\s*\n[^\n]*?(\d+) bytes stack frame, "
                      r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert props and props.groups() == ("0", "0", "0"), report[-3000:]


@pytest.mark.parametrize("batch", [1, 2])
def test_gpt2_llvm_path_is_exact_through_the_users_call(hf_export, batch):
    """The same family on llvm (a dynamic-axes export at 32 tokens): no wgmma, exact against torch in float32 with
    the padded row, called as users call it."""
    path = hf_export("gpt2", "eager", "torchscript", 20, True)
    seq = 32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = stof_tvm.compile(path, mask="dense", batch=batch, seq_len=seq, target="llvm", dtype="float32")
    assert art.manifest["attention"]["kernel"]["kind"] in ("block", "row")
    inputs = hx.example_inputs("gpt2", batch, seq)
    expected = hx.torch_outputs(hx.build_model("gpt2", "tiny", "eager"), inputs)
    out = art.load()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])["last_hidden_state"]
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 1e-4


def test_tma_attention_runs_inside_the_whole_forward_cuda_graph(hf_export, monkeypatch, tmp_path):
    """The wgmma attention kernel with TMA loads in the compile path with ``cuda_graph=True`` (the same tiny GPT-2,
    its key padding applied by the kernel; TMA forced for the padded kernel too): Q, K and V are views into the QKV
    projection's output (no split copy; the maps start at each view), the kernel takes their maps as
    ``__grid_constant__`` parameters, every attention launch is inside the one captured graph (the maps are
    encoded when the graph is captured, from the static buffers it replays on; without a graph at each call from
    that call's tensors), and the host library calls the runtime's ``cuTensorMapEncodeTiled``."""
    from stof_tvm.compiler import front_end, lower
    from stof_tvm.compiler.kernel_grids import kernel_grids
    from stof_tvm.schedules import attention_wgmma
    from stof_tvm.vm_census import vm_census

    for key in attention_wgmma.DEFAULT_LOADS:
        monkeypatch.setitem(attention_wgmma.DEFAULT_LOADS, key, "tma")
    path = hf_export("gpt2", "eager", "torchscript", 17, False, batch=BATCH, seq_len=SEQ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        front = front_end(path, mask="dense", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16")
    ops = [binding.value.op.name for block in front.mod["main"].body.blocks for binding in block.bindings
           if hasattr(binding.value, "op") and hasattr(binding.value.op, "name")]
    assert ops.count("relax.memory.view") == 3 * 2 and "relax.split" not in ops     # Q/K/V: views, 2 layers
    optimized, executable = lower(front, None, cuda_graph=True)
    (src,) = cuda_sources(executable)
    kernels = dict(re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{', src))
    params = kernels["stof_attention_wgmma_kernel"]
    assert params.count("const __grid_constant__ CUtensorMap") == 3, params
    assert "pad_bits" in params
    grids = kernel_grids(optimized)
    census = vm_census(executable.as_python(), {name: max(1, len(k)) for name, k in grids.items()})
    assert census.graph_launches == 1, census.table()
    assert not [name for name in census.outside if "attention" in name], census.outside
    calls = census.per_function()
    assert sum(n for name, n in calls.items() if "stof_attention_wgmma" in name) == 2, calls   # two layers
    library = tmp_path / "model.so"
    executable.export_library(str(library))
    assert b"runtime.cuTensorMapEncodeTiled" in library.read_bytes()
