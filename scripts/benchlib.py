"""Timing, checking and device-kit helpers shared by the benchmark and check scripts in scripts/.

One place for what every measurement needs, so that figures from different scripts mean the same thing:

- **timing**: :func:`time_ms` (CUDA events around back-to-back calls after warm-up, the median of many samples,
  each sample on the next input set of a pool of fresh random inputs; wall clock on the CPU), :func:`graphed`
  (a callable captured in a CUDA graph), :func:`finished` (a hang guard), :func:`trace_kernels` and
  :func:`timeline` (the kernels of back-to-back calls as CUPTI saw them, and the time each exposes, by class);
- **checking**: :func:`poison` (outputs filled with NaN / an impossible integer before a run, so an element a
  kernel never writes cannot pass), :func:`errors` against a float32 reference (max absolute, max relative to the
  reference's largest magnitude, relative Frobenius) and :func:`within`;
- **the hardware limit**: :func:`limit` (useful FLOPs / time against the H200's 790 TFLOP/s, bytes / time against
  its 4.2 TB/s: how far a figure is from what the chip can do);
- **robust runs**: :class:`Budget` (a run's wall-clock allowance, so it stops cleanly inside the device tool's
  10-minute limit), :func:`guarded` (one failing stage is recorded in its row, never fatal), :func:`write_json`
  (atomic: a run cut short leaves the last complete file), :func:`out_dir` ($OUT on the GPU machine);
- **output**: :func:`format_table` / :func:`print_table`, :func:`environment` (device, versions, commit);
- **the CUDA tool chain**: :func:`source_key` (the cubin cache key TVM's compile callback is looked up by),
  :func:`nvcc_cubin` (a cubin and ptxas' register / spill report) and :func:`sass_opcodes` (a cubin's SASS
  instructions, where a cuobjdump is found).

Imports only the standard library and numpy at module level: torch and TVM are imported where a helper needs
them, so the scripts' CPU-side steps (and the tests) load this without either.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# NVIDIA H200 (sm_90, 132 SMs): the dense fp16/bf16 tensor-core rate an 8192^3 matrix product reaches (769-798
# TFLOP/s measured on the lent machines) and the HBM bandwidth a device-to-device copy reaches (~4.3 TB/s).
PEAK_TFLOPS = 790.0
PEAK_TBPS = 4.2


# ------------------------------------------------------------------------------------------------------ timing
@dataclass
class Timing:
    """Milliseconds per call: the median (what scripts report), the spread, and how it was sampled."""

    median_ms: float
    min_ms: float
    max_ms: float
    samples: int
    calls_per_sample: int

    def as_dict(self) -> dict:
        return asdict(self)


def _cycle(fn, inputs):
    """A no-argument callable per sample: ``fn`` itself, or ``fn(*inputs[i])`` for sample ``i`` of the pool."""
    if inputs is None:
        return lambda i: fn
    if not inputs:
        raise ValueError("inputs: expected at least one input set")
    return lambda i: (lambda args=inputs[i % len(inputs)]: fn(*args))


def _clock(device: str):
    """(sync, elapsed) for ``device``: ``elapsed(body)`` runs ``body`` and returns its milliseconds, between CUDA
    events on torch's current stream (``"cuda"``), by the wall clock between device-wide synchronisations
    (``"cuda-wall"``) or by the wall clock (``"cpu"``)."""
    if device not in ("cuda", "cuda-wall", "cpu"):
        raise ValueError(f"device: expected 'cuda', 'cuda-wall' or 'cpu', got {device!r}")
    if device == "cuda":
        import torch

        def elapsed(body) -> float:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            body()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop)

        return torch.cuda.synchronize, elapsed
    if device == "cuda-wall":
        import torch

        sync = torch.cuda.synchronize
    else:
        def sync():
            return None

    def elapsed(body) -> float:
        sync()
        start = time.perf_counter()
        body()
        sync()
        return (time.perf_counter() - start) * 1e3

    return sync, elapsed


def _calls_per_sample(once_ms: float, sample_ms: float) -> int:
    """Back-to-back calls that fill about ``sample_ms`` given one call's ``once_ms`` (1 to 50)."""
    return max(1, min(50, int(sample_ms / max(once_ms, 1e-3))))


def _sample_ms(elapsed, body, number: int) -> float:
    """Milliseconds per call of ``number`` back-to-back calls of ``body``, timed together by ``elapsed``."""
    return elapsed(lambda: [body() for _ in range(number)]) / number


