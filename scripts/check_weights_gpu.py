"""Float16-stored weights on the GPU: an artifact whose weights.npz holds float16 (the module takes its weight
parameters as float16, :mod:`stof_tvm.compiler.weight_storage`) against the same compile with the storage step
skipped (float32 weights, as artifacts were saved before), both against the model in float32.

Two steps, because the GPU machine has no TVM compiler:

1. ``build`` (here): a small BERT (hidden 256, 2 layers: its 256x256 and 256x1024 matrices are weights, module
   parameters that the fusion templates' one-time transform concatenates and transposes; tiny BERT's are constants)
   compiled for CUDA sm_90 in float16 (templates, ``gemm`` and ``kernel`` auto, a BigBird mask), saved twice into
   ``<out>/{float16,float32}``; the inputs (one padded row) and the float32 reference (onnx's reference evaluator
   under the mask) beside them. A few MB in all.
2. ``run`` (GPU, runtime-only TVM): each artifact loaded (timed: ``runtime.load`` with its weight upload and
   one-time transform) and called; its output against the reference (relative Frobenius error; finite), and the
   two against each other. Prints a table; writes ``<json>``.

Commands::

    .venv/bin/python scripts/check_weights_gpu.py build
    run(command="source .devkit/bootstrap.sh && python3 -m pip install -q --no-deps --no-build-isolation "
                "--no-index -e . && python3 scripts/check_weights_gpu.py run --json $OUT/weights16.json",
        carry=[".devkit/runtime.tar.xz", ".devkit/bootstrap.sh", "out/weights16"], timeout_s=300)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

BATCH, SEQ = 2, 256
OUTPUT = "last_hidden_state"
TOLERANCE = 1e-2                # float16 activations through 2 layers, against float32


def build(out: Path) -> None:
    import stof_tvm
    import stof_tvm.compiler
    from stof_tvm import make_mask
    from stof_tvm.models.bert import BertConfig, make_bert
    from stof_tvm.models.reference import random_inputs, reference_outputs

    model = make_bert(BertConfig(hidden=256, layers=2, heads=4, ffn=1024, vocab=1000, max_positions=512),
                      batch=BATCH, seq_len=SEQ, seed=7)
    feeds = random_inputs(model, {"input_ids": (BATCH, SEQ), "attention_mask": (BATCH, SEQ)}, seed=11)
    feeds["attention_mask"][1, 200:] = 0
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "inputs.npz", **feeds)
    keep = make_mask("bigbird", SEQ)[None, None]
    np.save(out / "reference.npy", reference_outputs(model, keep, feeds)[OUTPUT])
    store = stof_tvm.compiler.store_weights_float16
    for stored in ("float16", "float32"):
        # "float32": the storage step skipped, as every artifact was compiled before it existed
        stof_tvm.compiler.store_weights_float16 = store if stored == "float16" else lambda mod, w, m: (mod, w)
        art = stof_tvm.compile(model, mask="bigbird", batch=BATCH, seq_len=SEQ, target="cuda", dtype="float16")
        art.save(out / stored)
        dtypes = sorted({w["dtype"] for w in art.manifest["weights"]})
        print(f"{stored}: {len(art.manifest['weights'])} weights {dtypes}, kernel "
              f"{art.manifest['attention']['kernel']['kind']}, weights.npz "
              f"{os.path.getsize(out / stored / 'weights.npz') / 1e6:.2f} MB")
    stof_tvm.compiler.store_weights_float16 = store


def run(out: Path, json_path: str | None) -> None:
    from stof_tvm import runtime

    with np.load(out / "inputs.npz") as data:
        feeds = {name: data[name] for name in data.files}
    reference = np.load(out / "reference.npy").astype(np.float64)
    rows, outputs = [], {}
    for stored in ("float16", "float32"):
        path = out / stored
        start = time.perf_counter()
        model = runtime.load(path)
        load_s = time.perf_counter() - start
        result = np.asarray(model(feeds)[OUTPUT], dtype=np.float64)
        outputs[stored] = result
        error = float(np.linalg.norm(result - reference) / np.linalg.norm(reference))
        rows.append({"weights": stored, "weights_mb": round(os.path.getsize(path / "weights.npz") / 1e6, 2),
                     "load_s": round(load_s, 3), "finite": bool(np.isfinite(result).all()), "rel_err": error,
                     "ok": bool(np.isfinite(result).all() and error < TOLERANCE)})
    between = float(np.linalg.norm(outputs["float16"] - outputs["float32"]) / np.linalg.norm(reference))
    print(f"float16 vs float32-stored artifact: relative difference {between:.2e}")
    print(f"{'weights':>8} {'MB':>6} {'load s':>7} {'finite':>6} {'rel err':>9} {'ok':>4}")
    for row in rows:
        print(f"{row['weights']:>8} {row['weights_mb']:>6} {row['load_s']:>7} {str(row['finite']):>6} "
              f"{row['rel_err']:>9.2e} {str(row['ok']):>4}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rows": rows, "between": between, "tolerance": TOLERANCE}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("build", "run"))
    parser.add_argument("--out", type=Path, default=Path("out/weights16"))
    parser.add_argument("--json", default=None, help="run: write the rows here")
    args = parser.parse_args()
    build(args.out) if args.step == "build" else run(args.out, args.json)


if __name__ == "__main__":
    main()
