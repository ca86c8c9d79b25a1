"""TensorIR kernels and schedule templates (installed as stof_tvm.schedules)."""
