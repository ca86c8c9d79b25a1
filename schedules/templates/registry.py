"""The Template interface, the registry, and the MetaSchedule glue shared by every template family.

A template is a PrimFunc generator plus a schedule with named knobs. Its knob space is a list of
dicts; ``apply`` schedules with one of them; ``sample`` draws each knob with ``sample_categorical``
(values restricted to a candidate list when one is given) so MetaSchedule can search the space; the
postprocessors from :meth:`Template.postprocs` drop draws that are not one of the candidates and then
carry out the deferred scheduling steps (:func:`.mainloop.finalize`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from tvm import s_tir, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .deferred import finalize

SPEC_ATTR = "stof.spec"  # PrimFunc attribute: JSON of {"template", "shape", "dtype", ...}
DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class Hardware:
    """Limits the knob spaces respect (per thread block, per SM) and rates for rough ordering.

    The tuner's analytical model (stof_tvm) has the full description; this is the subset that decides
    whether a configuration can run at all.
    """

    name: str = "H200"
    sm_count: int = 132
    max_threads_per_block: int = 1024
    max_shared_bytes_per_block: int = 232448  # 227 KiB opt-in
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255


H200 = Hardware()


def fits_hardware(res: Mapping, hw: Hardware):
    """Whether configurations with resources ``res`` (scalars, or columns from :meth:`Template.resource_columns`)
    fit ``hw``'s thread, shared-memory and register limits; elementwise for columns."""
    threads = res["threads"]
    # accumulators + operands + addressing must fit the per-thread and per-SM register files
    regs = res.get("acc_registers", 0) + res.get("operand_registers", 0) + 40
    return ((threads <= hw.max_threads_per_block) & (res["shared_bytes"] <= hw.max_shared_bytes_per_block)
            & (regs <= hw.max_registers_per_thread) & (regs * threads <= hw.registers_per_sm))


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype


def check_shape(shape: Mapping[str, int], keys: Sequence[str], template: str) -> dict[str, int]:
    """Validate a shape dict: exactly ``keys``, each a positive int."""
    if not isinstance(shape, Mapping):
        raise TypeError(f"{template}: shape must be a mapping of {list(keys)}, got {type(shape).__name__}")
    missing = [k for k in keys if k not in shape]
    extra = [k for k in shape if k not in keys]
    if missing or extra:
        raise ValueError(f"{template}: shape needs keys {list(keys)} (missing {missing}, unexpected {extra})")
    out = {}
    for key in keys:
        value = shape[key]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{template}: shape[{key!r}] must be a positive int, got {value!r}")
        out[key] = int(value)
    return out


