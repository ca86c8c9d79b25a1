"""Which knobs a fusion-template call gets, and whether a LayerNorm chain runs fused or as two templates.

Knobs of an mma.sync template on CUDA, in order of trust:

1. ``database``: the measured-best record of the template's workload in a tuning work dir (stage 2), read
   back into its knob set by matching the record's schedule against the stage-1 candidates;
2. ``model``: stage 1's top-ranked knob set (the analytical model, :func:`stof_tvm.cost_model.rank_template`);
3. ``default``: the template's own first configuration (when the model ranks nothing).

A wgmma template (thread-level kernel, one build per knob set) gets the fastest knob set that stage 2 measured
for its call (the choice of its task group, :func:`stof_tvm.records.wgmma_group`), else its own
first configuration (``default``: the knob order was set from H200 measurements, and the analytical model, fitted
to the same measurements, ranks the same sets first). On the CPU the definitions run unscheduled, or with the record of the definition measured there
(``database``; ``stof-tvm tune --target llvm``). The tuner plans exactly the calls these choices are made for
(:func:`stof_tvm.tuning.plan_model` runs the same rewrite), so a tuned work dir always has their records.

Fused or unfused (``LayerNorm(A @ W + b + residual)``): the fused template only when a tuning database measured
it faster than the unfused pair (``gemm`` + ``bias_residual_layernorm``) at that shape. Without measurements the
unfused pair runs: it measured faster at every BERT shape on the H200 (BENCHMARKS.md), while the model still
ranks the fused form first at some of them (see :meth:`TemplateChooser.fused_layernorm`). On Hopper the wgmma
form of the fused template (a cluster of blocks per row tile sharing the row sums) is another matter:
:meth:`TemplateChooser.fused_norm_wgmma`.
"""
from __future__ import annotations

import dataclasses

import tvm

from ..cost_model import DEFAULT_CALIBRATION
from ..cost_model.templates import rank_template
from ..records import mean_seconds, normalize_workload, wgmma_group

# Stage-1 candidates compared with a database record to recover its knobs.
RECORD_CANDIDATES = 16
# Fewest 128-row blocks for which the fused FFN (one block per 128 rows, ffn_wgmma) is predicted faster than the
# unfused pair: one full wave on the H200's 132 SMs. Below it most SMs idle, while the pair's GEMMs also split
# the ffn columns over blocks; above it the fused kernel saves the [m, ffn] intermediate's round trip.
FUSED_FFN_MIN_BLOCKS = 132
# Fewest blocks (128-row tiles x the cluster's column blocks) for which the wgmma GEMM + bias + residual + LayerNorm
# (gemm_bias_residual_layernorm_wgmma, only with the compile option norm_fusion) is taken: half the SMs. Below it the
# pair's GEMM has split-K sets to fill the GPU with, which the fused kernel has not. Measured (H100, session 19,
# check_wgmma_gpu.py --suite norm) the fused kernel was slower than the pair at every shape, 0.57-0.88x at 1576-32768
# rows, 0.40-0.68x at 128: hence the option's default off.
FUSED_NORM_MIN_BLOCKS = 66


@dataclasses.dataclass
class KnobChoice:
    """Knobs of one template call, where they came from, and the model's or the record's time."""

    knobs: dict | None
    source: str                      # "database", "model", "default" or "unscheduled"
    seconds: float | None = None     # measured (database) or predicted (model)
    trace: object = None             # the record's trace, when its knobs are not among the candidates

    def to_json(self) -> dict:
        out = {"knobs": self.knobs, "source": self.source}
        if self.seconds is not None:
            out["seconds"] = self.seconds
        return out


