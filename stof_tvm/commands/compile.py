"""``stof-tvm compile``: ONNX model (or a built-in one) + mask -> artifact directory."""
from __future__ import annotations

import argparse
import sys
import time

from stof_tvm.models import BUILTIN

from .mask_arg import HELP as MASK_HELP
from .mask_arg import load_mask_arg


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compile", help="compile an ONNX transformer with a sparse attention mask into an artifact",
        description="Import an ONNX transformer, replace its attention with stof-tvm's sparse kernels for the "
                    "given mask, build it for the target and write the artifact (module.so + manifest.json) "
                    "to OUT. The mask becomes a run-time input: 'stof-tvm run' accepts any mask of the same kind.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("model", nargs="?", metavar="MODEL.onnx", help="path to the ONNX model")
    source.add_argument("--builtin", choices=sorted(BUILTIN), help="compile a built-in model instead")
    parser.add_argument("--mask", required=True, metavar="SPEC", help=MASK_HELP)
    parser.add_argument("--batch", type=int, required=True, help="batch size B")
    parser.add_argument("--seq-len", type=int, required=True, help="sequence length S")
    parser.add_argument("--target", default="cuda", choices=["cuda", "llvm"], help="target (default cuda)")
    parser.add_argument("--arch", default="sm_90", help="CUDA architecture (default sm_90)")
    parser.add_argument("--dtype", choices=["float16", "float32"],
                        help="compute dtype (default float16 on cuda, float32 on llvm)")
    parser.add_argument("--kernel", default="auto", choices=["auto", "block", "row", "wgmma", "dense"],
                        help="attention kernel (default: chosen from the mask; wgmma: Hopper, sm_90 targets)")
    parser.add_argument("--templates", action=argparse.BooleanOptionalAction, default=None,
                        help="use stof-tvm's fusion templates for the QKV projection, GEMM + residual + "
                             "LayerNorm and FFN chains (float16; default: on for cuda float16)")
    parser.add_argument("--gemm", default="auto", choices=["auto", "mma", "wgmma"],
                        help="GEMM kernel of the templates: wgmma (Hopper sm_90a; needs nvcc here), mma "
                             "(mma.sync) or auto (default: wgmma on sm_90 when nvcc is found, else mma)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture the static regions between attention calls in CUDA graphs (cuda only)")
    parser.add_argument("--dependent-launch", action=argparse.BooleanOptionalAction, default=None,
                        help="launch each kernel so that its start overlaps the end of the one before it "
                             "(programmatic dependent launch; default: on for sm_90 and later)")
    parser.add_argument("--tune-trials", type=int, default=0, metavar="N",
                        help="tune the calls this compile makes first, at most N measurements per task (needs "
                             "--database; complete tasks there are not measured again)")
    parser.add_argument("--top-k", type=int, default=8, help="with --tune-trials: stage-1 survivors per job "
                                                             "(default 8)")
    parser.add_argument("--time-budget", type=float, metavar="SECONDS", help="with --tune-trials: stop tuning "
                                                                             "after this long")
    parser.add_argument("--database", metavar="DIR", help="tuning work directory whose records are applied "
                                                          "('stof-tvm tune' writes one; so does --tune-trials)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed of a built-in model (default 0)")
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="artifact directory to write")
    parser.set_defaults(func=run)


def run(args) -> int:
    from stof_tvm.artifact import check_output_dir
    from stof_tvm.workflow import compile as compile_model

    check_output_dir(args.output)
    if args.builtin:
        from stof_tvm.models import builtin_model

        model = builtin_model(args.builtin, seed=args.seed)
    else:
        model = args.model
    target = {"kind": "cuda", "arch": args.arch} if args.target == "cuda" else "llvm"
    dtype = args.dtype or ("float16" if args.target == "cuda" else "float32")
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    artifact = compile_model(model, mask=load_mask_arg(args.mask), batch=args.batch, seq_len=args.seq_len,
                             target=target, dtype=dtype, kernel=args.kernel, templates=args.templates,
                             gemm=args.gemm, cuda_graph=args.cuda_graph, dependent_launch=args.dependent_launch,
                             tune_trials=args.tune_trials,
                             database=args.database, top_k=args.top_k, time_budget_s=args.time_budget,
                             progress=progress)
    if args.builtin:
        artifact.manifest["source"] = {"builtin": args.builtin, "seed": args.seed}
    path = artifact.save(args.output)
    att = artifact.manifest["attention"]
    kernel = att["kernel"]
    print(f"compiled {args.builtin or args.model} -> {path}")
    if kernel["kind"] == "none":
        print(f"  attention not on stof-tvm's kernels ({att['fallback']}): TVM's default pipeline")
        _print_coverage(artifact.manifest)
        if args.database:
            print("  " + records_line(artifact.manifest["tuning"]))
        return 0
    print(f"  {att['sites']} attention sites [B={att['batch']}, H={att['heads']}, S={att['seq_q']}, "
          f"D={att['head_dim']}] {att['dtype']} on {artifact.manifest['target']['kind']}")
    print(f"  kernel: {kernel['kind']} {kernel['config'] or ''} ({kernel['reason']})")
    if artifact.manifest["templates"]:
        entry = artifact.manifest["templates"]
        print(f"  templates ({entry['gemm']}): {entry['calls']}")
    _print_coverage(artifact.manifest)
    if args.database:
        print("  " + records_line(artifact.manifest["tuning"]))
    return 0


def _print_coverage(manifest: dict) -> None:
    """The manifest's coverage report: per operator kind, how many run on stof-tvm's kernels, and each fallback."""
    from stof_tvm.compiler.coverage import coverage_lines

    if manifest.get("coverage"):
        for line in coverage_lines(manifest["coverage"]):
            print("  " + line)


def records_line(tuning: dict) -> str:
    """The manifest's ``tuning`` entry in one line: records applied, calls without one, database jobs unused."""
    line = f"tuning records: {tuning['applied']} applied from {tuning['database']}"
    if tuning["missing"]:
        line += f"; {len(tuning['missing'])} calls without a record ({', '.join(tuning['missing'])})"
    if tuning["unused"]:
        line += f"; {len(tuning['unused'])} measured jobs there not used by this compile"
    tuned = tuning.get("tuned")
    if tuned:
        line += (f"; tuned here: {tuned['measured']} trials over {tuned['tasks']} tasks in {tuned['seconds']:.1f} s"
                 + (f" (stopped: {tuned['stopped']})" if tuned["stopped"] else ""))
    return line
