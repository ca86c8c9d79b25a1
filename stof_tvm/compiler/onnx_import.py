"""Load an ONNX model, check its operators, fix its symbolic dims, and import it into Relax.

Symbolic input dims are resolved by name: a dim called like a batch (``batch``, ``batch_size``, ``N``...)
becomes ``batch``; one called like a sequence (``sequence``, ``seq_len``, ``tokens``...) becomes ``seq_len``.
Inputs whose dims are already static must agree with the requested sizes where a dim is named so.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnx

from .onnx_rules import REWRITTEN_OPS, apply_rules
from .onnx_shapes import infer_shapes, is_weight, weightless

_BATCH_NAMES = {"batch", "batch_size", "batchsize", "n", "b", "bs"}
_SEQ_NAMES = {"sequence", "sequence_length", "seq", "seq_len", "seqlen", "tokens", "s", "length"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, static shape and dtype of a model input or output."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, obj: dict) -> "TensorSpec":
        return cls(obj["name"], tuple(int(d) for d in obj["shape"]), obj["dtype"])


def load_model(model) -> onnx.ModelProto:
    """Accept a path (str or os.PathLike) or an ``onnx.ModelProto``; return the ModelProto."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"model: no ONNX file at {os.fspath(model)!r}")
        try:
            return onnx.load(os.fspath(model))
        except Exception as err:        # protobuf's DecodeError and the like: not an ONNX model
            raise ValueError(f"model: {os.fspath(model)!r} is not an ONNX model ({type(err).__name__}: "
                             f"{str(err)[:200]})") from err
    raise TypeError(f"model: expected a path to an .onnx file or an onnx.ModelProto, got {type(model).__name__}")


def check_supported_ops(model: onnx.ModelProto) -> None:
    """Raise ValueError naming every operator of ``model`` that TVM's ONNX frontend cannot convert."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | {"Constant", "If"} | set(REWRITTEN_OPS)
    unsupported: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type not in known and node.domain in ("", "ai.onnx"):
            unsupported.setdefault(node.op_type, node.name or node.output[0])
        elif node.domain not in ("", "ai.onnx"):
            unsupported.setdefault(f"{node.domain}::{node.op_type}", node.name or node.output[0])
    if unsupported:
        listing = ", ".join(f"{op} (first at node {where!r})" for op, where in sorted(unsupported.items()))
        raise ValueError(f"model: unsupported ONNX operator(s): {listing}")


def _dtype_name(elem_type: int) -> str:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in initializers]


def _resolve_dim(dim, tensor: str, axis: int, batch: int, seq_len: int) -> int:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    name = dim.dim_param.strip().lower()
    if name in _BATCH_NAMES:
        return batch
    if name in _SEQ_NAMES:
        return seq_len
    # unnamed, or named by the exporter rather than the user (TorchScript's "input_ids_dynamic_axes_1" for a list
    # of dynamic axes, dynamo's "s72" for Dim.AUTO): by position, as every transformer lays out its inputs
    if axis == 0:
        return batch
    if axis == 1:
        return seq_len
    raise ValueError(f"model: cannot resolve dim {axis} ({dim.dim_param!r}) of input {tensor!r} from "
                     f"batch/seq_len; name it like 'batch' or 'sequence'")


def _check_fixed_dims(tensor: str, shape: tuple[int, ...], dims, dtype: str, batch: int, seq_len: int) -> None:
    """Refuse ``batch`` / ``seq_len`` where the file fixes them otherwise (an export without dynamic axes) in a
    [B, S] integer or boolean input (token ids, attention masks, token types, positions): the module would
    otherwise be built for the file's shape, not the one asked for. Other inputs (images, a rotary table passed
    in) say nothing certain about B and S and are not checked."""
    if len(dims) != 2 or not (dtype == "bool" or np.dtype(dtype).kind in "iu"):
        return
    fixed = [d.HasField("dim_value") for d in dims]
    if (fixed[0] and shape[0] != batch) or (fixed[1] and shape[1] != seq_len):
        raise ValueError(f"model: input {tensor!r} has the fixed shape {list(shape)} in the ONNX file (exported "
                         f"without dynamic axes), so it cannot be compiled for batch={batch}, seq_len={seq_len}; "
                         f"compile it at that shape, or export with dynamic axes (torch.onnx.export's "
                         f"dynamic_axes or dynamic_shapes) to compile other shapes")


def input_specs(model: onnx.ModelProto, batch: int, seq_len: int) -> list[TensorSpec]:
    """The model's real inputs (initializers excluded) with static shapes for ``batch`` and ``seq_len``."""
    specs = []
    for vi in _graph_inputs(model):
        ttype = vi.type.tensor_type
        shape = tuple(_resolve_dim(d, vi.name, i, batch, seq_len) for i, d in enumerate(ttype.shape.dim))
        dtype = _dtype_name(ttype.elem_type)
        _check_fixed_dims(vi.name, shape, ttype.shape.dim, dtype, batch, seq_len)
        specs.append(TensorSpec(vi.name, shape, dtype))
    return specs