class TemplateChooser:
    """Chooses knobs per (template, shape, dtype) for one target; caches rankings and database reads."""

    def __init__(self, target: tvm.target.Target, database: str | None):
        self.target = target
        self.cuda = target.kind.name == "cuda"
        self.database = None
        if database is not None:
            from ..records import open_database

            self.database = open_database(database)
        self._hw = None
        self._cache: dict = {}

    @property
    def hardware(self):
        if self._hw is None:
            from ..hardware import profile_for_target

            self._hw = profile_for_target(self.target)
        return self._hw

    def ranked(self, template, shape: dict, dtype: str) -> list:
        key = ("ranked", template.name, tuple(sorted(shape.items())), dtype)
        if key not in self._cache:
            self._cache[key] = rank_template(template, shape, dtype, self.hardware, DEFAULT_CALIBRATION,
                                             explain_top=0)
        return self._cache[key]

    def knobs(self, template, shape: dict, dtype: str, options: dict | None = None) -> KnobChoice:
        """The knob choice for one call; ``options``: the definition's constants (``eps``), part of its workload.

        On the CPU: the measured record of the definition (its trace) or ``unscheduled``."""
        options = dict(options or {})
        key = ("knobs", template.name, tuple(sorted(shape.items())), dtype, tuple(sorted(options.items())))
        if key not in self._cache:
            if not self.cuda:
                self._cache[key] = self._cpu(template, shape, dtype, options)
            elif template.name.endswith("_wgmma"):
                self._cache[key] = self._wgmma(template, shape, dtype)
            else:
                self._cache[key] = self._choose(template, shape, dtype, options)
        return self._cache[key]

    def _cpu(self, template, shape, dtype, options) -> KnobChoice:
        if self.database is not None:
            record = self.database.best_record(template.primfunc(shape, dtype, **options))
            if record is not None:
                return KnobChoice(None, "database", mean_seconds(record), record.trace)
        return KnobChoice(None, "unscheduled")

    def _wgmma(self, template, shape, dtype) -> KnobChoice:
        if self.database is not None:
            best = self.database.choice(wgmma_group(template, shape, dtype))
            if best is not None:
                return KnobChoice(dict(best["meta"]["knobs"]), "database", float(best["best_s"]))
        return KnobChoice(dict(template.default_knobs(shape, dtype)), "default")

    def _choose(self, template, shape, dtype, options) -> KnobChoice:
        ranked = self.ranked(template, shape, dtype)
        if self.database is not None and ranked:
            recorded = self._from_database(template, shape, dtype, options, ranked)
            if recorded is not None:
                return recorded
        if ranked:
            return KnobChoice(dict(ranked[0].candidate), "model", float(ranked[0].time_s))
        return KnobChoice(dict(template.default_knobs(shape, dtype)), "default")

    def _from_database(self, template, shape, dtype, options, ranked) -> KnobChoice | None:
        func = template.primfunc(shape, dtype, **options)
        record = self.database.best_record(func)
        if record is None:
            return None
        candidates = [dict(r.candidate) for r in ranked[:RECORD_CANDIDATES]]
        index = self.database.candidate_index(normalize_workload(func), candidates, template.apply, record)
        if index is not None:
            return KnobChoice(candidates[index], "database", mean_seconds(record))
        return KnobChoice(None, "database", mean_seconds(record), record.trace)

    def fused_layernorm(self, fused, gemm, layernorm, gemm_shape: dict, ln_shape: dict, dtype: str,
                        options: dict | None = None) -> tuple[bool, str]:
        """Whether ``LayerNorm(A @ W + b + r)`` should run as the fused template; returns (fused, why).

        Fused only when the database measured all three templates and the fused one was faster. The model's
        prediction is reported but does not decide: on the H200 it ranks the fused form first at BERT-Base
        128 and 4096 tokens, where the unfused pair measured 1.3-4.4x faster (BENCHMARKS.md, templates)."""
        try:
            fused.knob_space(gemm_shape, dtype)
        except ValueError as err:
            return False, f"unfused: the fused form does not fit ({err})"
        if not self.cuda:
            return False, "unfused (measured faster on the H200; CPU build)"
        choices = [self.knobs(fused, gemm_shape, dtype, options), self.knobs(gemm, gemm_shape, dtype),
                   self.knobs(layernorm, ln_shape, dtype, options)]
        times = [c.seconds for c in choices]
        if any(t is None for t in times):
            return False, "unfused (measured faster on the H200; no time for one of the forms)"
        split = times[1] + times[2]
        if all(c.source == "database" for c in choices):
            if times[0] < split:
                return True, f"fused: measured {times[0] * 1e6:.1f} us < unfused {split * 1e6:.1f} us"
            return False, f"unfused: measured {split * 1e6:.1f} us <= fused {times[0] * 1e6:.1f} us"
        return False, (f"unfused (measured faster on the H200; not all forms measured here, the model predicts "
                       f"fused {times[0] * 1e6:.1f} us vs unfused {split * 1e6:.1f} us)")

    def fused_norm_wgmma(self, fused, gemm_shape: dict, dtype: str) -> tuple[bool, str]:
        """Whether ``LayerNorm(A @ W + b + residual)`` runs as ``fused`` (the wgmma GEMM + LayerNorm template) instead of
        the wgmma GEMM + ``bias_residual_layernorm`` pair; returns (fused, why). Only on sm_90a and where it fits; then
        where its first knob set launches :data:`FUSED_NORM_MIN_BLOCKS` blocks or more."""
        if not (self.cuda and str(self.target.attrs.get("arch", "")) == "sm_90a"):
            return False, "unfused: the fused GEMM + LayerNorm is a Hopper kernel (CUDA sm_90a, gemm='wgmma')"
        try:
            knobs = self.knobs(fused, gemm_shape, dtype).knobs
            blocks = fused.resources(gemm_shape, dtype, knobs)["grid"]
        except ValueError as err:
            return False, f"unfused: the fused form does not fit ({err})"
        if blocks >= FUSED_NORM_MIN_BLOCKS:
            return True, f"fused: {blocks} blocks in clusters of {gemm_shape['n'] // knobs['block_n']}"
        return False, f"unfused: the fused form's {blocks} blocks < {FUSED_NORM_MIN_BLOCKS} fill too few SMs"

    def fused_ffn(self, fused, unfused: list, ffn_shape: dict, unfused_shapes: list, dtype: str) -> tuple[bool, str]:
        """Whether ``act(x @ W1 + b1) @ W2`` should run as the fused FFN template; returns (fused, why).

        Only on sm_90a (a wgmma kernel) and where it fits (hidden 128-256). Measured times decide when the database
        has all forms; otherwise the prediction: fused with at least :data:`FUSED_FFN_MIN_BLOCKS` blocks of 128 rows."""
        if not (self.cuda and str(self.target.attrs.get("arch", "")) == "sm_90a"):
            return False, "unfused: the fused FFN is a Hopper kernel (CUDA sm_90a, gemm='wgmma')"
        try:
            fused.knob_space(ffn_shape, dtype)
        except ValueError as err:
            return False, f"unfused: the fused form does not fit ({err})"
        if self.database is not None:
            choices = [self.knobs(fused, ffn_shape, dtype)] + [self.knobs(t, shape, dtype)
                                                               for t, shape in zip(unfused, unfused_shapes)]
            if all(c.source == "database" for c in choices):
                split = sum(c.seconds for c in choices[1:])
                if choices[0].seconds < split:
                    return True, f"fused: measured {choices[0].seconds * 1e6:.1f} us < unfused {split * 1e6:.1f} us"
                return False, f"unfused: measured {split * 1e6:.1f} us <= fused {choices[0].seconds * 1e6:.1f} us"
        blocks = ffn_shape["m"] // 128
        if blocks >= FUSED_FFN_MIN_BLOCKS:
            return True, f"fused: predicted faster ({blocks} blocks of 128 rows >= {FUSED_FFN_MIN_BLOCKS})"
        return False, f"unfused: predicted faster ({blocks} blocks of 128 rows < {FUSED_FFN_MIN_BLOCKS} fill too few SMs)"
