"""Where the engine runs and in which dtype, decided once at startup from what this machine can do.

`dtype="auto"` picks the fastest dtype the hardware runs natively: bfloat16 on CUDA (float16 on GPUs
without bf16), and on a CPU bfloat16 only where the CPU multiplies bf16 in hardware (AVX512_BF16 or AMX
on x86, the BF16 extension on Arm). Elsewhere a CPU emulates bf16 through fp32 and runs it slower than
fp32 itself, so auto keeps fp32 there. Capabilities differ between machines of one fleet: nothing here is
assumed, everything is read off the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nanovllm.common.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# cpuinfo flags that mean native bf16 matrix arithmetic: x86 AVX512_BF16 / AMX-BF16, Arm's BF16 extension.
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@dataclass(frozen=True)
class Placement:
    """The device and dtype the engine runs in, and why that dtype (logged at startup)."""

    device: torch.device
    dtype: torch.dtype
    reason: str

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (x86 "flags", Arm "Features"); empty elsewhere."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_bf16_support(flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether this CPU has native bf16 matrix arithmetic, and the evidence either way."""
    flags = cpu_flags() if flags is None else flags
    found = [f for f in _BF16_CPU_FLAGS if f in flags]
    if found:
        return True, f"the CPU has native bf16 ({', '.join(found)})"
    # Where /proc/cpuinfo is missing or terse, ask torch's own CPU probe (x86 only).
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if not flags and probe is not None and probe():
        return True, "the CPU has native bf16 (avx512_bf16, per torch's CPU probe)"
    capability = torch.backends.cpu.get_cpu_capability()
    return False, f"the CPU has no native bf16 (no avx512_bf16/amx_bf16; torch CPU capability {capability})"


def resolve_device(name: str) -> torch.device:
    """ "auto" -> CUDA when available, else CPU; an explicit device must exist on this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device {name!r} is not a device name; use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device {name!r} is not supported; nanovllm runs on cpu and cuda")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but this machine has no usable CUDA device")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} GPUs"
        )
    return device


def resolve_placement(device_name: str, dtype_name: str) -> Placement:
    """The device and dtype to run in, or a ConfigError naming both when the device cannot run the dtype.

    A tiny matmul in the chosen dtype proves the device runs it, before any model or process starts."""
    device = resolve_device(device_name)
    where = f"device {device_name!r} ({device})"
    if dtype_name == "auto":
        dtype, reason = _auto_dtype(device)
    elif dtype_name in DTYPES:
        dtype, reason = DTYPES[dtype_name], "asked for"
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"dtype 'bfloat16' is not supported by the GPU of {where}; use float16")
        if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_bf16_support()[0]:
            reason = "asked for; the CPU has no native bf16, so it is emulated and slower than float32"
    else:
        raise ConfigError(f"dtype {dtype_name!r} is not supported on {where}: use auto, {', '.join(DTYPES)}")
    try:
        a = torch.ones(8, 8, dtype=dtype, device=device)
        (a @ a).sum().item()
    except RuntimeError as exc:
        raise ConfigError(f"dtype {dtype_name!r} cannot run on {where}: {exc}") from exc
    return Placement(device, dtype, reason)


def _auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: the GPU supports bf16"
        return torch.float16, "auto: the GPU has no bf16, float16 instead"
    native, evidence = cpu_bf16_support()
    if native:
        return torch.bfloat16, f"auto: {evidence}"
    return torch.float32, f"auto: {evidence}, and emulated bf16 is slower than float32"


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """CPUs the process's cgroup quota allows (rounded up), or None without a quota. Reads cgroup v2's
    cpu.max ("max 100000" or "200000 100000"), else v1's cpu.cfs_quota_us / cpu.cfs_period_us."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or int(period) <= 0:
        return None
    return max(1, -(-int(quota) // int(period)))


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may actually run on: its affinity mask, capped by its cgroup's quota (a pod's CPU
    limit). os.cpu_count() and torch's default see every core of the host instead."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root)
    return allowed if limit is None else min(allowed, limit)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without waiting for the GPU. A plain copy from pageable memory makes the
    host wait until the GPU has run everything queued before it (the step's forward pass, say); one from
    pinned memory is queued in stream order and returns at once. torch caches the pinned buffers."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


_NUMPY_DTYPES = {
    torch.long: np.int64,
    torch.int32: np.int32,
    torch.float64: np.float64,
    torch.float32: np.float32,
}


def host_tensor(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A CPU tensor of a (possibly nested) list of Python numbers. numpy converts a list about four times
    faster than torch.tensor, which parses it element by element, and a step converts several such lists
    (docs/performance.md#measurements-behind-choices-in-the-code)."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))
