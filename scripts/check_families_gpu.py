"""The Hugging Face families of the export corpus on the GPU, called as users call them.

The corpus (tests/test_hf_exports.py) checks every family on ``llvm``; this runs the same exports through the CUDA
build on the GPU machine. Per family (tiny seeded configs, :mod:`stof_tvm.models.hf_export`; head dims 16-256):

1. export once with dynamic batch and sequence axes (``--exporter``: TorchScript at opset 17 or dynamo at 23;
   ``--export-dtype float16`` / ``bfloat16``: after ``model.to(dtype)``, the reference then those weights computed
   in float32);
2. compile it for ``cuda`` in float16 with ``--mask`` (``dense``: the torch model is the reference as it is) at
   each batch of ``--batches`` (1 and 4 by default), and twice with a sparse BigBird mask (below);
3. call ``model(input_ids=..., attention_mask=...)`` with torch CUDA tensors whose last row is padded, and check
   the output against the torch model in float32 on the kept positions (relative Frobenius error and max error
   over the reference's max, every element finite);
4. a build with a sparse BigBird mask against a build with the same mask on TVM's dense attention
   (``kernel="dense"``), on the same inputs: the sparse CUDA kernels at each family's head dim, checked the same way.

Prints one row per (family, batch) as it goes and writes JSON. On the GPU machine, with the compiler kit installed:

    python3 scripts/check_families_gpu.py --json $OUT/families.json

Or build here and check there with the TVM runtime alone (no compiler kit; the GPU's time goes to the checks):

    .venv/bin/python scripts/check_families_gpu.py --save out/fam_cuda             # here: artifacts, inputs, references
    python3 scripts/check_families_gpu.py --load out/fam_cuda --json $OUT/fam.json  # GPU machine
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

FAMILIES = ("bert", "roberta", "distilbert", "gpt2", "vit", "t5", "deberta", "bloom", "phi", "gemma", "mistral",
            "gptneox", "bart", "clip", "modernbert", "qwen2", "opt", "llama", "phi3")
SPARSE_MASK = "bigbird:window=8,globals=8,block=8,density=0.2"
SEQ = 64
TOLERANCE = 5e-3          # float16 against float32: the corpus's FP16_TOL


def _errors(out: np.ndarray, ref: np.ndarray, kept: np.ndarray) -> dict:
    out, ref = np.asarray(out, np.float64)[kept], np.asarray(ref, np.float64)[kept]
    return {"rel": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
            "max_over_max": float(np.abs(out - ref).max() / np.abs(ref).max()),
            "finite": bool(np.isfinite(out).all())}


def _call(model, inputs: dict, target: str) -> np.ndarray:
    """``model(**inputs)`` with torch tensors (on the GPU for ``cuda``), as users write it; the output back as
    float32 numpy."""
    import torch

    device = "cuda" if target == "cuda" else "cpu"
    out = model(**{name: torch.from_numpy(value).to(device) for name, value in inputs.items()})["last_hidden_state"]
    return out.float().cpu().numpy()


BUILDS = (("dense", None, "auto"), ("sparse", SPARSE_MASK, "auto"), ("sparse_ref", SPARSE_MASK, "dense"))


def build_family(family: str, exporter: str, batch: int, mask: str, work: str, target: str = "cuda",
                 export_dtype: str = "float32"):
    """Export ``family`` (cached; in ``export_dtype``, after ``model.to(export_dtype)``), compile its three builds
    at ``batch`` (:data:`BUILDS`; ``None`` = ``mask``) and compute the torch float32 reference (of the 16-bit
    weights, for a 16-bit export). Returns (row, inputs, reference, kept, artifacts by label)."""
    import torch

    import stof_tvm
    from stof_tvm.models import hf_export as hx

    opset = 17 if exporter == "torchscript" else 23
    attn = "sdpa" if exporter == "dynamo" and "sdpa" in hx.attention_kinds(family) else "eager"
    path = hx.cached_export(work, family, attn=attn, exporter=exporter, opset=opset, dynamic=True,
                            dtype=export_dtype)
    seq = hx.sequence_length(family, "tiny", SEQ)
    suffix = {"float16": "-fp16", "bfloat16": "-bf16"}.get(export_dtype, "")
    row = {"family": family, "exporter": f"{exporter}{opset}{suffix}",
           "batch": batch, "seq": seq}
    inputs = hx.example_inputs(family, batch, seq)
    model = hx.build_model(family, "tiny", "eager")
    reference = hx.torch_outputs(model.to(getattr(torch, export_dtype)).float(), inputs)
    kept = (inputs["attention_mask"].astype(bool) if "attention_mask" in inputs
            else np.ones(reference.shape[:2], bool))
    artifacts = {}
    for label, spec, kernel in BUILDS:
        start = time.time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            artifacts[label] = stof_tvm.compile(path, mask=spec or mask, batch=batch, seq_len=seq, target=target,
                                                dtype="float16", kernel=kernel)
        row[f"{label}_compile_s"] = round(time.time() - start, 1)
        row[f"{label}_sites"] = artifacts[label].manifest["attention"].get("sites", 0)
        row[f"{label}_fallbacks"] = [str(w.message)[:160] for w in caught if "default pipeline" in str(w.message)]
    return row, inputs, reference, kept, artifacts


def check_outputs(row: dict, outputs: dict, reference: np.ndarray, kept: np.ndarray) -> dict:
    """Fill ``row`` with the dense build against torch and the sparse build against the dense kernel."""
    row["dense_vs_torch"] = _errors(outputs["dense"], reference, kept)
    row["sparse_vs_dense"] = _errors(outputs["sparse"], outputs["sparse_ref"], kept)
    row["ok"] = all(row[key]["finite"] and row[key]["rel"] <= TOLERANCE
                    for key in ("dense_vs_torch", "sparse_vs_dense"))
    return row


def _guarded(row: dict, step) -> dict:
    """Run ``step()``; a failure becomes the row's error (one family's failure must not hide the others)."""
    try:
        step()
    except Exception as error:
        row["ok"] = False
        row["error"] = f"{type(error).__name__}: {error}"[:400]
        traceback.print_exc()
    print(format_row(row), flush=True)
    return row


def check_family(family: str, exporter: str, batches: list[int], mask: str, work: str,
                 target: str = "cuda", save: str | None = None, export_dtype: str = "float32") -> list[dict]:
    """Rows of one family, one per batch. In process: build, call and check. With ``save``: build here and write
    each batch's artifacts, inputs and reference under ``save`` for :func:`check_saved` on the GPU machine."""
    rows = []
    for batch in batches:
        row = {"family": family, "batch": batch}

        def step():
            built, inputs, reference, kept, artifacts = build_family(family, exporter, batch, mask, work, target,
                                                                     export_dtype)
            row.update(built)
            if save:
                _save(os.path.join(save, f"{family}-b{batch}"), row, inputs, reference, kept, artifacts)
            else:
                outputs = {label: _call(art.load(), inputs, target) for label, art in artifacts.items()}
                check_outputs(row, outputs, reference, kept)
        rows.append(_guarded(row, step))
    return rows


