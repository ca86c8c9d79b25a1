"""ONNX-level rewrites of exporter forms that TVM's ONNX importer cannot take, run before the import.

Each :class:`OnnxRule` handles one form; ``apply(model) -> model | None`` (None: nothing to rewrite), composed in
:data:`RULES` and run by :func:`apply_rules` on the model whose input shapes are already static and whose shape
computations are folded (:func:`.onnx_import.fold_shape_computations`), so that shapes are known. The Relax-level
canonical form comes later (:mod:`.canonical`); these rules only make the graph importable, in the operator forms
that canonical form reads.

- :class:`AttentionOp`: the ``Attention`` operator of opset 23 (the dynamo exporter's SDPA), which TVM's importer
  confuses with onnxruntime's ``com.microsoft.Attention`` (``KeyError: 'num_heads'``), becomes
  ``MatMul(Q, K^T) * scale``, its mask (``Where(mask, scores, lowest)`` for a boolean one, ``Add`` for a float
  one; the causal flag a constant lower-triangular ``Where``), ``Softmax`` and ``MatMul(P, V)``: the attention
  form the matcher reads. Forms outside the SDPA subset (KV cache inputs, softcap, the QK output modes, 3-D
  inputs) are refused with a clear error.
- :class:`RotaryEmbeddingOp`: the ``RotaryEmbedding`` operator of opset 23 (the dynamo exporter's rotary position
  embedding in Llama-style models: Phi, Mistral, GPT-NeoX, Gemma...), which TVM's importer does not know, becomes
  its definition in elementwise operators: the cos/sin caches (gathered by the position ids when given) times the
  halves (or the even and odd elements, ``interleaved``) of the rotated part, concatenated with the part left
  as it is.
- :class:`TileAsExpand`: ``Tile`` by constant repeats as ``Reshape``/``Expand``/``Reshape`` (TVM imports ``Tile`` as
  a TIR function, which its mixed-precision pass refuses).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .onnx_shapes import infer_shapes


class OnnxRule:
    """One ONNX rewrite; subclasses set ``name`` and implement :meth:`apply`."""

    name = "onnx-rule"

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto | None:    # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<onnx rule {self.name}>"


def _with_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _constant_node(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"stof_rule_{name}",
                            value=numpy_helper.from_array(np.asarray(value), name))


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _value_infos(model: onnx.ModelProto) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """From onnx's shape inference: the static shapes (where every dim is known) and element types by name."""
    inferred = infer_shapes(model)
    shapes, types = {}, {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        ttype = vi.type.tensor_type
        types[vi.name] = ttype.elem_type
        if ttype.HasField("shape") and all(d.HasField("dim_value") for d in ttype.shape.dim):
            shapes[vi.name] = tuple(int(d.dim_value) for d in ttype.shape.dim)
    return shapes, types


class AttentionOp(OnnxRule):
    """The opset-23 ``Attention`` operator (4-D Q/K/V, no KV cache) -> MatMul, scale, mask, Softmax, MatMul."""

    name = "attention-op"

    def apply(self, model):
        if not any(n.op_type == "Attention" and n.domain in ("", "ai.onnx") for n in model.graph.node):
            return None
        shapes, types = _value_infos(model)
        used = {name for n in model.graph.node for name in n.input} | {o.name for o in model.graph.output}
        nodes = []
        for node in model.graph.node:
            if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
                nodes.extend(self._expand(node, shapes, types, used))
            else:
                nodes.append(node)
        return _with_nodes(model, nodes)

    @staticmethod
    def _refuse(node: onnx.NodeProto, why: str):
        raise ValueError(f"model: the ONNX Attention operator at node {node.name or node.output[0]!r} {why}; "
                         f"stof-tvm takes 4-D Q/K/V with an optional boolean or additive mask and is_causal")

    def _expand(self, node, shapes, types, used) -> list[onnx.NodeProto]:
        attrs = _attributes(node)
        inputs = list(node.input) + [""] * (6 - len(node.input))
        q, k, v, mask, past_key, past_value = inputs[:6]
        if past_key or past_value:
            self._refuse(node, "has KV-cache inputs (past_key / past_value)")
        if any(name in used for name in node.output[1:] if name):
            self._refuse(node, "has its present-KV or QK outputs used")
        if attrs.get("softcap", 0.0) or attrs.get("qk_matmul_output_mode", 0):
            self._refuse(node, "uses softcap or a QK output mode")
        if "q_num_heads" in attrs or "kv_num_heads" in attrs or len(shapes.get(q, (0,) * 4)) != 4:
            self._refuse(node, "has 3-D inputs (q_num_heads / kv_num_heads)")
        q_shape, k_shape = shapes.get(q), shapes.get(k)
        if q_shape is not None and k_shape is not None and q_shape[1] != k_shape[1]:
            self._refuse(node, f"groups {q_shape[1]} query heads over {k_shape[1]} key heads")
        scale = attrs.get("scale")
        if scale is None:
            if q_shape is None:
                self._refuse(node, "has no scale attribute and a query of unknown head size")
            scale = 1.0 / float(np.sqrt(q_shape[3]))
        prefix = f"{node.name or node.output[0]}_stof"
        dtype = helper.tensor_dtype_to_np_dtype(types.get(q, onnx.TensorProto.FLOAT))
        out = [helper.make_node("Transpose", [k], [f"{prefix}_kt"], perm=[0, 1, 3, 2]),
               helper.make_node("MatMul", [q, f"{prefix}_kt"], [f"{prefix}_qk"]),
               _constant_node(f"{prefix}_scale", np.array(scale, dtype)),
               helper.make_node("Mul", [f"{prefix}_qk", f"{prefix}_scale"], [f"{prefix}_scores"])]
        scores = f"{prefix}_scores"
        # masked scores get the lowest finite value (not -inf as the operator's definition: a fully masked row
        # stays finite, and the canonical form has a finite fill)
        lowest = f"{prefix}_lowest"
        if mask and types.get(mask) == onnx.TensorProto.BOOL or attrs.get("is_causal", 0):
            out.append(_constant_node(lowest, np.array(np.finfo(dtype).min, dtype)))
        if mask and types.get(mask) == onnx.TensorProto.BOOL:
            out.append(helper.make_node("Where", [mask, scores, lowest], [f"{prefix}_masked"]))
            scores = f"{prefix}_masked"
        elif mask:
            out.append(helper.make_node("Add", [scores, mask], [f"{prefix}_masked"]))
            scores = f"{prefix}_masked"
        if attrs.get("is_causal", 0):
            if q_shape is None or k_shape is None:
                self._refuse(node, "is causal over a sequence of unknown length")
            causal = np.tril(np.ones((q_shape[2], k_shape[2]), bool))
            out += [_constant_node(f"{prefix}_causal", causal),
                    helper.make_node("Where", [f"{prefix}_causal", scores, lowest], [f"{prefix}_causal_s"])]
            scores = f"{prefix}_causal_s"
        out += [helper.make_node("Softmax", [scores], [f"{prefix}_probs"], axis=-1),
                helper.make_node("MatMul", [f"{prefix}_probs", v], [node.output[0]])]
        return out


def _is_rotary(node: onnx.NodeProto) -> bool:
    return node.op_type == "RotaryEmbedding" and node.domain in ("", "ai.onnx")


class RotaryEmbeddingOp(OnnxRule):
    """The opset-23 ``RotaryEmbedding`` operator -> Gather (position ids), Slice, Mul, Sub/Add and Concat, as the
    operator is defined (onnx's reference implementation; the test compares with it). A 4-D input [B, H, S, D] is
    rotated on its own layout (the caches [B or 1, S, r/2] unsqueezed at the head axis); a 3-D one [B, S, H*D]
    (``num_heads``) through a [B, S, H, D] view."""

    name = "rotary-embedding-op"

    def apply(self, model):
        if not any(_is_rotary(n) for n in model.graph.node):
            return None
        shapes, _ = _value_infos(model)
        nodes = []
        for node in model.graph.node:
            nodes.extend(self._expand(node, shapes) if _is_rotary(node) else [node])
        return _with_nodes(model, nodes)

    @staticmethod
    def _refuse(node: onnx.NodeProto, why: str):
        raise ValueError(f"model: the ONNX RotaryEmbedding operator at node {node.name or node.output[0]!r} {why}")

    def _expand(self, node, shapes) -> list[onnx.NodeProto]:
        attrs = _attributes(node)
        x, cos, sin, positions = (list(node.input) + [""] * 4)[:4]
        shape = shapes.get(x)
        if shape is None or len(shape) not in (3, 4):
            self._refuse(node, f"has an input of shape {shape} (expected a static 3-D or 4-D shape)")
        prefix = f"{node.name or node.output[0]}_stof"
        out: list[onnx.NodeProto] = []
        made: set[str] = set()

        def const(name: str, values) -> str:
            if f"{prefix}_{name}" not in made:
                made.add(f"{prefix}_{name}")
                out.append(_constant_node(f"{prefix}_{name}", np.array(values, np.int64)))
            return f"{prefix}_{name}"

        def emit(op: str, inputs: list[str], name: str, **kwargs) -> str:
            out.append(helper.make_node(op, inputs, [f"{prefix}_{name}"], **kwargs))
            return f"{prefix}_{name}"

        def last_axis(tensor: str, name: str, start: int, end: int, step: int = 1) -> str:
            return emit("Slice", [tensor, const(f"{name}_from", [start]), const(f"{name}_to", [end]),
                                  const(f"{name}_axes", [-1]), const(f"{name}_step", [step])], name)

        heads = int(attrs.get("num_heads", 0))
        if len(shape) == 3:
            if heads <= 0 or shape[2] % heads:
                self._refuse(node, f"has a 3-D input of width {shape[2]} and num_heads {heads}")
            head, cache_axis = shape[2] // heads, 2
            x = emit("Reshape", [x, const("heads", [0, 0, heads, head])], "x4")
        else:
            head, cache_axis = shape[3], 1
        rot = int(attrs.get("rotary_embedding_dim", 0)) or head
        if rot % 2 or rot > head:
            self._refuse(node, f"rotates {rot} of {head} elements per head (expected an even count at most {head})")
        half = rot // 2
        if positions:
            cos = emit("Gather", [cos, positions], "cos_at", axis=0)
            sin = emit("Gather", [sin, positions], "sin_at", axis=0)
        cos = emit("Unsqueeze", [cos, const("cache_axis", [cache_axis])], "cos")
        sin = emit("Unsqueeze", [sin, const("cache_axis", [cache_axis])], "sin")
        rotated = last_axis(x, "rotated", 0, rot) if rot < head else x
        if attrs.get("interleaved", 0):
            x1, x2 = last_axis(rotated, "x1", 0, rot, 2), last_axis(rotated, "x2", 1, rot, 2)
        else:
            x1, x2 = last_axis(rotated, "x1", 0, half), last_axis(rotated, "x2", half, rot)
        real = emit("Sub", [emit("Mul", [cos, x1], "cos_x1"), emit("Mul", [sin, x2], "sin_x2")], "real")
        imag = emit("Add", [emit("Mul", [sin, x1], "sin_x1"), emit("Mul", [cos, x2], "cos_x2")], "imag")
        if attrs.get("interleaved", 0):          # (real, imag) pairs back at the even and odd positions
            pairs = emit("Concat", [emit("Unsqueeze", [real, const("pair_axis", [-1])], "real_1"),
                                    emit("Unsqueeze", [imag, const("pair_axis", [-1])], "imag_1")], "pairs",
                         axis=-1)
            result = emit("Reshape", [pairs, const("unpair", [0, 0, 0, rot])], "result")
        else:
            result = emit("Concat", [real, imag], "result", axis=-1)
        if rot < head:
            result = emit("Concat", [result, last_axis(x, "kept", rot, head)], "whole", axis=-1)
        if len(shape) == 3:
            result = emit("Reshape", [result, const("flat", [0, 0, shape[2]])], "flat_out")
        out.append(helper.make_node("Identity", [result], [node.output[0]]))
        return out


def _constant_values(model: onnx.ModelProto, names: set[str]) -> dict[str, np.ndarray]:
    """The values of ``names`` that initializers or ``Constant`` nodes (a ``value`` tensor, as folding writes them)
    hold; only those are converted (not the model's weights)."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in names}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] in names:
            tensor = _attributes(node).get("value")
            if tensor is not None:
                values[node.output[0]] = numpy_helper.to_array(tensor)
    return values


class TileAsExpand(OnnxRule):
    """``Tile`` by constant repeats -> ``Reshape``, ``Expand``, ``Reshape`` (x of shape [d0, d1, ...] viewed as
    [1, d0, 1, d1, ...], broadcast to [r0, d0, r1, d1, ...], viewed as [r0 * d0, r1 * d1, ...]: the same
    elements). TVM's importer builds ``Tile`` as a TIR function called from the graph, which its mixed-precision
    pass refuses (HF DeBERTa-v3 repeats its relative-position keys per batch row this way), while ``Expand``
    imports as ``broadcast_to``."""

    name = "tile-as-expand"

    def apply(self, model):
        repeats = {n.input[1] for n in model.graph.node if n.op_type == "Tile"}
        if not repeats:
            return None
        shapes, _ = _value_infos(model)
        constants = _constant_values(model, repeats)
        nodes, changed = [], False
        for node in model.graph.node:
            reps = constants.get(node.input[1]) if node.op_type == "Tile" else None
            shape = shapes.get(node.input[0]) if node.op_type == "Tile" else None
            if reps is None or shape is None or len(reps) != len(shape):
                nodes.append(node)
                continue
            reps = [int(r) for r in np.asarray(reps).reshape(-1)]
            prefix = f"{node.name or node.output[0]}_stof"
            spread = [n for d in shape for n in (1, d)]
            wide = [n for r, d in zip(reps, shape) for n in (r, d)]
            nodes += [_constant_node(f"{prefix}_spread", np.array(spread, np.int64)),
                      helper.make_node("Reshape", [node.input[0], f"{prefix}_spread"], [f"{prefix}_x"]),
                      _constant_node(f"{prefix}_wide", np.array(wide, np.int64)),
                      helper.make_node("Expand", [f"{prefix}_x", f"{prefix}_wide"], [f"{prefix}_expanded"]),
                      _constant_node(f"{prefix}_shape", np.array([r * d for r, d in zip(reps, shape)], np.int64)),
                      helper.make_node("Reshape", [f"{prefix}_expanded", f"{prefix}_shape"], [node.output[0]])]
            changed = True
        return _with_nodes(model, nodes) if changed else None


RULES: list[OnnxRule] = [AttentionOp(), RotaryEmbeddingOp(), TileAsExpand()]
# standard operators TVM's importer lacks that a rule above rewrites (the import's operator check accepts them)
REWRITTEN_OPS = ("RotaryEmbedding",)


def apply_rules(model: onnx.ModelProto, rules: list[OnnxRule] | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with each of ``rules`` (default :data:`RULES`) applied once, in order; also the names of the rules
    that changed something."""
    applied = []
    for rule in RULES if rules is None else rules:
        out = rule.apply(model)
        if out is not None:
            model = out
            applied.append(rule.name)
    return model, applied


__all__ = ["OnnxRule", "AttentionOp", "RotaryEmbeddingOp", "TileAsExpand", "RULES", "REWRITTEN_OPS", "apply_rules"]