def split_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[TensorSpec]]:
    """Keep ``model``'s large float initializers (:func:`.onnx_shapes.is_weight`) as initializers (imported as
    parameters) and turn all others into Constant nodes, so that they fold; returns the model with the weights'
    specs in initializer order. In place: :func:`import_onnx` passes the folded copy it owns (copying it again
    would move every weight twice more)."""
    initializers = model.graph.initializer
    weights = [t for t in initializers if is_weight(t)]
    constants = [onnx.helper.make_node("Constant", [], [t.name], value=t, name=f"stof_const_{t.name}")
                 for t in initializers if not is_weight(t)]
    for index in reversed(range(len(initializers))):
        if not is_weight(initializers[index]):
            del initializers[index]
    nodes = constants + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    specs = [TensorSpec(t.name, tuple(int(d) for d in t.dims), _dtype_name(t.data_type)) for t in weights]
    return model, specs


FOLD_MAX_ELEMENTS = 1 << 16


def _static_inputs(model: onnx.ModelProto, specs: list[TensorSpec]) -> onnx.ModelProto:
    static = onnx.ModelProto()
    static.CopyFrom(model)
    by_name = {spec.name: spec for spec in specs}
    for vi in static.graph.input:
        if vi.name in by_name:
            for dim, size in zip(vi.type.tensor_type.shape.dim, by_name[vi.name].shape):
                dim.Clear()
                dim.dim_value = size
    return static


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    inferred = infer_shapes(model, data_prop=True)
    shapes = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = tuple(int(d.dim_value) for d in dims)
    return shapes


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    """The value of a Constant node, whichever attribute holds it."""
    attr = node.attribute[0]
    if attr.name == "value":
        return onnx.numpy_helper.to_array(attr.t)
    value = onnx.helper.get_attribute_value(attr)
    dtype = np.float32 if attr.name.startswith("value_float") else np.int64
    return np.array(value, dtype=dtype)


def _foldable(node: onnx.NodeProto, known: dict, shapes: dict) -> bool:
    """A standard, deterministic single-output node whose inputs are all known and whose output is small."""
    return (node.domain in ("", "ai.onnx") and len(node.output) == 1 and bool(node.input)
            and all(not name or name in known for name in node.input)
            and np.prod(shapes.get(node.output[0], (0,))) <= FOLD_MAX_ELEMENTS
            and not node.op_type.startswith("Random"))


def _gather_elements(node: onnx.NodeProto, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    indices = np.where(indices < 0, indices + data.shape[axis], indices)
    return np.take_along_axis(data, indices, axis=axis)


# Ops folded with numpy instead of onnx's reference implementation, whose GatherElements cannot gather from a
# larger axis than the indices have (BertModel's token-type buffer [1, 512] gathered at [1, S]: it raised
# "cannot reshape array of size 1 into shape (1,S)")
_NUMPY_FOLDS = {"GatherElements": _gather_elements}


def _evaluate(node: onnx.NodeProto, known: dict, opset_import) -> np.ndarray:
    """Run one node on known inputs with onnx's reference implementation (numpy for :data:`_NUMPY_FOLDS`).

    numpy's floating-point warnings are off: the model's own constant arithmetic may pass through an infinity
    that a later ``Where`` discards (T5's relative-position buckets take the log of a zero distance, then cast
    it), as torch computes it, silently."""
    from onnx.reference import ReferenceEvaluator

    if node.op_type in _NUMPY_FOLDS:
        return _NUMPY_FOLDS[node.op_type](node, *(known[name] for name in node.input))

    out = onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.UNDEFINED, None)
    graph = onnx.helper.make_graph([node], "fold", [], [out], initializer=[
        onnx.numpy_helper.from_array(known[name], name) for name in set(node.input) if name])
    with np.errstate(all="ignore"):
        return ReferenceEvaluator(onnx.helper.make_model(graph, opset_imports=opset_import)).run(None, {})[0]


def fold_shape_computations(model: onnx.ModelProto, specs: list[TensorSpec]) -> onnx.ModelProto:
    """Fix the input shapes and fold what then becomes constant: ``Shape`` of statically shaped tensors and
    every small computation on constants (the ``Shape -> Gather -> Concat -> Reshape`` chains exporters emit
    for dynamic axes, which TVM's importer cannot always follow). Each node is evaluated with onnx's reference
    implementation; outputs larger than ``FOLD_MAX_ELEMENTS`` stay as nodes.

    Folding runs again while it folds something new (at most ``FOLD_ROUNDS`` times): a folded ``Range`` (the
    position ids of a dynamic-axes export) lets shape inference find the static shapes downstream of it, whose
    ``Shape`` nodes then fold in the next round."""
    model = _static_inputs(model, specs)
    folded = _folded_constants(model)
    for _ in range(FOLD_ROUNDS):
        model = _fold_once(model)
        count = _folded_constants(model)
        if count == folded:
            break
        folded = count
    return model


FOLD_ROUNDS = 4


