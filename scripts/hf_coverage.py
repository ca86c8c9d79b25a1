"""Coverage of real Hugging Face exports on stof-tvm's fast path: export (hf_export), compile (default: CUDA sm_90,
float16, the full build with nvcc-built cubins), and print one row per export from the manifest's ``coverage``:
attention on a sparse kernel, linears on templates, QKV as one projection into heads, GELU / ReLU in the GEMM
epilogue, LayerNorm / RMSNorm on templates; then every fallback with its reason.

    .venv/bin/python scripts/hf_coverage.py                          # tiny models, every form below, cuda
    .venv/bin/python scripts/hf_coverage.py --size base --batch 8 --seq-len 512 --forms gpt2:eager:torchscript:17

Runs on the CPU (compiling for CUDA needs no GPU); ``--json`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

FORMS = ["bert:sdpa:torchscript:17", "bert:eager:dynamo:18", "roberta:eager:torchscript:17",
         "roberta:eager:torchscript:20", "roberta:sdpa:dynamo:18", "gpt2:eager:torchscript:17",
         "gpt2:sdpa:dynamo:18", "vit:eager:torchscript:17", "vit:sdpa:dynamo:18", "t5:eager:torchscript:17",
         "t5:eager:dynamo:18", "bigbird:eager:torchscript:17", "bigbird:eager:dynamo:18",
         "deberta:eager:torchscript:17", "llama:eager:dynamo:18", "qwen2:sdpa:torchscript:17",
         "mistral:sdpa:torchscript:17", "phi3:sdpa:dynamo:18"]
COLUMNS = [("attention", "attention"), ("linear", "linears"), ("qkv", "QKV fused"), ("act", "GELU/ReLU fused"),
           ("norm", "LN/RMSNorm")]


def _fraction(entry: dict) -> str:
    return f"{entry['accelerated']}/{entry['total']}"


def row_of(form: str, manifest: dict, seconds: float) -> dict:
    cov = manifest["coverage"]
    act = "relu" if cov["relu"]["total"] else "gelu"
    norm = "rmsnorm" if cov["rmsnorm"]["total"] else "layernorm"
    kernel = cov["attention"].get("kernel") or "none"
    return {"form": form, "attention": f"{_fraction(cov['attention'])} {kernel}", "linear": _fraction(cov["linear"]),
            "qkv": _fraction(cov["qkv"]), "act": f"{_fraction(cov[act])} {act}",
            "norm": f"{_fraction(cov[norm])} {norm}", "seconds": round(seconds, 1),
            "fallback": {kind: e["fallback"] for kind, e in cov.items() if e["fallback"]},
            "calls": manifest["templates"].get("calls", {})}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", nargs="*", default=FORMS, help="family:attention:exporter:opset")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--cache", default=os.path.join("out", "hf_exports"))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    import stof_tvm
    from stof_tvm.models import hf_export as hx

    rows = []
    for form in args.forms:
        family, attn, exporter, opset = form.split(":")
        started = time.monotonic()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                path = hx.cached_export(args.cache, family, size=args.size, attn=attn, exporter=exporter,
                                        opset=int(opset), batch=args.batch, seq_len=args.seq_len)
            art = stof_tvm.compile(path, mask="bigbird", batch=args.batch, seq_len=args.seq_len, target=args.target,
                                   dtype="float16")
            rows.append(row_of(form, art.manifest, time.monotonic() - started))
        except Exception as err:            # one row per form: a failure is reported, the others still run
            rows.append({"form": form, "error": f"{type(err).__name__}: {str(err)[:200]}"})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("| export | " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for row in rows:
        cells = [row.get(key, "") for key, _ in COLUMNS] if "error" not in row else [row["error"]] + [""] * 4
        print(f"| {row['form']} | " + " | ".join(cells) + " |")
    for row in rows:
        for kind, fallbacks in row.get("fallback", {}).items():
            for f in fallbacks:
                print(f"{row['form']}: {kind}: {f['count']} fell back: {f['reason']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
