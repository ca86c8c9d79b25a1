"""templates=True in the compile path: every chain of an encoder layer mapped to the fusion templates (checked
on the CPU against onnx.reference), each site's template and knobs in the manifest, CUDA builds that nvcc
compiles (mma.sync with CUDA graphs; wgmma with prebuilt sm_90a cubins in the artifact), and bad flags."""
import json

import pytest

import stof_tvm
from stof_tvm import make_mask
from stof_tvm.compiler import linear_match
from stof_tvm.compiler.cubins import cuda_sources, find_nvcc, nvcc_cubin
from stof_tvm.compiler.pipeline import CUDA_DEFAULTS, make_target
from stof_tvm.compiler.template_choice import TemplateChooser
from stof_tvm.cost_model.templates import rank_template
from stof_tvm.models import builtin_model
from stof_tvm.models.reference import random_inputs, reference_outputs

from attention_reference import relative_error
from stof_tvm.schedules.templates import get_template

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
# per layer: the QKV projection, two GEMM + residual LayerNorm pairs, the GELU GEMM; once: the embeddings' LayerNorm
LAYER_CALLS = {"qkv_projection_kn": 1, "gemm_kn": 2, "bias_residual_layernorm": 2, "gemm_bias_gelu_erf_kn": 1}


def bert_calls(layers: int) -> dict:
    return {**{name: layers * count for name, count in LAYER_CALLS.items()}, "layernorm": 1}


TINY_CALLS = bert_calls(2)


@pytest.fixture(scope="module")
def tiny_cuda_graph(tiny):
    return stof_tvm.compile(tiny, mask="bigbird", batch=2, seq_len=128, target="cuda", dtype="float16",
                            templates=True, gemm="mma", cuda_graph=True)


def _chains(manifest) -> dict:
    return {site["chain"]: [stage["template"] for stage in site["stages"]] for site in manifest["templates"]["sites"]}


@pytest.mark.slow
def test_bert_base_templates_match_reference():
    """BERT-Base (12 layers) with every chain on templates; the LayerNorm templates take its epsilon (1e-12)."""
    model = builtin_model("bert-base")
    art = stof_tvm.compile(model, mask="bigbird", batch=1, seq_len=16, target="llvm", dtype="float16",
                           templates=True)
    assert art.manifest["templates"]["calls"] == bert_calls(12)
    data = random_inputs(model, {"input_ids": (1, 16), "attention_mask": (1, 16)}, seed=2)
    data["attention_mask"][0, 13:] = 0
    out = art.load()(data)["last_hidden_state"]
    ref = reference_outputs(model, make_mask("bigbird", 16)[None, None], data)["last_hidden_state"]
    assert relative_error(out, ref) < 2e-2


def _ops(func) -> list[str]:
    """Names of the operators ``func`` calls, in binding order."""
    return [binding.value.op.name for block in func.body.blocks for binding in block.bindings
            if hasattr(binding.value, "op") and hasattr(binding.value.op, "name")]


def test_block_kernel_reads_qkv_views_and_writes_rows_then_heads(tiny):
    """With the block-wise kernel, Q/K/V are views into the QKV projection's output (no split copy) and the
    kernel writes [B, S, H, D], so no transpose is left between attention and the output projection; the module
    still matches onnx's reference evaluator."""
    args = dict(mask="bigbird", batch=2, seq_len=64, target="llvm", dtype="float16", kernel="block", templates=True)
    ops = _ops(stof_tvm.compiler.front_end(tiny, **args).mod["main"])
    assert ops.count("relax.memory.view") == 3 * 2 and "relax.split" not in ops      # 2 layers
    assert "relax.permute_dims" not in ops
    data = random_inputs(tiny, {"input_ids": (2, 64), "attention_mask": (2, 64)}, seed=5)
    data["attention_mask"][1, 50:] = 0
    out = stof_tvm.compile(tiny, **args).load()(data)["last_hidden_state"]
    ref = reference_outputs(tiny, make_mask("bigbird", 64)[None, None], data)["last_hidden_state"]
    assert relative_error(out, ref) < 2e-2


def test_row_kernel_gets_copies(tiny):
    """The row-wise kernel's Q/K/V must start at offset 0: each is copied out of the QKV output (a slice each)."""
    ops = _ops(stof_tvm.compiler.front_end(tiny, mask="bigbird", batch=1, seq_len=64, target="llvm",
                                           dtype="float16", kernel="row", templates=True).mod["main"])
    assert "relax.memory.view" not in ops and ops.count("relax.strided_slice") == 3 * 2 and "relax.split" not in ops


