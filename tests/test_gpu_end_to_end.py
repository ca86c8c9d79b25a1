"""On a GPU: the tiny built-in BERT compiled for CUDA with the product's defaults (fusion templates, wgmma GEMMs on
Hopper, the attention kernel the model picks), saved, loaded by the runtime and checked against onnx's reference
evaluator; the same with the mma.sync templates and CUDA graphs. Skipped without a GPU."""
import numpy as np
import pytest
import tvm

import stof_tvm
from stof_tvm import make_mask
from stof_tvm.models.reference import random_inputs, reference_outputs

from attention_reference import relative_error


def _gpu_arch():
    from stof_tvm.cuda_runtime import ensure_cuda_runtime

    if not ensure_cuda_runtime() or not tvm.cuda(0).exist:
        return None
    return "sm_" + tvm.cuda(0).compute_version.replace(".", "")


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_arch() is None, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("options", [{}, {"gemm": "mma", "cuda_graph": True}], ids=["defaults", "mma-graphs"])
def test_tiny_bert_on_the_gpu_matches_the_reference(tiny, tmp_path, options):
    arch = _gpu_arch()
    art = stof_tvm.compile(tiny, mask="bigbird", batch=2, seq_len=128, target={"kind": "cuda", "arch": arch},
                           dtype="float16", **options)
    if not options and arch in ("sm_90", "sm_90a"):    # tiny-bert's GEMMs are small: wgmma mode, mma.sync stages
        assert art.manifest["templates"]["gemm"] == "wgmma"
    compiled = stof_tvm.runtime.load(art.save(tmp_path / "artifact"))
    data = random_inputs(tiny, {"input_ids": (2, 128), "attention_mask": (2, 128)}, seed=4)
    data["attention_mask"][1, 100:] = 0
    keep = make_mask("bigbird", 128)[None, None]
    ref = reference_outputs(tiny, keep, data)["last_hidden_state"]
    out = compiled(data)["last_hidden_state"]
    got = out.numpy() if hasattr(out, "numpy") else np.asarray(out)
    assert np.isfinite(got).all()
    assert relative_error(got, ref) < 2e-2
