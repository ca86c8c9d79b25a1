"""A compile prints no TVM warning about forms the compiler has already made safe.

TVM's ``FoldConstant`` legalizes every call it visits, also those it cannot fold, and TVM warns from C++ while
legalizing ``pow(x, n >= 3)`` (GPT-2's ``gelu_new``) and a ``take`` in ``"fast"`` mode (every embedding lookup).
The compiler turns integer powers into products and makes input-indexed gathers clamp (``"clip"``) before that
pass, so a user compiling HF GPT-2 saw neither the pow warning nor "Fast mode segfaults when there are
out-of-bounds indices" that came before for what no kernel of the module does. Folding the model's constant
arithmetic with onnx's reference evaluator raises no numpy floating-point warning either (T5's relative-position
buckets take the log of a zero distance, which a later ``Where`` discards)."""
import warnings

import stof_tvm

TVM_WARNINGS = ("Detected pow(x, y)", "Fast mode segfaults")


def test_hf_gpt2_compiles_without_tvms_pow_and_gather_warnings(hf_export, capfd):
    path = hf_export("gpt2", "eager", "torchscript", 17, False)
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stof_tvm.compile(path, mask="bigbird", batch=2, seq_len=64, target="llvm", dtype="float32")
    err = capfd.readouterr().err
    assert not [w for w in TVM_WARNINGS if w in err], err[-2000:]


def test_hf_t5_constant_folding_raises_no_numpy_warning(hf_export):
    path = hf_export("t5", "eager", "torchscript", 17, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stof_tvm.compile(path, mask="bigbird", batch=2, seq_len=64, target="llvm", dtype="float32")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
