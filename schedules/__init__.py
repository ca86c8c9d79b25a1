"""TensorIR kernels and schedule templates (installed as stof_tvm.schedules).

Importing it makes TVMScript's macro expansion fast (:mod:`stof_tvm.tvmscript_macros`): the thread-level
kernels here expand hundreds of ``T.macro`` calls each."""
from stof_tvm import tvmscript_macros as _tvmscript_macros

_tvmscript_macros.install()
