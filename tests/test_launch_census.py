"""The launch census (stof_tvm.vm_census, compiler.kernel_grids) and the whole-forward CUDA graph it measures.

On a real Hugging Face RoBERTa export (tiny config; the same graph as RoBERTa-base, 2 layers): compiled for CUDA
with graphs (built here, no GPU), the forward pass is one graph plus a few launches outside it, and the counts
must not regress; on llvm the staged inputs and the fixed mask inputs (the same rewrites) keep the call through
``model(input_ids=..., attention_mask=...)`` exact against the unstaged module and torch float32, at batch 1 and 2
and across masks of one format size (the runtime's fixed format tensors)."""
import numpy as np
import pytest
import tvm
from tvm import relax

import stof_tvm
from stof_tvm.compiler import front_end, lower
from stof_tvm.compiler.graph_inputs import COPY_SYMBOL, copy_primfunc, whole_graph
from stof_tvm.compiler.kernel_grids import kernel_grids
from stof_tvm.compiler.input_checks import COUNT_SYMBOL
from stof_tvm.compiler.pipeline import build, optimize
from stof_tvm.compiler.row_scan import scan_rows_primfunc
from stof_tvm.mask_formats import MaskFormats
from stof_tvm.runtime import CompiledModel
from stof_tvm.sparse_formats.masks import make_mask
from stof_tvm.vm_census import vm_census

SEQ = 64

PROGRAM = '''ib = rx.Builder()
with ib.function("main", num_inputs=2):
    ib.emit_call("vm.builtin.check_tensor_info", args=[ib.r(0), ib.imm(2), ib.c(0), ib.c(1)])
    ib.emit_call("stof_stage_inputs", args=[ib.r(0), ib.r(2)])
    ib.emit_call("vm.builtin.cuda_graph.run_or_capture", args=[ib.r(vm), ib.f("graph0"), ib.r(3), ib.imm(0)])
    ib.emit_call("vm.builtin.null_value", args=[], dst=ib.r(3))
    ib.emit_call("fused_cast", args=[ib.r(4), ib.r(5)])
    ib.emit_ret(ib.r(5))
with ib.function("graph0", num_inputs=1):
    ib.emit_call("vm.builtin.alloc_tensor", args=[ib.r(0), ib.imm(0), ib.c(2), ib.c(3)], dst=ib.r(1))
    ib.emit_call("gemm", args=[ib.r(0), ib.r(1)])
    ib.emit_call("scan", args=[ib.r(1), ib.r(0)])
    ib.emit_call("gemm", args=[ib.r(0), ib.r(1)])
    ib.emit_ret(ib.r(1))
'''


def test_census_counts_a_known_program():
    census = vm_census(PROGRAM, {"scan": 3})
    assert census.graph_launches == 1 and census.graphs == ["graph0"]
    assert census.kernels_outside_graphs == 2 and census.kernels_in_graphs == 2 + 3
    assert census.kernels == 7 and census.distinct_kernels == 4
    # what main runs per call: its builtins, its two launches, the run_or_capture and the ret (never the capture
    # function's own instructions: a replay does not run them)
    assert census.vm_instructions == 6
    assert census.host_ops == {"vm.builtin.check_tensor_info": 1, "vm.builtin.null_value": 1, "ret": 1}
    assert census.per_function() == {"stof_stage_inputs": 1, "fused_cast": 1, "gemm": 2, "scan": 1}
    with pytest.raises(ValueError, match="no VM function"):
        vm_census(PROGRAM, entry="missing")


@pytest.fixture(scope="module")
def roberta(hf_export):
    return hf_export("roberta", "eager", "torchscript", 17, True, 2, SEQ)


