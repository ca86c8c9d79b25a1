"""Programmatic dependent launch for every CUDA kernel of a build (Hopper, sm_90 and later).

A transformer forward pass is a chain of ~100 kernels, each reading what the one before wrote. With plain stream
order a kernel's blocks are scheduled only after the previous kernel has finished and its memory is flushed, so
every boundary costs the launch latency plus the new kernel's block start-up (a few microseconds; at 1 x 128
tokens most kernels run for less than ten). Launched with CUDA's programmatic stream serialization attribute, a
kernel may be scheduled as soon as every block of the previous one has issued ``griddepcontrol.launch_dependents``;
it then runs ``griddepcontrol.wait``, which returns once the previous kernel has completed and its writes are
visible. So the launch and block scheduling of kernel i+1 overlap the tail of kernel i, with the same ordering of
memory accesses as before.

The pass works on the device kernels SplitHostDevice made, so it covers every kernel alike (fusion templates,
attention kernels, TVM's default schedules): it puts ``wait`` then ``launch_dependents`` at the top of each
kernel, after its thread bindings and before any statement that could touch global memory, and adds TVM's
launch tag (spelled ``use_programtic`` in TVM) that makes the runtime launch the kernel with the attribute. A kernel
that already places its own ``wait`` (to read constant data, weights, before it) keeps its placement and only
gets the tag.
Signalling right after the wait lets the next kernel's blocks take SM slots freed by this one's finished blocks;
they hold no global state until their own wait returns. A kernel launched after a plain one (a copy, a torch
kernel) simply waits for it as stream order would. Builds use it through :data:`PIPELINE` (TVM's ``s_tir`` TIR
pipeline followed by this pass).
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm.script import tirx as T

LAUNCH_TAG = "tirx.use_programtic_dependent_launch"
DYNAMIC_SHARED_TAG = "tirx.use_dyn_shared_memory"
PIPELINE = "stof_dependent_launch"
DEVICE_KERNEL_LAUNCH = 2  # calling_conv of the kernels SplitHostDevice makes
FIRST_ARCH = 90


def supports(target: tvm.target.Target) -> bool:
    """Whether ``target`` is a CUDA target whose GPUs have ``griddepcontrol`` (sm_90 and later)."""
    if target.kind.name != "cuda":
        return False
    arch = str(target.attrs.get("arch", ""))
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    return bool(digits) and int(digits) >= FIRST_ARCH


def _grid_dependency_prologue() -> list:
    return [tvm.tirx.Evaluate(T.ptx["griddepcontrol.wait"]()),
            tvm.tirx.Evaluate(T.ptx["griddepcontrol.launch_dependents"]())]


def places_own_wait(body) -> bool:
    """Whether ``body`` already runs ``griddepcontrol.wait`` somewhere."""
    found = []

    def visit(call):
        action = getattr(call.args[0], "value", None) if call.args else None
        if getattr(call.op, "name", "") == "tirx.ptx.griddepcontrol" and action == "wait":
            found.append(call)
        return call

    tvm_ffi.structural_map(body, (tvm.ir.Call, visit), order="post")
    return bool(found)


def _is_thread_binding(stmt) -> bool:
    return isinstance(stmt, tvm.tirx.AttrStmt) and stmt.attr_key == "thread_extent"


def _is_declaration(stmt) -> bool:
    return isinstance(stmt, tvm.tirx.DeclBuffer)


def with_prologue(body):
    """``body`` with the wait and the signal placed after its leading thread bindings (and the buffer
    declarations between them), before the first statement that does any work."""
    if _is_thread_binding(body):
        return tvm.tirx.AttrStmt(body.node, body.attr_key, body.value, with_prologue(body.body))
    if isinstance(body, tvm.tirx.SeqStmt):
        stmts = list(body.seq)
        first = next((i for i, stmt in enumerate(stmts) if not _is_declaration(stmt)), len(stmts))
        if first < len(stmts) and _is_thread_binding(stmts[first]):
            stmts[first] = with_prologue(stmts[first])
        else:
            stmts[first:first] = _grid_dependency_prologue()
        return tvm.tirx.SeqStmt(stmts)
    return tvm.tirx.SeqStmt([*_grid_dependency_prologue(), body])


def launch_tags(tags) -> list[str]:
    """The kernel's launch tags with the dependent-launch tag added (the dynamic shared memory tag stays last,
    where TVM's runtime expects it)."""
    tags = [str(tag) for tag in tags]
    if LAUNCH_TAG in tags:
        return tags
    at = tags.index(DYNAMIC_SHARED_TAG) if DYNAMIC_SHARED_TAG in tags else len(tags)
    return tags[:at] + [LAUNCH_TAG] + tags[at:]


def _is_kernel(func) -> bool:
    attrs = func.attrs
    return (isinstance(func, tvm.tirx.PrimFunc) and attrs is not None
            and int(attrs.get("calling_conv", 0)) == DEVICE_KERNEL_LAUNCH
            and "target" in attrs and supports(attrs["target"]))


@tvm.transform.module_pass(opt_level=0, name="DependentLaunch")
def dependent_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every sm_90+ CUDA kernel of ``mod`` (after SplitHostDevice) made a programmatic dependent launch."""
    updates = {}
    for gvar, func in mod.functions_items():
        if _is_kernel(func):
            tags = launch_tags(func.attrs.get("tirx.kernel_launch_params", []))
            body = func.body if places_own_wait(func.body) else with_prologue(func.body)
            updates[gvar] = func.with_body(body).with_attr("tirx.kernel_launch_params", tags)
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


def _pipeline():
    from tvm.s_tir.pipeline import default_s_tir_pipeline

    lower, finalize_host, finalize_device = default_s_tir_pipeline()

    @tvm.transform.module_pass(opt_level=0, name="LowerWithDependentLaunch")
    def lower_with_dependent_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return dependent_launch(lower(mod))

    return lower_with_dependent_launch, finalize_host, finalize_device


tvm.tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)
