"""What FSDP2 allocates during a training step, read from the allocator.

Tensor-level tracking (`gpulab.live_bytes`) misses FSDP2's memory: it gathers parameters by resizing
the storage of tensors that already exist. The allocator sees every byte: on CUDA its counters, on a
CPU its events in a profiler trace (`profile_memory=True`).

`fsdp_step_peak_bytes` runs the step in one process that plays rank 0 of n in a fake process group:
FSDP2 shards, gathers and reduce-scatters with buffers of their real sizes, as with NCCL, while the
collectives move nothing (the values are meaningless; the bytes are not).
"""

from __future__ import annotations

import bisect
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
from gpulab.profiling import complete_events, gc_paused, load_trace, quiet_profile

DTYPES = {"fp32": torch.float32, "bf16-pure": torch.bfloat16}
# what the measured step does not do; a setup that asks for another value is refused
UNMEASURED = {"optimizer": "adamw", "attention": "sdpa", "padding_mask": False, "lora_rank": 0,
              "quantization": None, "kv_cache_len": 0, "tp_degree": 1, "sequence_parallel": False,
              "loss_chunk_tokens": 0, "grad_accumulation": 1}


# On a CPU, oneDNN's bf16 matmuls take scratch buffers from torch's allocator and free them before they
# return. Their size depends on the instruction set oneDNN picks: at the peak of tests/test_fsdp_peak.py's
# pure-bf16 step they added 0, 2% and 4% (AVX512-BF16, AMX, plain AVX512); fp32 matmuls took none.
# They are no tensor of the step, and on CUDA cuBLAS keeps its workspace from call to call (at rest).
MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


def _matmul_scratch(mem: list[dict], events: list[dict]) -> set[int]:
    """Indices into `mem` (allocator events in time order) of the allocations, and their frees, made and
    freed inside one matmul call on the same thread."""
    calls: dict[object, list[tuple[float, float]]] = {}
    for op in complete_events(events, "cpu_op"):
        if op["name"] in MATMULS:
            calls.setdefault(op.get("tid"), []).append((op["ts"], op["ts"] + op["dur"]))

    def enclosing_end(e: dict) -> float | None:
        """The end of the innermost matmul call on e's thread that was running at e."""
        spans = calls.get(e.get("tid"), [])
        for start, end in reversed(spans[:bisect.bisect_right(spans, (e["ts"], float("inf")))]):
            if end >= e["ts"]:
                return end
        return None

    scratch: set[int] = set()
    made: dict[object, tuple[int, float | None]] = {}
    for i, e in enumerate(mem):
        addr = e["args"].get("Addr")
        if e["args"]["Bytes"] > 0:
            made[addr] = (i, enclosing_end(e))
        elif addr in made:
            j, end = made.pop(addr)
            if end is not None and e["ts"] <= end:
                scratch.update((i, j))
    return scratch


