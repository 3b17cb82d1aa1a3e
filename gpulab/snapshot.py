"""A memory timeline of one training step, allocation by allocation.

On a CUDA GPU the caching allocator keeps a history of its allocations and frees when asked
(`torch.cuda.memory._record_memory_history`); `torch.cuda.memory._snapshot()` returns it, and
pytorch.org/memory_viz draws it. A CPU has no such allocator history, so `LiveTensorRecorder` stands
in: a TorchDispatchMode that sees every tensor an operator returns, counts the bytes of each new
storage, and counts them off when a weakref finalizer says the storage died.

Both give a list of `Event`s (alloc or free, address, bytes) with a mark at the end of each phase;
`timeline()` sorts the bytes into categories (weights, optimizer state, gradients, activations,
temporaries) and gives the live bytes of each after every event.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gpulab.memory import measure

PHASES = ("forward", "backward", "optimizer step", "zero_grad")
CATEGORIES = ("weights", "optimizer state", "other", "gradients", "activations", "temporaries")


@dataclass(frozen=True)
class Event:
    action: str  # "alloc" or "free"
    addr: int  # storage (CPU) or allocator block (CUDA) address
    size: int  # bytes; on CUDA the bytes requested (the allocator's block may be larger)


@dataclass
class StepRecord:
    """The events of one training step, as `record_step` returns them.

    `marks[phase]` is the number of events up to the end of that phase. `baseline` holds the bytes
    alive before the step by category. `owners` names allocations after the fact: (category, phase,
    addresses) says that an allocation alive at the end of that phase at one of those addresses
    belongs to the category (the gradients, found at the end of backward).
    """

    events: list[Event]
    marks: dict[str, int]
    baseline: dict[str, int]
    owners: list[tuple[str, str, set[int]]] = field(default_factory=list)
    source: str = ""
    cuda_snapshot: dict[str, Any] | None = None  # on CUDA: the allocator's snapshot, for memory_viz
    requested_after: int | None = None  # on CUDA: requested_bytes() after the step


class LiveTensorRecorder(TorchDispatchMode):
    """Record the bytes of every storage an operator creates, and when it is freed (CPU stand-in
    for the CUDA allocator's history).

    An output that shares storage with an input (a view, an in-place op, `out=`) is not new. Tensors
    created before the recorder started (the weights, the batch) are never seen: counts are relative
    to them. Storages are counted once, at their full size, like `gpulab.memory.measure`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self._live: dict[int, int] = {}

    def _freed(self, addr: int, size: int) -> None:
        if self._live.pop(addr, None) is not None:
            self.events.append(Event("free", addr, size))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            addr, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or addr in inputs or addr in self._live:
                continue
            self._live[addr] = size
            self.events.append(Event("alloc", addr, size))
            # storages keep their Python object while the C++ storage lives: the finalizer runs when
            # the last tensor, view or autograd-saved copy that uses it is gone
            weakref.finalize(storage, self._freed, addr, size)
        return out


def cuda_events(trace: list[Mapping[str, Any]]) -> list[Event]:
    """The allocations and frees of a CUDA snapshot's device trace (`_snapshot()["device_traces"][i]`).

    A block counts as allocated from "alloc" to "free_completed" (the allocator may reuse it), with
    the size that was asked for, as in `requested_bytes`; segment and snapshot entries are left out.
    """
    kinds = {"alloc": "alloc", "free_completed": "free"}
    return [Event(kinds[e["action"]], int(e["addr"]), int(e["size"])) for e in trace if e["action"] in kinds]


def requested_bytes(device: torch.device) -> int:
    """Bytes the live CUDA allocations asked for: the sizes the allocator's history records.

    `torch.cuda.memory_allocated` counts whole blocks instead: sizes rounded up to 512 B, and a cached
    block up to 1 MiB larger than the request when the allocator does not split the rest off.
    """
    return int(torch.cuda.memory_stats(device)["requested_bytes.all.current"])


def _sum_baseline(model: torch.nn.Module, optimizer: torch.optim.Optimizer, total: int | None) -> dict[str, int]:
    weights, state = measure.parameter_bytes(model), measure.optimizer_state_bytes(optimizer)
    other = 0 if total is None else total - weights - state
    return {"weights": weights, "optimizer state": state, "other": other}


def record_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor],
                use_cache: bool = False, max_entries: int = 1_000_000) -> StepRecord:
    """Run one training step (forward, backward, optimizer step, zero_grad) and record its memory.

    On CUDA from the allocator's history, elsewhere with `LiveTensorRecorder`. The gradients are
    found by address at the end of backward. `use_cache=False`: in training, transformers' Llama
    would otherwise build a KV cache in every forward and keep it until the output is dropped.
    """
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    marks: dict[str, int] = {}
    grad_addrs: set[int] = set()

    def step(mark: Callable[[str], None]) -> None:
        loss = model(**batch, use_cache=use_cache).loss
        mark("forward")
        loss.backward()
        del loss  # the graph, and with it anything it still held
        mark("backward")
        grad_addrs.update(p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        mark("optimizer step")
        optimizer.zero_grad(set_to_none=True)
        mark("zero_grad")

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(device)
        baseline = _sum_baseline(model, optimizer, requested_bytes(device))
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=max_entries)
        try:
            def trace_len() -> int:
                return len(torch.cuda.memory._snapshot()["device_traces"][index])

            start = trace_len()  # re-enabling may keep an earlier recording's events: skip them

            def mark(phase: str) -> None:
                torch.cuda.synchronize(device)
                marks[phase] = trace_len() - start

            step(mark)
            requested_after = requested_bytes(device)
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][index]
        if len(trace) >= max_entries:
            raise RuntimeError(f"the allocator's history wrapped ({max_entries} entries): raise max_entries")
        # the marks count trace entries; convert them to counts of alloc/free events
        entries = trace[start:]
        marks = {phase: len(cuda_events(entries[:n])) for phase, n in marks.items()}
        events = cuda_events(entries)
        return StepRecord(events, marks, baseline, [("gradients", "backward", grad_addrs)],
                          "CUDA caching allocator history", snapshot, requested_after)

    baseline = _sum_baseline(model, optimizer, None)
    recorder = LiveTensorRecorder()

    def mark_cpu(phase: str) -> None:
        marks[phase] = len(recorder.events)

    with recorder:
        step(mark_cpu)
    return StepRecord(recorder.events, marks, baseline, [("gradients", "backward", grad_addrs)],
                      "live storages (LiveTensorRecorder)")


