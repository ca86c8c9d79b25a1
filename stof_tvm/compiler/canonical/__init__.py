"""One canonical Relax form for every exporter's spelling of a transformer, before attention and chain matching.

torch's TorchScript and dynamo exporters, at opsets 17-23, with eager or sdpa attention, spell the same model
differently: the scale on the scores or split over Q and K, boolean or additive masks with ``-inf`` or finfo.min
fills, NaN guards after the softmax, no-op casts, GELU as an operator, as ``erf`` arithmetic or as the tanh
formula, ``pow(x, n)``. The matchers (:mod:`..attention_match`, :mod:`..linear_match`, :mod:`..qkv_heads`,
:mod:`..rmsnorm_match`, :mod:`..downstream`) read one form. Each exporter form is one small :class:`.base.Rule`
(``apply(func) -> func | None``) in :data:`RULES`; :func:`canonicalize` runs them to a fixed point. A new exporter
form is one new rule and its test (tests/test_canonical.py).

The canonical form (see each module for its rules and their exactness):

- attention (:mod:`.attention`): ``softmax(where(keep, matmul(Q, K^T) * c, finite fill) + bias) @ V``, any of the
  scale, the ``where`` and the additive terms optional, no NaN guard;
- layout (:mod:`.layout`): head splits as one ``permute_dims`` of a ``reshape``, attention's products on the heads
  rather than on a [B*H, ...] view of them, no one-tensor ``concat``, grouped-query key/value heads as one
  ``repeat``, linear
  layers on their input's own shape, a vision transformer's patch conv as a linear layer on the image's patches;
- activations (:mod:`.activations`): ``nn.gelu`` (exact) and ``nn.gelu_tanh`` (tanh approximation) as operators,
  integer powers as products, no cast to the dtype a tensor already has nor a cast there and back through a wider
  type;
- constants (:mod:`.constants`): no large constant that merely repeats one slice (folding's broadcast tensors).
"""
from __future__ import annotations

import tvm
from tvm import relax

from .activations import GeluErf, GeluTanh, IntegerPowers, NoOpCasts, RoundTripCasts
from .attention import FiniteFill, NanGuard, SelectMask, SplitScale
from .base import Rule
from .constants import RepeatedConstant
from .layout import (FlatHeads, FlatLinear, PatchEmbedding, PermutePairs, RepeatedKVHeads, ScaleAfterHeadSplit,
                     SingleConcat, TransposeThrough3D)

# Order matters only for speed (each rule runs until no rule changes anything): the casts and layout detours
# first, so that the attention rules see adjacent operators.
RULES: list[Rule] = [NoOpCasts(), RoundTripCasts(), SingleConcat(), RepeatedKVHeads(), TransposeThrough3D(),
                     PermutePairs(), FlatHeads(),
                     FlatLinear(), PatchEmbedding(), ScaleAfterHeadSplit(),
                     SplitScale(), SelectMask(), FiniteFill(), NanGuard(), GeluErf(), GeluTanh(), IntegerPowers(),
                     RepeatedConstant()]
MAX_ROUNDS = 8


def canonicalize_function(func: relax.Function, rules: list[Rule] | None = None) -> tuple[relax.Function, dict]:
    """``func`` with ``rules`` (default :data:`RULES`) applied until none changes it; also returns how many rounds
    each rule changed something (``{rule name: rounds}``)."""
    rules = RULES if rules is None else rules
    applied: dict[str, int] = {}
    for _ in range(MAX_ROUNDS):
        changed = False
        for rule in rules:
            out = rule.apply(func)
            if out is not None:
                func, changed = out, True
                applied[rule.name] = applied.get(rule.name, 0) + 1
        if not changed:
            return func, applied
    raise RuntimeError(f"canonical form: the rules did not reach a fixed point in {MAX_ROUNDS} rounds ({applied})")


def canonicalize(mod: tvm.IRModule, rules: list[Rule] | None = None) -> tvm.IRModule:
    """Every Relax function of ``mod`` in the canonical form (see :func:`canonicalize_function`)."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gv] = canonicalize_function(func, rules)[0]
    return mod


__all__ = ["RULES", "Rule", "canonicalize", "canonicalize_function", "GeluErf", "GeluTanh", "IntegerPowers",
           "NoOpCasts", "RoundTripCasts", "RepeatedConstant", "FiniteFill", "NanGuard", "SelectMask", "SplitScale",
           "FlatLinear", "PatchEmbedding", "PermutePairs", "SingleConcat", "TransposeThrough3D", "FlatHeads"]
