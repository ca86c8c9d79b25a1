"""``stof-tvm tune``: two-stage tuning (analytical model, then MetaSchedule) into a reusable database."""
from __future__ import annotations

import argparse
import json
import sys

from stof_tvm.models import BUILTIN


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tune", help="tune a model, a template call or an attention problem into a MetaSchedule database",
        description="Stage 1: the analytical model ranks every kernel configuration (attention kernel kind and "
                    "tiles; template knobs) and keeps the top K of each job. Stage 2: MetaSchedule measures "
                    "them (XGBoost-guided) and records every measurement in the database directory, which "
                    "later compiles reuse. Tasks already complete there are never measured again; Ctrl-C stops "
                    "after the batch in flight and keeps every record, and running the same command again "
                    "resumes. With neither --model nor --template, tunes one attention problem.")
    job = parser.add_mutually_exclusive_group()
    job.add_argument("--model", metavar="NAME|MODEL.onnx",
                     help=f"a built-in model ({', '.join(sorted(BUILTIN))}) or an ONNX file")
    job.add_argument("--template", metavar="NAME", help="one fusion template (see schedules/templates)")
    parser.add_argument("--shape", metavar="K=V,...", help="template shape, e.g. m=4096,n=3072,k=768")
    parser.add_argument("--mask", default="causal", metavar="SPEC",
                        help="attention mask spec or a .npy boolean array (default causal)")
    parser.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    parser.add_argument("--seq-len", type=int, default=128, help="sequence length S (default 128)")
    parser.add_argument("--heads", type=int, default=12, help="heads, for one attention problem (default 12)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim, for one attention problem (default 64)")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                        help="compute dtype (default float16; for --model on llvm float32, as for compile)")
    parser.add_argument("--kernel", default="auto", choices=["auto", "block", "row", "dense"],
                        help="--model: the attention kernel, as for compile (default auto)")
    parser.add_argument("--target", default="cuda", choices=["cuda", "llvm"], help="default cuda")
    parser.add_argument("--arch", default="sm_90", help="CUDA architecture (default sm_90)")
    parser.add_argument("--gemm", default="auto", choices=["auto", "mma", "wgmma"],
                        help="--model: the templates' GEMM kernel, as for compile (default auto: wgmma on sm_90 "
                             "with nvcc)")
    parser.add_argument("--templates", action=argparse.BooleanOptionalAction, default=None,
                        help="--model: tune the fusion-template calls compile makes (default, as for compile: on "
                             "for cuda float16)")
    parser.add_argument("--trials", type=int, help="at most this many measurements per task (default: all "
                                                   "stage-1 survivors)")
    parser.add_argument("--top-k", type=int, default=8, help="stage-1 survivors per job (default 8)")
    parser.add_argument("--kernels", default="block,row", help="attention kernel kinds to consider "
                                                               "(default block,row)")
    parser.add_argument("--database", default="stof-tuning", metavar="DIR",
                        help="tuning work directory (MetaSchedule JSON database; default ./stof-tuning)")
    parser.add_argument("--time-budget", type=float, metavar="SECONDS", help="stop measuring after this long")
    parser.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on the devices of this RPC tracker")
    parser.add_argument("--rpc-key", metavar="KEY", help="device key the RPC servers registered with")
    parser.add_argument("--build-workers", type=int, help="parallel candidate builds (default: CPU cores)")
    parser.add_argument("--hardware", metavar="NAME", help="hardware profile for the model: detect, h200, h100, "
                                                           "a100, rtx4090 (default: the target's)")
    parser.add_argument("--calibration", metavar="FILE", help="model constants from scripts/calibrate_model.py")
    parser.add_argument("--explain", action="store_true", help="print the model's ranking and terms per job")
    parser.add_argument("--dry-run", action="store_true", help="stage 1 only: plan, print, measure nothing")
    parser.add_argument("--whole-model-check", action=argparse.BooleanOptionalAction, default=True,
                        help="--model on cuda: after stage 2, compile the model without and with the records, time "
                             "both forward passes on this machine's GPU and veto the records if they made it slower "
                             "(default on; not over RPC)")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                        help="--model on cuda: stage 3 compiles as 'compile --cuda-graph' does, the fast form "
                             "(default on; --no-cuda-graph to judge the records as a compile without graphs runs)")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.set_defaults(func=run)