@dataclass
class Timeline:
    """Live bytes by category before the first event (index 0) and after each event (index i + 1)."""

    bytes_by_category: dict[str, list[int]]
    marks: dict[str, int]

    @property
    def total(self) -> list[int]:
        columns = list(self.bytes_by_category.values())
        return [sum(values) for values in zip(*columns)]

    def at(self, phase: str) -> int:
        """Live bytes at the end of a phase ("start" for before the step)."""
        return self.total[0 if phase == "start" else self.marks[phase]]

    def category_at(self, category: str, phase: str) -> int:
        return self.bytes_by_category[category][0 if phase == "start" else self.marks[phase]]

    def peak(self) -> tuple[int, int, str]:
        """(bytes, index, phase) of the highest point."""
        total = self.total
        index = max(range(len(total)), key=total.__getitem__)
        return total[index], index, self.phase_of(index)

    def phase_of(self, index: int) -> str:
        """The phase an index falls in (the event that made it happened in that phase)."""
        if index == 0:
            return "start"
        for phase in PHASES:
            if index <= self.marks[phase]:
                return phase
        return PHASES[-1]

    def phase_max(self, phase: str) -> int:
        """The highest total within one phase."""
        begin = 0 if phase == PHASES[0] else self.marks[PHASES[PHASES.index(phase) - 1]]
        return max(self.total[begin:self.marks[phase] + 1])


def timeline(record: StepRecord) -> Timeline:
    """Sort every allocation into a category and follow the live bytes of each.

    Allocations made in forward are activations (what autograd saves, and forward's own
    temporaries); in the later phases, temporaries, unless `record.owners` claims them (the
    gradients). A free of memory allocated before the step counts against "other".
    """
    events, marks = record.events, record.marks
    ends = {phase: marks[phase] for phase in PHASES}
    # where each allocation ends: index of its free, or len(events) if it outlives the step
    freed_at: dict[int, int] = {}
    open_allocs: dict[int, int] = {}
    for i, e in enumerate(events):
        if e.action == "alloc":
            open_allocs[e.addr] = i
        elif e.addr in open_allocs:
            freed_at[open_allocs.pop(e.addr)] = i

    def category(i: int, e: Event) -> str:
        phase = next(p for p in PHASES if i < ends[p]) if i < ends[PHASES[-1]] else PHASES[-1]
        for name, at_phase, addrs in record.owners:
            end = ends[at_phase]
            if e.addr in addrs and i < end <= freed_at.get(i, len(events)):
                return name
        return "activations" if phase == "forward" else "temporaries"

    live = {c: record.baseline.get(c, 0) for c in CATEGORIES}
    series: dict[str, list[int]] = {c: [live[c]] for c in CATEGORIES}
    owner_of: dict[int, str] = {}
    for i, e in enumerate(events):
        if e.action == "alloc":
            c = category(i, e)
            owner_of[e.addr] = c
            live[c] += e.size
        else:
            live[owner_of.pop(e.addr, "other")] -= e.size
        for c in CATEGORIES:
            series[c].append(live[c])
    return Timeline(series, dict(ends))