def _folded_constants(model: onnx.ModelProto) -> int:
    return sum(1 for node in model.graph.node if node.op_type == "Constant")


class _KnownValues:
    """Tensor values known while folding, by name: computed ones, and the initializers, converted to numpy only
    when a fold reads one (converting every weight each round copied the whole model)."""

    def __init__(self, initializers):
        self._protos = {t.name: t for t in initializers}
        self._arrays: dict[str, np.ndarray] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._arrays or name in self._protos

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = onnx.numpy_helper.to_array(self._protos[name])
        return self._arrays[name]

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._arrays[name] = value


def _fold_once(model: onnx.ModelProto) -> onnx.ModelProto:
    """One pass of :func:`fold_shape_computations` over ``model`` (static inputs)."""
    shapes = _inferred_shapes(model)
    known = _KnownValues(model.graph.initializer)
    nodes = []
    for node in model.graph.node:
        value = None
        if node.op_type == "Constant":
            known[node.output[0]] = _constant_value(node)
            nodes.append(node)
            continue
        if node.op_type == "Shape" and node.input[0] in shapes:
            attrs = {a.name: a.i for a in node.attribute}
            value = np.array(shapes[node.input[0]], np.int64)[attrs.get("start", 0):attrs.get("end", None)]
        elif _foldable(node, known, shapes):
            candidate = np.asarray(_evaluate(node, known, model.opset_import))
            value = candidate if candidate.size <= FOLD_MAX_ELEMENTS else None
        if value is None:
            nodes.append(node)
            continue
        known[node.output[0]] = np.asarray(value)
        nodes.append(onnx.helper.make_node("Constant", [], [node.output[0]], name=f"stof_fold_{node.output[0]}",
                                           value=onnx.numpy_helper.from_array(np.asarray(value), node.output[0])))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def import_onnx(model: onnx.ModelProto, batch: int, seq_len: int):
    """Check operators, fold the shape computations for the static shapes, rewrite the exporter forms TVM's importer
    cannot take (:mod:`.onnx_rules`) and import to Relax with static shapes.

    Returns ``(IRModule, input specs, weight specs)``; ``main`` takes the inputs, then the weights (its
    ``num_input`` attribute counts the inputs).
    """
    check_supported_ops(model)
    specs = input_specs(model, batch, seq_len)
    split, weights = split_weights(apply_rules(fold_shape_computations(model, specs))[0])
    try:
        mod = _to_relax(split, specs)
    except Exception as err:        # TVM raises several error types; all mean the graph does not fit the shapes
        first_line = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ValueError(f"model: import failed for batch={batch}, seq_len={seq_len} ({type(err).__name__}: "
                         f"{first_line[:300]}); check that the model supports this sequence length") from err
    names = [p.name for p in mod["main"].params[len(specs):]]
    # TVM's importer drops the "onnx::" prefix the PyTorch exporter gives to the weights it creates (transposed
    # MatMul operands such as "onnx::MatMul_1499"); the artifact keeps the initializers' own names
    if names != [w.name.removeprefix("onnx::") for w in weights]:
        raise ValueError(f"model: imported parameters {names[:4]}... do not match the weights' initializer names")
    return mod, specs, weights


def _to_relax(model: onnx.ModelProto, specs: list[TensorSpec]):
    """TVM's ``relax.frontend.onnx.from_onnx`` (static input shapes, weights kept as parameters, names as they
    are), except for its first step: onnx's model checker, which serialises every weight (3-4 s of a base model's
    import) only to warn when it fails, checks the :func:`.onnx_shapes.weightless` graph instead."""
    import warnings

    from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter

    if model.ir_version < 3:
        raise ValueError(f"Model IR version {model.ir_version} not supported. Must be at least after 1.1.0.")
    try:
        onnx.checker.check_model(weightless(model))
    except Exception as err:        # the checker is strict; TVM's importer only warns, and so do we
        warnings.warn(str(err), stacklevel=3)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    importer = ONNXGraphImporter({s.name: list(s.shape) for s in specs}, {s.name: s.dtype for s in specs},
                                 keep_params_in_input=True, sanitize=False)
    return importer.from_onnx(model.graph, opset)


def output_names(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output]


# ops that only reshape their first input: ids pass through them unchanged (GPT-2's ``input_ids.view(-1, S)``)
_ID_PRESERVING = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}


def embedding_rows(model: onnx.ModelProto, name: str) -> int | None:
    """Rows of the embedding table(s) that input ``name`` indexes through a Gather of an initializer, directly
    or after reshapes, if any (the valid range of token ids)."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    names, frontier = {name}, [name]
    while frontier:
        value = frontier.pop()
        for node in model.graph.node:
            if node.op_type in _ID_PRESERVING and node.input and node.input[0] == value:
                fresh = [out for out in node.output if out not in names]
                names.update(fresh)
                frontier.extend(fresh)
    sizes = [dims[n.input[0]][0] for n in model.graph.node
             if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] in names and n.input[0] in dims]
    return min(sizes) if sizes else None
