"""``stof-tvm bench``: time a compiled artifact on its device (TVM's time_evaluator, inputs prepared once)."""
from __future__ import annotations

import json

import numpy as np

from .mask_arg import HELP as MASK_HELP
from .mask_arg import load_mask_arg


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="time a compiled artifact on its device",
        description="Load an artifact, prepare random valid inputs and the mask's format once, then time the "
                    "module alone with TVM's time_evaluator (warm-up first; median over --repeat runs).")
    parser.add_argument("artifact", metavar="OUT", help="artifact directory written by 'stof-tvm compile'")
    parser.add_argument("--inputs", metavar="X.npz", help="model inputs by name (default: random)")
    parser.add_argument("--mask", metavar="SPEC", help=f"{MASK_HELP}, instead of the compiled default")
    parser.add_argument("--repeat", type=int, default=20, help="timed repetitions (default 20)")
    parser.add_argument("--number", type=int, default=5, help="calls per repetition (default 5)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="also time every kernel call (device synchronised around each) and show where a "
                             "forward pass spends its time")
    parser.set_defaults(func=run)


def run(args) -> int:
    from stof_tvm import runtime

    from .run import model_inputs

    for name in ("repeat", "number"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    model = runtime.load(args.artifact)
    prepared = model.prepare(model_inputs(model, args.inputs), load_mask_arg(args.mask))
    model.run(prepared)                                     # warm-up (and CUDA JIT at first call)
    timer = model.vm.time_evaluator("main", model.device, number=args.number, repeat=args.repeat,
                                    min_repeat_ms=0)
    result = timer(*prepared, *model.params)
    samples = np.array(result.results) * 1e3
    att = model.manifest["attention"]
    report = {"artifact": args.artifact, "kernel": att["kernel"]["kind"], "batch": att["batch"],
              "seq_len": att.get("seq_q"), "dtype": model.manifest["dtype"], "target": model.manifest["target"]["kind"],
              "median_ms": float(np.median(samples)), "min_ms": float(samples.min()),
              "max_ms": float(samples.max()), "repeat": args.repeat, "number": args.number}
    if args.profile:
        from stof_tvm.profiling import profile_calls

        profile = profile_calls(model.vm, model.device, prepared + model.params)
        report["profile"] = profile.rows()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['kernel']} kernel, B={report['batch']} S={report['seq_len']} {report['dtype']} on "
              f"{report['target']}: median {report['median_ms']:.3f} ms (min {report['min_ms']:.3f}, "
              f"max {report['max_ms']:.3f}; {args.repeat} x {args.number} calls)")
        if args.profile:
            print(profile.table())
    return 0