def _timing(times: list[float], number: int) -> Timing:
    return Timing(float(statistics.median(times)), float(min(times)), float(max(times)), len(times), number)


def time_ms(fn, *, device: str = "cuda", inputs=None, warmup: int = 3, samples: int = 20,
            number: int | None = None, sample_ms: float = 5.0, budget_s: float | None = None) -> Timing:
    """Time ``fn`` (no arguments, or ``fn(*inputs[i])`` cycling through a pool of input sets).

    After ``warmup`` calls, each of ``samples`` samples times ``number`` back-to-back calls (``None``: as many as
    fill about ``sample_ms``, 1 to 50) and divides: on ``device="cuda"`` between CUDA events on torch's current
    stream (the GPU's time for the work, also what host overhead adds when the host cannot keep up); on
    ``"cuda-wall"`` by the wall clock between device-wide synchronisations (counts work on any stream, e.g. a
    runtime that launches on its own); on the CPU by the wall clock. Sample ``i`` uses input set
    ``i % len(inputs)``, so repeated calls do not all see one set of values. ``budget_s``: stop sampling after
    this many seconds (at least 3 samples are always taken).
    """
    if warmup < 0 or samples < 1:
        raise ValueError(f"time_ms: expected warmup >= 0 and samples >= 1, got {warmup}, {samples}")
    call = _cycle(fn, inputs)
    sync, elapsed = _clock(device)
    for i in range(warmup):
        call(i)()
    sync()
    if number is None:
        number = _calls_per_sample(elapsed(call(0)), sample_ms)
    started, times = time.perf_counter(), []
    for i in range(samples):
        times.append(_sample_ms(elapsed, call(i), number))
        if budget_s is not None and len(times) >= 3 and time.perf_counter() - started > budget_s:
            break
    return _timing(times, number)


def time_interleaved(cases: dict, *, device: str = "cuda", warmup: int = 3, rounds: int = 30,
                     sample_ms: float = 5.0, budget_s: float | None = None) -> dict:
    """Time several callables against each other: ``cases`` maps a name to ``(fn, inputs)`` (as :func:`time_ms`
    takes them; ``device`` as there). Every round times one sample of each case, back to back, starting one case
    further along each round, so that a drift of the GPU's clocks or temperature over the run reaches every case
    alike (timed one after another, the same module has measured 2-5% apart). Every sample is ``number`` calls, the
    same ``number`` for all (fitting about ``sample_ms`` for the slowest case); returns name -> :class:`Timing` over
    the rounds. ``budget_s``: stop after this many seconds (at least 3 rounds)."""
    if not cases or rounds < 1 or warmup < 0:
        raise ValueError("time_interleaved: expected at least one case, one round and warmup >= 0")
    sync, elapsed = _clock(device)
    names = list(cases)
    calls = {name: _cycle(*cases[name]) for name in names}
    for name in names:
        for i in range(warmup):
            calls[name](i)()
    sync()
    number = _calls_per_sample(max(elapsed(calls[name](0)) for name in names), sample_ms)
    times = {name: [] for name in names}
    started = time.perf_counter()
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            times[name].append(_sample_ms(elapsed, calls[name](r), number))
        if budget_s is not None and r >= 2 and time.perf_counter() - started > budget_s:
            break
    return {name: _timing(t, number) for name, t in times.items()}


def graphed(fn, warmup: int = 3):
    """``fn`` (no arguments) captured once in a torch CUDA graph; returns ``(replay, outputs)``: ``replay()``
    reruns the captured kernels with no launch overhead and refills ``outputs`` (what the captured call
    returned) in place. The warm-up runs on a side stream, as capture requires."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph.replay, outputs


def finished(seconds: float) -> bool:
    """Whether the GPU work queued so far finishes within ``seconds`` (a kernel that hangs would block a plain
    synchronize forever: the caller reports it and exits instead)."""
    import torch

    done = torch.cuda.Event()
    done.record()
    deadline = time.time() + seconds
    while not done.query():
        if time.time() > deadline:
            return False
        time.sleep(0.001)
    return True


# ---------------------------------------------------------------------------------------------- kernel timeline
def trace_kernels(fn, inputs, calls: int) -> list[dict]:
    """The GPU kernels of ``calls`` back-to-back calls of ``fn`` (cycling the input sets ``inputs``, as
    :func:`time_ms` does), as CUPTI recorded them through torch.profiler: one ``{"name", "start", "end"}`` (us) per
    kernel, in launch order. CUPTI sees every kernel of the process, TVM's and those CUDA graphs replay included,
    with the times they ran in place (programmatic dependent launches overlapping): what the synchronised per-call
    profile cannot show."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    call = _cycle(fn, inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            call(i)()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return kernel_events(json.loads(path.read_text()))