def test_manifest_lists_each_site(tiny_cuda_graph):
    entry = tiny_cuda_graph.manifest["templates"]
    assert entry["gemm"] == "mma" and entry["calls"] == TINY_CALLS
    assert _chains(tiny_cuda_graph.manifest) == {
        "qkv": ["qkv_projection_kn"], "attn_out_ln": ["gemm_kn", "bias_residual_layernorm"],
        "ffn_down_ln": ["gemm_kn", "bias_residual_layernorm"], "linear_gelu": ["gemm_bias_gelu_erf_kn"],
        "layernorm": ["layernorm"]}
    for site in entry["sites"]:
        assert site["count"] == (1 if site["chain"] == "layernorm" else 2)
        for stage in site["stages"]:     # no database: stage 1's top-ranked knob set, with its predicted time
            assert stage["source"] == "model" and stage["seconds"] > 0
            ranked = rank_template(get_template(stage["template"]), stage["shape"], "float16")
            assert stage["knobs"] == ranked[0].candidate
    json.dumps(tiny_cuda_graph.manifest)     # the manifest stays plain JSON


def test_fused_layernorm_only_when_measured():
    chooser = TemplateChooser(make_target(dict(CUDA_DEFAULTS)), None)
    fused, why = chooser.fused_layernorm(get_template("gemm_bias_residual_layernorm_kn"), get_template("gemm_kn"),
                                         get_template("bias_residual_layernorm"), {"m": 4096, "n": 768, "k": 768},
                                         {"m": 4096, "n": 768}, "float16")
    assert not fused and "model predicts" in why
    fused, why = chooser.fused_layernorm(get_template("gemm_bias_residual_layernorm_kn"), get_template("gemm_kn"),
                                         get_template("bias_residual_layernorm"), {"m": 4096, "n": 96, "k": 768},
                                         {"m": 4096, "n": 96}, "float16")
    assert not fused and "does not fit" in why


@needs_nvcc
def test_cuda_build_with_graphs_compiles_with_nvcc(tiny_cuda_graph):
    """The module's CUDA code (attention + templates + dlight) compiles for sm_90; the whole forward pass is one
    CUDA graph (attention included: the mask's format arrays are fixed inputs), only the copy of the model inputs
    and the kernels writing main's outputs run outside it."""
    from stof_tvm.vm_census import vm_census

    census = vm_census(tiny_cuda_graph.executable.as_python())
    assert census.graph_launches == 1
    assert census.per_function()["stof_attention_block"] == 2 and "stof_attention_block" not in census.outside
    assert census.outside["stof_stage_inputs"] == 1 and census.kernels_outside_graphs <= 3, census.outside
    assert tiny_cuda_graph.manifest["cuda_graph"] is True and tiny_cuda_graph.manifest["static_mask_inputs"] is True
    sources = cuda_sources(tiny_cuda_graph.executable)
    assert len(sources) == 1 and "mma.sync" in sources[0]
    assert len(nvcc_cubin(sources[0], "sm_90", find_nvcc())) > 0


