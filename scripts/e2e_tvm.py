"""The end-to-end benchmark's TVM baseline: TVM's own default pipeline on the same ONNX file, not stof-tvm's compiler.

The end-to-end issue asks for ">= 2x TVM's default pipeline on the same ONNX". What a TVM user would run:

1. the ONNX file with its input shapes fixed and its shape computations folded (onnx's shape inference and
   reference evaluator, :func:`stof_tvm.compiler.onnx_import.fold_shape_computations`; the ONNX-to-ONNX step
   onnx-simplifier is used for). TVM's importer cannot take the Hugging Face exports without it: every
   BERT/RoBERTa/GPT-2/T5 export fails in ``from_onnx`` with "broadcast_to expects the input shape to have the
   number of ndim at least as the input tensor's" (the attention mask's ``Expand``); the folding changes no
   arithmetic of the forward pass;
2. ``tvm.relax.frontend.onnx.from_onnx`` (static shapes, weights embedded as constants);
3. float16: ``relax.transform.ToMixedPrecision(out_dtype="float32")``, TVM's own mixed precision (matrix
   products in float16 with float32 accumulation; the weight casts fold at compile time);
4. ``tvm.compile`` for the target with TVM's default Relax pipeline: on CUDA
   ``relax.backend.cuda.get_default_pipeline`` (legalize, ``FuseOps`` / ``FuseTIR``, dlight's default GPU rules
   ``Matmul, GEMV, Reduction, GeneralReduction, Fallback``, static memory planning; no CUDA graphs, TVM's
   default), on the CPU the generic default pipeline;
5. ``export_library`` into ``module.so`` beside a small JSON manifest (inputs, output, how it was built).

:class:`TvmRunner` loads it into a Relax VM on the device; :meth:`TvmRunner.run` is one forward pass on inputs
:meth:`TvmRunner.prepare` bound once, timed as stof-tvm's module alone is. Its attention is dense (the ONNX graph
has no sparse pattern), so it is checked against the dense float32 reference. Expected on the GPU: HF GPT-2's
``gelu_new`` keeps ``Pow(x, 3)``, which TVM's CUDA code computes as ``hpow`` (``powf`` under the fast math TVM
always compiles with, NaN for negative bases), so that row's output is likely NaN: TVM's default as it stands.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

LIBRARY = "module.so"
MANIFEST = "tvm.json"
# the CUDA target stof-tvm compiles for (stof_tvm.compiler.pipeline.CUDA_DEFAULTS), so both use one description
CUDA_TARGET = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "max_shared_memory_per_block": 232448}


def make_target(kind: str):
    import tvm

    if kind == "cuda":
        return tvm.target.Target(dict(CUDA_TARGET), host={"kind": "llvm"})
    if kind == "llvm":
        return tvm.target.Target({"kind": "llvm"})
    raise ValueError(f"target: expected 'cuda' or 'llvm', got {kind!r}")


def importable(onnx_path: str, batch: int, seq_len: int):
    """The ONNX model with its input shapes fixed at ``batch`` x ``seq_len`` (dims named like a batch or a
    sequence; static dims stay as they are) and its shape computations folded (step 1), and its input specs."""
    import onnx

    from stof_tvm.compiler.onnx_import import fold_shape_computations, input_specs

    model = onnx.load(onnx_path)
    specs = input_specs(model, batch, seq_len)
    return fold_shape_computations(model, specs), specs


def build(onnx_path: str, out_dir: str, batch: int, seq_len: int, target: str, dtype: str) -> dict:
    """Compile ``onnx_path`` with TVM's default pipeline (steps 1-5 of the module docstring) into ``out_dir``;
    returns the build report (also in the manifest): seconds per step, the target and the output's name."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype: expected 'float16' or 'float32', got {dtype!r}")
    seconds = {}
    start = time.time()
    model, specs = importable(onnx_path, batch, seq_len)
    seconds["fold"] = time.time() - start
    start = time.time()
    mod = from_onnx(model, shape_dict={s.name: list(s.shape) for s in specs},
                    dtype_dict={s.name: s.dtype for s in specs})
    seconds["import"] = time.time() - start
    if dtype == "float16":
        mod = relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
    start = time.time()
    with tvm.transform.PassContext(opt_level=3):
        executable = tvm.compile(mod, target=make_target(target))
    seconds["compile"] = time.time() - start
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    executable.export_library(str(out / LIBRARY))
    seconds["export"] = time.time() - start
    report = {"inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in specs],
              "output": model.graph.output[0].name, "target": target, "dtype": dtype,
              "pipeline": "tvm.compile default (cuda: relax.backend.cuda.get_default_pipeline with dlight)"
                          if target == "cuda" else "tvm.compile default",
              "mixed_precision": "ToMixedPrecision(out_dtype='float32')" if dtype == "float16" else None,
              "tvm": tvm.__version__, "seconds": {k: round(v, 2) for k, v in seconds.items()}}
    (out / MANIFEST).write_text(json.dumps(report, indent=1))
    return report


class TvmRunner:
    """A module :func:`build` wrote, loaded into a Relax VM on ``device`` ("cuda" or "cpu")."""

    def __init__(self, out_dir: str, device: str):
        import tvm
        from tvm import relax

        out = Path(out_dir)
        self.manifest = json.loads((out / MANIFEST).read_text())
        if device == "cuda":
            from stof_tvm.cuda_runtime import ensure_cuda_runtime

            ensure_cuda_runtime()
        self.device = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(str(out / LIBRARY)), self.device)
        self._main = self.vm["main"]

    def prepare(self, feeds: dict) -> list:
        """The module's input tensors from ``feeds`` (by name; numpy arrays, or torch tensors already on the
        device, bound through DLPack without a copy), in the module's order, checked against the manifest."""
        import numpy as np
        import tvm

        args = []
        for spec in self.manifest["inputs"]:
            if spec["name"] not in feeds:
                raise ValueError(f"inputs: missing {spec['name']!r}; the module takes "
                                 f"{[s['name'] for s in self.manifest['inputs']]}")
            value = feeds[spec["name"]]
            if list(value.shape) != spec["shape"]:
                raise ValueError(f"input {spec['name']!r}: expected shape {spec['shape']}, got {list(value.shape)}")
            if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
                args.append(tvm.runtime.from_dlpack(value))
            else:
                args.append(tvm.runtime.tensor(np.ascontiguousarray(value, dtype=spec["dtype"]), self.device))
        return args

    def run(self, args: list):
        """One forward pass on prepared inputs; the model's first output (a TVM tensor)."""
        out = self._main(*args)
        return out if hasattr(out, "numpy") else out[0]