def kernel_events(trace: dict) -> list[dict]:
    """The kernel records of a Chrome trace (torch.profiler's export), in launch order (start time)."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(({"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"])}
                   for e in kernels), key=lambda e: e["start"])


def exposed_us(events: list[dict]) -> list[tuple[float, float]]:
    """Per kernel, ``(exposed, idle)`` in us: how far it moves the end of the work past every kernel launched before
    it, and the part of that when the GPU ran none of them (a gap before its start: launch latency, host work).
    Kernels overlap under dependent launches (one starts, and waits, before the one before ends), so their own
    durations add up to more than the calls take; the exposed times add up to the span from the first start to
    the last end."""
    shares, horizon = [], events[0]["start"] if events else 0.0
    for event in events:
        shares.append((max(0.0, event["end"] - horizon), max(0.0, event["start"] - horizon)))
        horizon = max(horizon, event["end"])
    return shares


def timeline(events: list[dict], calls: int, classify) -> dict:
    """``events`` (:func:`trace_kernels` of ``calls`` calls) per call: kernels, the device span (the exposed times'
    sum, us), the idle part of it, the kernels' own durations summed (more than the span where they overlap), and
    the exposed time by kernel class (``classify(name) -> str``) and by kernel, largest first.
    ValueError unless every call launched the same number of kernels."""
    if calls < 1 or not events or len(events) % calls:
        raise ValueError(f"timeline: {len(events)} kernels do not split into {calls} calls")
    shares = exposed_us(events)
    per_class: dict[str, list] = {}
    per_kernel: dict[str, list] = {}
    for event, (us, _) in zip(events, shares):
        for table, key in ((per_class, classify(event["name"])), (per_kernel, event["name"])):
            entry = table.setdefault(key, [0.0, 0])
            entry[0] += us / calls
            entry[1] += 1
    span = sum(us for us, _ in shares) / calls

    def rows(table, label):
        return [{label: key, "us": us, "kernels": count / calls, "share": us / span if span else 0.0}
                for key, (us, count) in sorted(table.items(), key=lambda kv: -kv[1][0])]

    return {"calls": calls, "kernels_per_call": len(events) // calls, "span_us": span,
            "idle_us": sum(idle for _, idle in shares) / calls,
            "kernel_us": sum(e["end"] - e["start"] for e in events) / calls,
            "classes": rows(per_class, "class"), "kernels": rows(per_kernel, "kernel")}


def random_token_ids(rng: np.random.Generator, batch: int, seq_len: int, vocab: int) -> np.ndarray:
    """Token ids drawn uniformly from ``[0, vocab)``, int64 ``[batch, seq_len]``."""
    return rng.integers(0, vocab, (batch, seq_len), dtype=np.int64)


# ---------------------------------------------------------------------------------------------------- checking
def poison(value):
    """Fill ``value`` (a torch tensor or numpy array) in place with NaN, or for integers with their dtype's
    minimum, and return it: a result buffer poisoned before a run shows every element the run never wrote."""
    if hasattr(value, "fill_"):
        import torch

        fill = float("nan") if value.is_floating_point() else torch.iinfo(value.dtype).min
        return value.fill_(fill)
    array = np.asarray(value)
    array.fill(np.nan if array.dtype.kind in "fc" else np.iinfo(array.dtype).min)
    return array


def as_float64(value) -> np.ndarray:
    """A float64 numpy copy of a numpy array, torch tensor (any device or dtype) or TVM tensor."""
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().numpy()
    elif hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    return np.asarray(value, dtype=np.float64)


def errors(out, ref) -> dict:
    """How far ``out`` is from the reference ``ref`` (float32 or better): ``max_abs``, ``max_rel`` (max
    absolute error over the reference's largest magnitude), ``rel`` (relative Frobenius norm, the figure the
    benchmarks check), and ``nonfinite`` (elements of ``out`` that are NaN or infinite). A shape mismatch
    raises."""
    out, ref = as_float64(out), as_float64(ref)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {list(out.shape)} differs from the reference's {list(ref.shape)}")
    nonfinite = int(out.size - np.isfinite(out).sum())
    if nonfinite:
        return {"max_abs": math.inf, "max_rel": math.inf, "rel": math.inf, "nonfinite": nonfinite}
    diff = np.abs(out - ref)
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    norm = float(np.linalg.norm(ref))
    max_abs = float(diff.max()) if diff.size else 0.0
    return {"max_abs": max_abs, "max_rel": max_abs / scale if scale else max_abs,
            "rel": float(np.linalg.norm(diff)) / norm if norm else max_abs, "nonfinite": 0}


def within(errs: dict, tolerance: float) -> bool:
    """Whether :func:`errors`' result passes: every element finite and the relative error at most ``tolerance``."""
    return errs["nonfinite"] == 0 and errs["rel"] <= tolerance


