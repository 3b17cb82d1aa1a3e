"""What ran: the kernels a piece of code launches, read from torch.profiler.

On a GPU a "kernel" is a CUDA kernel (each reads its inputs from and writes its outputs to global
memory). On a CPU the analogue is an operator that computes (allocations and views left out), each one
pass over its tensors; torch.compile's CPU kernels show up when
`torch._inductor.config.cpp.enable_kernel_profile` is on.
"""

from __future__ import annotations

import gc
import gzip
import json
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from gpulab.timing import synchronize

# ATen operators that allocate, alias or reshape without touching the data
NOT_COMPUTE = frozenset({
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::_unsafe_view",
    "aten::as_strided", "aten::reshape", "aten::_reshape_alias", "aten::detach", "aten::alias",
    "aten::contiguous", "aten::t", "aten::transpose", "aten::expand", "aten::resize_", "aten::lift_fresh",
    "aten::result_type", "aten::set_", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select",
})


@contextmanager
def quiet_stderr_fd() -> Iterator[None]:
    """Silence file descriptor 2 in the block: the profiler's C++ library logs its start and stop there
    (timestamped lines no Python setting turns off), which would show up in notebook outputs."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage now and not in the block: a step's memory measured from the allocator (its events
    or its counters) counts every free, and a reference cycle left by earlier code (a model of an earlier
    measurement in the same process), freed when the collector happens to run mid-step, would lower the
    step's peak above rest by the cycle's bytes. Seen in tests/test_fsdp_peak.py: half the peak, now and
    then, after other tests in the same process."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def quiet_profile(**kwargs: Any) -> Iterator[profile]:
    """`torch.profiler.profile(**kwargs)` without its console noise: the C++ library's lines on file
    descriptor 2 (`quiet_stderr_fd`), and torch 2.11's UserWarning that the profiler "clears events at the
    end of each cycle", which it gives once per process even for a single `with profile()` (torch 2.13
    does not). Other warnings raised in the block still show."""
    with quiet_stderr_fd(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
        with profile(**kwargs) as prof:
            yield prof


def _is_op(name: str) -> bool:
    if "cpp_fused" in name:  # a kernel torch.compile generated (with inductor's cpp.enable_kernel_profile)
        return True
    return "::" in name and not name.startswith(("autograd::", "torch::")) and name not in NOT_COMPUTE


def _computes(event: object) -> bool:
    """An operator that does the work itself: none of its callees is an operator that computes."""
    name = getattr(event, "name", "")
    children = getattr(event, "cpu_children", [])
    return _is_op(name) and not any(_computes_anywhere(c) for c in children)


def _computes_anywhere(event: object) -> bool:
    return _is_op(getattr(event, "name", "")) or any(_computes_anywhere(c) for c in getattr(event, "cpu_children", []))


def kernels(fn: Callable[[], object], device: torch.device | str) -> list[str]:
    """Names of the kernels `fn()` runs: CUDA kernels on a GPU, computing ATen operators on a CPU."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    synchronize(device)
    with quiet_profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.events()
    if on_gpu:
        return [e.name for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("Memcpy")]
    return [e.name for e in events if _computes(e)]


# --- Reading a Chrome trace (`prof.export_chrome_trace(path)`), the file Perfetto and chrome://tracing open.
# Each complete event ("ph": "X") has a category ("cat"), a name, a process and thread ("pid", "tid"),
# a start ("ts") and a duration ("dur"), both in microseconds. Categories (Kineto's names): "cpu_op" for
# ATen operators, "user_annotation" for `record_function` ranges, "cuda_runtime" for CUDA API calls
# such as cudaLaunchKernel, "kernel" for GPU kernels (their tid is the CUDA stream), "gpu_memcpy" and
# "gpu_memset"; flow events ("ph": "s"/"f", category "ac2g") link a launch to its kernel.
TraceEvent = dict[str, Any]


def load_trace(path: str | os.PathLike[str]) -> list[TraceEvent]:
    """The events of a Chrome trace file (.json, or .json.gz as `tensorboard_trace_handler` writes)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def complete_events(events: Iterable[TraceEvent], cat: str) -> list[TraceEvent]:
    """The events of category `cat` that span time ("ph": "X"), in order of start."""
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == cat), key=lambda e: e["ts"])


def name_counts(events: Iterable[TraceEvent], cat: str = "cpu_op") -> Counter[str]:
    """How many times each name occurs among the complete events of category `cat`."""
    return Counter(e["name"] for e in complete_events(events, cat))


def top_level(events: Iterable[TraceEvent], cat: str = "cpu_op") -> list[TraceEvent]:
    """Complete events of category `cat` that no other one on the same thread contains: the operators
    the Python code called, without the operators they called in turn."""
    tops: list[TraceEvent] = []
    end_by_thread: dict[tuple[Any, Any], float] = {}
    for e in complete_events(events, cat):
        thread = (e.get("pid"), e.get("tid"))
        if e["ts"] >= end_by_thread.get(thread, float("-inf")) - 1e-3:  # 1 ns of rounding
            tops.append(e)
            end_by_thread[thread] = e["ts"] + e["dur"]
    return tops


def union_us(spans: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals: time covered by at least one of them."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(spans):
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None and current_start is not None:
        total += current_end - current_start
    return total


def busy_fraction(events: Iterable[TraceEvent], cat: str, window: tuple[float, float]) -> float:
    """Fraction of `window` (start, end in microseconds) covered by complete events of category `cat`:
    for "kernel", the share of time the GPU was running a kernel; the rest is idle (gaps)."""
    start, end = window
    if end <= start:
        raise ValueError("the window must end after it starts")
    spans = [(max(e["ts"], start), min(e["ts"] + e["dur"], end)) for e in complete_events(events, cat)]
    return union_us((a, b) for a, b in spans if b > a) / (end - start)


def timeline(events: Iterable[TraceEvent], window: tuple[float, float]) -> dict[str, list[tuple[float, float, str]]]:
    """What Perfetto draws, as lanes of (start, duration, name) in microseconds from the window's start:
    one lane per CPU thread (top-level operators) and one per CUDA stream (kernels)."""
    events = list(events)
    start, end = window
    lanes: dict[str, list[tuple[float, float, str]]] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in top_level(events, "cpu_op"):
        if e["ts"] + e["dur"] < start or e["ts"] > end:
            continue
        key = (e.get("pid"), e.get("tid"))
        lane = threads.setdefault(key, f"CPU thread {len(threads) + 1}")
        lanes.setdefault(lane, []).append((e["ts"] - start, e["dur"], e["name"]))
    for e in complete_events(events, "kernel"):
        if e["ts"] + e["dur"] < start or e["ts"] > end:
            continue
        stream = e.get("args", {}).get("stream", e.get("tid"))
        lanes.setdefault(f"GPU stream {stream}", []).append((e["ts"] - start, e["dur"], e["name"]))
    return lanes
