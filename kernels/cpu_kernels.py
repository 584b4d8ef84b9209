"""Build and load the C++ CPU kernels in kernels/csrc on first use (cached by torch's extension builder).

Only the decode attention lives there: on a CPU, gathering paged K/V into a padded tensor for SDPA costs as
much as the attention itself, and no PyTorch op reads a paged cache in place. When no compiler is
available the engine keeps the PyTorch implementation, which computes the same thing.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from types import ModuleType

from nanovllm.common.logging import get_logger

log = get_logger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled module, or None (with a warning) when it cannot be built on this machine."""
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="nanovllm_paged_attention_cpu",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
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
