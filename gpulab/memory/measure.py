"""Measure memory from the tensors themselves, so the numbers mean the same on a CPU and a GPU.

On CUDA the caching allocator also reports a peak (`torch.cuda.max_memory_allocated`): every tensor
alive, temporaries included, each in the block the allocator gave it (rounded up to 512 bytes, and up
to 1 MiB above the request for blocks over 1 MiB; cached blocks and fragmentation show in
`memory_reserved`); on a CPU there is no such counter, so we count bytes of the tensors
that make up each part of training. Tensors that share storage are counted once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


def _storage_key(t: torch.Tensor) -> tuple[int, str]:
    return (t.untyped_storage().data_ptr(), str(t.device))


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and aliases are counted once)."""
    seen: dict[tuple[int, str], int] = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def parameter_bytes(model: torch.nn.Module) -> int:
    return tensor_bytes(model.parameters())


def gradient_bytes(model: torch.nn.Module) -> int:
    return tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (moments, step counters, quantization maps)."""
    return tensor_bytes(_state_tensors(optimizer))


def paged_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state in CUDA managed memory (bitsandbytes' paged optimizers page
    tensors of over 1e5 values). `torch.cuda.max_memory_allocated` does not count them: the CUDA
    driver holds them outside PyTorch's allocator, so a paged run's allocator peak leaves them out."""
    return tensor_bytes(t for t in _state_tensors(optimizer) if getattr(t, "is_paged", False))


@dataclass
class SavedTensors:
    """What autograd saved for backward during a forward pass (filled by `record_saved_tensors`)."""

    bytes: int = 0
    count: int = 0


@contextmanager
def record_saved_tensors(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedTensors]:
    """Count the distinct storages autograd saves for backward inside the block.

    Pass the model's parameters as `exclude`: a linear layer saves its weight, but the weight is
    already counted as a parameter, not as an activation.
    """
    skip = {_storage_key(t) for t in exclude}
    seen: dict[tuple[int, str], int] = {}
    result = SavedTensors()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in skip and t.device.type != "meta":
            seen[key] = t.untyped_storage().nbytes()
        # detached: a saved output still carries its grad_fn, which owns this saved tensor; keeping
        # t itself closes a cycle through C++ that gc cannot see, and a forward never run backward
        # would then keep its whole graph (activations and parameters) alive for good (pytorch#115255)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result.bytes, result.count = sum(seen.values()), len(seen)


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], Any]) -> tuple[int, Any]:
    """Run `forward()` and return (bytes saved for backward, its result), parameters excluded."""
    with record_saved_tensors(exclude=model.parameters()) as saved:
        out = forward()
    return saved.bytes, out


def cuda_peak_bytes(device: torch.device | str | None = None) -> int | None:
    """Peak bytes allocated by tensors on a CUDA device since the last reset; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(device))
