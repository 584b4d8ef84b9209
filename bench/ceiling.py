"""A matmul-only ceiling: the time the model's own linear layers alone need for the token counts the engine ran."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from nanovllm.worker.layers.kernels import LayerKernels
from nanovllm.worker.layers.linear import ParallelLinear, linear


def bracket(m: int) -> tuple[int, int]:
    """The powers of two around m (equal when m is one)."""
    hi = 1 << max(0, (m - 1).bit_length())
    return (hi if hi == m else hi // 2), hi


class MatmulCeiling:
    """Time of the model's own linear layers (in their dtype) at M tokens, as a lower bound for a step.
    They run as the engine runs them (`linear`: the C++ few-rows kernel where the model has the CPU
    kernels bound, PyTorch's GEMM otherwise).

    Timings are taken at powers of two and interpolated linearly in between: matmul time is flat in
    M while it is bound by reading the weights, and linear once it is bound by arithmetic. Small M
    runs through every layer's weights, because one layer's weights would sit in cache and look
    faster than the real model; large M is compute bound, so one layer times the layer count is
    accurate and much cheaper to measure.
    """

    ALL_LAYERS_UP_TO = 256

    def __init__(self, model: torch.nn.Module, kernels: LayerKernels | None = None) -> None:
        """`kernels`: run the matmuls on these instead of the model's (PYTORCH: the fastest GEMM, the
        hardware's bound rather than the engine's kernels')."""
        # Every projection of each layer (attention or linear attention, and the MLP), in module order.
        self.layer_weights = [
            [m.weight for m in layer.modules() if isinstance(m, ParallelLinear)]
            for layer in model.model.layers
        ]
        self.lm_head = model.lm_head.weight
        self.kernels = model.lm_head.kernels if kernels is None else kernels
        self._stack: dict[int, float] = {}
        self._head: dict[int, float] = {}

    @staticmethod
    def _time(fn: Callable[[], None], min_total_s: float = 0.2, min_reps: int = 3) -> float:
        """Best of several runs: a ceiling is what the hardware can do, and on a shared machine every
        slower run is someone else's load, not the matmul."""
        fn()  # warm-up: allocator and kernel selection
        times: list[float] = []
        while len(times) < min_reps or sum(times) < min_total_s:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if len(times) >= 50:
                break
        return min(times)

    def _measure_stack(self, m: int) -> float:
        in_dims = {w.shape[1] for weights in self.layer_weights for w in weights}
        inputs = {d: torch.randn(m, d, dtype=self.lm_head.dtype) for d in in_dims}

        def time_layers(layers: list[list[torch.Tensor]]) -> float:
            def run() -> None:
                for weights in layers:
                    for w in weights:
                        linear(inputs[w.shape[1]], w, None, self.kernels)

            return self._time(run)

        with torch.inference_mode():
            if m <= self.ALL_LAYERS_UP_TO:
                return time_layers(self.layer_weights)
            # One layer of each kind (a hybrid model has two), times its kind's count.
            kinds: dict[tuple, list] = {}
            for weights in self.layer_weights:
                kinds.setdefault(tuple(tuple(w.shape) for w in weights), []).append(weights)
            return sum(time_layers(group[:1]) * len(group) for group in kinds.values())

    def _measure_head(self, m: int) -> float:
        x = torch.randn(m, self.lm_head.shape[1], dtype=self.lm_head.dtype)
        with torch.inference_mode():
            return self._time(lambda: linear(x, self.lm_head, None, self.kernels), min_total_s=0.05)

    @staticmethod
    def _interpolate(m: int, table: dict[int, float], measure: Callable[[int], float]) -> float:
        if m <= 0:
            return 0.0
        lo, hi = bracket(m)
        for b in {lo, hi}:
            if b not in table:
                table[b] = measure(b)
        if lo == hi:
            return table[lo]
        return table[lo] + (table[hi] - table[lo]) * (m - lo) / (hi - lo)

    def step_time(self, num_tokens: int, sampled_rows: int) -> float:
        return self._interpolate(num_tokens, self._stack, self._measure_stack) + self._interpolate(
            sampled_rows, self._head, self._measure_head
        )
