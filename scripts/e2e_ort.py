"""The end-to-end benchmark's onnxruntime baseline in its strongest form: the same ONNX file after ORT's own
transformer optimizer, converted to float16, on the CUDA execution provider with I/O bound to torch GPU tensors
and the whole forward replayed as a CUDA graph (or on the CPU).

Preparation (:func:`optimize`), the way that fuses on these exports (transformers 5, TorchScript exporter):

- ``optimize_model(model_type=..., num_heads, hidden_size, opt_level=0)``: the Python fusions only, on the export
  itself. The default ``opt_level=1`` first runs an ORT session over the file, and its basic-level
  ``MatMulAddFusion`` turns each MatMul + bias Add into Gemm; the Attention and BiasGelu fusions then match nothing
  (session 5's GPU run: "Gelu 12, SkipLayerNormalization 24", no Attention: the 2.5-3.5x slower ORT rows of
  sessions 5 and 9). With ``opt_level=0`` the CPU and the GPU machine prepare byte-identical files, so the CPU
  test of the fused counts holds for the GPU run. The runtime session applies ORT's graph optimisations anyway.
- :func:`scale_as_division`: transformers 5's eager attention scales the scores as ``(q @ k^T) * s``; ORT's fuser
  matches the no-mask form only as ``/ (1 / s)`` (ViT: no attention mask, so no Attention without this). The
  rewrite is exact for s = 1 / sqrt(head_dim) with a power-of-two head dim, and changes no other graph.
- ``convert_float_to_float16(keep_io_types=True)``: float16 inside, float32 logits out (one output Cast);
  :func:`float32_casts` counts the casts back to float32 that remain inside.
- :func:`expected_fusions` / :func:`missing_fusions`: what a fully fused model of each family has (per layer one
  attention, one GELU with its bias, two residual LayerNorms); a shortfall is reported loudly, never silently.
  ORT's fusers match no attention on the transformers-5 GPT-2 and T5 exports (GPT-2: one c_attn Gemm + Split
  and a boolean causal mask; T5: the position bias and mask added in two Adds): those rows run ORT's unfused
  attention, and the row says so.

Session (:class:`OrtRunner`): ``ORT_ENABLE_ALL`` (lower levels only when building fails, with the reason kept),
CUDA EP with ``cudnn_conv_algo_search=EXHAUSTIVE`` (ViT's patch Conv) and ``enable_cuda_graph`` (static shapes,
the binding's addresses fixed; a session whose capture fails is rebuilt without it and says so), IOBinding on torch
device tensors. :func:`placement` runs one profiled forward and counts the nodes each execution provider ran
(Memcpy nodes included), so a CPU fallback shows in the log. On the GPU machine onnxruntime-gpu comes from
scripts/ort_parts.py + scripts/ort_install.sh.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np

# the optimizer's model_type per family (RoBERTa and ViT have BERT's encoder; GPT-2 and T5: their own fusions;
# Llama and Qwen2 have none of their own: ORT's Llama export scripts optimise with GPT-2's, which fuse their RMSNorms)
MODEL_TYPES = {"bert": "bert", "roberta": "bert", "gpt2": "gpt2", "vit": "vit", "t5": "t5", "llama": "gpt2",
               "qwen2": "gpt2"}
ATTENTION_OPS = ("Attention", "MultiHeadAttention")
GROUPED_ATTENTION_FAMILIES = ("llama", "qwen2")   # their attention would fuse as GroupQueryAttention
RMS_NORM_FAMILIES = ("t5", "llama", "qwen2")       # their residual norms fuse as SkipSimplifiedLayerNormalization
NO_GELU_FAMILIES = ("t5", "llama", "qwen2")        # ReLU (T5) and SwiGLU (Llama, Qwen2) feed-forwards
GELU_OPS = ("BiasGelu", "FastGelu", "Gelu")
GRAPH_LEVELS = ("ORT_ENABLE_ALL", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_BASIC", "ORT_DISABLE_ALL")
FLOAT = 1                  # onnx TensorProto.FLOAT


def expected_fusions(family: str, layers: int) -> dict[tuple[str, ...], int]:
    """The fused operators a fully optimised model of ``family`` with ``layers`` layers holds: ``{(op types that
    count, ...): how many}`` (one attention and one GELU per layer; two residual LayerNorms per layer, T5's
    RMSNorm form for T5 and Llama). GELU counts only with its bias folded in (BiasGelu, or FastGelu which takes the
    bias)."""
    norm = ("SkipSimplifiedLayerNormalization",) if family in RMS_NORM_FAMILIES else ("SkipLayerNormalization",)
    attention = ATTENTION_OPS + ("GroupQueryAttention",) if family in GROUPED_ATTENTION_FAMILIES else ATTENTION_OPS
    expected = {attention: layers, norm: 2 * layers}
    if family not in NO_GELU_FAMILIES:
        expected[GELU_OPS[:2]] = layers
    return expected


def missing_fusions(fused: dict, family: str, layers: int) -> list[str]:
    """``"Attention|MultiHeadAttention 0/12"`` for every expected fusion below its count in ``fused``."""
    missing = []
    for ops, want in expected_fusions(family, layers).items():
        have = sum(fused.get(op, 0) for op in ops)
        if have < want:
            missing.append(f"{'|'.join(ops)} {have}/{want}")
    return missing


def scale_as_division(model) -> int:
    """Rewrite, in the ONNX ``model``, every ``Softmax(Mul(MatMul(..), c))`` with a scalar constant ``c`` into
    ``Softmax(Div(MatMul(..), 1 / c))``, the form ORT's attention fuser matches when there is no mask. Returns how
    many it rewrote."""
    from onnx import numpy_helper

    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    scalars = {t.name: numpy_helper.to_array(t) for t in graph.initializer if np.prod(t.dims) == 1}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.size == 1:
                scalars[node.output[0]] = value
    rewritten = 0
    for node in graph.node:
        mul = producer.get(node.input[0]) if node.op_type == "Softmax" else None
        if mul is None or mul.op_type != "Mul":
            continue
        scores, scale = mul.input
        if scale not in scalars or getattr(producer.get(scores), "op_type", None) != "MatMul":
            continue
        value = scalars[scale]
        inverse = f"{mul.name or mul.output[0]}/inverse_scale"
        inverse_value = np.asarray(1 / value.reshape(()), dtype=value.dtype)
        graph.initializer.append(numpy_helper.from_array(inverse_value, inverse))
        mul.op_type, mul.input[1] = "Div", inverse
        rewritten += 1
    return rewritten


def _constant_value(model, name: str, producer: dict, initializers: dict):
    """The value of tensor ``name`` of ``model`` when it depends on initializers and Constant nodes only (evaluated
    with onnx's reference evaluator on the nodes it comes from, at the model's opsets), else None."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    needed, stack, seen = [], [name], set()
    while stack:
        tensor = stack.pop()
        if tensor in seen or tensor in initializers or not tensor:
            continue
        seen.add(tensor)
        node = producer.get(tensor)
        if node is None:                       # a graph input: not a constant
            return None
        needed.append(node)
        stack.extend(node.input)
    position = {id(node): i for i, node in enumerate(graph.node)}
    nodes = sorted({id(n): n for n in needed}.values(), key=lambda n: position[id(n)])
    used = {i for n in nodes for i in n.input}
    sub = onnx.helper.make_graph(nodes, "constant", [], [onnx.helper.make_tensor_value_info(name, 0, None)],
                                 initializer=[t for t in graph.initializer if t.name in used])
    return ReferenceEvaluator(onnx.helper.make_model(sub, opset_imports=model.opset_import)).run(None, {})[0]