def test_roberta_forward_is_one_graph(roberta):
    """RoBERTa at batch 1 x 128 for CUDA with graphs: one graph holds attention, the key-padding summary, the
    position-id scan, the embedding gathers and the value checks; outside it only the input copy and the two
    kernels writing main's outputs. Before the staged inputs, fixed mask inputs and row scan, RoBERTa-base at 1x128
    ran 14 graphs and 21 launches outside them (every attention call, every input reader, TVM's GPU cumsum) and
    324 VM instructions per call; now 1, 3 and 68."""
    front = front_end(roberta, mask="bigbird", batch=1, seq_len=128, target="cuda", dtype="float16")
    optimized, executable = lower(front, None, cuda_graph=True)
    grids = kernel_grids(optimized)
    census = vm_census(executable.as_python(), {name: max(1, len(k)) for name, k in grids.items()})
    assert census.graph_launches == 1, census.table()
    assert census.kernels_outside_graphs == 3 and census.outside[COPY_SYMBOL] == 1, census.outside
    assert census.vm_instructions <= 70, census.table()
    # the two output writers: the hidden state's cast and the value counts (one kernel for both inputs)
    assert not [name for name in census.outside if name.startswith("stof_") and name not in (COPY_SYMBOL, COUNT_SYMBOL)
                ], census.outside
    assert census.outside[COUNT_SYMBOL] == 1, census.outside
    assert not [name for name in census.per_function() if "cumsum" in name]
    calls = census.per_function()
    assert sum(n for name, n in calls.items() if name.startswith("stof_attention")) == 2, calls
    assert calls["stof_key_padding"] == 1
    # per layer: QKV, attention, output GEMM, LayerNorm, GELU GEMM, down GEMM, LayerNorm (7 x 2 layers); then the
    # input copy, key padding, the position-id scan (counting the ids unequal to the pad id itself), the pad test
    # + embeddings' ids + gathers + sum as one kernel (:mod:`.gathers`), their LayerNorm, and the two output
    # kernels (the hidden state, the value counts of both inputs in one): 7 (14 with a kernel per gather, 10 before
    # the counts were one kernel and the scan read the ids)
    assert census.kernels <= 7 * 2 + 7, census.table()
    assert [name for name in calls if name.startswith("stof_scan_rows")] == ["stof_scan_rows_1x128_int32_unequal"]
    alone = [name for name in calls if name.startswith("fused_") and "equal" in name
             and not any(key in name for key in ("take", "gather", "sum"))]
    assert not alone, calls       # the pad test has no kernel of its own: it joined the embeddings' kernel
    assert not [name for name in calls if name.startswith(("take", "gather"))], calls
    # the embeddings' kernel and the output cast: a vector of elements a thread (schedules.elementwise), not one
    fused = [name for name in calls if name.startswith("fused_")]
    assert len(fused) == 2 and all([k.threads for k in grids[name]] == [256] for name in fused), fused
    # the grid of every GEMM template is its tile count, as the knobs say (what the census reports per kernel)
    for site in front.template_entry["sites"]:
        for stage in site["stages"]:
            knobs, shape = stage["knobs"], stage["shape"]
            if stage["template"].startswith("gemm"):
                name = f"stof_{stage['template']}_m{shape['m']}_n{shape['n']}_k{shape['k']}"
                tiles = (shape["m"] // (16 * knobs["warps_m"] * knobs["frag_m"])) * \
                    (shape["n"] // (16 * knobs["warps_n"] * knobs["frag_n"]))
                assert [k.blocks for k in grids[name]] == [tiles], name
                assert [k.threads for k in grids[name]] == [32 * knobs["warps_m"] * knobs["warps_n"]], name


def test_copy_kernel_copies_every_input():
    specs = [((2, 5), "int64"), ((3,), "int32"), ((1, 2, 3), "float32")]
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-9, 9, size=shape).astype(dtype) for shape, dtype in specs]
    lib = tvm.compile(tvm.IRModule({"main": copy_primfunc(specs, "llvm")}), target="llvm")
    outs = [tvm.runtime.empty(shape, dtype) for shape, dtype in specs]
    lib[COPY_SYMBOL](*[tvm.runtime.tensor(a) for a in arrays], *outs)
    for out, want in zip(outs, arrays):
        np.testing.assert_array_equal(out.numpy(), want)
    cuda = copy_primfunc(specs, "cuda")       # one kernel: one grid over the largest input
    assert [(k.blocks, k.threads) for k in kernel_grids(tvm.IRModule({"f": cuda}))[COPY_SYMBOL]] == [(1, 256)]


