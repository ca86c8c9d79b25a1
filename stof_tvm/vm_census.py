"""What one forward pass of a compiled module does, counted from its Relax VM bytecode: host instructions, kernel
launches inside and outside CUDA graphs, CUDA graph launches.

The Relax VM runs ``main`` instruction by instruction on the host. Under ``cuda_graph=True`` the build lifts each
static region of kernel launches into a ``*_cuda_graph_capture*`` function that ``main`` hands to
``vm.builtin.cuda_graph.run_or_capture``: captured on the first call, afterwards replayed by one
``cudaGraphLaunch`` without running the function's instructions again; the static buffers come from
``cuda_graph_alloc`` once (``get_cached_alloc``). So after the first call, a call executes ``main``'s own
instructions only: every ``vm.builtin.*`` / ``runtime.*`` instruction is host work (allocation, views, tuple
bookkeeping, shape checks), every other callee is a compiled function (a kernel launch on CUDA), and each
``run_or_capture`` launches its graph's kernels at once.

:func:`vm_census` reads the text of ``Executable.as_python()`` (the compiled executable, or the ``as_python``
function of a loaded ``module.so``): runtime-only, no compiler needed. ``kernels_per_call`` maps a compiled
function's name to the kernels one call of it launches (a PrimFunc can hold several; default 1), as
:func:`stof_tvm.compiler.kernel_grids.kernel_grids` counts them. Control flow in ``main`` (none in the models
compiled here) is counted as if every instruction ran once.
"""
from __future__ import annotations

import collections
import dataclasses
import re

RUN_OR_CAPTURE = "vm.builtin.cuda_graph.run_or_capture"
HOST_PREFIXES = ("vm.builtin.", "runtime.", "vm.")
_FUNCTION = re.compile(r'^with ib\.function\("([^"]+)"')
_CALL = re.compile(r'^\s+ib\.emit_call\("([^"]+)", args=\[(.*)\](?:, dst=.*)?\)\s*$')
_OTHER = re.compile(r"^\s+ib\.emit_(\w+)\(")
_CAPTURED = re.compile(r'ib\.f\("([^"]+)"\)')


def is_host_builtin(callee: str) -> bool:
    """Whether ``callee`` is a VM builtin run on the host (not a compiled kernel)."""
    return callee.startswith(HOST_PREFIXES)


@dataclasses.dataclass
class VMCensus:
    """Per-call figures of ``main`` after the first call (see the module docstring).

    ``host_ops``: main's instructions by callee (builtins) or kind (``ret``, ``goto``, ``if``); ``outside``:
    compiled functions main calls directly, by name, with call counts; ``graphs``: one entry per
    ``run_or_capture`` in main, the name of its capture function; ``captured``: per capture function, its compiled
    functions and call counts (what one replay launches); ``kernels_per_call``: kernels per call of a function."""

    host_ops: collections.Counter
    outside: collections.Counter
    graphs: list
    captured: dict
    kernels_per_call: dict

    def _kernels(self, calls: collections.Counter) -> int:
        return sum(count * self.kernels_per_call.get(name, 1) for name, count in calls.items())

    @property
    def vm_instructions(self) -> int:
        """Instructions main executes per call (every builtin, every launch, every run_or_capture, ret)."""
        return sum(self.host_ops.values()) + sum(self.outside.values()) + len(self.graphs)

    @property
    def graph_launches(self) -> int:
        return len(self.graphs)

    @property
    def kernels_outside_graphs(self) -> int:
        return self._kernels(self.outside)

    @property
    def kernels_in_graphs(self) -> int:
        return sum(self._kernels(self.captured[name]) for name in self.graphs)

    @property
    def kernels(self) -> int:
        """Kernel launches per forward pass, inside and outside graphs."""
        return self.kernels_outside_graphs + self.kernels_in_graphs

    @property
    def distinct_kernels(self) -> int:
        """Distinct compiled functions a forward pass calls (inside graphs or not)."""
        names = set(self.outside)
        for graph in set(self.graphs):
            names |= set(self.captured[graph])
        return len(names)

    def per_function(self) -> collections.Counter:
        """Calls per forward pass of each compiled function, inside and outside graphs."""
        total = collections.Counter(self.outside)
        for graph in self.graphs:
            total.update(self.captured[graph])
        return total

    def summary(self) -> dict:
        """The headline figures as a JSON-ready dict."""
        return {"kernels": self.kernels, "distinct_kernels": self.distinct_kernels,
                "kernels_outside_graphs": self.kernels_outside_graphs, "kernels_in_graphs": self.kernels_in_graphs,
                "graph_launches": self.graph_launches, "vm_instructions": self.vm_instructions,
                "host_builtins": dict(sorted(self.host_ops.items(), key=lambda kv: -kv[1])),
                "outside_graphs": dict(self.outside)}

    def table(self) -> str:
        """A short text summary (what :mod:`scripts.count_launches` prints)."""
        lines = [f"kernel launches per forward: {self.kernels} ({self.distinct_kernels} distinct functions): "
                 f"{self.kernels_in_graphs} in {self.graph_launches} CUDA graph launch(es), "
                 f"{self.kernels_outside_graphs} outside",
                 f"VM instructions per call: {self.vm_instructions}"]
        for name, count in sorted(self.host_ops.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {name:<44} {count:5d}")
        lines.append(f"  {'(kernel launches outside graphs)':<44} {sum(self.outside.values()):5d}")
        lines.append(f"  {'(run_or_capture)':<44} {len(self.graphs):5d}")
        for name, count in sorted(self.outside.items(), key=lambda kv: -kv[1]):
            lines.append(f"    outside: {name:<40} {count:4d}")
        return "\n".join(lines)


def parse_functions(text: str) -> dict[str, list[tuple[str, str]]]:
    """``as_python()`` text -> {function name: [(callee or instruction kind, argument text)]} in order."""
    functions: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        match = _FUNCTION.match(line)
        if match:
            current = functions.setdefault(match.group(1), [])
            continue
        if current is None:
            continue
        call = _CALL.match(line)
        if call:
            current.append((call.group(1), call.group(2)))
            continue
        other = _OTHER.match(line)
        if other:
            current.append((other.group(1), ""))
    return functions


def vm_census(text: str, kernels_per_call: dict | None = None, entry: str = "main") -> VMCensus:
    """Count what a call of ``entry`` does after the first call (see :class:`VMCensus`)."""
    functions = parse_functions(text)
    if entry not in functions:
        raise ValueError(f"entry: no VM function {entry!r} in the executable (has {sorted(functions)[:8]})")
    host_ops, outside, graphs = collections.Counter(), collections.Counter(), []
    for callee, args in functions[entry]:
        if callee == RUN_OR_CAPTURE:
            captured = _CAPTURED.search(args)
            if captured is None:
                raise ValueError(f"run_or_capture without a capture function: {args[:80]}")
            graphs.append(captured.group(1))
        elif callee in ("ret", "goto", "if") or is_host_builtin(callee):
            host_ops[callee] += 1
        else:
            outside[callee] += 1
    captured_calls = {}
    for name in set(graphs):
        captured_calls[name] = collections.Counter(
            callee for callee, _ in functions.get(name, []) if callee not in ("ret", "goto", "if")
            and not is_host_builtin(callee))
    return VMCensus(host_ops, outside, graphs, captured_calls, dict(kernels_per_call or {}))