class Template:
    """Base class. Subclasses set ``name``, ``family``, ``shape_keys``, ``knob_names`` and implement
    ``_primfunc``, ``_knob_space``, ``_schedule``, ``resources``, ``arguments`` and ``reference``."""

    name: str = ""
    family: str = ""
    fused: bool = False
    shape_keys: tuple[str, ...] = ()
    knob_names: tuple[str, ...] = ()
    description: str = ""

    # ---- definition -------------------------------------------------------------------------------
    def primfunc(self, shape: Mapping[str, int], dtype: str = "float16", **options) -> tirx.PrimFunc:
        """The unscheduled TensorIR function for ``shape`` and input ``dtype`` (float16 or bfloat16).

        ``options``: family-specific constants of the definition (``eps`` of the LayerNorm families, for a
        model whose LayerNorm epsilon differs from the default); knobs and schedules do not depend on them."""
        shape = check_shape(shape, self.shape_keys, self.name)
        check_dtype(dtype)
        self._check(shape)
        func = self._primfunc(shape, dtype, **options)
        spec = {"template": self.name, "shape": shape, "dtype": dtype, **options}
        return func.with_attr(SPEC_ATTR, json.dumps(spec, sort_keys=True)).with_attr("tirx.noalias", True)

    def arguments(self, shape: Mapping[str, int], dtype: str = "float16") -> list[tuple[str, tuple, str]]:
        """(name, shape, dtype) of each parameter, inputs first, outputs last (in call order)."""
        raise NotImplementedError

    def outputs(self) -> int:
        """How many trailing parameters are outputs."""
        return 1

    def reference(self, shape: Mapping[str, int], inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs computed in float64 numpy from the named inputs."""
        raise NotImplementedError

    def flops(self, shape: Mapping[str, int]) -> int:
        """Useful floating-point operations (2 per multiply-add of the GEMMs; elementwise work ignored)."""
        return 0

    # ---- knobs ------------------------------------------------------------------------------------
    def knob_space(self, shape: Mapping[str, int], dtype: str = "float16", hw: Hardware = H200) -> list[dict]:
        """Every configuration that fits ``hw`` for this shape (shared memory, threads, registers, tiling)."""
        shape = check_shape(shape, self.shape_keys, self.name)
        check_dtype(dtype)
        self._check(shape)
        space = self._knob_space(shape, dtype, hw)
        fits = self._fits_space(shape, dtype, space, hw) if space else []
        space = [knobs for knobs, ok in zip(space, fits) if ok]
        if not space:
            raise ValueError(f"{self.name}: no configuration fits shape {shape} ({dtype}) on {hw.name}")
        return space

    def default_knobs(self, shape: Mapping[str, int], dtype: str = "float16", hw: Hardware = H200) -> dict:
        """A reasonable untuned configuration (the template's own first choice)."""
        return self.knob_space(shape, dtype, hw)[0]

    def resources(self, shape: Mapping[str, int], dtype: str, knobs: Mapping) -> dict:
        """Per-block resources of a configuration: threads, shared_bytes, acc_registers (float32 accumulators
        per thread), grid (blocks launched)."""
        raise NotImplementedError

    def resource_columns(self, shape: Mapping[str, int], dtype: str, space: Sequence[Mapping]
                         ) -> dict[str, np.ndarray]:
        """:meth:`resources` of every configuration in ``space`` (non-empty), one numpy column per key.

        This default asks :meth:`resources` once per configuration; families whose resources are plain arithmetic
        on the knobs override it with array formulas, so that :meth:`knob_space` and the tuner's cost model
        check and price spaces of a thousand configurations without a Python call for each."""
        rows = [self.resources(shape, dtype, knobs) for knobs in space]
        return {key: np.array([row[key] for row in rows]) for key in rows[0]}

    def _fits_space(self, shape, dtype, space, hw: Hardware):
        """Which configurations of ``space`` (non-empty) fit ``hw``: a boolean per configuration."""
        return fits_hardware(self.resource_columns(shape, dtype, space), hw)

    # ---- scheduling -------------------------------------------------------------------------------
    def apply(self, sch: s_tir.Schedule, knobs: Mapping) -> None:
        """Schedule ``sch`` (made from :meth:`primfunc`) with fixed knob values."""
        spec = self.spec_of(sch)
        missing = [k for k in self.knob_names if k not in knobs]
        if missing:
            raise ValueError(f"{self.name}: knobs missing {missing}")
        self._schedule(sch, spec, {k: knobs[k] for k in self.knob_names})
        finalize(sch)

    def sample(self, sch: s_tir.Schedule, candidates: Sequence[Mapping] | None = None) -> None:
        """Schedule ``sch`` with knobs drawn by ``sample_categorical`` (MetaSchedule design space).

        ``candidates`` (default: the whole knob space) limits each knob to the values it takes there; pair
        with :meth:`postprocs` so that only exact candidates are measured."""
        spec = self.spec_of(sch)
        values = self._values(spec, candidates)
        knobs = {}
        for key in self.knob_names:
            options = values[key]
            knobs[key] = options[0] if len(options) == 1 else sch.sample_categorical(
                candidates=options, probs=[1.0 / len(options)] * len(options))
        self._schedule(sch, spec, knobs)

    def schedule(self, shape: Mapping[str, int], dtype: str = "float16", knobs: Mapping | None = None
                 ) -> s_tir.Schedule:
        """Convenience: a Schedule of :meth:`primfunc` with ``knobs`` (default: :meth:`default_knobs`) applied."""
        sch = s_tir.Schedule(self.primfunc(shape, dtype))
        self.apply(sch, knobs if knobs is not None else self.default_knobs(shape, dtype))
        return sch

    def postprocs(self, shape: Mapping[str, int], dtype: str = "float16",
                  candidates: Sequence[Mapping] | None = None) -> list:
        """MetaSchedule postprocessors for :meth:`sample`: keep exact candidates, then finalize."""
        spec = {"template": self.name, "shape": check_shape(shape, self.shape_keys, self.name), "dtype": dtype}
        keep = list(candidates) if candidates is not None else self.knob_space(shape, dtype)
        return [KeepCandidates(self.name, spec, [dict(c) for c in keep]), Finalize()]

    def space_generator(self, shape: Mapping[str, int], dtype: str = "float16",
                        candidates: Sequence[Mapping] | None = None) -> ms.space_generator.ScheduleFn:
        """A MetaSchedule design space over this template (for ``ms.tune_tir(..., space=...)``)."""
        keep = list(candidates) if candidates is not None else None

        def space(sch: s_tir.Schedule) -> None:
            self.sample(sch, keep)

        return ms.space_generator.ScheduleFn(space, sch_rules=[], postprocs=self.postprocs(shape, dtype, keep),
                                             mutator_probs={})

    def decode(self, sch: s_tir.Schedule, candidates: Sequence[Mapping] | None = None) -> dict:
        """The knob values a sampled schedule took, read back from its trace decisions."""
        spec = self.spec_of(sch)
        return self._decode(spec, sch.trace, candidates)

    # ---- helpers ----------------------------------------------------------------------------------
    def spec_of(self, sch: s_tir.Schedule) -> dict:
        func = sch.mod["main"]
        if func.attrs is None or SPEC_ATTR not in func.attrs:
            raise ValueError(f"{self.name}: the schedule's function was not made by Template.primfunc")
        spec = json.loads(str(func.attrs[SPEC_ATTR]))
        if spec["template"] != self.name:
            raise ValueError(f"{self.name}: the function belongs to template {spec['template']!r}")
        return spec

    def _values(self, spec, candidates) -> dict[str, list[int]]:
        space = candidates if candidates is not None else self.knob_space(spec["shape"], spec["dtype"])
        if not space:
            raise ValueError(f"{self.name}: empty candidate list")
        return {k: sorted({int(c[k]) for c in space}) for k in self.knob_names}

    def _decode(self, spec, trace, candidates) -> dict:
        values = self._values(spec, candidates)
        drawn = [int(trace.decisions[inst]) for inst in trace.insts
                 if inst.kind.name == "SampleCategorical" and inst in trace.decisions]
        knobs, pos = {}, 0
        for key in self.knob_names:
            options = values[key]
            if len(options) == 1:
                knobs[key] = options[0]
            else:
                knobs[key] = options[drawn[pos]]
                pos += 1
        return knobs

    def _check(self, shape) -> None:
        """Raise ValueError for shapes the template cannot tile (overridden by families)."""

    def _primfunc(self, shape, dtype):
        raise NotImplementedError

    def _knob_space(self, shape, dtype, hw):
        raise NotImplementedError

    def _schedule(self, sch, spec, knobs):
        raise NotImplementedError


TEMPLATES: dict[str, Template] = {}


def register(template: Template) -> Template:
    if template.name in TEMPLATES:
        raise ValueError(f"template {template.name!r} registered twice")
    TEMPLATES[template.name] = template
    return template


def get_template(name: str) -> Template:
    if name not in TEMPLATES:
        raise ValueError(f"unknown template {name!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def template_of(func: tirx.PrimFunc) -> Template:
    """The template that made ``func`` (from its ``stof.spec`` attribute)."""
    if func.attrs is None or SPEC_ATTR not in func.attrs:
        raise ValueError("function has no stof.spec attribute (not made by a template)")
    return get_template(json.loads(str(func.attrs[SPEC_ATTR]))["template"])


@derived_object
class KeepCandidates(ms.postproc.PyPostproc):
    """Drop sampled schedules whose knob combination is not one of the candidates."""

    def __init__(self, template: str, spec: dict, candidates: list[dict]):
        self.template = template
        self.spec = spec
        self.candidates = candidates

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch: s_tir.Schedule) -> bool:
        tmpl = get_template(self.template)
        knobs = tmpl._decode(self.spec, sch.trace, self.candidates)
        return any(all(int(c[k]) == v for k, v in knobs.items()) for c in self.candidates)

    def clone(self):
        return KeepCandidates(self.template, self.spec, self.candidates)


@derived_object
class Finalize(ms.postproc.PyPostproc):
    """Run :func:`.mainloop.finalize` (cooperative copies, pipeline annotations) on a sampled schedule."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch: s_tir.Schedule) -> bool:
        try:
            finalize(sch)
        except (ValueError, s_tir.ScheduleError):
            return False
        return True

    def clone(self):
        return Finalize()
