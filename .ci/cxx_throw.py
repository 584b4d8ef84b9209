"""Which C++ extensions can raise on this machine (`.ci/gpu cxx-throw`).

On the H200 machine of 2026-11-30 (Intel Xeon with AMX and AVX512-FP16, Ubuntu's g++ 13.3, torch 2.11+cu130)
every TORCH_CHECK that failed inside kernels/csrc ended the process with a segmentation fault instead of a
RuntimeError; the same checks raise on the CPU machines (Debian's g++ 12, torch 2.13 CPU). This builds a
one-function extension that fails a TORCH_CHECK under each set of flags our build differs from torch's
defaults by (-O3, -march=native, -fopenmp, -fno-trapping-math), one set at a time and together, with and
without -fcf-protection=none (Ubuntu's g++ adds control-flow protection by default), calls each in a fresh
process and prints whether it raised or crashed; then the same for the project's module. Also prints what the
machine enables of shadow stacks (a crash on unwinding is what they cause when an object is not ready).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE = r"""
#include <torch/extension.h>
at::Tensor fail(at::Tensor x) {
  TORCH_CHECK(x.dim() == 7, "fail: got ", x.sizes());
  return x;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fail", &fail); }
"""

FLAG_SETS = {
    "torch defaults": [],
    "-O3": ["-O3"],
    "-march=native": ["-march=native"],
    "-fopenmp": ["-fopenmp"],
    "-fno-trapping-math": ["-fno-trapping-math"],
    "ours": ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"],
    "ours, -fcf-protection=none": [
        "-O3",
        "-march=native",
        "-fno-trapping-math",
        "-fopenmp",
        "-fcf-protection=none",
    ],
}

CALL = """
import sys, torch
from torch.utils.cpp_extension import load
module = load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3],
              extra_cflags=sys.argv[4:], extra_ldflags=["-fopenmp"] if "-fopenmp" in sys.argv[4:] else [])
try:
    module.fail(torch.zeros(2))
except RuntimeError as exc:
    print("raised:", str(exc).splitlines()[0][:60])
"""

OURS = """
import torch
from nanovllm.kernels.cpu_kernels import load_cpu_kernels
try:
    load_cpu_kernels().argmax_rows(torch.zeros(2, 3, dtype=torch.bfloat16))
except RuntimeError as exc:
    print("raised:", str(exc).splitlines()[0][:60])
"""


def _outcome(args: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", *args], check=False, capture_output=True, text=True, timeout=240
    )
    if done.returncode == 0:
        return done.stdout.strip().splitlines()[-1]
    return f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[0][:100]}"


def main() -> None:
    status = Path("/proc/self/status").read_text()
    print(
        "\n".join(line for line in status.splitlines() if "x86_Thread_features" in line)
        or "no x86_Thread_features"
    )
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "fail.cpp"
        source.write_text(SOURCE)
        builds = [Path(tmp) / f"b{i}" for i in range(len(FLAG_SETS))]
        for build in builds:
            build.mkdir()
        calls = [
            [CALL, f"fail{i}", str(source), str(builds[i]), *flags]
            for i, flags in enumerate(FLAG_SETS.values())
        ]
        with ThreadPoolExecutor(len(calls)) as pool:  # each a compilation of torch's headers
            for label, outcome in zip(FLAG_SETS, pool.map(_outcome, calls)):
                print(f"{label}: {outcome}")
    print(f"nanovllm's kernels: {_outcome([OURS])}")


if __name__ == "__main__":
    main()