@needs_nvcc
def test_wgmma_build_carries_sm90a_cubins(tiny, tmp_path, monkeypatch):
    """Batch 1 also checks that the templates stay opaque to FuseOps (a LayerNorm template absorbing the
    reshapes around it once broke FuseTIR)."""
    monkeypatch.setattr(linear_match, "WGMMA_MIN_TILES", 1)     # tiny-bert's GEMMs are too small for wgmma otherwise
    art = stof_tvm.compile(tiny, mask="bigbird", batch=1, seq_len=128, target="cuda", dtype="float16")
    # the defaults for CUDA sm_90 in float16: templates on, wgmma GEMMs (nvcc is here)
    assert art.manifest["target"]["arch"] == "sm_90a" and art.manifest["templates"]["gemm"] == "wgmma"
    chains = _chains(art.manifest)
    assert chains["attn_out_ln"] == ["gemm_wgmma", "bias_residual_layernorm"]
    assert chains["linear_gelu"] == ["gemm_bias_gelu_erf_wgmma"] and chains["qkv"] == ["qkv_projection_wgmma"]
    (source,) = cuda_sources(art.executable)
    assert "wgmma.mma_async" in source
    path = art.save(tmp_path / "art", weights=False)
    (key,) = art.manifest["cuda_binaries"]["files"]
    cubin = (tmp_path / "art" / "cubins" / f"{key}.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF"
    from stof_tvm.cuda_runtime import source_key

    assert source_key(source) == key and path


@pytest.mark.parametrize("m, n, k, why", [
    (4096, 768, 768, None), (16384, 128, 128, None), (8192, 128, 128, "64 wgmma tiles"),
    (128, 768, 128, "6 wgmma tiles fill too few SMs"), (4096, 768, 96, "k % 64"), (4096, 200, 768, "n % 128"),
    (128, 768, 768, None), (4000, 768, 768, None), (197, 2304, 768, None), (197, 768, 128, "12 wgmma tiles"),
    (4096, 960, 2560, None), (4096, 1600, 960, "n % 128 == 0 or n % 192 == 0"),
])
def test_small_gemms_stay_on_mma_sync(m, n, k, why):
    """wgmma only where its 128-row tiles (a partial last one counted whole), or its split-K blocks, fill enough of
    the GPU (measured: mma.sync was 1.35x faster for BERT at 128 tokens without split-K, wgmma 1.3x faster at 4096;
    split-K 1.17x faster than mma.sync at 128 x 768 x 768) and the columns (in 128- or 192-wide tiles: SmolLM2's
    960) and k tile exactly; any m."""
    note = linear_match.wgmma_misfit(m, n, k)
    assert (note is None) if why is None else (why in note and note.endswith("mma.sync"))


@pytest.mark.parametrize("gemm, m, n, k, columns", [
    ("wgmma", 4096, 1600, 960, 1664),     # SmolLM2-360M's Q, K, V: 64 zero columns (4%) put it on wgmma
    ("mma", 4096, 1600, 960, 1600),       # mma.sync tiles 1600 as it is
    ("wgmma", 4096, 960, 960, 960),       # five 192-wide tiles: nothing to add
    ("wgmma", 4096, 704, 576, 768),       # 9% more
    ("wgmma", 4096, 320, 576, 320),       # 20% more: too many; mma.sync
    ("wgmma", 128, 1600, 960, 1664),      # one row tile: split-K blocks fill the GPU once padded
    ("wgmma", 128, 704, 576, 704),        # 6 tiles, 18 split-K blocks even padded: too few
])
def test_one_gemm_of_concatenated_weights_pads_its_columns_only_onto_wgmma(gemm, m, n, k, columns):
    from stof_tvm.compiler.sibling_linears import wgmma_columns

    assert wgmma_columns(gemm, m, n, k) == columns


@pytest.mark.parametrize("m, gemm, rows", [
    (394, "mma", 400), (394, "wgmma", 394),       # ViT-Base at 2x197: wgmma takes the rows as they are
    (6304, "mma", 6304), (6304, "wgmma", 6304), (197, "wgmma", 197),
    (4096, "wgmma", 4096), (34, "mma", 48), (34, "wgmma", 34),   # 34 rows: split-K (18 tiles, 96 blocks)
])
def test_gemm_rows_padded_for_the_templates(m, gemm, rows):
    """Any row count takes a template: wgmma's as they are (a partial last row tile), mma.sync's padded to 16."""
    assert linear_match.padded_rows(m, 2304, 768, gemm) == rows


@pytest.mark.parametrize("gemm, templates, target, expected", [
    ("auto", True, {"kind": "cuda", "arch": "sm_90"}, ("wgmma", "sm_90a")),
    ("auto", True, {"kind": "cuda", "arch": "sm_80"}, ("mma", "sm_80")),
    ("auto", False, {"kind": "cuda", "arch": "sm_90"}, ("mma", "sm_90")),
    ("auto", True, {"kind": "llvm"}, ("mma", None)),
    ("mma", True, {"kind": "cuda", "arch": "sm_90"}, ("mma", "sm_90")),
])
def test_gemm_auto_picks_wgmma_only_for_hopper_templates(gemm, templates, target, expected, monkeypatch):
    from stof_tvm.compiler import check_gemm, cubins

    monkeypatch.setattr(cubins, "find_nvcc", lambda: "/usr/bin/nvcc")
    chosen, tspec = check_gemm(gemm, templates, target)
    assert (chosen, tspec.get("arch")) == expected
    monkeypatch.setattr(cubins, "find_nvcc", lambda: None)     # no nvcc to prebuild sm_90a cubins: mma.sync
    assert check_gemm("auto", True, {"kind": "cuda", "arch": "sm_90"})[0] == "mma"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"gemm": "wgmma", "templates": False, "target": "cuda"}, ValueError, "needs templates=True"),
    ({"gemm": "wgmma", "templates": True, "target": "llvm"}, ValueError, "Hopper"),
    ({"gemm": "wgmma", "templates": True, "target": {"kind": "cuda", "arch": "sm_80"}}, ValueError, "sm_90"),
    ({"gemm": "tensor", "templates": True}, ValueError, "gemm: expected"),
    ({"cuda_graph": True, "target": "llvm"}, ValueError, "cuda_graph"),
    ({"cuda_graph": "yes", "target": "cuda"}, TypeError, "cuda_graph"),
    ({"templates": True, "dtype": "float32"}, ValueError, "templates"),
])
def test_bad_flag_combinations(tiny, kwargs, error, match):
    args = {"mask": "bigbird", "batch": 1, "seq_len": 128, "target": "llvm", "dtype": "float16", **kwargs}
    with pytest.raises(error, match=match):
        stof_tvm.compile(tiny, **args)
