"""stof-tvm: sparse-attention transformer inference on NVIDIA GPUs through Apache TVM."""
from stof_tvm.attention import AttentionPlan, sparse_attention
from stof_tvm.sparse_formats import make_mask, normalize_mask

__all__ = ["AttentionPlan", "sparse_attention", "make_mask", "normalize_mask", "compile", "tune"]


def __getattr__(name):
    # stof_tvm.compile imports TVM's compiler (tvm.relax); load it on first use so that processes running
    # with TVM's runtime alone (stof_tvm.runtime) can still import stof_tvm.
    if name == "compile":              # the compiler, tuning first when asked (stof_tvm.workflow)
        from stof_tvm.workflow import compile

        return compile
    if name == "tune":                 # MetaSchedule and the compiler too: same reason
        from stof_tvm.tuning import tune

        return tune
    raise AttributeError(f"module 'stof_tvm' has no attribute {name!r}")
