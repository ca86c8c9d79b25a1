"""The wgmma GEMM kernel's ``stream_k`` knob (schedules/templates/wgmma_kernel.py): one block per SM, each on an equal
share of all tiles' k steps; a tile split between blocks is summed by the last of its parts to arrive, counted in an
int32 ``counters`` input that is zero before and after every call. What the CPU can check: the partition, the
slots and the last-arriver sum (a model of the kernel's protocol in numpy, every arrival order), the knob's
refusals, the kernel's source and ptxas report, and the compile path passing the counters."""
from __future__ import annotations

import itertools
import re
import shutil

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

from stof_tvm.schedules.templates import cuda_source, get_template
from stof_tvm.schedules.templates.gemm_wgmma import build_kernel, nvcc_cubin
from stof_tvm.schedules.templates.wgmma_kernel import WgmmaConfig, stream_k_block, stream_k_start

# ViT-Base's FFN down at 8 x 197 tokens: 13 row tiles x 4 column tiles of 128 x 192, 48 k steps each, for 132 blocks
FFN_DOWN = {"m": 1576, "n": 768, "k": 3072}
STREAM = {"block_n": 192, "stages": 4, "persistent": True, "pingpong": False, "staged": True, "loads": "tma",
          "stream_k": True}
SIGNATURE = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?gemm_wgmma_kernel\(([^)]*)\)')