def _parse_shape(text: str | None) -> dict | None:
    if text is None:
        return None
    shape = {}
    for item in text.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value.isdigit():
            raise ValueError(f"--shape must look like m=4096,n=3072,k=768, got {text!r}")
        shape[key] = int(value)
    return shape


def run(args) -> int:
    from stof_tvm.commands.mask_arg import load_mask_arg
    from stof_tvm.tuning import plan as make_plan
    from stof_tvm.tuning import tune_tasks, tuning_target

    kinds = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    target = tuning_target({"kind": "cuda", "arch": args.arch} if args.target == "cuda" else "llvm")
    if args.template and not args.shape:
        raise ValueError("--template needs --shape (e.g. m=4096,n=3072,k=768)")
    dtype = args.dtype or ("float32" if args.model and args.target == "llvm" else "float16")
    print("stage 1: " + ("planning the calls 'stof-tvm compile' makes with these arguments (front end, then the "
                         "analytical model)" if args.model else "ranking the candidates with the analytical model"),
          file=sys.stderr, flush=True)
    stage1 = make_plan(args.model, template=args.template, shape=_parse_shape(args.shape),
                       mask=load_mask_arg(args.mask), batch=args.batch, seq_len=args.seq_len, heads=args.heads,
                       head_dim=args.head_dim, dtype=dtype, target=target, top_k=args.top_k,
                       hardware=args.hardware, calibration=args.calibration, kinds=kinds, kernel=args.kernel,
                       templates=args.templates, gemm=args.gemm, database=args.database, explain=args.explain)
    if stage1.target is not None:     # a model: measure on the target its compile builds for (sm_90a for wgmma)
        target = tuning_target(stage1.target)
    for text in stage1.explanations:
        print(text + "\n")
    for note in stage1.notes:
        print(f"not tuned: {note}")
    print(f"stage 1: {len(stage1.tasks)} tasks, "
          f"{sum(t.space_size for t in stage1.tasks)} candidates, model time {stage1.model_seconds * 1e3:.1f} ms")
    if args.dry_run:
        for task in stage1.tasks:
            print(f"  {task.name} (weight {task.weight:g}, {task.space_size} candidates)")
        return 0
    print(f"stage 2: measuring on {target.kind.name} {target.attrs.get('arch', '')}".rstrip()
          + f", records in {args.database}", file=sys.stderr, flush=True)
    report = tune_tasks(stage1.tasks, target, args.database, trials=args.trials, time_budget_s=args.time_budget,
                        rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key, build_workers=args.build_workers)
    print(report.table())
    verdict = _whole_model_check(args, stage1, dtype) if args.model and not report.stopped.startswith("interrupted") \
        else None
    if args.json:
        data = report.to_json()
        data["stage1"] = {"model_seconds": stage1.model_seconds, "notes": stage1.notes}
        if verdict is not None:
            data["whole_model"] = verdict
        with open(args.json, "w") as handle:
            json.dump(data, handle, indent=1)
    return 130 if report.stopped.startswith("interrupted") else 0


def _whole_model_check(args, stage1, dtype: str) -> dict | None:
    """Stage 3 (:mod:`stof_tvm.tuning_check`) for a tuned model, where asked and the device is this machine's."""
    from stof_tvm.commands.mask_arg import load_mask_arg
    from stof_tvm.tuning_check import stage3

    if not args.whole_model_check or args.rpc_tracker or not stage1.tasks:
        return None
    return stage3(args.model, database=args.database, tasks=stage1.tasks,
                  report=lambda line: print(line, file=sys.stderr, flush=True),
                  compile_options={"mask": load_mask_arg(args.mask), "batch": args.batch, "seq_len": args.seq_len,
                                   "target": args.target, "dtype": dtype, "kernel": args.kernel,
                                   "templates": args.templates, "gemm": args.gemm,
                                   "cuda_graph": args.cuda_graph and args.target == "cuda"})
