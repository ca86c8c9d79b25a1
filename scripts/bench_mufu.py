"""How fast the H200's MUFU pipe computes base-2 exponentials in float32 and in packed half precision.

The attention kernels spend about as many cycles on ``ex2`` (MUFU) as on their products at head dim 64
(scripts/NOTES_attention_wgmma.md). P is packed to fp16 / bf16 for the P V product anyway, so packed exponentials
(``ex2.approx.f16x2``, ``ex2.approx.ftz.bf16x2``) would pay only if the hardware ran them faster per element.
nvcc 13 for sm_90a turns each packed instruction into two ``MUFU.EX2.F16`` / ``.BF16`` (printed by ``build``), so
the question is whether those issue faster than ``MUFU.EX2`` on float32: ``run`` times the three forms.

Each thread runs eight independent chains ``x <- 2^(-x)`` (they converge to 0.6412, the root of x = 2^-x, which
``run`` checks in every output), enough warps on every SM to keep the pipe busy.

    .venv/bin/python scripts/bench_mufu.py build --out out/mufu         # here: nvcc, SASS opcode counts
    python3 scripts/bench_mufu.py run --out out/mufu --json $OUT/mufu.json   # GPU machine (torch only)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

CHAINS = 8
THREADS = 256
BLOCKS_PER_SM = 8
FIXED_POINT = 0.641185744504986     # x = 2^-x
# kernel name -> (exponentials per instruction, C type of a chain, its start from v (a float in 0 .. 0.1), one step
# of chain k, its value as a float)
FORMS = {
    "ex2_f32": (1, "float", "v",
                'asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(x[k]) : "f"(-x[k]));', "x[k]"),
    "ex2_f16x2": (2, "__half2", "__floats2half2_rn(v, 2.0f * v)",
                  'asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(*(unsigned*)&x[k]) : '
                  '"r"(*(unsigned*)&neg));', "__low2float(x[k]) + __high2float(x[k])"),
    "ex2_bf16x2": (2, "__nv_bfloat162", "__floats2bfloat162_rn(v, 2.0f * v)",
                   'asm volatile("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(*(unsigned*)&x[k]) : '
                   '"r"(*(unsigned*)&neg));', "__low2float(x[k]) + __high2float(x[k])"),
}


def kernel_source() -> str:
    """One CUDA file with a kernel per form: ``out[thread]`` = the sum of its chains' last values (a sum of
    ``CHAINS`` values, twice that for the packed forms, each near :data:`FIXED_POINT`)."""
    parts = ["#include <cuda_fp16.h>", "#include <cuda_bf16.h>"]
    for name, (_, ctype, start, step, to_float) in FORMS.items():
        negate = "" if ctype == "float" else f"{ctype} neg = __hneg2(x[k]); "
        parts.append(f"""
extern "C" __global__ void __launch_bounds__({THREADS}) {name}(float* out, int iters) {{
  {ctype} x[{CHAINS}];
  #pragma unroll
  for (int k = 0; k < {CHAINS}; ++k) {{ float v = (float)(threadIdx.x % 97 + k) * 1e-3f; x[k] = {start}; }}
  for (int i = 0; i < iters; ++i) {{
    #pragma unroll
    for (int k = 0; k < {CHAINS}; ++k) {{ {negate}{step} }}
  }}
  float s = 0.0f;
  #pragma unroll
  for (int k = 0; k < {CHAINS}; ++k) s += {to_float};
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}}""")
    return "\n".join(parts) + "\n"


def build(args) -> None:
    """The cubin (sm_90a) and, per kernel, its MUFU instructions by opcode (from cuobjdump, where one is found)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = bl.nvcc_cubin(kernel_source(), out / "mufu.cubin", "sm_90a", gencode=True)
    ops = bl.sass_opcodes(out / "mufu.cubin")
    mufu = dict(Counter(op for op in ops if op.startswith("MUFU"))) if ops is not None else None
    manifest = {"forms": list(FORMS), "ptxas": report, "mufu_opcodes_all_kernels": mufu}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"built {out / 'mufu.cubin'}: {report['registers']} registers at most, spills {report['spill_stores']}; "
          f"MUFU opcodes over the {len(FORMS)} kernels: {mufu}")


class DriverModule:
    """A cubin loaded through the CUDA driver (ctypes, libcuda) into torch's current context, its kernels launched
    on torch's current stream."""

    def __init__(self, image: bytes):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self._image = ctypes.create_string_buffer(image, len(image))   # kept alive with the module
        self.module = ctypes.c_void_p()
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), self._image), "cuModuleLoadData")

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUresult {result}")

    def launch(self, name: str, grid: int, block: int, out_ptr: int, iters: int, stream: int) -> None:
        function = ctypes.c_void_p()
        self._check(self.cuda.cuModuleGetFunction(ctypes.byref(function), self.module, name.encode()),
                    f"cuModuleGetFunction({name})")
        arg_out, arg_iters = ctypes.c_uint64(out_ptr), ctypes.c_int32(iters)
        params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(arg_out), ctypes.c_void_p),
                                       ctypes.cast(ctypes.byref(arg_iters), ctypes.c_void_p))
        self._check(self.cuda.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, ctypes.c_void_p(stream), params,
                                             None), f"cuLaunchKernel({name})")


def run(args) -> None:
    import numpy as np
    import torch

    torch.cuda.init()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * BLOCKS_PER_SM
    out = torch.empty(grid * THREADS, device="cuda", dtype=torch.float32)
    module = DriverModule((Path(args.out) / "mufu.cubin").read_bytes())
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for name, (per_instruction, *_rest) in FORMS.items():
        def launch(iters=args.iters, name=name):
            module.launch(name, grid, THREADS, out.data_ptr(), iters, stream)

        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        values = out.cpu().numpy() / (CHAINS * per_instruction)
        error = float(np.max(np.abs(values - FIXED_POINT)))
        timing = bl.time_ms(launch, warmup=3, samples=args.samples)
        elements = grid * THREADS * CHAINS * args.iters * per_instruction
        rows.append({"form": name, "ms": timing.median_ms, "g_exp_per_s": elements / timing.median_ms / 1e6,
                     "per_sm_ns": elements / timing.median_ms / 1e6 / sms, "max_error": error,
                     "ok": bool(error < 5e-3)})
    base = rows[0]["g_exp_per_s"]
    for row in rows:
        row["vs_f32"] = row["g_exp_per_s"] / base
    bl.print_table(rows, [("form", "form", "s"), ("ms", "ms", ".3f"), ("g_exp_per_s", "G exp/s", ".0f"),
                          ("per_sm_ns", "exp/ns an SM", ".1f"), ("vs_f32", "vs f32", ".2f"),
                          ("max_error", "|x - 0.6412|", ".1e"), ("ok", "ok", "")],
                   title=f"MUFU exponentials, {grid} blocks x {THREADS} threads x {CHAINS} chains x {args.iters}")
    if args.json:
        bl.write_json(args.json, {"environment": bl.environment(), "sms": sms, "rows": rows})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="compile the kernels (here)")
    b.add_argument("--out", default="out/mufu")
    r = sub.add_parser("run", help="time them (GPU machine)")
    r.add_argument("--out", default="out/mufu")
    r.add_argument("--iters", type=int, default=4096)
    r.add_argument("--samples", type=int, default=20)
    r.add_argument("--json")
    args = parser.parse_args(argv)
    (build if args.step == "build" else run)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
