"""Fixtures shared by several test modules, and the thread budget of parallel runs.

README's test command runs the suite on two pytest-xdist workers (``-n 2 --dist worksteal``). Each worker would
otherwise start a thread per core in TVM's thread pool, torch and OpenMP, and the workers' spinning threads
would fight over the same cores; so each worker takes its share of the cores (1 of 2 on a 2-core machine).
The variables are set before anything imports TVM or torch (they read them once, at start-up)."""
import functools
import os
import warnings

if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    for _name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, str(_share))

import pytest

from stof_tvm.models import builtin_model


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny BERT as an ONNX model."""
    return builtin_model("tiny-bert")


@pytest.fixture(scope="session")
def hf_export(pytestconfig):
    """``hf_export(family, attn, exporter, opset, dynamic, batch=2, seq_len=64, size="tiny", dtype="float32") ->
    path``: a Hugging Face model exported by torch (:func:`stof_tvm.models.hf_export.cached_export`; ``float16``
    after ``model.half()``), once per session and cached on disk under pytest's cache dir (keyed by the torch and
    transformers versions and the export parameters). Skips where torch or transformers is missing (they are test
    extras)."""
    pytest.importorskip("torch", reason="exports need torch (pip install -e '.[test]')")
    pytest.importorskip("transformers", reason="exports need transformers (pip install -e '.[test]')")
    from stof_tvm.models import hf_export as hx

    cache = pytestconfig.cache.mkdir("hf_exports")

    @functools.lru_cache(maxsize=None)
    def export(family, attn, exporter, opset, dynamic, batch=2, seq_len=64, size="tiny", dtype="float32") -> str:
        with warnings.catch_warnings():                 # the exporters' deprecation and tracer warnings
            warnings.simplefilter("ignore")
            return hx.cached_export(cache, family, size=size, attn=attn, exporter=exporter, opset=opset,
                                    batch=batch, seq_len=seq_len, dynamic=dynamic, dtype=dtype)

    return export


@pytest.fixture(scope="session")
def deberta_on_llvm(hf_export):
    """``deberta_on_llvm(batch, seq, **options) -> (last_hidden_state, kept, artifact)``: the tiny HF DeBERTa-v3
    (TorchScript, opset 17) compiled for llvm in float16 with the block-wise kernel, a BigBird mask and the compile
    ``options``, run on the family's example inputs; ``kept`` marks the unpadded positions, where outputs compare."""
    def run(batch: int, seq: int, **options):
        import numpy as np

        import stof_tvm
        from stof_tvm.models import hf_export as hx

        path = hf_export("deberta", "eager", "torchscript", 17, False, batch, seq)
        inputs = hx.example_inputs("deberta", batch, seq)
        keep = np.asarray(stof_tvm.make_mask("bigbird", seq), bool)
        art = stof_tvm.compile(path, mask=keep, batch=batch, seq_len=seq, target="llvm", dtype="float16",
                               kernel="block", **options)
        return art.load()(inputs)["last_hidden_state"], inputs["attention_mask"].astype(bool), art

    return run


@pytest.fixture
def llama_export(tmp_path):
    """``llama_export(hidden, heads, kv_heads, batch, seq_len, intermediate=512) -> (model, path)``: a one-layer HF
    Llama of those widths (head_dim hidden / heads; SDPA attention, seeded weights as hf_export draws them) exported
    by the TorchScript exporter into ``tmp_path``, for shapes the tiny corpus does not have (weights large enough to
    be imported as parameters, widths no wgmma tile divides)."""
    transformers = pytest.importorskip("transformers", reason="exports need transformers (pip install -e '.[test]')")
    import torch

    from stof_tvm.models import hf_export as hx

    def export(hidden: int, heads: int, kv_heads: int, batch: int, seq_len: int, intermediate: int = 512):
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=intermediate,
                                          num_hidden_layers=1, num_attention_heads=heads,
                                          num_key_value_heads=kv_heads, max_position_embeddings=max(512, seq_len),
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
                                          initializer_range=hx.INIT_RANGE, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = hx._wrapped(transformers.LlamaModel(config).eval(), "llama")
        with warnings.catch_warnings():                 # the exporter's tracer warnings
            warnings.simplefilter("ignore")
            path = hx.export(model, tmp_path / f"llama_{hidden}_{heads}_{kv_heads}.onnx", batch=batch,
                             seq_len=seq_len)
        return model, path

    return export