@pytest.mark.parametrize("rows, length", [(1, 128), (3, 129), (2, 7), (2, 2048)])
def test_row_scan_kernel_runs_on_cpu_threads(rows, length, tmp_path):
    """The lowered CUDA scan kernel (one warp per row, lanes' chunk sums through shared memory) against numpy."""
    from cuda_emulation import run_on_cpu

    func = scan_rows_primfunc(rows, length, "int32", name="main")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    src = tvm.compile(tvm.IRModule({"main": func}), target=target).mod.imports[0].inspect_source()
    x = np.random.default_rng(length).integers(-3, 4, size=(rows, length)).astype(np.int32)
    got = run_on_cpu(src, {"x": x}, {"out": (rows, length)}, rows, (32, 1), tmp_path, dtype="int32")["out"]
    np.testing.assert_array_equal(got, np.cumsum(x, axis=1))


@pytest.mark.parametrize("rows, length", [(1, 128), (3, 129)])
def test_row_scan_counting_unequal_ids_runs_on_cpu_threads(rows, length, tmp_path):
    """The scan that reads token ids and sums ``ids != pad`` (RoBERTa's position ids), CUDA kernel and CPU twin,
    against numpy."""
    from cuda_emulation import run_on_cpu

    ids = np.random.default_rng(length).integers(0, 4, size=(rows, length)).astype(np.int64)
    want = np.cumsum(ids != 1, axis=1).astype(np.int32)
    func = scan_rows_primfunc(rows, length, "int32", name="main", unequal_to=(1, "int32"))   # the emulation: one dtype
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    src = tvm.compile(tvm.IRModule({"main": func}), target=target).mod.imports[0].inspect_source()
    got = run_on_cpu(src, {"x": ids.astype(np.int32)}, {"out": (rows, length)}, rows, (32, 1), tmp_path,
                     dtype="int32")["out"]
    np.testing.assert_array_equal(got, want)
    cpu = tvm.compile(tvm.IRModule({"main": scan_rows_primfunc(rows, length, "int32", name="main",
                                                                 target_kind="llvm", unequal_to=(1, "int64"))}),
                      target="llvm")
    out = tvm.runtime.empty((rows, length), "int32")
    cpu["main"](tvm.runtime.tensor(ids), out)
    np.testing.assert_array_equal(out.numpy(), want)


def _compile_keeping_front(path, **options):
    """``stof_tvm.compile(path, **options)`` with the front end it built kept as ``art._front`` (the module the
    whole-graph rewrites start from): one import and attention rewrite of the model per test, not a second
    ``front_end`` call with the same arguments."""
    import stof_tvm.compiler as compiler

    plain, fronts = compiler.front_end, []

    def keep(*args, **kwargs):
        fronts.append(plain(*args, **kwargs))
        return fronts[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiler, "front_end", keep)
        art = stof_tvm.compile(path, **options)
    (art._front,) = fronts
    return art


def _staged_model(art) -> CompiledModel:
    """``art`` (an llvm artifact) rebuilt with the whole-graph rewrites of a CUDA-graph build, and loaded with the
    runtime's fixed format tensors (and the row scan of the position ids on our kernel)."""
    front = art._front
    mod = relax.transform.LiftTransformParams()(front.mod)
    mod = whole_graph(mod, len(front.inputs), True, "llvm")
    assert int(mod["main"].attrs["num_input"]) == len(front.inputs)
    executable = build(optimize(mod, front.target, None), front.target)
    manifest = {**art.manifest, "static_mask_inputs": True}
    return CompiledModel(executable, manifest, art.arrays, tvm.cpu(0), art.weights), mod


@pytest.mark.parametrize("batch", [1, 2])
def test_staged_inputs_keep_the_call_exact(roberta, batch):
    from stof_tvm.models import hf_export as hx

    inputs = hx.example_inputs("roberta", batch, SEQ)
    art = _compile_keeping_front(roberta, mask="bigbird", batch=batch, seq_len=SEQ, target="llvm", dtype="float32")
    (staged, mod), plain = _staged_model(art), art.load()
    assert staged.formats.static and not plain.formats.static
    assert any(gv.name_hint.startswith("stof_scan_rows") for gv, _ in mod.functions_items())    # the position ids
    want = plain(**inputs)["last_hidden_state"]
    np.testing.assert_array_equal(staged(**inputs)["last_hidden_state"], want)
    torch_out = hx.torch_outputs(hx.build_model("roberta", "tiny", "eager"), inputs)
    # the sparse mask makes it differ from the dense torch model; the dense mask must match torch float32
    dense = make_mask("dense", SEQ)
    out = staged(**inputs, mask=dense)["last_hidden_state"]
    assert np.linalg.norm(out - torch_out) / np.linalg.norm(torch_out) < 1e-5
    # back and forth between two masks: each call gets its own mask's result
    other = make_mask("sliding:window=8", SEQ)
    for mask in (None, other, None, dense, other):
        np.testing.assert_array_equal(staged(**inputs, mask=mask)["last_hidden_state"],
                                      plain(**inputs, mask=mask)["last_hidden_state"])


