"""ZeRO stages 0-3 on real processes: per-rank bytes, losses against one process, bytes communicated.

Each run trains the course's tiny Llama for a few AdamW steps (fp32) on the same global batches:

- `ddp`       DistributedDataParallel: everything replicated (ZeRO stage 0);
- `zero1`     DDP + ZeroRedundancyOptimizer: optimizer state sharded (stage 1);
- `zero2`     FSDP2 `fully_shard` per decoder layer + root, reshard_after_forward=False: the gathered
              parameters stay until backward, so only gradients and optimizer state are split during
              compute and one all-gather per step is spent (stage 2's traffic);
- `zero3`     the same with reshard_after_forward=True: parameters re-gathered in backward (stage 3);
- `zero3_bf16` zero3 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32);
- `zero3_offload` zero3 with CPUOffloadPolicy(pin_memory=False).

For zero2 and zero3 one more forward and backward from the state at rest measures the in-step
memory: bytes allocated above rest at the forward/backward boundary and at the step's peak (CUDA: the
allocator's counters; CPU: the profiler's allocator events) and the gathered parameter bytes held
between forward and backward, which is what tells the two apart (at rest they hold the same bytes).

Rank 0 also trains one process on the whole batch as the reference (the mean of the two half-batch
losses, which is what data parallelism averages). Bytes are counted from the tensors each rank holds
(a DTensor's local shard; storages counted once); communication from the tensors handed to
all-gather / reduce-scatter (FSDP2), to broadcast (ZeroRedundancyOptimizer's parameter updates) and
to the all-reduce of DDP's comm hook.

Run by hand (gloo on CPU processes, NCCL with a GPU per process):

    torchrun --nproc-per-node=2 labs/scripts/12_zero_fsdp.py --steps 3 --out zero.json

On two nodes (the same line on each; host is one of them, and the rendezvous numbers the nodes):

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=host:29500 labs/scripts/12_zero_fsdp.py --out zero.json
"""

from __future__ import annotations

import argparse
import inspect
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from gpulab.data import load_task
from gpulab.distributed import finish, gather, init, say
from gpulab.fsdp_memory import cpu_allocated_bytes
from gpulab.models import build_model
from gpulab.presets import PRESETS
from gpulab.profiling import gc_paused

RUNS = ("ddp", "zero1", "zero2", "zero3", "zero3_bf16", "zero3_offload")


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the local parts of `tensors` (padding included)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = local(t)
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(moment bytes, step-counter bytes) of an optimizer's state on this rank."""
    moments = steps = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                n = local(value).numel() * local(value).element_size()
                steps += n if key == "step" else 0
                moments += 0 if key == "step" else n
    return moments, steps