# ---------------------------------------------------------------------------------------------- hardware limit
def limit(ms: float, flops: float = 0.0, bytes_moved: float = 0.0, peak_tflops: float = PEAK_TFLOPS,
          peak_tbps: float = PEAK_TBPS) -> dict:
    """Where a measured ``ms`` stands against the chip: ``tflops`` and ``tbps`` achieved (useful FLOPs and the
    least bytes the work must move, over the time), ``limit_ms`` (the longer of the compute and memory floors)
    and ``fraction`` = limit_ms / ms (1.0 = at the physical limit)."""
    if ms <= 0:
        raise ValueError(f"ms: expected a positive time, got {ms}")
    floor_ms = max(flops / (peak_tflops * 1e12), bytes_moved / (peak_tbps * 1e12)) * 1e3
    return {"tflops": flops / ms * 1e-9, "tbps": bytes_moved / ms * 1e-9, "limit_ms": floor_ms,
            "fraction": floor_ms / ms}


# ------------------------------------------------------------------------------------------------ robust runs
class Budget:
    """A run's wall-clock allowance: scripts check :meth:`allows` before each stage and stop cleanly (writing
    what finished) instead of being killed at the device tool's limit."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.started = time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.seconds - self.used()

    def allows(self, estimate_s: float = 0.0) -> bool:
        """Whether a stage expected to take ``estimate_s`` seconds still fits."""
        return self.left() > estimate_s


def guarded(row: dict, label: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None when it raises: the error goes into ``row[label + "_failed"]`` (type and
    message, 400 characters) and is printed with the last frames of its traceback, so one failing stage costs
    only its own result."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:      # noqa: BLE001 - any failure of one stage is a result to report
        row[label + "_failed"] = f"{type(err).__name__}: {err}"[:400]
        frames = traceback.format_exception(type(err), err, err.__traceback__)
        print(f"  {label} failed: {row[label + '_failed']}\n    " + "    ".join(frames[-3:]).rstrip(), flush=True)
        return None


def out_dir(default: str = "out") -> Path:
    """Where results go: ``$OUT`` (set by the device tool on the GPU machine) or ``default``; created."""
    path = Path(os.environ.get("OUT") or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path, payload) -> Path:
    """Write ``payload`` as indented JSON atomically (a temporary file renamed over ``path``), so a run killed
    while writing still leaves the previous complete file. Non-JSON values (numpy scalars, paths) become
    numbers or strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_json_default))
    os.replace(tmp, path)
    return path


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


# ------------------------------------------------------------------------------------------------------ output
def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    return format(value, fmt)


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain-text table: ``columns`` are ``(key, header, format)``; missing or NaN cells print as ``-``;
    strings print as they are; each column as wide as its widest cell, numbers right-aligned."""
    cells = [[_cell(row.get(key), fmt) for key, _, fmt in columns] for row in rows]
    widths = [max([len(header)] + [len(r[i]) for r in cells]) for i, (_, header, _) in enumerate(columns)]
    numeric = [any(isinstance(row.get(key), (int, float)) for row in rows) for key, _, _ in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line([h for _, h, _ in columns]), line(["-" * w for w in widths])] + [line(r) for r in cells])


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], title: str | None = None) -> None:
    if title:
        print(f"\n{title}")
    print(format_table(rows, columns), flush=True)


def environment() -> dict:
    """What a result was measured with: date, host, Python, the git commit of this checkout (when there is a
    .git), and the GPU and library versions that are importable (nothing is imported that is not already)."""
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": sys.version.split()[0]}
    root = Path(__file__).resolve().parent.parent
    try:
        info["commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    for name in ("torch", "tvm", "onnxruntime", "transformers", "onnx"):
        module = sys.modules.get(name)
        if module is not None:
            info[name] = getattr(module, "__version__", "?")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# ---------------------------------------------------------------------------------------------- CUDA tool chain
def source_key(src: str) -> str:
    """The key a CUDA source's cubin is stored under: the first 24 hex digits of its SHA-256."""
    return hashlib.sha256(src.encode()).hexdigest()[:24]