def _manifest(block_m=16, block_n=64) -> dict:
    return {"attention": {"kernel": {"kind": "block", "config": {"block_m": block_m, "block_n": block_n},
                                     "mask_batch": 1, "mask_heads": 1}, "batch": 1, "heads": 2},
            "mask": {"spec": "sliding:window=8", "seq_q": SEQ, "seq_k": SEQ}}


def test_fixed_format_tensors_hold_the_mask_in_use():
    """Two masks of one format size share one set of device tensors, which hold whichever was used last; a new
    size gets its own set, and the old one stays (captured graphs read it)."""
    a = make_mask("sliding:window=8", SEQ)
    b = a.copy()
    b[..., 9, 1] = False                          # the same tiles full / partial, other bits in one of them
    formats = MaskFormats(_manifest(), {}, tvm.cpu(0), static=True)
    plain = MaskFormats(_manifest(), {}, tvm.cpu(0))
    first = formats.tensors(a)
    assert [t.shape for t in first] == [t.shape for t in plain.tensors(b)]      # one format size
    assert any((x.numpy() != y.numpy()).any() for x, y in zip(plain.tensors(a), plain.tensors(b)))  # other values
    second = formats.tensors(b)
    assert all(x.same_as(y) for x, y in zip(first, second))
    for tensor, want in zip(formats.tensors(b), plain.tensors(b)):
        np.testing.assert_array_equal(tensor.numpy(), want.numpy())
    for tensor, want in zip(formats.tensors(a), plain.tensors(a)):
        np.testing.assert_array_equal(tensor.numpy(), want.numpy())
    default = formats.tensors(None)               # the default (the same spec as a): the values of a
    for tensor, want in zip(default, plain.tensors(a)):
        np.testing.assert_array_equal(tensor.numpy(), want.numpy())
    formats.tensors(b)
    for tensor, want in zip(formats.tensors(None), plain.tensors(a)):   # not the stale fast path
        np.testing.assert_array_equal(tensor.numpy(), want.numpy())
    dense = formats.tensors(make_mask("dense", SEQ))
    assert dense[1].shape != first[1].shape and not dense[1].same_as(first[1])


def test_only_small_inputs_are_staged():
    """Token ids and masks are copied into main's own buffers; an input over STAGE_MAX_BYTES (ViT's pixels at a
    large batch) is read where it is, and main keeps its signature."""
    from stof_tvm.compiler.graph_inputs import STAGE_MAX_BYTES

    big_rows = STAGE_MAX_BYTES // (4 * 1024) + 1
    builder = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType([2, 8], "int64"))
    pixels = relax.Var("pixels", relax.TensorType([big_rows, 1024], "float32"))
    with builder.function("main", [ids, pixels]):
        with builder.dataflow():
            total = builder.emit_output(relax.op.add(relax.op.sum(relax.op.astype(ids, "float32")),
                                                     relax.op.sum(pixels)))
        builder.emit_func_output(total)
    mod = builder.get()
    mod["main"] = mod["main"].with_attr("num_input", 2)
    staged = whole_graph(mod, 2, False, "llvm")["main"]
    assert [p.name for p in staged.params] == ["ids", "pixels"]
    first = staged.body.blocks[0].bindings[0].value
    assert first.op.name == "relax.call_tir" and [a.name for a in first.args[1].fields] == ["ids"]
    assert staged.params[1].same_as(mod["main"].params[1])        # the pixels parameter is read as it is


