"""Weight-only quantized matmuls against the 16/32-bit ones at SmolLM2-135M's projection shapes and the
engine's step sizes: PyTorch's shipped ops and the engine's own kernel, which the engine runs only where it
beats them.

For each row count M, one decode step's projections (q/k/v, o, gate/up, down of 30 layers; 540 MB of
float32 weights, read from memory as in the model) run as:
  - `F.linear` in float32 and bfloat16, and the engine's few-rows kernel (kernels/csrc/linear_cpu.cpp) in
    both where M <= 16 (the engine's float path),
  - `torch._weight_int8pack_mm` (int8, one scale per output channel) and
    `torch._weight_int4pack_mm_for_cpu` (int4, groups of 32 along K with a scale and a zero point each),
    up to 64 rows (on an AVX2 CPU they take about a minute per step at 512),
  - the engine's `linear_quantized` (kernels/csrc/linear_quantized_cpu.cpp) on the same two formats:
    int8 per channel, int4 in groups of 32 with a scale and a min (float16) each; by default (x quantized
    to int8 for the integer dots where the CPU has them) and, in float32, exact (--exact-quantized-matmuls:
    each weight dequantized to fp32).
x is float32 but in the bfloat16 columns (the engine's activations where the CPU has native bf16). The calls alternate, so drift falls on all alike; the
table gives median milliseconds per step.

    .venv/bin/python -m bench.quantized_matmul [--rows 1 8 64 512] [--repeat 15]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.report import machine_description
from nanovllm.kernels.cpu_kernels import FEW_ROWS_MAX, load_cpu_kernels
from nanovllm.worker.layers.quantization import PackedWeight, QuantScheme

HIDDEN, INTERMEDIATE, QKV, LAYERS, GROUP = 576, 1536, 576 + 2 * 192, 30, 32
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # (N, K)


def int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1).clamp_min(1e-8) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def int4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 and torch's [K / GROUP, N, 2] scales and zeros (w = (q - 8) * scale + zero)."""
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low).clamp_min(1e-8) / 15
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zeros = low + 8 * scale
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), torch.stack([scale.T, zeros.T], -1).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(LAYERS) for n, k in SHAPES]
    bf16 = [w.to(torch.bfloat16) for w in weights]
    q8 = [int8_weight(w) for w in weights]
    q4 = [int4_weight(w) for w in weights]
    schemes = {"int8": QuantScheme("int8", 8, None), "int4": QuantScheme("int4", 4, GROUP)}
    ours = {
        name: [PackedWeight(*w.shape, scheme, "bench").quantize_(w) for w in weights]
        for name, scheme in schemes.items()
    }
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ CPU kernels did not build here (see the cpu_kernels_unavailable warning)")
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine_description()}")
    print(f"SmolLM2-135M's 30 layers of projections per step, median ms of {args.repeat}\n")
    print(
        "| rows | float32 F.linear | float32 few-rows | bfloat16 F.linear | bfloat16 few-rows "
        "| torch int8 | torch int4 | ours int8 | ours int4 | ours int8, exact | ours int4, exact "
        "| ours int8, bf16 x | ours int4, bf16 x |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        x32 = torch.randn(rows, max(HIDDEN, INTERMEDIATE), generator=gen)
        x16 = x32.to(torch.bfloat16)

        def step(call: Callable[[torch.Tensor, int], object], x: torch.Tensor) -> Callable[[], None]:
            def one_step() -> None:
                for i, w in enumerate(weights):
                    call(x[:, : w.shape[1]].contiguous(), i)

            return one_step

        def packed(name: str, exact: bool = False) -> Callable[[torch.Tensor, int], object]:
            def call(x: torch.Tensor, i: int) -> object:
                p = ours[name][i]
                args = (p.bits, p.group_size, None, False, False, exact)
                return kernels.linear_quantized(x, p.qweight, p.scales, p.mins, *args)

            return call

        few, torch_ops = rows <= FEW_ROWS_MAX, rows <= 64
        cases = {
            "f32": step(lambda x, i: F.linear(x, weights[i]), x32),
            "few": step(lambda x, i: kernels.linear_few_rows(x, weights[i], None), x32) if few else None,
            "bf16": step(lambda x, i: F.linear(x, bf16[i]), x16),
            "few16": step(lambda x, i: kernels.linear_few_rows(x, bf16[i], None), x16) if few else None,
            "int8": step(lambda x, i: torch._weight_int8pack_mm(x, *q8[i]), x32) if torch_ops else None,
            "int4": step(lambda x, i: torch._weight_int4pack_mm_for_cpu(x, q4[i][0], GROUP, q4[i][1]), x32)
            if torch_ops
            else None,
            "ours8": step(packed("int8"), x32),
            "ours4": step(packed("int4"), x32),
            "ours8x": step(packed("int8", exact=True), x32),
            "ours4x": step(packed("int4", exact=True), x32),
            "ours8_16": step(packed("int8"), x16),
            "ours4_16": step(packed("int4"), x16),
        }
        runs = {name: run for name, run in cases.items() if run is not None}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeat):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        cell = {name: f"{statistics.median(t) * 1e3:.1f}" for name, t in times.items()}
        columns = ["f32", "few", "bf16", "few16", "int8", "int4", "ours8", "ours4", "ours8x", "ours4x"]
        columns += ["ours8_16", "ours4_16"]
        print(f"| {rows} | " + " | ".join(cell.get(name, "-") for name in columns) + " |")


if __name__ == "__main__":
    main()
