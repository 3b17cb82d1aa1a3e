"""Tensor parallelism with PyTorch's DTensor API on the course's Llama, and how to count what it costs.

Lab 14's two programs, its notebook and its tests share these pieces:

- `llama_tp_plan` / `parallelize_llama`: the plan for `transformers`' `LlamaForCausalLM` (Megatron's
  layout: q, k, v, gate and up column-parallel, o and down row-parallel; embedding and LM head sharded on
  the vocabulary; optionally sequence parallelism in the norms);
- `local`, `held_bytes`, `record_saved`: bytes on this rank, counted from the local shards of DTensors;
- `CollectiveCounter`: every collective this rank launches (c10d and the functional collectives that
  DTensor uses), with the bytes handed to it, split into forward and backward.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

SEQ_DIM = 1  # transformers' activations are (batch, sequence, hidden)


def llama_tp_plan(sequence_parallel: bool = False,
                  prepare_inputs: bool = True) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """(plan for the model's top modules, plan for each decoder layer) of a `LlamaForCausalLM`.

    Megatron's layout (Shoeybi et al. 2019): q/k/v and gate/up split by output features (columns of
    W^T, so whole heads and whole MLP channels per rank), o_proj and down_proj by input features, so
    each block needs one reduction at its end. The embedding is split by vocabulary rows (each rank
    looks up the ids it owns, then a reduction) and the LM head by vocabulary columns (logits gathered).
    `prepare_inputs` turns each block's input into one replicated DTensor, so that q, k and v (gate and
    up) share it and backward reduces its gradient once per block, not once per projection.
    With `sequence_parallel` (Korthikanti et al. 2022) the residual stream and the norms are sharded on
    the sequence: blocks all-gather their input and reduce-scatter their output.
    """
    seq = Shard(SEQ_DIM) if sequence_parallel else Replicate()
    layer: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq),
    }
    if prepare_inputs or sequence_parallel:
        # the attention block gets hidden_states as a keyword argument, the MLP positionally
        layer["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()})
        layer["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    top: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        layer["input_layernorm"] = SequenceParallel()
        layer["post_attention_layernorm"] = SequenceParallel()
        top["model.norm"] = SequenceParallel()
    return top, layer


def parallelize_llama(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False,
                      prepare_inputs: bool = True) -> nn.Module:
    """Shard a `LlamaForCausalLM` in place over the 1-D `mesh` (the tensor-parallel group).

    With `sequence_parallel`, call the model with explicit `position_ids` of the full sequence: the
    model would otherwise number the positions of its local shard of the embeddings only.
    """
    top, layer = llama_tp_plan(sequence_parallel, prepare_inputs)
    for block in model.model.layers:  # type: ignore[union-attr]
        parallelize_module(block, mesh, layer)  # type: ignore[arg-type]
    parallelize_module(model, mesh, top)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (a functional collective's result unwrapped)."""
    while True:
        if isinstance(t, DTensor):
            t = t._local_tensor
        elif type(t).__name__ == "AsyncCollectiveTensor":
            t = t.elem  # type: ignore[attr-defined]
        else:
            return t


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the local parts of `tensors` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = local(t)
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass
class Saved:
    """What autograd saved for backward (filled when `record_saved`'s block ends): distinct storages,
    and their bytes by the region that first saved them."""

    bytes: int = 0
    count: int = 0
    by_region: dict[str, int] = field(default_factory=dict)


@contextmanager
def record_saved(exclude: Iterable[torch.Tensor] = (), region: Callable[[], str] = lambda: "all") -> Iterator[Saved]:
    """Bytes autograd saves for backward inside the block, counted from local shards.

    As `gpulab.memory.measure.record_saved_tensors`, for models whose tensors are DTensors (a DTensor
    has no storage of its own). Pass the parameters as `exclude`: they are counted as parameters.
    `region()` names where the forward is when a tensor is saved (e.g. set by module hooks).
    """
    skip = {local(t).untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, tuple[str, int]] = {}
    result = Saved()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        key = storage.data_ptr()
        if key not in skip and t.device.type != "meta":
            seen[key] = (seen[key][0] if key in seen else region(), storage.nbytes())
        return t.detach()  # as in record_saved_tensors: t itself would keep an unrun graph alive

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result.bytes, result.count = sum(n for _, n in seen.values()), len(seen)
    for name, n in seen.values():
        result.by_region[name] = result.by_region.get(name, 0) + n


# Collective ops as the dispatcher sees them: c10d's (torch.distributed.all_reduce and friends) and the
# functional ones DTensor uses. The value says which argument holds the full-size tensor, and whether
# that size is the argument's times the group size (a functional all-gather gets only its input, and
# the group size as its second argument).
_COLLECTIVES: dict[str, tuple[str, int, bool]] = {
    "c10d.allreduce_": ("all_reduce", 0, False),
    "c10d.allgather_": ("all_gather", 0, False),
    "c10d._allgather_base_": ("all_gather", 0, False),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "c10d.reduce_scatter_": ("reduce_scatter", 1, False),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1, False),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "c10d.broadcast_": ("broadcast", 0, False),
    "c10d.alltoall_base_": ("all_to_all", 1, False),
    "_c10d_functional.all_reduce": ("all_reduce", 0, False),
    "_c10d_functional.all_reduce_": ("all_reduce", 0, False),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0, True),
    "_c10d_functional.all_gather_into_tensor_out": ("all_gather", 0, True),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "_c10d_functional.broadcast": ("broadcast", 0, False),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0, False),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


class CollectiveCounter(TorchDispatchMode):
    """Count the collectives this rank launches, and their bytes, by kind and by `phase`.

    Bytes are the full (gathered) size: an all-gather's output, a reduce-scatter's input, an
    all-reduce's buffer. In a ring each rank sends (n-1)/n of an all-gather's or a reduce-scatter's,
    and 2(n-1)/n of an all-reduce's (a reduce-scatter, then an all-gather). Set `phase` ("forward", "backward",
    anything) before each part of a step; a dispatch mode sees the collectives that autograd runs in
    backward too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before tensor subclasses: let DTensor turn the op into local ops and collectives
            # (its implicit redistributions too, e.g. of a Partial gradient in the optimizer), which
            # then come back here (as torch.distributed.tensor.debug.CommDebugMode does).
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        name = f"{func.namespace}.{func._overloadpacket.__name__}"
        if name in _COLLECTIVES:
            kind, index, times_group = _COLLECTIVES[name]
            size = _nbytes(args[index]) * (int(args[1]) if times_group else 1)
            self.calls[self.phase, kind] += 1
            self.bytes[self.phase, kind] += size
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, dict[str, int]]]:
        """{phase: {kind: {"calls": n, "bytes": b}}}, JSON-ready."""
        out: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
        for (phase, kind), n in self.calls.items():
            out[phase][kind] = {"calls": n, "bytes": self.bytes[phase, kind]}
        return dict(out)