# The collectives FSDP2 calls by module attribute: torch 2.13 calls the `*_single` functions, torch 2.11
# (the GPU machine's) `all_gather_into_tensor` and `reduce_scatter_tensor`. Same (output, input, ...) order.
FSDP_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
FSDP_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class Traffic:
    """Bytes handed to each kind of collective on this rank (the full, gathered size)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved = (getattr(dist, FSDP_ALL_GATHER), getattr(dist, FSDP_REDUCE_SCATTER), dist.broadcast)

    def __enter__(self) -> Traffic:
        gather, scatter, broadcast = self._saved

        def all_gather_single(output, input, *args, **kwargs):
            self.add("all_gather", output)
            return gather(output, input, *args, **kwargs)

        def reduce_scatter_single(output, input, *args, **kwargs):
            self.add("reduce_scatter", input)
            return scatter(output, input, *args, **kwargs)

        def broadcast_(tensor, *args, **kwargs):  # ZeroRedundancyOptimizer sends updated parameters this way
            self.add("broadcast", tensor)
            return broadcast(tensor, *args, **kwargs)

        setattr(dist, FSDP_ALL_GATHER, all_gather_single)
        setattr(dist, FSDP_REDUCE_SCATTER, reduce_scatter_single)
        dist.broadcast = broadcast_
        return self

    def __exit__(self, *exc) -> None:
        gather, scatter, dist.broadcast = self._saved
        setattr(dist, FSDP_ALL_GATHER, gather)
        setattr(dist, FSDP_REDUCE_SCATTER, scatter)

    def add(self, kind: str, t: torch.Tensor) -> None:
        self.bytes[kind] += t.numel() * t.element_size()
        self.calls[kind] += 1

    def ddp_hook(self, state, bucket):
        """DDP comm hook: count the bucket, then average it with an all-reduce as DDP would."""
        buf = bucket.buffer()
        self.add("all_reduce", buf)
        fut = dist.all_reduce(buf.div_(dist.get_world_size()), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])


def _storage_refs(tensors) -> dict[int, int]:
    """How many tensors share each storage behind `tensors` (the storage's use count)."""
    ptrs = [t.untyped_storage()._cdata for t in tensors]
    return {ptr: torch._C._storage_Use_Count(ptr) for ptr in ptrs}


SETTLED = "settled collective"


def settled(collective):
    """`collective` (output, input, ...) run to completion inside a `record_function(SETTLED)` span that
    ends once gloo is done with it. The CPU profiler records an allocator event only on a thread that
    carries its state; a gloo worker carries it while it runs a collective, not when it drops the
    collective's work afterwards. Whatever the worker held last was freed unseen and counted as held for
    the rest of the step: in CI one rank's forward/backward boundary came out a root unit (1.05 MB) high,
    and gloo's copy of each reduce-scatter's input stayed in the count. So gloo gets views of FSDP2's
    tensors, and the span waits until the views are gone: the work is freed, FSDP2's own tensors are
    freed on this thread (recorded), and the copies gloo made inside the span are freed by its end
    (`cpu_allocated_bytes(owner=SETTLED)` counts them so)."""
    signature = inspect.signature(collective)
    output_name, input_name = list(signature.parameters)[:2]

    def call(*args, **kwargs):
        call_args = signature.bind(*args, **kwargs).arguments
        before = _storage_refs(call_args[name] for name in (output_name, input_name))
        for name in (output_name, input_name):  # gloo's references go to views, apart from FSDP2's tensors
            call_args[name] = call_args[name].view(call_args[name].shape)
        call_args["async_op"] = True
        with record_function(SETTLED):
            collective(**call_args).wait()
            del call_args  # this thread's references to the views
            deadline = time.monotonic() + 60
            while any(torch._C._storage_Use_Count(ptr) > n for ptr, n in before.items()):
                if time.monotonic() > deadline:
                    raise RuntimeError("gloo's worker thread kept a collective's tensors for 60 s after it finished")
                time.sleep(1e-4)
        return None  # done: FSDP2 waits only on a Work it gets back
    return call


def gathered_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters that are whole (gathered) right now: FSDP2 swaps a module's sharded
    DTensor parameters for plain unsharded tensors while they are gathered."""
    return held_bytes(p for p in model.parameters() if not isinstance(p, DTensor))


def step_memory(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> dict:
    """One forward and backward from the state at rest: bytes above rest at the forward/backward
    boundary and at the step's peak (CUDA: the caching allocator's counters; CPU: the profiler's
    allocator events), and the gathered parameter bytes held at the boundary."""
    # gc_paused: a reference cycle freed mid-step would count as the step freeing memory
    if device.type == "cuda":
        with gc_paused():
            torch.cuda.synchronize(device)
            rest = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            loss = model(**batch).loss
            torch.cuda.synchronize(device)
            boundary, gathered = torch.cuda.memory_allocated(device) - rest, gathered_bytes(model)
            loss.backward()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - rest
    else:
        saved = {name: getattr(dist, name) for name in (FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER)}
        for name, collective in saved.items():
            setattr(dist, name, settled(collective))
        try:
            with gc_paused(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                loss = model(**batch).loss
                gathered = gathered_bytes(model)
                with record_function("backward"):
                    loss.backward()
        finally:
            for name, collective in saved.items():
                setattr(dist, name, collective)
        # FSDP2 gathers by resizing storages, which tensor-level tracking (gpulab.live_bytes) misses
        start, at_peak, at_boundary = cpu_allocated_bytes(prof, mark="backward", owner=SETTLED)
        boundary, peak = at_boundary - start, at_peak - start
    model.zero_grad(set_to_none=True)
    return {"boundary_bytes": boundary, "peak_bytes": peak, "gathered_bytes": gathered}


def halves(batch: dict[str, torch.Tensor], world: int) -> list[dict[str, torch.Tensor]]:
    return [{k: v.chunk(world)[r] for k, v in batch.items()} for r in range(world)]


def reference(batches, steps: int, lr: float, world: int, device: torch.device) -> list[float]:
    """One process: the mean of the per-rank losses over the same global batches."""
    model = build_model(PRESETS["tiny"].shape, device=device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches[:steps]:
        parts = halves(batch, world)
        loss = sum(model(**{k: v.to(device) for k, v in p.items()}).loss for p in parts) / world
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def wrap(kind: str, model: torch.nn.Module, device: torch.device, traffic: Traffic):
    if kind in ("ddp", "zero1"):
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        ddp.register_comm_hook(None, traffic.ddp_hook)
        return ddp
    kwargs: dict = {"reshard_after_forward": kind != "zero2"}
    if kind == "zero3_bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if kind == "zero3_offload":
        # pin_memory=True (the default) needs an accelerator; with one, pinned memory copies faster
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    # the mesh names the ranks' device: without it FSDP2 picks CUDA whenever torch sees a GPU, and gloo
    # ranks on a one-GPU machine would each claim cuda:<local rank>
    kwargs["mesh"] = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def run(kind: str, batches, steps: int, lr: float, device: torch.device) -> dict:
    """Train `steps` steps as `kind` says; this rank's bytes, traffic per step and the mean losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(PRESETS["tiny"].shape, device=device, seed=0)  # same seed: same weights everywhere
    traffic = Traffic()
    model = wrap(kind, model, device, traffic)
    params = list(model.parameters())
    if kind == "zero1":
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr)
    else:
        opt = torch.optim.AdamW(params, lr=lr)
    seen_dtypes: set[str] = set()
    q_proj = (model.module if isinstance(model, DDP) else model).model.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_pre_hook(lambda m, args: seen_dtypes.add(str(m.weight.dtype)))
    losses, grad_bytes = [], 0
    with traffic:
        for i, batch in enumerate(batches[:steps]):
            mine = {k: v.to(device) for k, v in halves(batch, world)[rank].items()}
            loss = model(**mine).loss
            loss.backward()
            if i == 0:
                grad_bytes = held_bytes(p.grad for p in params if p.grad is not None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)  # outside the counted collectives: only the training's traffic counts
            losses.append(mean.item() / world)
    hook.remove()
    step_mem = None
    if kind in ("zero2", "zero3"):  # the in-step memory that tells ZeRO-2-like from ZeRO-3
        step_mem = step_memory(model, {k: v.to(device) for k, v in halves(batches[0], world)[rank].items()}, device)
    moments, step_bytes = state_bytes(opt.optim if kind == "zero1" else opt)
    return {
        "losses": losses,
        "param_bytes": held_bytes(params),
        "grad_bytes": grad_bytes,
        "moment_bytes": moments,
        "step_bytes": step_bytes,
        "traffic_bytes_per_step": {k: v // steps for k, v in traffic.bytes.items()},
        "calls_per_step": {k: v // steps for k, v in traffic.calls.items()},
        "forward_param_dtypes": sorted(seen_dtypes),
        "stored_param_dtypes": sorted({str(p.dtype) for p in params}),
        "param_devices": sorted({local(p).device.type for p in params}),
        "step_memory": step_mem,
    }


T0 = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16-steps", type=int, default=1, help="steps of the bf16 run on a CPU")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--out", default=None, help="write every rank's results here as JSON (rank 0 writes)")
    args = parser.parse_args()

    me = init()
    rank, world, device, backend = me.rank, me.world, me.device, me.backend

    task = load_task(seq_len=PRESETS["tiny"].seq_len)
    stream = task.batches(args.batch_size, seed=0)
    batches = [next(stream) for _ in range(args.steps)]
    results: dict = {"world_size": world, "backend": backend, "steps": args.steps, "batch_size": args.batch_size,
                     "seq_len": PRESETS["tiny"].seq_len}
    results["setup_seconds"] = time.perf_counter() - T0
    if rank == 0:
        results["reference"] = reference(batches, args.steps, args.lr, world, device)
    for kind in args.runs.split(","):
        torch.manual_seed(0)
        start = time.perf_counter()
        # bf16 matmuls are slow on CPUs without bf16 units: one step shows the dtypes and the traffic
        steps = args.bf16_steps if kind == "zero3_bf16" and device.type == "cpu" else args.steps
        r = run(kind, batches, steps, args.lr, device)
        r["seconds"] = time.perf_counter() - start
        results[kind] = gather(r)
        say(rank, f"{kind:<14} params {r['param_bytes']:>10,} B  grads {r['grad_bytes']:>10,} B  "
                  f"optimizer {r['moment_bytes'] + r['step_bytes']:>10,} B")
    finish(results, args.out)


if __name__ == "__main__":
    main()
