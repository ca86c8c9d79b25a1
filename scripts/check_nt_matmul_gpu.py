"""The batched short-k matmul kernel (``schedules/batched_nt_matmul.py``) on the GPU: checked against float32 and timed
against what the pipeline ran before it (TVM's tensor-core form, dlight's wmma matmul) and torch's ``matmul`` (cuBLAS),
side by side, at HF DeBERTa-v3-base's relative-position product shapes ``[B*H, S, 64] x [B*H, 2 * buckets, 64]``.

Every variant computes ``C[s] = A[s] @ B[s]^T`` in float16 with float32 accumulation; outputs are NaN-poisoned before
each checked run and compared with the float32 product of the same inputs. Times: CUDA events, median of 20 samples
after warm-up (:func:`benchlib.time_ms`), fresh inputs per sample from a pool. On the GPU machine, with the compiler
kit installed (it builds there):

    python3 scripts/check_nt_matmul_gpu.py --json $OUT/nt_matmul.json
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

import benchlib as bl  # noqa: E402

# (batch, rows, cols, depth): DeBERTa-v3-base at 8 x 512 and 1 x 512 tokens; a head dim of 32
SHAPES = [(96, 512, 512, 64), (12, 512, 512, 64), (96, 512, 512, 32)]
TOLERANCE = 2e-3          # float16 rounding of the output (unit roundoff 4.9e-4) against float32
POOL = 3                  # input sets cycled through while timing
BEFORE = "tvm wmma (before)"  # what the pipeline ran before this kernel: dlight's tensor-core form


def relax_product(batch: int, rows: int, cols: int, depth: int):
    """The product as the compiler meets it: ``matmul(A, B^T)`` in float32, cast to float16, legalised and fused
    into one PrimFunc."""
    import tvm
    from tvm import relax

    a = relax.Var("a", relax.TensorType([batch, rows, depth], "float16"))
    b = relax.Var("b", relax.TensorType([batch, cols, depth], "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            product = relax.op.matmul(a, relax.op.permute_dims(b, [0, 2, 1]), out_dtype="float32")
            out = bb.emit_output(relax.op.astype(product, "float16"))
        bb.emit_func_output(out)
    passes = [relax.transform.FuseTransposeMatmul(), relax.transform.LegalizeOps(),
              relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
              relax.transform.FuseTIR()]
    mod = tvm.transform.Sequential(passes)(bb.get())
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(funcs) == 1, [gv.name_hint for gv, _ in mod.functions_items()]
    return funcs[0]


def builds(shape) -> dict:
    """name -> a built TVM function ``f(A, B, C)``: ours at each tile height, TVM's wmma form (dlight)."""
    import tvm
    from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization

    from stof_tvm.compiler.pipeline import CUDA_DEFAULTS, make_target
    from stof_tvm.schedules.batched_nt_matmul import ROW_CHOICES, batched_nt_matmul, fits

    target = make_target(dict(CUDA_DEFAULTS))
    out = {}
    for rows in ROW_CHOICES:
        if fits(*shape[1:], block_rows=rows):
            func = batched_nt_matmul(*shape, block_rows=rows).with_attr("global_symbol", "main")
            out[f"ours {rows}x128"] = tvm.compile(tvm.IRModule({"main": func}), target=target)["main"]
    with target:
        sch = MatmulTensorization().apply(relax_product(*shape), target, False)
    func = sch.mod["main"].with_attr("global_symbol", "main")
    out[BEFORE] = tvm.compile(tvm.IRModule({"main": func}), target=target)["main"]
    return out


def run_shape(shape) -> list[dict]:
    """One row per variant at ``shape``: its error against float32 (checked on two input sets, each into a poisoned
    output), its median time, bandwidth and fraction of the hardware limit, and its speed-up over :data:`BEFORE`."""
    import torch
    import tvm

    batch, rows, cols, depth = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = [(torch.randn(batch, rows, depth, device="cuda", dtype=torch.float16, generator=gen),
             torch.randn(batch, cols, depth, device="cuda", dtype=torch.float16, generator=gen)) for _ in range(POOL)]
    out = torch.empty(batch, rows, cols, device="cuda", dtype=torch.float16)
    reference = torch.matmul(pool[0][0].float(), pool[0][1].float().transpose(1, 2))
    flops = 2.0 * batch * rows * cols * depth
    moved = 2.0 * (batch * rows * depth + batch * cols * depth + batch * rows * cols)
    results = []
    cases = {name: (lambda a, b, f=f: f(*[tvm.runtime.from_dlpack(t) for t in (a, b, out)]))
             for name, f in builds(shape).items()}
    cases["torch.matmul (cuBLAS)"] = lambda a, b: torch.matmul(a, b.transpose(1, 2), out=out)
    for name, call in cases.items():
        row = {"shape": "x".join(map(str, shape)), "variant": name}
        bl.poison(out)
        call(*pool[0])
        torch.cuda.synchronize()
        row.update(bl.errors(out, reference))
        row["ok"] = bl.within(row, TOLERANCE)
        timing = bl.time_ms(call, inputs=pool, warmup=5, samples=20)
        row["ms"] = timing.median_ms
        row["us"] = 1e3 * timing.median_ms
        row.update({key: value for key, value in bl.limit(row["ms"], flops, moved).items() if key != "limit_ms"})
        bl.poison(out)
        call(*pool[1])
        torch.cuda.synchronize()
        again = bl.errors(out, torch.matmul(pool[1][0].float(), pool[1][1].float().transpose(1, 2)))
        row["ok"] = "yes" if row["ok"] and bl.within(again, TOLERANCE) else "NO"
        results.append(row)
    before_ms = next(r["ms"] for r in results if r["variant"] == BEFORE)
    for r in results:
        r["speedup_vs_before"] = before_ms / r["ms"]
    return results


COLUMNS = [("shape", "shape", "s"), ("variant", "variant", "s"), ("us", "us", ".1f"), ("tbps", "TB/s", ".2f"),
           ("fraction", "of limit", ".2f"), ("speedup_vs_before", "vs before", ".2f"), ("rel", "rel err", ".1e"),
           ("ok", "ok", "s")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        rows += run_shape(shape)
        if args.json:
            bl.write_json(args.json, {"environment": bl.environment(), "rows": rows})
    bl.print_table(rows, COLUMNS, title="batched NT matmul, float16 (CUDA events, median of 20)")


if __name__ == "__main__":
    main()
