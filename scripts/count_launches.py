"""Launch census of a compiled model: what one forward pass launches and how much host work the VM does per call.

Per row (``MODEL:BxS``, models of ``scripts/e2e_models.py``): export the Hugging Face model with torch.onnx (cached
in ``--onnx-dir``), compile it as the benchmark does (cuda sm_90 fp16, BigBird, CUDA graphs, templates and wgmma
where nvcc is found; no GPU needed), then count from the executable and the scheduled module
(:mod:`stof_tvm.vm_census`, :mod:`stof_tvm.compiler.kernel_grids`):

- kernel launches per forward (total, distinct functions, inside CUDA graphs / outside), CUDA graph launches;
- the VM instructions ``main`` runs per call, by builtin (alloc_tensor, null_value, reshape, views, ...);
- per compiled function: calls per forward, kernels per call, grid blocks, threads per block, the share of the
  H200's 132 SMs its grid occupies, the most loop iterations one thread runs (``steps``: thousands mean a
  kernel whose threads each walk a whole tensor), and the analytical model's predicted time where the function is
  a fusion template call (the manifest's stage ``seconds``).

A short table per row is printed; ``--out FILE`` writes the JSON. On this CPU (2 cores) a base-size row takes
about a minute, most of it the build. Example:

    .venv/bin/python scripts/count_launches.py --rows roberta-base:1x128 roberta-base:8x512 --out out/census.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

SM_COUNT = 132      # H200


def parse_row(text: str) -> tuple[str, int, int]:
    name, _, shape = text.partition(":")
    batch, _, length = shape.partition("x")
    if not (name and batch.isdigit() and length.isdigit()):
        raise argparse.ArgumentTypeError(f"expected MODEL:BxS (e.g. roberta-base:1x128), got {text!r}")
    return name, int(batch), int(length)


def exported(name: str, batch: int, length: int, onnx_dir: Path, seed: int = 0) -> Path:
    """The model's ONNX export at this shape (TorchScript exporter, opset 17), made once per shape."""
    import e2e_models

    path = onnx_dir / f"{name}_{batch}x{length}.onnx"
    if not path.exists():
        spec = e2e_models.spec(name)
        length = e2e_models.seq_len(spec, length)
        model = e2e_models.build(spec, "eager", seed=seed, length=length)
        onnx_dir.mkdir(parents=True, exist_ok=True)
        e2e_models.export(model, e2e_models.inputs(spec, batch, length, seed), str(path))
    return path


def template_seconds(template_entry: dict) -> dict[str, float]:
    """{function symbol prefix: predicted seconds per call} of every template stage the manifest lists."""
    out = {}
    for site in (template_entry or {}).get("sites", []):
        for stage in site["stages"]:
            if stage.get("seconds") is not None:
                label = "_".join(f"{k}{v}" for k, v in stage["shape"].items())
                out[f"stof_{stage['template']}_{label}"] = float(stage["seconds"])
    return out


def predicted(symbol: str, seconds: dict[str, float]) -> float | None:
    matches = [prefix for prefix in seconds if symbol == prefix or symbol.startswith(prefix + "_")]
    return seconds[max(matches, key=len)] if matches else None


def census_row(onnx_path: Path, batch: int, length: int, args) -> dict:
    """Compile one model (as ``stof_tvm.compile`` does) and count; returns the row's JSON."""
    from stof_tvm.compiler import front_end, lower
    from stof_tvm.compiler.kernel_grids import kernel_grids, sm_share
    from stof_tvm.vm_census import vm_census

    start = time.time()
    front = front_end(str(onnx_path), mask=args.mask, batch=batch, seq_len=length, target=args.target,
                      dtype=args.dtype, gemm=args.gemm, **args.options)
    optimized, executable = lower(front, None, args.cuda_graph)
    compile_s = time.time() - start
    grids = kernel_grids(optimized)
    counts = {name: max(1, len(kernels)) for name, kernels in grids.items()}
    census = vm_census(executable.as_python(), counts)
    seconds = template_seconds(front.template_entry)
    functions = []
    for name, calls in sorted(census.per_function().items(), key=lambda kv: -kv[1]):
        kernels = grids.get(name, [])
        first = kernels[0] if kernels else None
        functions.append({
            "function": name, "calls": calls, "kernels_per_call": max(1, len(kernels)),
            "in_graph": name not in census.outside,
            "blocks": first.blocks if first else None, "threads": first.threads if first else None,
            "sm_share": sm_share(first, SM_COUNT) if first else None,
            "serial_steps": max((k.serial_steps for k in kernels), default=None),
            "grids": [k.to_json() for k in kernels], "predicted_us": _us(predicted(name, seconds))})
    total_predicted = sum(f["predicted_us"] * f["calls"] for f in functions if f["predicted_us"] is not None)
    return {"compile_s": round(compile_s, 1), "census": census.summary(), "functions": functions,
            "predicted_template_us": round(total_predicted, 1), "text": census.table(),
            "kernel_choice": front.choice.to_json() if front.choice else None}


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e6, 2)


def print_row(label: str, row: dict) -> None:
    print(f"== {label} (compiled in {row['compile_s']} s)\n{row['text']}")
    print(f"  {'function':<58} {'calls':>5} {'k/call':>6} {'blocks':>6} {'thr':>5} {'SMs':>5} {'steps':>6} "
          f"{'pred us':>8} graph")
    for f in row["functions"]:
        share = "-" if f["sm_share"] is None else f"{f['sm_share']:.2f}"
        pred = "-" if f["predicted_us"] is None else f"{f['predicted_us']:.1f}"
        print(f"  {f['function'][:58]:<58} {f['calls']:5d} {f['kernels_per_call']:6d} {str(f['blocks']):>6} "
              f"{str(f['threads']):>5} {share:>5} {str(f['serial_steps']):>6} {pred:>8} "
              f"{'yes' if f['in_graph'] else 'no'}")
    print(f"  predicted template time per forward (analytical model, H200): {row['predicted_template_us']} us",
          flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", type=parse_row, required=True, metavar="MODEL:BxS")
    p.add_argument("--mask", default="bigbird")
    p.add_argument("--target", default="cuda", choices=("cuda", "llvm"))
    p.add_argument("--dtype", default="float16")
    p.add_argument("--gemm", default="auto")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    p.add_argument("--options", type=json.loads, default={}, metavar="JSON",
                   help='front-end compile options, e.g. \'{"gated_epilogue": true}\'')
    p.add_argument("--onnx-dir", type=Path, default=ROOT / "out" / "onnx")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.target != "cuda":
        args.cuda_graph = False
    results = []
    for name, batch, length in args.rows:
        onnx_path = exported(name, batch, length, args.onnx_dir)
        row = census_row(onnx_path, batch, length, args)
        print_row(f"{name} {batch}x{length}", row)
        results.append({"model": name, "batch": batch, "seq_len": length, **row})
    if args.out is not None:
        os.makedirs(args.out.parent, exist_ok=True)
        args.out.write_text(json.dumps({"rows": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
