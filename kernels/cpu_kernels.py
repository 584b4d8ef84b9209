"""Build and load the C++ CPU kernels in kernels/csrc on first use (cached by torch's extension builder).

The decode attention lives there (with RMSNorm, RoPE and the SwiGLU gate): on a CPU, gathering paged K/V
into a padded tensor for SDPA costs as much as the attention itself, and no PyTorch op reads a paged cache
in place. So does the projections' matmul for a few rows (small batches, speculative verification), which
reads each weight once where PyTorch's GEMM is far from the memory's speed; structured output's token
bitmasks applied to the logits without unpacking them into a tensor; and sampling at temperature > 0 with one
uniform number per row instead of an exponential per vocabulary entry. When no compiler is available the
engine keeps the PyTorch implementation, which computes the same thing (sampling: draws from the same
distribution).

Every kernel takes float32, bfloat16 or float16 tensors, all of one call in one dtype (a mix is an
error that names the dtypes), and returns that dtype; arithmetic is in fp32, and 16-bit results are rounded
where transformers rounds (see the .cpp header). bench/cpu_kernels.py times each against PyTorch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from nanovllm.common.logging import get_logger

log = get_logger(__name__)

# Resolved: one path whether imported installed or from the source tree (the Makefile builds from there).
_CSRC = Path(__file__).resolve().parent / "csrc"
# Two translation units, compiled side by side: the Python bindings (with decode_layers_cpu.cpp, whose classes
# they bind: the only code that needs torch/extension.h), and every kernel's file in one unit
# (kernels_cpu.cpp). Parsing ATen's headers was most of each file's compilation, paid once per file
# (docs/performance.md#measurements-behind-choices-in-the-code).
_SOURCES = [_CSRC / "bindings_cpu.cpp", _CSRC / "kernels_cpu.cpp"]
_NAME = "nanovllm_paged_attention_cpu"
# Model dtypes the model runner binds the kernels for (PyTorch for any other): those where they beat the
# PyTorch path (bench/cpu_kernels.py).
SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
# The projections use linear_few_rows for at most this many rows, PyTorch's GEMM above: the kernel wins up to
# 16 rows and breaks even by 24, each 8 rows another pass over the weights
# (docs/performance.md#measurements-behind-choices-in-the-code).
FEW_ROWS_MAX = 16
# A build takes well under a minute; a lock this old was left by a process killed mid-build, and torch's
# builder would wait on it forever.
_STALE_LOCK_S = 300.0


def cpu_digest(cpuinfo: str) -> str:
    """A hash of the CPU's model and instruction-set flags, given /proc/cpuinfo's text. The kernels are
    built with -march=native, so a build from another CPU (a shared home directory, an image built
    elsewhere, a VM moved to other hardware) can hold instructions this one lacks, and torch's builder would
    load it all the same: each CPU gets a build directory of its own."""
    fields = [line for line in cpuinfo.splitlines() if line.startswith(("model name", "flags", "Features"))]
    identity = "\n".join(dict.fromkeys(fields)) or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def _build_directory() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        cpuinfo = ""
    # Keyed by the checkout too: torch's builder rebuilds whenever the sources' paths differ from the last
    # build's, so two checkouts sharing one directory (a CI clone beside a working tree) rebuilt each
    # other's module, and a process could load it while the other rewrote it.
    checkout = hashlib.sha256(str(_CSRC.resolve()).encode()).hexdigest()[:8]
    path = Path(root) / f"{_NAME}-{cpu_digest(cpuinfo)}-{checkout}"
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        log.warning("cpu_kernels_stale_lock_removed", path=str(lock))
        lock.unlink(missing_ok=True)
    return path


def _sources_digest() -> str:
    """A hash of every file in kernels/csrc: torch's builder rebuilds when a listed source or a flag changes,
    but does not look at what they include (the headers, and the kernels' files that the two units include),
    so their digest goes into the flags."""
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        if path.suffix in (".h", ".cpp"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _own_ninja_first() -> Iterator[None]:
    """While building, the ninja installed beside this Python (a dependency in pyproject.toml) comes first on
    PATH. torch's builder runs whichever `ninja` PATH finds, and ninja 1.11 and 1.12+ read each other's build
    logs as changed commands: a shell with the venv activated and one without rebuilt every kernel (one to two
    minutes) each time they took turns."""
    path = os.environ.get("PATH", "")
    own_bin = Path(sys.executable).parent
    if (own_bin / "ninja").exists():
        os.environ["PATH"] = os.pathsep.join([str(own_bin), path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled module, or None (with a warning) when it cannot be built on this machine."""
    try:
        from torch.utils.cpp_extension import load

        # -fno-trapping-math: GCC (12 here) keeps exp_simd's range checks as branches unless it may assume that
        # no float operation traps, and a branch keeps every loop that calls it scalar: the SwiGLU gate, the
        # attention's softmax and the sampler's exp pass ran several times slower
        # (docs/performance.md#measurements-behind-choices-in-the-code). Results are unchanged (no
        # -ffast-math: IEEE rounding, NaNs and infinities are kept; nothing here reads the FP exception flags).
        with _own_ninja_first():
            return load(
                name=_NAME,
                sources=[str(source) for source in _SOURCES],
                build_directory=str(_build_directory()),
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-fno-trapping-math",
                    "-fopenmp",
                    f"-DNANOVLLM_SOURCES={_sources_digest()}",
                ],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except (
        OSError,
        RuntimeError,
        ImportError,
        subprocess.CalledProcessError,
    ) as exc:  # no compiler, build error
        log.warning("cpu_kernels_unavailable", error=str(exc)[:500])
        return None
