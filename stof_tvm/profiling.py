"""Per-kernel time of a loaded artifact: where a forward pass spends its time.

TVM 0.27's Relax VM has no profiler in its runtime, but it calls an instrument function before and after
every call instruction. :func:`profile_calls` uses that hook: it synchronises the device on both sides of each
call and charges the wall time in between, less the time of calls nested inside it (a Relax subfunction's own
kernels), to the callee's symbol. Synchronising serialises the GPU and adds a
few microseconds per call, so the sum exceeds the module's real time on launch-bound shapes; on large shapes
the shares are the kernels' own times. Runtime-only (``tvm.runtime``), so it works where artifacts are run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# tvm.runtime.vm.VMInstrumentReturnKind.NO_OP: the VM carries on with the call as usual
_CONTINUE = 0


@dataclass
class CallProfile:
    """Wall time per callee symbol over ``runs`` forward passes (seconds, summed over the runs)."""

    runs: int
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def total_ms(self) -> float:
        """Sum over every call of one forward pass, in milliseconds."""
        return sum(self.seconds.values()) * 1e3 / self.runs

    def rows(self) -> list[dict]:
        """One row per symbol, the most expensive first: ms per forward, calls per forward, share of the total."""
        total = sum(self.seconds.values()) or 1.0
        order = sorted(self.seconds, key=self.seconds.get, reverse=True)
        return [{"symbol": name, "ms": self.seconds[name] * 1e3 / self.runs,
                 "calls": self.calls[name] // self.runs, "share": self.seconds[name] / total} for name in order]

    def table(self, top: int = 15) -> str:
        """A short text table of the ``top`` symbols and the rest folded into one line."""
        rows = self.rows()
        lines = [f"{'callee':<48} {'ms/fwd':>8} {'calls':>6} {'share':>6}"]
        for row in rows[:top]:
            lines.append(f"{row['symbol'][:48]:<48} {row['ms']:8.3f} {row['calls']:6d} {row['share']:6.1%}")
        rest = rows[top:]
        if rest:
            lines.append(f"{'(%d more)' % len(rest):<48} {sum(r['ms'] for r in rest):8.3f} "
                         f"{sum(r['calls'] for r in rest):6d} {sum(r['share'] for r in rest):6.1%}")
        lines.append(f"{'total (synchronised calls)':<48} {self.total_ms:8.3f}")
        return "\n".join(lines)


def profile_calls(vm, device, args: list, runs: int = 3, warmup: int = 1) -> CallProfile:
    """Run ``vm["main"](*args)`` ``warmup + runs`` times, timing each call instruction of the timed runs.

    ``vm`` is a :class:`tvm.runtime.vm.VirtualMachine`; ``args`` every argument of ``main`` (inputs, mask
    arrays and weights, as :meth:`stof_tvm.runtime.CompiledModel.prepare` and ``params`` give them).
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"runs: expected >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    for _ in range(warmup):
        vm["main"](*args)
    device.sync()
    profile = CallProfile(runs=runs)
    open_calls: list[list[float]] = []     # [start time, time spent in nested calls] per call in progress

    def instrument(func, symbol, before_run, ret_value, *call_args):
        device.sync()
        if before_run:
            open_calls.append([time.perf_counter(), 0.0])
            return _CONTINUE
        start, nested = open_calls.pop()
        elapsed = time.perf_counter() - start
        if open_calls:
            open_calls[-1][1] += elapsed
        profile.seconds[symbol] = profile.seconds.get(symbol, 0.0) + elapsed - nested
        profile.calls[symbol] = profile.calls.get(symbol, 0) + 1
        return _CONTINUE

    vm.set_instrument(instrument)
    try:
        for _ in range(runs):
            vm["main"](*args)
    finally:
        vm.set_instrument(None)
    return profile


def profile_artifact(model, prepared: list, label: str, row: dict, top: int = 25) -> CallProfile:
    """Profile a loaded artifact (:class:`stof_tvm.runtime.CompiledModel`) on ``prepared`` inputs for a benchmark
    script: its ``top`` rows go into ``row[label + "_profile"]`` and the table is printed."""
    profile = profile_calls(model.vm, model.device, prepared + model.params)
    row[label + "_profile"] = profile.rows()[:top]
    print(f"  {label} per call (device synchronised around each):\n{profile.table()}", flush=True)
    return profile