class PrebuiltCubins:
    """TVM's CUDA compile callback answered from a folder of cubins named ``<source_key>.cubin`` (what the scripts'
    ``build`` steps wrote with nvcc here); a source without one goes to the callback registered before (NVRTC or
    nvcc on the GPU machine). ``hits`` counts the cubins served, ``misses`` lists the source keys compiled there
    instead (a miss means the run did not time the prebuilt binary)."""

    def __init__(self, folder):
        import tvm_ffi

        self.folder = Path(folder)
        self.hits = 0
        self.misses: list[str] = []
        self._previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", self._compile_or_serve, override=True)

    def _compile_or_serve(self, code, *rest):
        key = source_key(code)
        cubin = self.folder / f"{key}.cubin"
        if cubin.exists():
            self.hits += 1
            return bytearray(cubin.read_bytes())
        self.misses.append(key)
        if self._previous is None:
            raise RuntimeError(f"no prebuilt cubin {cubin} and no CUDA compile callback to build it")
        return self._previous(code, *rest)


def ptxas_report(text: str) -> dict:
    """Registers, spill stores / loads and stack frame (bytes) from ``nvcc -Xptxas -v`` output, over every kernel
    reported (a module may hold several, e.g. split-KV attention's tile-row and merge kernels): the most
    registers, the spill and stack bytes summed; None for a figure the text does not give."""
    def values(pattern, group=1):
        return [int(found.group(group)) for found in re.finditer(pattern, text)]

    spills = r"(\d+) bytes spill stores, (\d+) bytes spill loads"
    registers, stores, loads = values(r"Used (\d+) registers"), values(spills, 1), values(spills, 2)
    stacks = values(r"(\d+) bytes stack frame")
    return {"registers": max(registers) if registers else None, "spill_stores": sum(stores) if stores else None,
            "spill_loads": sum(loads) if loads else None, "stack_frame": sum(stacks) if stacks else None}


def nvcc_cubin(src: str, cubin: Path, arch: str = "sm_90", *, fast_math: bool = False, gencode: bool = False,
               nvcc: str = "nvcc") -> dict:
    """Compile CUDA source ``src`` into ``cubin`` with ``nvcc -cubin -O3 -Xptxas -v``; returns
    :func:`ptxas_report`'s figures plus ``cubin`` (the file name). ``fast_math`` adds ``--use_fast_math`` (TVM's
    own nvcc flags); ``gencode`` names the architecture as ``-gencode=arch=compute_X,code=sm_X`` (needed for
    ``sm_90a``: the ``-arch`` shorthand also runs a plain sm_90 pass) instead of ``-arch=``."""
    cubin = Path(cubin)
    cu = cubin.with_suffix(".cu")
    cu.write_text(src)
    digits = arch.removeprefix("sm_")
    flags = [f"-gencode=arch=compute_{digits},code=sm_{digits}"] if gencode else [f"-arch={arch}"]
    flags += ["-cubin", "-O3"] + (["--use_fast_math"] if fast_math else []) + ["-Xptxas", "-v"]
    try:
        proc = subprocess.run([nvcc, *flags, "-o", str(cubin), str(cu)], capture_output=True, text=True)
    finally:
        cu.unlink(missing_ok=True)
    text = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"nvcc failed for {cubin.name}:\n{text[-3000:]}")
    return {**ptxas_report(text), "cubin": cubin.name}


def sass_opcodes(cubin) -> list[str] | None:
    """The opcodes (with their modifiers, e.g. ``UTMALDG.2D``, ``HGMMA.64x192x16.F32``; predicates and NOPs left
    out) of ``cubin``'s SASS in order, by the first cuobjdump found ($STOF_CUOBJDUMP, PATH, the CUDA toolkit);
    None without one."""
    import shutil

    tool = next((c for c in (os.environ.get("STOF_CUOBJDUMP"), shutil.which("cuobjdump"),
                             "/usr/local/cuda/bin/cuobjdump") if c and Path(c).is_file()), None)
    if tool is None:
        return None
    text = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, flags=re.M)
    return [op for op in ops if op != "NOP"]