def _unrecorded_frees(mem: list[dict], events: list[dict], owner: str) -> list[dict]:
    """Free events for the blocks of `mem` (allocator events in time order) allocated inside a
    `record_function(owner)` span that no recorded event frees, placed at the span's end. The profiler
    records an allocator event only on a thread that carries its state: a block whose last reference
    another thread drops (gloo's worker, done with a collective) is freed unseen, and would count as held
    to the end of the trace. A span named `owner` promises that whatever it allocated and did not hand
    back is gone by its end."""
    spans = sorted((e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
                   if e.get("name") == owner and e.get("ph") == "X")
    live: dict[object, dict] = {}
    unfreed = []
    for e in mem:
        addr = e["args"].get("Addr")
        if e["args"]["Bytes"] > 0:
            if addr in live:  # the address came back from the allocator: its last block was freed unseen
                unfreed.append(live[addr])
            live[addr] = e
        else:
            live.pop(addr, None)
    extra = []
    for e in unfreed + list(live.values()):
        end = next((end for start, end, tid in spans if start <= e["ts"] <= end and tid == e.get("tid")), None)
        if end is not None:
            extra.append({"ts": end, "tid": e.get("tid"), "args": {**e["args"], "Bytes": -e["args"]["Bytes"]}})
    return extra


def cpu_allocated_bytes(prof: profile, mark: str | None = None,
                        owner: str | None = None) -> tuple[int, int, int | None]:
    """(bytes allocated when `prof` started, the most while it ran, at the start of the first
    `record_function(mark)`) from the CPU allocator's events, leaving out the scratch that matmul
    kernels allocate and free within one call (`MATMULS`' comment says why). Blocks allocated inside a
    `record_function(owner)` span and never seen freed count as freed at its end (`_unrecorded_frees`)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = load_trace(path)
    finally:
        os.remove(path)
    mem = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                 key=lambda e: e["ts"])
    if owner:
        mem = sorted(mem + _unrecorded_frees(mem, events, owner), key=lambda e: e["ts"])
    scratch = _matmul_scratch(mem, events)
    # 'Total Allocated' is the allocator's running total after each event; it counts the scratch
    start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    mark_ts = min(e["ts"] for e in events if e.get("name") == mark and e.get("ph") == "X") if mark else None
    total = peak = start
    at_mark = start if mark else None
    for i, e in enumerate(mem):
        if i not in scratch:
            total += e["args"]["Bytes"]
            peak = max(peak, total)
        if mark_ts is not None and e["ts"] <= mark_ts:
            at_mark = total
    return start, peak, at_mark


def fsdp_step_peak_bytes(shape: ModelShape, setup: TrainingSetup, device: torch.device | str = "cpu") -> int:
    """Most bytes allocated above rest during one forward and backward of a Llama with `shape`,
    `fully_shard` per decoder layer and at the root, on rank 0 of `setup.world_size` (fake process
    group): ZeRO-3 for `setup.zero_stage` 3, ZeRO-2 (`reshard_after_forward=False`) for 2. At rest: the
    sharded parameters and AdamW's states, no gradients (`zero_grad(set_to_none=True)`).
    `setup` gives the precision ("fp32" or "bf16-pure"), micro-batch, sequence length and checkpointing:
    `transformers`' own per layer for `checkpoint_every=1`, `gpulab.checkpointing.checkpoint_in_segments`
    for more. The step is fused AdamW's, on unpadded batches, with SDPA. On CUDA in fp32 give a shape
    without grouped-query attention (`num_kv_heads == num_heads`): SDPA has no fused kernel for it without
    a mask there and falls back to its math kernel, which saves whole attention matrices that the
    calculator's SDPA does not count."""
    if setup.precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)} (the parameters' dtype), got {setup.precision!r}")
    unmeasured = {name: getattr(setup, name) for name, default in UNMEASURED.items() if getattr(setup, name) != default}
    if unmeasured or setup.zero_stage not in (2, 3) or setup.world_size < 2 or not setup.seq_len:
        raise ValueError(f"measures ZeRO-2 or ZeRO-3 over 2 or more ranks with a sequence length, fused AdamW, "
                         f"no LoRA, tensor parallelism, padding, accumulation or chunked loss; got {setup}")
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
        # ZeRO-2 keeps each gathered layer from its forward to its backward; ZeRO-3 takes FSDP2's default
        # (None: every layer resharded after forward, the root kept, since backward starts with it)
        reshard = None if setup.zero_stage == 3 else False
        for layer in layers:  # every decoder layer a unit, inside a checkpointed segment or not
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        ids = torch.randint(0, shape.vocab_size, (setup.batch_size, setup.seq_len),
                            generator=torch.Generator().manual_seed(0)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        for _ in range(2):  # AdamW's states exist and the gradients are freed: the state at rest
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            with gc_paused():
                torch.cuda.synchronize(device)
                rest = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                model(input_ids=ids, labels=ids).loss.backward()
                torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - rest
        with gc_paused(), quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(input_ids=ids, labels=ids).loss.backward()
        start, peak, _ = cpu_allocated_bytes(prof)
        return peak - start
    finally:
        dist.destroy_process_group()
