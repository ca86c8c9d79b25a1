"""Hardware descriptions for the analytical cost model.

A :class:`HardwareProfile` holds what the model needs to predict a kernel's time: the SM count and clock, the
per-SM limits that decide occupancy (shared memory, registers, threads, resident blocks), the peak rates of the
tensor cores and the CUDA cores, and the memory system (DRAM bandwidth, L2 size and bandwidth).

:func:`detect` reads what the CUDA driver reports through ``tvm.cuda(i)`` (SM count, clock, shared memory per
block, L2 size, device memory) and fills the rest from the built-in profile of the same architecture, so a
profile always comes back complete. :data:`H200` is the default when no GPU is present (this repository's CPU
machines build for the H200).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["DeviceUnavailable", "HardwareProfile", "H200", "H100", "A100", "RTX4090", "PROFILES", "detect",
           "profile_for_target", "get_profile"]


class DeviceUnavailable(RuntimeError):
    """This machine lacks the device an artifact was built for (no CUDA GPU, or one of another architecture): a
    fact about the machine the user can act on, which the CLI reports as an error line rather than a traceback."""


@dataclass(frozen=True)
class HardwareProfile:
    """Static description of one GPU (rates are per second for the whole chip, sizes in bytes).

    ``tensor_flops`` is the dense fp16/bf16 tensor-core peak reachable with ``mma.sync`` (what our kernels
    issue), ``cuda_flops`` the fp32 FMA peak counted as two operations. ``dram_bw`` and ``l2_bw`` are peak
    bandwidths; the cost model applies calibrated efficiencies on top.
    """

    name: str
    compute_version: str
    sm_count: int
    clock_hz: float
    smem_per_sm: int
    smem_per_block: int
    regs_per_sm: int
    regs_per_thread: int
    threads_per_sm: int
    threads_per_block: int
    blocks_per_sm: int
    tensor_flops: float
    cuda_flops: float
    dram_bw: float
    l2_bytes: int
    l2_bw: float
    dram_bytes: int
    warp_size: int = 32

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("int", "float") and not value > 0:
                raise ValueError(f"HardwareProfile.{field.name} must be positive, got {value!r}")

    @property
    def warps_per_sm(self) -> int:
        return self.threads_per_sm // self.warp_size

    def per_sm(self, chip_rate: float) -> float:
        """A chip-wide rate divided among the SMs."""
        return chip_rate / self.sm_count

    def replace(self, **changes) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)


_KIB = 1024
_MIB = 1024 * 1024
_GIB = 1024 * _MIB

# H200 SXM (GH100, 141 GB HBM3e): 132 SMs at up to 1.98 GHz, 228 KiB shared memory per SM (227 KiB per block),
# 64 Ki registers per SM, 50 MiB L2, 4.8 TB/s. mma.sync issues at about two thirds of the wgmma dense peak
# (989 TFLOP/s), hence 660 TFLOP/s here; 128 fp32 lanes per SM give 66.9 TFLOP/s of FMA.
H200 = HardwareProfile(
    name="NVIDIA H200", compute_version="9.0", sm_count=132, clock_hz=1.98e9, smem_per_sm=228 * _KIB,
    smem_per_block=227 * _KIB, regs_per_sm=65536, regs_per_thread=255, threads_per_sm=2048,
    threads_per_block=1024, blocks_per_sm=32, tensor_flops=660e12, cuda_flops=66.9e12, dram_bw=4.8e12,
    l2_bytes=50 * _MIB, l2_bw=12e12, dram_bytes=141 * 10**9)

H100 = H200.replace(name="NVIDIA H100 SXM", dram_bw=3.35e12, dram_bytes=80 * 10**9)

A100 = HardwareProfile(
    name="NVIDIA A100 SXM4", compute_version="8.0", sm_count=108, clock_hz=1.41e9, smem_per_sm=164 * _KIB,
    smem_per_block=163 * _KIB, regs_per_sm=65536, regs_per_thread=255, threads_per_sm=2048,
    threads_per_block=1024, blocks_per_sm=32, tensor_flops=312e12, cuda_flops=19.5e12, dram_bw=2.04e12,
    l2_bytes=40 * _MIB, l2_bw=5.5e12, dram_bytes=80 * 10**9)

RTX4090 = HardwareProfile(
    name="NVIDIA GeForce RTX 4090", compute_version="8.9", sm_count=128, clock_hz=2.52e9, smem_per_sm=100 * _KIB,
    smem_per_block=99 * _KIB, regs_per_sm=65536, regs_per_thread=255, threads_per_sm=1536,
    threads_per_block=1024, blocks_per_sm=24, tensor_flops=165e12, cuda_flops=82.6e12, dram_bw=1.01e12,
    l2_bytes=72 * _MIB, l2_bw=5.0e12, dram_bytes=24 * 10**9)

PROFILES = {"h200": H200, "h100": H100, "a100": A100, "rtx4090": RTX4090}


def get_profile(name: str) -> HardwareProfile:
    """A built-in profile by name (``h200``, ``h100``, ``a100``, ``rtx4090``; case-insensitive)."""
    key = str(name).lower().replace("-", "").replace("_", "").replace("nvidia", "").strip()
    if key not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; expected one of {', '.join(PROFILES)}")
    return PROFILES[key]


def _closest_builtin(compute_version: str, memory_bytes: int) -> HardwareProfile:
    if compute_version.startswith("9."):
        return H200 if memory_bytes > 100 * 10**9 else H100
    if compute_version == "8.9":
        return RTX4090
    return A100


def detect(device_index: int = 0) -> HardwareProfile:
    """The profile of CUDA device ``device_index`` (driver-reported values, built-in rates), or :data:`H200`.

    Reported by the driver and used as they are: name, compute version, SM count, clock, threads per block,
    L2 size and device memory. Rates scale with the clock and SM count relative to the closest built-in profile
    of the same architecture. Shared memory per block: the driver reports the default 48 KiB limit, while the
    kernels opt in to the architecture's larger limit (TVM sets the dynamic shared-memory attribute at launch),
    so the built-in profile's opt-in limit is kept when it is larger (measured on the H200: 49152 reported).
    """
    import tvm

    dev = tvm.cuda(device_index)
    if not dev.exist:
        return H200
    version = str(dev.compute_version)
    memory = int(dev.total_global_memory or 0)
    base = _closest_builtin(version, memory)
    sm_count = int(dev.multi_processor_count) or base.sm_count
    clock = float(dev.max_clock_rate or 0) * 1e3 or base.clock_hz          # the driver reports kHz
    scale = (sm_count * clock) / (base.sm_count * base.clock_hz)
    return base.replace(
        name=str(dev.device_name), compute_version=version, sm_count=sm_count, clock_hz=clock,
        smem_per_block=max(int(dev.max_shared_memory_per_block or 0), base.smem_per_block),
        threads_per_block=int(dev.max_threads_per_block) or base.threads_per_block,
        l2_bytes=int(dev.l2_cache_size_bytes or 0) or base.l2_bytes, dram_bytes=memory or base.dram_bytes,
        tensor_flops=base.tensor_flops * scale, cuda_flops=base.cuda_flops * scale)


def profile_for_target(target) -> HardwareProfile:
    """The profile matching a TVM CUDA target: the local GPU if one is present, else the profile its ``arch``
    names (sm_90 -> H200, sm_89 -> RTX 4090, sm_80 -> A100), with the target's shared-memory limit applied."""
    import tvm

    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    if target.kind.name != "cuda":
        raise ValueError(f"profile_for_target expects a CUDA target, got kind {target.kind.name!r}")
    if tvm.cuda(0).exist:
        profile = detect(0)
    else:
        arch = str(target.attrs.get("arch", "sm_90"))
        digits = arch.split("_")[-1].rstrip("a")
        version = f"{digits[:-1]}.{digits[-1]}" if digits.isdigit() and len(digits) >= 2 else "9.0"
        profile = _closest_builtin(version, H200.dram_bytes if version.startswith("9.") else 0)
    limit = target.attrs.get("max_shared_memory_per_block")
    return profile.replace(smem_per_block=min(int(limit), profile.smem_per_block)) if limit else profile
