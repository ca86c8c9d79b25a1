"""``stof-tvm run``: load an artifact, run it once (or a few times), print outputs and timing; ``--check``
compares with onnx's reference evaluator on the same inputs and mask."""
from __future__ import annotations

import os
import time

import numpy as np

from .mask_arg import HELP as MASK_HELP
from .mask_arg import load_mask_arg


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="run a compiled artifact (optionally checking it against onnx's reference evaluator)",
        description="Load an artifact directory with TVM's runtime, run it on inputs from --inputs (an .npz "
                    "with one array per model input) or on random valid inputs, and print each output's shape "
                    "and the time per call.")
    parser.add_argument("artifact", metavar="OUT", help="artifact directory written by 'stof-tvm compile'")
    parser.add_argument("--inputs", metavar="X.npz", help="model inputs by name (default: random)")
    parser.add_argument("--mask", metavar="SPEC", help=f"{MASK_HELP}, instead of the compiled default")
    parser.add_argument("--repeat", type=int, default=3, help="calls to time (default 3)")
    parser.add_argument("--check", action="store_true",
                        help="compare the outputs with onnx.reference on the original model under the same mask")
    parser.add_argument("--save", metavar="Y.npz", help="write the outputs to this .npz")
    parser.set_defaults(func=run)


def model_inputs(model, path: str | None, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs from an .npz file, or random ones valid for the model (token ids inside the embedding range,
    all-ones attention masks)."""
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--inputs: no such file {path!r}")
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    return model.random_inputs(seed)


def source_model(manifest: dict):
    """The ONNX model an artifact was compiled from (regenerated for built-ins; a 16-bit model widened to float32,
    so that the reference is its exact weights computed in float32)."""
    source = manifest.get("source", {})
    if "builtin" in source:
        from stof_tvm.models import builtin_model

        return builtin_model(source["builtin"], seed=source.get("seed", 0))
    if "path" in source and os.path.isfile(source["path"]):
        import onnx

        from stof_tvm.compiler.widen_floats import reference_types, widen

        model = onnx.load(source["path"])
        return widen(model, reference_types(model))[0]
    raise ValueError("--check: the artifact does not record where its ONNX model is (compiled from a ModelProto?)")


def _keep(manifest: dict, mask):
    """The keep-mask ``--check`` applies to the reference (``mask``: the one the call ran under)."""
    from stof_tvm.sparse_formats.masks import normalize_mask

    if mask is None:
        raise ValueError("--check: pass --mask; the artifact keeps no default mask")
    att = manifest["attention"]
    return normalize_mask(mask, batch=att["batch"], heads=att["heads"], seq_q=att["seq_q"], seq_k=att["seq_k"])


def check_against_reference(manifest: dict, inputs: dict, outputs: dict, mask) -> bool:
    """Print the error of each output against onnx.reference; True when all are within tolerance."""
    from stof_tvm.models.reference import evaluate, reference_outputs

    if manifest["attention"]["kernel"]["kind"] == "none":     # compiled without stof-tvm's attention: as it is
        reference = evaluate(source_model(manifest), inputs)
    else:
        reference = reference_outputs(source_model(manifest), _keep(manifest, mask), inputs)
    # 16-bit where the build computes in float16, or where the model's own outputs are 16-bit (a float32 build of a
    # float32 model that casts its outputs to float16; a half model's float32 build is widened, outputs included)
    half = manifest["dtype"] == "float16" or any(value.dtype == np.float16 for value in outputs.values())
    tolerance = 2e-2 if half else 1e-4
    ok = True
    for name, value in outputs.items():
        ref = reference[name].astype(np.float64)
        err = np.linalg.norm(value.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)
        passed = bool(np.isfinite(err) and err <= tolerance)
        ok &= passed
        print(f"check {name}: relative error {err:.2e} (tolerance {tolerance:g}, max abs "
              f"{np.abs(value - ref).max():.2e}) {'PASS' if passed else 'FAIL'}")
    return ok


def run(args) -> int:
    from stof_tvm import runtime

    if args.repeat < 1:
        raise ValueError(f"--repeat: expected a positive integer, got {args.repeat}")
    model = runtime.load(args.artifact)
    inputs = model_inputs(model, args.inputs)
    mask = load_mask_arg(args.mask)
    outputs = model(inputs, mask=mask)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        outputs = model(inputs, mask=mask)
        times.append(time.perf_counter() - start)
    kernel = model.manifest["attention"]["kernel"]["kind"]
    for name, value in outputs.items():
        print(f"output {name}: shape {list(value.shape)} {value.dtype}")
    print(f"kernel {kernel} on {model.manifest['target']['kind']}: {np.median(times) * 1e3:.3f} ms per call "
          f"(median of {args.repeat}, including host-side input and mask preparation)")
    if args.save:
        np.savez(args.save, **outputs)
    if args.check:
        if mask is None:            # the compiled default: a spec, or the array the artifact keeps
            mask = model.formats.default_mask if model.formats is not None else model.manifest["mask"].get("spec")
        return 0 if check_against_reference(model.manifest, inputs, outputs, mask) else 1
    return 0