def test_staged_single_input_model_is_exact(hf_export):
    """ViT (one input, its pixels, staged alone) on llvm with the whole-graph rewrites: the same output as the
    module without them, and with a dense mask within float32 rounding of torch."""
    from stof_tvm.models import hf_export as hx

    path = hf_export("vit", "eager", "torchscript", 17, True, 2, SEQ)
    inputs = hx.example_inputs("vit", 1, SEQ)
    tokens = hx.sequence_length("vit")
    art = _compile_keeping_front(path, mask="dense", batch=1, seq_len=SEQ, target="llvm", dtype="float32")
    (staged, _), plain = _staged_model(art), art.load()
    out = staged(**inputs)["last_hidden_state"]
    np.testing.assert_array_equal(out, plain(**inputs)["last_hidden_state"])
    want = hx.torch_outputs(hx.build_model("vit", "tiny", "eager"), inputs)
    assert out.shape[1] == tokens and np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-5


def test_gathers_count_as_injective():
    """A legalized take (one spatial block reading the table at the ids' values) is marked injective, so FuseOps
    fuses it with the ids' arithmetic and the sum after it; a reduction stays as TVM annotated it."""
    from stof_tvm.compiler.gathers import INJECTIVE, gathers_injective, is_spatial_gather

    builder = relax.BlockBuilder()
    table = relax.Var("table", relax.TensorType([10, 4], "float32"))
    ids = relax.Var("ids", relax.TensorType([3], "int64"))
    with builder.function("main", [table, ids]):
        with builder.dataflow():
            rows = builder.emit(relax.op.take(table, relax.op.add(ids, relax.const(1, "int64")), axis=0,
                                              mode="clip"))
            out = builder.emit_output(relax.op.sum(relax.op.add(rows, rows), axis=[1]))
        builder.emit_func_output(out)
    mod = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(builder.get()))
    kinds = {gv.name_hint: (is_spatial_gather(f), int(f.attrs["op_pattern"]))
             for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert kinds["take"][0] and not kinds["sum"][0], kinds
    marked = gathers_injective(mod)
    assert int(marked["take"].attrs["op_pattern"]) == INJECTIVE
    assert int(marked["sum"].attrs["op_pattern"]) == kinds["sum"][1]
    fused = relax.transform.FuseTIR()(relax.transform.FuseOps()(marked))
    names = [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert "take" not in names and any("take" in name for name in names), names     # the add, take, add fused
    lib = tvm.compile(fused, target="llvm")
    vm = relax.VirtualMachine(lib, tvm.cpu())
    table_np = np.arange(40, dtype=np.float32).reshape(10, 4)
    got = vm["main"](tvm.runtime.tensor(table_np), tvm.runtime.tensor(np.array([0, 8, 20], np.int64))).numpy()
    np.testing.assert_array_equal(got, 2 * table_np[[1, 9, 9]].sum(axis=1))         # ids + 1, clamped to the table


MAX_SERIAL_STEPS = 1024     # loop iterations one thread may run: the templates' deepest nest at 4096 rows is 768


def test_no_kernel_walks_a_tensor_in_one_thread(roberta):
    """RoBERTa at 8 x 512 tokens for CUDA: no kernel's thread runs more than MAX_SERIAL_STEPS loop iterations (the
    census's ``serial_steps``). The guard fails on the form dlight gave session 15's value checks (a thread per input
    counting all 4096 values: 0.35 ms of a 1.85 ms forward on the H200)."""
    front = front_end(roberta, mask="bigbird", batch=8, seq_len=512, target="cuda", dtype="float16")
    optimized, _ = lower(front, None, cuda_graph=True)
    steps = {name: max(k.serial_steps for k in kernels) for name, kernels in kernel_grids(optimized).items() if kernels}
    assert max(steps.values()) <= MAX_SERIAL_STEPS, sorted(steps.items(), key=lambda kv: -kv[1])[:5]
    assert steps["stof_count_outside"] == 4096 // 1024

    bb = relax.BlockBuilder()
    ids = [relax.Var(f"x{i}", relax.TensorType([8, 512], "int64")) for i in range(3)]
    with bb.function("main", ids):
        with bb.dataflow():
            flags = [relax.op.greater_equal(x, relax.const(2, "int64")) for x in ids]
            counts = relax.op.sum(relax.op.astype(relax.op.stack(flags, axis=0), "int64"), axis=[1, 2])
            out = bb.emit_output(counts)
        bb.emit_func_output(out)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024,
                                "max_shared_memory_per_block": 232448})
    stacked = kernel_grids(optimize(bb.get(), target, None))
    assert max(k.serial_steps for kernels in stacked.values() for k in kernels) == 8 * 512 > MAX_SERIAL_STEPS
