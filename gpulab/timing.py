"""Timing that means something: warm-up first, then the median of repeats, with CUDA events on a GPU
(a kernel launch returns before the kernel finishes, so host clocks alone would time the launch)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms (median of {self.repeats}, min {self.min_ms:.3f}, max {self.max_ms:.3f})"


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def benchmark(fn: Callable[[], object], device: torch.device | str = "cpu", warmup: int = 3,
              repeats: int = 10) -> Timing:
    """Median wall time of `fn()` in milliseconds after `warmup` untimed calls."""
    device = torch.device(device)
    if warmup < 0 or repeats < 1:
        raise ValueError("warmup must be >= 0 and repeats >= 1")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times_ms = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times_ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times_ms.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times_ms), min(times_ms), max(times_ms), repeats)
