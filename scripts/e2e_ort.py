"""The end-to-end benchmark's onnxruntime baseline: the same ONNX file after ORT's own transformer optimizer,
converted to float16, on the CUDA execution provider with I/O bound to torch GPU tensors (or on the CPU).

This is what a user of ONNX would deploy: ``onnxruntime.transformers.optimizer.optimize_model`` fuses attention
(``Attention`` / ``MultiHeadAttention``), GELU with its bias, LayerNorm with the residual add
(``SkipLayerNormalization``) and the embeddings; ``convert_float_to_float16(keep_io_types=True)`` keeps float32
outputs. ORT has no sparse pattern: it runs dense attention with the padding mask. On the GPU machine
onnxruntime-gpu comes from scripts/ort_parts.py + scripts/ort_install.sh.
"""
from __future__ import annotations

import os

import numpy as np

# the optimizer's model_type per family (RoBERTa has BERT's graph; T5 encoder: its own fusions)
MODEL_TYPES = {"bert": "bert", "roberta": "bert", "gpt2": "gpt2", "vit": "vit", "t5": "t5"}


def optimize(onnx_path: str, out_path: str, family: str, heads: int, hidden: int, fp16: bool, gpu: bool) -> dict:
    """Run ORT's transformer optimizer (and the float16 conversion) on ``onnx_path`` into ``out_path``; returns
    the fused operator counts it reports."""
    from onnxruntime.transformers.optimizer import optimize_model

    optimized = optimize_model(onnx_path, model_type=MODEL_TYPES.get(family, "bert"), num_heads=heads,
                               hidden_size=hidden, use_gpu=gpu)
    if fp16:
        optimized.convert_float_to_float16(keep_io_types=True)
    optimized.save_model_to_file(out_path)
    stats = optimized.get_fused_operator_statistics()
    return {name: int(count) for name, count in stats.items() if count}


class OrtRunner:
    """An ORT session of ``onnx_path`` with inputs and outputs bound once to torch tensors on ``device``:
    :meth:`run` is one forward pass (ORT synchronises its stream before returning, so CUDA events on torch's
    stream around it see the whole run)."""

    def __init__(self, onnx_path: str, feeds: dict, output_shape: tuple, device: str):
        import onnxruntime as ort
        import torch

        if device == "cuda":
            if hasattr(ort, "preload_dlls"):       # the CUDA / cuDNN libraries torch's wheels bring
                ort.preload_dlls()
            providers = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        self.session, self.session_note = _session(ort, onnx_path, providers)
        self.providers = self.session.get_providers()
        if device == "cuda" and self.providers[0] != "CUDAExecutionProvider":
            raise RuntimeError(f"onnxruntime: no CUDA execution provider (have {self.providers}; "
                               f"available {ort.get_available_providers()})")
        dev = torch.device(device)
        self.inputs = {name: torch.from_numpy(np.ascontiguousarray(value)).to(dev) for name, value in feeds.items()}
        out_name = self.session.get_outputs()[0].name
        self.output = torch.full(output_shape, float("nan"), dtype=torch.float32, device=dev)
        self.binding = self.session.io_binding()
        for name, tensor in self.inputs.items():
            self.binding.bind_input(name, device, 0, _numpy_dtype(tensor), tuple(tensor.shape), tensor.data_ptr())
        self.binding.bind_output(out_name, device, 0, np.float32, tuple(self.output.shape), self.output.data_ptr())

    def run(self):
        self.session.run_with_iobinding(self.binding)
        return self.output


def _session(ort, onnx_path: str, providers) -> tuple:
    """A session with ORT's full graph optimisations, or without any when building it fails (ORT 1.31.1 fails
    with "Attempt to replace the existing tensor" on the optimizer's output for HF RoBERTa; the transformer
    optimizer's fusions are in the file either way). Returns the session and what was given up, if anything."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        return ort.InferenceSession(onnx_path, options, providers=providers), None
    except Exception as err:      # noqa: BLE001 - retried below, and the reason recorded
        note = f"session optimisations off ({type(err).__name__}: {str(err)[-160:]})"
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(onnx_path, options, providers=providers), note


def _numpy_dtype(tensor):
    return {"torch.int64": np.int64, "torch.int32": np.int32, "torch.float32": np.float32,
            "torch.float16": np.float16}[str(tensor.dtype)]


def version() -> str | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    return f"{onnxruntime.__version__} ({os.path.dirname(onnxruntime.__file__)})"