def drop_zero_score_masks(model) -> int:
    """Remove, in the ONNX ``model``, every ``Softmax(Add(scores, m))`` whose ``m`` is built from constants alone and
    is all zeros: the additive mask that some exporters write for a model without a mask input (HF ViT's eager
    attention in transformers 5.17: ``Where`` of a constant all-true mask), which keeps ORT's attention fuser from
    matching. Returns how many Softmax inputs it rewired."""
    from onnx import numpy_helper

    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    initializers = {t.name: t for t in graph.initializer}
    zeros: dict[str, bool] = {}
    dropped = []
    for node in graph.node:
        add = producer.get(node.input[0]) if node.op_type == "Softmax" else None
        if add is None or add.op_type != "Add":
            continue
        for keep, mask in ((0, 1), (1, 0)):
            tensor = add.input[mask]
            if tensor not in zeros:
                value = (numpy_helper.to_array(initializers[tensor]) if tensor in initializers
                         else _constant_value(model, tensor, producer, initializers))
                zeros[tensor] = value is not None and not np.any(value)
            if zeros[tensor]:
                node.input[0] = add.input[keep]
                dropped.append(add)
                break
    consumed = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for add in dropped:
        if add.output[0] not in consumed:
            graph.node.remove(add)
    return len(dropped)


def float32_casts(model) -> int:
    """Casts to float32 inside ``model`` (not those producing a graph output: keep_io_types' own)."""
    outputs = {o.name for o in model.graph.output}
    return sum(1 for n in model.graph.node if n.op_type == "Cast" and n.output[0] not in outputs
               and any(a.name == "to" and a.i == FLOAT for a in n.attribute))


