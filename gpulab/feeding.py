"""Feeding the GPU (lab 3): batches that cost CPU time to prepare, and timelines of who did what when.

The dataset lives here, not in the notebook, because DataLoader workers unpickle it: under the spawn
start method (macOS, Windows) a worker cannot find a class that was defined in a notebook.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset, get_worker_info


@dataclass(frozen=True)
class Span:
    """One piece of work on a timeline.

    `lane` is where it ran ("main", "worker 0", "stream 7"), `kind` what it was ("load", "compute",
    "copy"); `start_s` and `end_s` are seconds on one clock shared by the lanes being compared.
    """

    lane: str
    kind: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def burn_cpu(seconds: float) -> int:
    """Do integer arithmetic until this thread has used `seconds` of CPU time; returns the rounds done.

    A stand-in for per-batch work of known cost (decoding files, tokenizing raw text, augmenting).
    It counts CPU time, not wall time: on a busy machine it takes longer, as real work would. Plain
    Python on one thread, so its cost does not depend on PyTorch's thread settings.
    """
    x, rounds = 1, 0
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        for _ in range(1000):  # a 64-bit linear congruential generator: cheap, real arithmetic
            x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        rounds += 1
    return rounds


class LoadedBatch(NamedTuple):
    """What `CostlyBatches` yields: the batch, and when and where it was prepared."""

    batch: dict[str, torch.Tensor]
    span: Span


class CostlyBatches(Dataset[LoadedBatch]):
    """Batch `k` of one fixed shuffled order of `data`, prepared with `load_s` seconds of CPU work.

    `data` maps names to tensors with the examples along dim 0 (e.g. `gpulab.data.Task.train`).
    Item `k` is a `LoadedBatch`: a dict of `[batch_size, ...]` tensors and the `Span` of its
    preparation (lane "main" or "worker i", wall-clock seconds from `time.time()`, the clock all
    processes share). Use it with `DataLoader(batch_size=None)`: every item is already a batch, and
    the same `seed` gives the same batches in the same order whatever the number of workers.
    """

    def __init__(self, data: Mapping[str, torch.Tensor], batch_size: int, n_batches: int, load_s: float,
                 seed: int = 0) -> None:
        n = next(iter(data.values())).shape[0]
        if n_batches * batch_size > n:
            raise ValueError(f"{n_batches} batches of {batch_size} need {n_batches * batch_size} examples; "
                             f"data has {n}")
        self.data = dict(data)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        self.order = order[:n_batches * batch_size].view(n_batches, batch_size)
        self.load_s = load_s

    def __len__(self) -> int:
        return self.order.shape[0]

    def __getitem__(self, k: int) -> LoadedBatch:
        start_s = time.time()
        batch = {name: t[self.order[k]] for name, t in self.data.items()}  # indexing copies
        if self.load_s > 0:
            burn_cpu(self.load_s)
        info = get_worker_info()
        lane = "main" if info is None else f"worker {info.id}"
        return LoadedBatch(batch, Span(lane, "load", start_s, time.time()))


# torch.profiler Chrome-trace categories of GPU activity, and what the timelines call them
TRACE_KINDS = {"kernel": "compute", "gpu_memcpy": "copy"}


def gpu_spans(trace: Mapping[str, Any]) -> list[Span]:
    """Kernels and memory copies from a `torch.profiler` Chrome trace (`prof.export_chrome_trace`).

    Each complete event ("ph": "X") of category "kernel" or "gpu_memcpy" becomes a Span in lane
    "stream N" (its CUDA stream, `args.stream`), kind "compute" or "copy"; the trace's
    microseconds are converted to seconds. Sorted by start.
    """
    spans = []
    for event in trace.get("traceEvents", []):
        kind = TRACE_KINDS.get(event.get("cat", ""))
        if kind is None or event.get("ph") != "X":
            continue
        stream = event.get("args", {}).get("stream", event.get("tid"))
        start_s = float(event["ts"]) * 1e-6
        spans.append(Span(f"stream {stream}", kind, start_s, start_s + float(event.get("dur", 0)) * 1e-6))
    return sorted(spans, key=lambda s: s.start_s)


def _merged(spans: Iterable[Span]) -> list[tuple[float, float]]:
    intervals: list[tuple[float, float]] = []
    for s in sorted(spans, key=lambda s: s.start_s):
        if intervals and s.start_s <= intervals[-1][1]:
            intervals[-1] = (intervals[-1][0], max(intervals[-1][1], s.end_s))
        else:
            intervals.append((s.start_s, s.end_s))
    return intervals


def overlap_fraction(spans: Sequence[Span], others: Sequence[Span]) -> float:
    """Fraction of the total duration of `spans` during which at least one of `others` runs (0 to 1)."""
    total_s = sum(s.duration_s for s in spans)
    if total_s <= 0:
        return 0.0
    busy = _merged(others)
    shared_s = sum(max(0.0, min(s.end_s, end) - max(s.start_s, start)) for s in spans for start, end in busy)
    return shared_s / total_s


KIND_COLORS = {"load": "tab:orange", "copy": "tab:orange", "compute": "tab:blue"}


def draw_timeline(ax: Any, spans: Sequence[Span], title: str, lanes: Sequence[str] | None = None) -> None:
    """Draw `spans` on a matplotlib Axes: one row per lane, bars coloured by kind, time in ms from the
    first start. `lanes` fixes the rows' order (top first); by default, in order of first appearance."""
    if not spans:
        ax.set_title(f"{title} (nothing recorded)")
        return
    lanes = list(lanes) if lanes is not None else list(dict.fromkeys(s.lane for s in spans))
    t0 = min(s.start_s for s in spans)
    for row, lane in enumerate(reversed(lanes)):
        for kind, color in KIND_COLORS.items():
            bars = [((s.start_s - t0) * 1e3, s.duration_s * 1e3) for s in spans if s.lane == lane and s.kind == kind]
            if bars:
                ax.broken_barh(bars, (row - 0.35, 0.7), color=color, edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)))
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
