"""The GPU benchmark's whole path in its CPU smoke mode (bench/gpu.py's docstring): every measurement it
reports on a GPU runs here too, on a tiny model, in a process of its own as it is run by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_bench_runs_on_a_cpu():
    args = "--device cpu --tiny --layers 2 --num-seqs 4 --max-input-len 64 --max-output-len 16 "
    args += "--profile-steps 2 --single-prompt 16 --single-new-tokens 4 --sampler-batch 8 --sampler-steps 2"
    args += " --kv-cache-dtype fp8"
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args.split()],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # a bound on a hang; the run takes seconds
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "total output tokens 64" in out
    for n in range(1, 7):
        assert f"\n[{n}] " in out, out
    assert "GPU busy (kernels / wall): n/a (no GPU)" in out
    header, rule, row = out.strip().splitlines()[-3:]
    assert header.count("|") == rule.count("|") == row.count("|") == 12