def optimize(onnx_path: str, out_path: str, family: str, heads: int, hidden: int, layers: int, fp16: bool,
             gpu: bool, mask: str = "index") -> dict:
    """ORT's transformer optimizer (Python fusions, ``opt_level=0``) on ``onnx_path`` after
    :func:`drop_zero_score_masks` and :func:`scale_as_division`, then the float16 conversion, into ``out_path``. ``mask``: the fused attention's
    mask, ``index`` (the optimizer's default for BERT: per-row key lengths, so ORT's TensorRT fused kernels or its
    unfused path run) or ``none`` (no mask input: ORT's flash / memory-efficient kernels become eligible; the same
    result only because the benchmark's inputs are unpadded, ``e2e_torch.check_unpadded``). Returns the
    preparation's record: ``fused`` operator counts, ``missing`` fusions (:func:`missing_fusions`),
    ``model_type``, ``opt_level``, ``mask``, ``zero_masks_dropped``, ``scale_rewrites``, ``fp16`` and
    ``float32_casts``."""
    import onnx
    from onnxruntime.transformers.fusion_options import AttentionMaskFormat, FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    model = onnx.load(onnx_path)
    masks_dropped = drop_zero_score_masks(model)
    rewrites = scale_as_division(model)
    model_type = MODEL_TYPES.get(family, "bert")
    options = FusionOptions(model_type)
    if mask == "none":
        options.attention_mask_format = AttentionMaskFormat.NoMask
    elif mask != "index":
        raise ValueError(f"mask: expected 'index' or 'none', got {mask!r}")
    optimized = optimize_model(model, model_type=model_type, num_heads=heads, hidden_size=hidden, opt_level=0,
                               use_gpu=gpu, optimization_options=options)
    fused = {name: int(count) for name, count in optimized.get_fused_operator_statistics().items() if count}
    if fp16:
        optimized.convert_float_to_float16(keep_io_types=True)
    optimized.save_model_to_file(out_path)
    return {"model_type": model_type, "opt_level": 0, "mask": mask, "zero_masks_dropped": masks_dropped,
            "scale_rewrites": rewrites, "fused": fused,
            "missing": missing_fusions(fused, family, layers), "fp16": fp16,
            "float32_casts": float32_casts(optimized.model)}


def providers_for(device: str, cuda_graph: bool) -> list:
    """Execution providers of a session on ``device``: CUDA EP (exhaustive cuDNN algorithm search, copies on the
    compute stream, optionally CUDA graphs) before the CPU EP, or the CPU EP alone."""
    if device != "cuda":
        return ["CPUExecutionProvider"]
    options = {"device_id": 0, "cudnn_conv_algo_search": "EXHAUSTIVE", "do_copy_in_default_stream": "1"}
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def build_session(ort, onnx_path: str, providers, profile_prefix: str | None = None, first_level: int = 0):
    """A session at the highest graph optimisation level of :data:`GRAPH_LEVELS` (from ``first_level`` on) that
    builds. Returns ``(session, level index, notes)``: notes say which levels failed and why."""
    notes = []
    for index in range(first_level, len(GRAPH_LEVELS)):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_LEVELS[index])
        if profile_prefix:
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        try:
            return ort.InferenceSession(onnx_path, options, providers=providers), index, notes
        except Exception as err:   # noqa: BLE001 - the next level is tried, the reason recorded
            notes.append(f"{GRAPH_LEVELS[index]} failed ({type(err).__name__}: {str(err)[-200:]})")
            if index == len(GRAPH_LEVELS) - 1:
                raise
    raise AssertionError("unreachable")


def placement(onnx_path: str, feeds: dict, device: str, level: int, profile_prefix: str) -> dict:
    """Which execution provider ran each node: one profiled forward (no CUDA graph, the timed session's graph
    optimisation level) counted from ORT's profile. Returns ``{"nodes": {provider: count}, "ops": {provider:
    {op: count}}, "memcpy": count}``."""
    import onnxruntime as ort

    session, _, _ = build_session(ort, onnx_path, providers_for(device, cuda_graph=False), profile_prefix, level)
    session.run(None, {name: feeds[name] for name in session_inputs(session)})
    path = session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    return summarise_placement(events)


def session_inputs(session) -> list[str]:
    """The input names a session takes (a file prepared with ``mask="none"`` has no ``attention_mask``)."""
    return [i.name for i in session.get_inputs()]


def summarise_placement(events: list) -> dict:
    """Provider counts from an ORT profile's events (each node's ``*_kernel_time`` event names its provider)."""
    ops: dict[str, Counter] = {}
    seen = set()
    for event in events:
        args = event.get("args") or {}
        name = event.get("name", "")
        if event.get("cat") != "Node" or not name.endswith("_kernel_time") or "provider" not in args:
            continue
        if name in seen:
            continue
        seen.add(name)
        ops.setdefault(args["provider"], Counter())[args.get("op_name", "?")] += 1
    memcpy = sum(c for counter in ops.values() for op, c in counter.items() if op.startswith("Memcpy"))
    return {"nodes": {p: sum(c.values()) for p, c in ops.items()}, "ops": {p: dict(c) for p, c in ops.items()},
            "memcpy": memcpy}


