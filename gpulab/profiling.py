"""What ran: the kernels a piece of code launches, read from torch.profiler.

On a GPU a "kernel" is a CUDA kernel (each reads its inputs from and writes its outputs to global
memory). On a CPU the analogue is an operator that computes (allocations and views left out), each one
pass over its tensors; torch.compile's CPU kernels show up when
`torch._inductor.config.cpp.enable_kernel_profile` is on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
    with quiet_stderr_fd(), profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.events()
    if on_gpu:
        return [e.name for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("Memcpy")]
    return [e.name for e in events if _computes(e)]