def block_tiles(block: int, total: int, grid: int, k_steps: int) -> list[tuple[int, int, int]]:
    """(tile, first step, end step) of each tile block ``block`` has k steps of, as the kernel walks them."""
    first, end = stream_k_start(block, total, grid), stream_k_start(block + 1, total, grid)
    return [(tile, max(first - tile * k_steps, 0), min(end - tile * k_steps, k_steps))
            for tile in range(first // k_steps, (end - 1) // k_steps + 1)]


def slot(block: int, tile: int, total: int, grid: int, k_steps: int) -> int:
    """The kernel's workspace slot of ``block``'s part of ``tile``: 0 for the block's first tile, 1 for its last."""
    return block * 2 + (0 if tile == stream_k_start(block, total, grid) // k_steps else 1)


@settings(max_examples=300, deadline=None)
@given(tiles=st.integers(1, 300), k_steps=st.integers(1, 64), grid=st.integers(1, 132))
def test_the_blocks_cover_every_step_once_and_split_at_most_two_tiles_each(tiles, k_steps, grid):
    total = tiles * k_steps
    if total < grid:   # the kernel refuses these (test_refusals)
        return
    covered = []
    for block in range(grid):
        first, end = stream_k_start(block, total, grid), stream_k_start(block + 1, total, grid)
        assert first < end, "a block without k steps"
        covered += range(first, end)
        assert all(stream_k_block(step, total, grid) == block for step in (first, end - 1))
        parts = [(tile, k0, k1) for tile, k0, k1 in block_tiles(block, total, grid, k_steps)
                 if (k0, k1) != (0, k_steps)]
        # only a block's first and last tiles can be shared, and they take different slots
        assert len(parts) <= 2 and len({slot(block, tile, total, grid, k_steps) for tile, _, _ in parts}) == len(parts)
    assert covered == list(range(total))


@pytest.mark.parametrize("tiles, k_steps, grid", [(52, 48, 132), (100, 12, 132), (7, 5, 9), (3, 40, 132)])
def test_the_last_part_to_arrive_sums_the_parts_in_block_order(tiles, k_steps, grid):
    """The kernel's protocol played in numpy: per tile, each block's part of the k sum written to its slot, a counter
    raised per arrival; whichever order the parts arrive in, the one that brings the counter to the number of parts
    sums the slots of blocks lo..hi in order: exactly the same float32 value, the whole k sum, the counter zero
    again."""
    total = tiles * k_steps
    rng = np.random.default_rng(0)
    steps = rng.standard_normal((tiles, k_steps)).astype(np.float32)   # one output element's products per step
    parts = {}
    for block in range(grid):
        for tile, k0, k1 in block_tiles(block, total, grid, k_steps):
            value = np.float32(0)
            for t in range(k0, k1):
                value = np.float32(value + steps[tile, t])
            parts[tile, block] = value
    for tile in range(tiles):
        lo, hi = stream_k_block(tile * k_steps, total, grid), stream_k_block(tile * k_steps + k_steps - 1, total, grid)
        blocks = [block for (t, block) in parts if t == tile]
        assert blocks == list(range(lo, hi + 1))
        if lo == hi:
            continue   # the whole tile in one block: stored without the workspace
        workspace = {slot(block, tile, total, grid, k_steps): parts[tile, block] for block in blocks}
        assert len(workspace) == len(blocks)
        sums = set()
        for order in itertools.islice(itertools.permutations(blocks), 24):
            counter = 0
            for block in order:
                arrived, counter = counter, counter + 1
                if arrived == hi - lo:   # the last part: sum every slot in block order, reset the counter
                    value = np.float32(0)
                    for c in range(lo, hi + 1):
                        value = np.float32(value + workspace[slot(c, tile, total, grid, k_steps)])
                    sums.add(float(value))
                    counter = 0
            assert counter == 0
        assert len(sums) == 1
        assert abs(sums.pop() - float(steps[tile].sum(dtype=np.float64))) < 1e-4 * k_steps


@pytest.mark.parametrize("change, message", [
    ({"pingpong": True}, "stream_k"), ({"persistent": False}, "stream_k"), ({"loads": "cp.async"}, "stream_k"),
    ({"early_weights": True}, "stream_k"), ({"stream_k": "yes"}, "stream_k must be a bool")])
def test_refusals(change, message):
    with pytest.raises(ValueError, match=message):
        WgmmaConfig(**{**STREAM, **change}).validate()


def test_fewer_k_steps_than_blocks_are_refused():
    with pytest.raises(ValueError, match="fewer than"):
        get_template("gemm_bias_wgmma").kernel({"m": 128, "n": 384, "k": 64}, "float16", STREAM)


def test_without_the_knob_the_kernel_is_unchanged():
    pick = get_template("gemm_bias_wgmma").default_knobs(FFN_DOWN)
    assert (cuda_source(build_kernel("gemm_bias_wgmma", FFN_DOWN, "float16", pick))
            == cuda_source(build_kernel("gemm_bias_wgmma", FFN_DOWN, "float16", dict(pick, stream_k=False))))


def test_the_kernel_takes_counters_and_a_workspace_and_publishes_each_part():
    """Parameters A, W, bias, counters, out, workspace (the caller allocates it: nothing is allocated inside, where a
    CUDA graph capture would forbid it); the source fences each part before one atomic add per warp, and reads the
    parts back at gpu scope (not through the SM's incoherent L1)."""
    func = get_template("gemm_bias_wgmma").kernel(FFN_DOWN, "float16", STREAM)
    assert [p.name for p in func.params] == ["A", "W", "bias_buf", "counters", "out", "ws"]
    counters, workspace = get_template("gemm_bias_wgmma").stream_k_buffers(FFN_DOWN, STREAM)
    assert (counters, workspace) == (13 * 4 * 8, 132 * 2 * 256 * 96)   # tiles x warps; blocks x 2 parts x fragments
    src = cuda_source(build_kernel("gemm_bias_wgmma", FFN_DOWN, "float16", STREAM))
    assert "counters_ptr" in SIGNATURE.search(src).group(1)
    body = src[SIGNATURE.search(src).end():]
    assert len(re.findall(r"atom_global_add_s32\(arrived", body)) == 1
    assert body.index("fence_acq_rel_gpu();") < body.index("atom_global_add_s32(arrived")
    assert "ld_relaxed_gpu_global_f32(part" in body


@pytest.mark.parametrize("name, shape", [
    ("gemm_bias_wgmma", FFN_DOWN),
    ("gemm_bias_gelu_erf_wgmma", {"m": 1576, "n": 3072, "k": 768}),
    ("qkv_projection_wgmma", {"batch": 8, "seq": 197, "heads": 12, "head_dim": 64}),
    ("gemm_wgmma", {"m": 1576, "n": 768, "k": 768}),
])
def test_ptxas_reports_no_spills_and_no_warning(name, shape, tmp_path):
    """Every ViT-Base GEMM form at 1576 rows: no stack frame, spills or ptxas warning (a flat loop over all k steps
    made ptxas wait for every wgmma batch, C7517; the loop per tile keeps one in flight)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    knobs = dict(STREAM, fast_gelu=True, gelu_form="half") if "gelu" in name else STREAM
    report = nvcc_cubin(cuda_source(build_kernel(name, shape, "float16", knobs)), tmp_path / "kernel.cubin")
    assert report["stack_frame"] == report["spill_stores"] == report["spill_loads"] == 0, report
    assert report["warnings"] == []


def test_the_compile_path_passes_zero_counters_and_takes_the_workspace_as_an_output():
    """A stream-K GEMM's call gets an int32 zeros constant of its counter count after its inputs and a float32
    workspace as a second output (memory planning places it); the model uses the first output. A call without the
    knob is a plain call_tir."""
    from stof_tvm.compiler.downstream import _Templates

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a", "max_threads_per_block": 1024,
                                "max_shared_memory_per_block": 232448})
    x = relax.Var("x", relax.TensorType([1576, 3072], "float16"))
    w = relax.Var("w", relax.TensorType([768, 3072], "float16"))
    b = relax.Var("b", relax.TensorType([768], "float16"))
    stream = _Templates(tvm.IRModule(), target, None, "wgmma", schedule=False,
                        gemm_knobs=dict(STREAM, early_weights=False))
    got, stage = stream.call("gemm_bias_wgmma", FFN_DOWN, "float16", [x, w, b], (1576, 768))
    assert isinstance(got, relax.TupleGetItem) and got.index == 0
    args = list(got.tuple_value.args[1])
    counters, workspace = get_template("gemm_bias_wgmma").stream_k_buffers(FFN_DOWN, stage["knobs"])
    zeros = args[3].value.numpy()
    assert len(args) == 4 and zeros.dtype == np.int32 and zeros.size == counters and not zeros.any()
    outputs = got.tuple_value.ty_args[0].fields
    assert [list(o.shape) for o in outputs] == [[1576, 768], [workspace]] and outputs[1].dtype == "float32"
    plain = _Templates(tvm.IRModule(), target, None, "wgmma", schedule=False)
    got, _ = plain.call("gemm_bias_wgmma", FFN_DOWN, "float16", [x, w, b], (1576, 768))
    assert len(got.args[1]) == 3


def test_gpu_plan_s22_times_each_pick_beside_its_stream_k_sets():
    """``--plan s22streamk``: ViT-Base's four GEMMs at 1576 rows and FFN down at 4096, each the knob space's first set
    then a stream_k set per tile width dividing n (the erf GELU's in its float16-pair form), every set one the
    template takes, with a tag of its own."""
    from test_gemm_tma import _bench_module

    bench = _bench_module()
    assert len(bench.S22_CASES) == 5
    for name, shape in bench.S22_CASES:
        space = get_template(name).knob_space(shape, "float16")
        sets = bench.s22_knob_sets(name, shape, space)
        assert sets[0] == space[0] and not sets[0].get("stream_k")
        assert [kn["block_n"] for kn in sets[1:]] == [192, 128] and all(kn["stream_k"] for kn in sets[1:])
        assert all(kn.get("gelu_form") == "half" for kn in sets[1:]) == ("gelu_erf" in name)
        assert len({bench.knob_tag(kn) for kn in sets}) == len(sets)
        for knobs in sets:
            get_template(name).config(knobs)
