"""What FSDP2 allocates during a training step, read from the allocator.

Tensor-level tracking (`gpulab.live_bytes`) misses FSDP2's memory: it gathers parameters by resizing
the storage of tensors that already exist. The allocator sees every byte: on CUDA its counters, on a
CPU its events in a profiler trace (`profile_memory=True`).

`fsdp_step_peak_bytes` runs the step in one process that plays rank 0 of n in a fake process group:
FSDP2 shards, gathers and reduce-scatters with buffers of their real sizes, as with NCCL, while the
collectives move nothing (the values are meaningless; the bytes are not).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore

from gpulab.checkpointing import checkpoint_in_segments, enable_transformers_checkpointing
from gpulab.memory import ModelShape, TrainingSetup
from gpulab.models import build_model
from gpulab.profiling import load_trace, quiet_profile

DTYPES = {"fp32": torch.float32, "bf16-pure": torch.bfloat16}
# what the measured step does not do; a setup that asks for another value is refused
UNMEASURED = {"optimizer": "adamw", "attention": "sdpa", "padding_mask": False, "lora_rank": 0,
              "quantization": None, "kv_cache_len": 0, "tp_degree": 1, "sequence_parallel": False,
              "loss_chunk_tokens": 0, "grad_accumulation": 1}


def cpu_allocated_bytes(prof: profile, mark: str | None = None) -> tuple[int, int, int | None]:
    """(bytes allocated when `prof` started, the most while it ran, at the start of the first
    `record_function(mark)`) from the CPU allocator's events. Their 'Total Allocated' is the running
    total of bytes allocated and not yet freed."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = load_trace(path)
    finally:
        os.remove(path)
    mem = sorted(((e["ts"], e["args"]) for e in events
                  if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0), key=lambda e: e[0])
    start = mem[0][1]["Total Allocated"] - mem[0][1]["Bytes"]
    peak = max(args["Total Allocated"] for _, args in mem)
    at_mark = None
    if mark is not None:
        ts = min(e["ts"] for e in events if e.get("name") == mark and e.get("ph") == "X")
        at_mark = [args["Total Allocated"] for t, args in mem if t <= ts][-1]
    return start, peak, at_mark


def fsdp_step_peak_bytes(shape: ModelShape, setup: TrainingSetup, device: torch.device | str = "cpu") -> int:
    """Most bytes allocated above rest during one forward and backward of a Llama with `shape`,
    `fully_shard` per decoder layer and at the root, on rank 0 of `setup.world_size` (fake process
    group). At rest: the sharded parameters and AdamW's states, no gradients (`zero_grad(set_to_none=True)`).
    `setup` gives the precision ("fp32" or "bf16-pure"), micro-batch, sequence length and checkpointing:
    `transformers`' own per layer for `checkpoint_every=1`, `gpulab.checkpointing.checkpoint_in_segments`
    for more. The step is fused AdamW's, on unpadded batches, with SDPA."""
    if setup.precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)} (the parameters' dtype), got {setup.precision!r}")
    unmeasured = {name: getattr(setup, name) for name, default in UNMEASURED.items() if getattr(setup, name) != default}
    if unmeasured or setup.zero_stage != 3 or setup.world_size < 2 or not setup.seq_len:
        raise ValueError(f"measures ZeRO-3 over 2 or more ranks with a sequence length, fused AdamW, no LoRA, "
                         f"tensor parallelism, padding, accumulation or chunked loss; got {setup}")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized: run this in a process without one "
                           "(it plays rank 0 of a fake process group of its own)")
    device = torch.device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=setup.world_size)
    try:
        model = build_model(shape, device=device, dtype=DTYPES[setup.precision])
        layers: list[torch.nn.Module] = list(model.model.layers)
        if setup.checkpointing and setup.checkpoint_every == 1:
            enable_transformers_checkpointing(model)
        elif setup.checkpointing:
            checkpoint_in_segments(model, setup.checkpoint_every)  # the layers keep their modules
        mesh = init_device_mesh(device.type, (setup.world_size,))
        for layer in layers:  # every decoder layer a unit, inside a checkpointed segment or not
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids = torch.randint(0, shape.vocab_size, (setup.batch_size, setup.seq_len),
                            generator=torch.Generator().manual_seed(0)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        for _ in range(2):  # AdamW's states exist and the gradients are freed: the state at rest
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            rest = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            model(input_ids=ids, labels=ids).loss.backward()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - rest
        with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(input_ids=ids, labels=ids).loss.backward()
        start, peak, _ = cpu_allocated_bytes(prof)
        return peak - start
    finally:
        dist.destroy_process_group()