def placement_problems(summary: dict, device: str) -> list[str]:
    """What in a :func:`placement` summary weakens a CUDA run: nodes on the CPU EP, host-device copies."""
    if device != "cuda":
        return []
    problems = []
    cpu = summary["ops"].get("CPUExecutionProvider", {})
    if cpu:
        problems.append(f"{sum(cpu.values())} nodes on the CPU EP ({', '.join(f'{k} {v}' for k, v in cpu.items())})")
    if summary["memcpy"]:
        problems.append(f"{summary['memcpy']} Memcpy nodes between host and device")
    return problems


def describe(prep: dict, session: dict, summary: dict | None) -> str:
    """The one log line that proves the configuration: preparation, fused counts, session, node placement."""
    fused = ", ".join(f"{k} {v}" for k, v in sorted(prep["fused"].items())) or "none"
    missing = f"MISSING {'; '.join(prep['missing'])}" if prep["missing"] else "all expected fusions present"
    nodes = "not checked" if summary is None else ", ".join(f"{p} {n}" for p, n in summary["nodes"].items())
    memcpy = "" if summary is None else f" (memcpy {summary['memcpy']})"
    return (f"ort config: model_type={prep['model_type']} opt_level={prep['opt_level']} "
            f"mask={prep['mask']} zero masks dropped {prep.get('zero_masks_dropped', 0)} scale rewrites "
            f"{prep['scale_rewrites']} fp16={prep['fp16']} (float32 casts inside "
            f"{prep['float32_casts']}) | fused: {fused} | {missing} | session {session['level']}"
            f"{' + cuda graph' if session['cuda_graph'] else ''} | nodes: {nodes}{memcpy}")


class OrtRunner:
    """An ORT session of ``onnx_path`` with inputs and outputs bound once to torch tensors on ``device``:
    :meth:`run` is one forward pass (ORT synchronises its stream before returning, so CUDA events on torch's
    stream around it see the whole run). On CUDA the forward is a CUDA graph when ``cuda_graph`` and the capture
    works (``self.cuda_graph`` says whether it did; ``self.notes`` why not, and any graph level given up)."""

    def __init__(self, onnx_path: str, feeds: dict, output_shape: tuple, device: str, cuda_graph: bool = True):
        import onnxruntime as ort
        import torch

        if device == "cuda" and hasattr(ort, "preload_dlls"):     # the CUDA / cuDNN libraries torch's wheels bring
            ort.preload_dlls()
        dev = torch.device(device)
        self.inputs = {name: torch.from_numpy(np.ascontiguousarray(value)).to(dev) for name, value in feeds.items()}
        self.output = torch.full(output_shape, float("nan"), dtype=torch.float32, device=dev)
        self.notes: list[str] = []
        self.cuda_graph = device == "cuda" and cuda_graph
        while True:
            try:
                self._bind(ort, onnx_path, device)
                self.run()                                    # with CUDA graphs: the capture
                break
            except Exception as err:  # noqa: BLE001 - retried without the graph, the reason recorded
                if not self.cuda_graph:
                    raise
                self.notes.append(f"cuda graph off ({type(err).__name__}: {str(err)[-200:]})")
                self.cuda_graph = False
        self.providers = self.session.get_providers()
        if device == "cuda" and self.providers[0] != "CUDAExecutionProvider":
            raise RuntimeError(f"onnxruntime: no CUDA execution provider (have {self.providers}; "
                               f"available {ort.get_available_providers()})")

    def _bind(self, ort, onnx_path: str, device: str) -> None:
        self.session, self.level, notes = build_session(ort, onnx_path, providers_for(device, self.cuda_graph))
        self.notes += notes
        self.binding = self.session.io_binding()
        for name in session_inputs(self.session):         # mask="none" files drop attention_mask
            tensor = self.inputs[name]
            self.binding.bind_input(name, device, 0, _numpy_dtype(tensor), tuple(tensor.shape), tensor.data_ptr())
        out_name = self.session.get_outputs()[0].name
        self.binding.bind_output(out_name, device, 0, np.float32, tuple(self.output.shape), self.output.data_ptr())

    def run(self):
        self.session.run_with_iobinding(self.binding)
        return self.output

    def session_record(self) -> dict:
        return {"level": GRAPH_LEVELS[self.level], "cuda_graph": self.cuda_graph, "notes": self.notes,
                "providers": self.providers}


def _numpy_dtype(tensor):
    return {"torch.int64": np.int64, "torch.int32": np.int32, "torch.float32": np.float32,
            "torch.float16": np.float16}[str(tensor.dtype)]


def version() -> str | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    return f"{onnxruntime.__version__} ({os.path.dirname(onnxruntime.__file__)})"