def _save(folder: str, row: dict, inputs: dict, reference, kept, artifacts: dict) -> None:
    """One (family, batch) under ``folder``: each build's artifact by label, the inputs with the reference and kept
    positions (``data.npz``), and the row so far (``row.json``)."""
    for label, artifact in artifacts.items():
        artifact.save(os.path.join(folder, label))
    np.savez(os.path.join(folder, "data.npz"), reference=reference, kept=kept,
             **{"input_" + name: value for name, value in inputs.items()})
    with open(os.path.join(folder, "row.json"), "w") as f:
        json.dump(row, f, indent=1)


def check_saved(folder: str, target: str = "cuda") -> dict:
    """Load one saved (family, batch) folder with the runtime alone, call each build and check it."""
    from stof_tvm.runtime import load

    with open(os.path.join(folder, "row.json")) as f:
        row = json.load(f)

    def step():
        data = np.load(os.path.join(folder, "data.npz"), allow_pickle=False)
        inputs = {key[len("input_"):]: data[key] for key in data.files if key.startswith("input_")}
        outputs = {label: _call(load(os.path.join(folder, label)), inputs, target) for label, _, _ in BUILDS}
        check_outputs(row, outputs, data["reference"], data["kept"])
    return _guarded(row, step)


HEADER = (f"{'family':11s} {'export':18s} {'B':>2s} {'sites':>5s} {'vs torch fp32 (rel / max)':>25s} "
          f"{'sparse vs dense (rel / max)':>28s} ok")


def format_row(row: dict) -> str:
    """One line of the table: the sites on stof-tvm's kernels (dense build / sparse build) and both checks."""
    head = f"{row['family']:11s} {row.get('exporter', '?'):18s} {row['batch']:2d}"
    if "error" in row:
        return f"{head} error: {row['error'][:100]}"
    if "dense_vs_torch" not in row:
        return f"{head} {row['dense_sites']:>2d}/{row['sparse_sites']:<2d} built and saved"
    torch_err, sparse_err = row["dense_vs_torch"], row["sparse_vs_dense"]
    return (f"{head} {row['dense_sites']:>2d}/{row['sparse_sites']:<2d} "
            f"{torch_err['rel']:12.2e} / {torch_err['max_over_max']:.2e} "
            f"{sparse_err['rel']:15.2e} / {sparse_err['max_over_max']:.2e} {'yes' if row['ok'] else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--exporter", choices=("torchscript", "dynamo"), default="dynamo")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 4])
    parser.add_argument("--mask", default="dense", help="the mask of the build checked against torch")
    parser.add_argument("--target", default="cuda", help="cuda on the GPU machine; llvm to try it here")
    parser.add_argument("--export-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                        help="float16 / bfloat16: export each model after model.to(dtype), as users do for GPU "
                        "inference")
    parser.add_argument("--work", default=os.path.join("out", "families"), help="export cache")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--save", metavar="DIR", help="build here and save artifacts, inputs and references to DIR "
                        "(no GPU needed); check them later with --load DIR")
    parser.add_argument("--load", metavar="DIR", help="check the builds saved in DIR with the runtime alone")
    args = parser.parse_args()
    rows = []
    print(HEADER, flush=True)
    if args.load:
        for name in sorted(os.listdir(args.load)):
            if os.path.isfile(os.path.join(args.load, name, "row.json")):
                rows.append(check_saved(os.path.join(args.load, name), args.target))
                _write_json(rows, args.json)
    else:
        for family in args.families:
            rows += check_family(family, args.exporter, args.batches, args.mask, args.work, args.target, args.save,
                                 args.export_dtype)
            _write_json(rows, args.json)
    print(f"{len(rows)} saved" if args.save else f"{sum(r.get('ok', False) for r in rows)}/{len(rows)} ok")


def _write_json(rows: list[dict], path: str | None) -> None:
    """After every family: a run stopped early keeps what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
