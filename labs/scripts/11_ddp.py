"""DistributedDataParallel on the course's tiny Llama: gradients, buckets, overlap and `no_sync`.

Every rank takes its share of one combined batch; rank 0 also computes the single-process gradients
of the whole combined batch as the reference. Five experiments in one launch (torchrun start-up costs
seconds):

1. DDP's averaged gradients equal the reference when each rank's loss is normalised by the *global*
   loss-token count (and miss it when each rank takes its own mean: the ranks hold unequal counts);
2. the gradient buckets DDP builds (`bucket_cap_mb`) and when each bucket's all-reduce is launched,
   recorded by a communication hook, against the backward pass's last gradient;
3. gradient accumulation over k micro-batches with `no_sync()` for the first k - 1: the same
   gradients as syncing every micro-batch, with k times fewer all-reduces;
4. overlap, measured: a `torch.profiler` trace of one backward puts the all-reduces' execution
   intervals (gloo's worker threads on CPUs, NCCL kernels on GPUs) and the backward's operations on
   one clock (host timestamps of a launch say nothing about when a GPU ran it);
5. the precision gradients travel in: under `torch.autocast(bfloat16)` the buckets are still fp32;
   `bf16_compress_hook` sends them in bf16, half the bytes, with bf16's rounding in the average.

Run it by hand on one machine (gloo over CPU processes, or NCCL with a GPU per process):

    torchrun --nproc-per-node=2 labs/scripts/11_ddp.py --out ddp.json

on two machines (the same line on each; host is one of them, and the rendezvous numbers the nodes):

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=host:29500 labs/scripts/11_ddp.py --out ddp.json

Rank 0 writes the measurements as JSON to --out; every rank prints `[rankN] ...` lines.
"""

import argparse
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from gpulab.data import IGNORE_INDEX, load_task
from gpulab.distributed import finish, init, say
from gpulab.models import build_model
from gpulab.presets import PRESETS


def loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that count in a causal-LM loss: labels shifted by one, -100 left out."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def summed_token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum (not mean) of the cross-entropy over the batch's loss tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                           batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """All parameters' gradients in one vector (every parameter must have one)."""
    grads = [p.grad for p in model.parameters()]
    if any(g is None for g in grads):
        raise RuntimeError("a parameter has no gradient")
    return torch.cat([g.reshape(-1) for g in grads if g is not None])


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


class CommRecorder:
    """State of the communication hook below: what each bucket's all-reduce carried, and when."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names  # id(parameter) -> name, to say which parameters share a bucket
        self.calls: list[dict] = []
        self.backward_start = 0.0


def record_and_allreduce(state: CommRecorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Log the bucket, then do what DDP does by default: divide by the world size and all-reduce the
    flat bucket buffer asynchronously. (DDP checks these annotations at run time: keep them real types.)"""
    buffer = bucket.buffer()
    state.calls.append({"bucket": bucket.index(), "bytes": buffer.numel() * buffer.element_size(),
                        "params": [state.names[id(p)] for p in bucket.parameters()],
                        "t_ms": (time.perf_counter() - state.backward_start) * 1e3})
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def bf16_compress(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """`default_hooks.bf16_compress_hook` under another name: DDP refuses a hook *named* so unless torch
    was built for a GPU (CUDA or ROCm) with NCCL 2.10+ or runs on an XPU with XCCL, but gloo all-reduces
    bf16 too, so CPU processes can run it."""
    return default_hooks.bf16_compress_hook(state, bucket)


class AllReduceBytes:
    """Inside `with`, count what every `dist.all_reduce` call is handed: bytes and dtype. DDP's comm
    hooks, the recorder above and `default_hooks.bf16_compress_hook` alike, call it by module attribute."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self._saved = dist.all_reduce

    def __enter__(self) -> "AllReduceBytes":
        def counting(tensor, *args, **kwargs):
            self.calls.append((tensor.numel() * tensor.element_size(), str(tensor.dtype)))
            return self._saved(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._saved


def overlap_from_trace(prof: profile, on_gpu: bool) -> dict:
    """All-reduce and backward intervals (ms, from the backward's first operation) read off a profiler
    trace: on GPUs the NCCL kernels against the other kernels; on CPUs gloo's `gloo:all_reduce` (run on
    its worker threads) against the autograd engine's operations."""
    events = prof.events()
    if on_gpu:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        comm = [e for e in kernels if "nccl" in e.name.lower() and "allreduce" in e.name.lower()]
        compute = [e for e in kernels if "nccl" not in e.name.lower()]
    else:
        comm = [e for e in events if e.name == "gloo:all_reduce"]
        compute = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    t0 = min(e.time_range.start for e in compute)
    end = max(e.time_range.end for e in compute)
    spans = sorted(((e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3) for e in comm)
    backward_ms = (end - t0) / 1e3
    return {"backward_ms": backward_ms, "allreduce_ms": spans,
            "overlapped_ms": sum(max(0.0, min(b, backward_ms) - a) for a, b in spans),
            "allreduce_total_ms": sum(b - a for a, b in spans),
            "started_during_backward": sum(a < backward_ms for a, _ in spans)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file rank 0 writes the measurements to")
    parser.add_argument("--batch", type=int, default=16, help="sequences in the combined batch")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per rank for no_sync")
    parser.add_argument("--bucket-cap-mb", type=float, default=2.0, help="DDP bucket size (default 25)")
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()

    me = init()
    rank, world, device, backend = me.rank, me.world, me.device, me.backend
    result: dict = {"backend": backend, "world": world, "bucket_cap_mb": args.bucket_cap_mb}

    shape = PRESETS["tiny"].shape
    # the same data on every rank; 256 examples are plenty for one batch and train the tokenizer in ms
    task = load_task(seq_len=args.seq_len, vocab_size=shape.vocab_size, n_train=256, n_eval=16)
    combined = next(task.batches(args.batch, seed=0, device=device))
    per_rank = args.batch // world
    local = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in combined.items()}

    # -- 1. gradients: DDP against one process on the combined batch ---------------------------
    ddp = DDP(build_model(shape, device=device, seed=0), device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=args.bucket_cap_mb)  # seed 0 everywhere; DDP also broadcasts rank 0's weights
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    recorder = CommRecorder(names)
    ddp.register_comm_hook(recorder, record_and_allreduce)

    local_tokens = torch.tensor(loss_tokens(local["labels"]), device=device)
    global_tokens = local_tokens.clone()
    dist.all_reduce(global_tokens)  # each rank needs the combined batch's count: one tiny all-reduce
    counts = [torch.zeros_like(local_tokens) for _ in range(world)]
    dist.all_gather(counts, local_tokens)
    n_global = int(global_tokens)

    def ddp_grads(how: str) -> torch.Tensor:
        ddp.zero_grad(set_to_none=True)
        if how == "per-rank mean":  # each rank's own mean; DDP then averages the ranks' gradients
            loss = ddp(**local).loss
        else:  # global-token normalisation: DDP divides by world, so multiply by it
            loss = summed_token_loss(ddp, local) * world / n_global
        recorder.calls.clear()
        recorder.backward_start = time.perf_counter()
        loss.backward()
        result.setdefault("backward_ms", []).append((time.perf_counter() - recorder.backward_start) * 1e3)
        return flat_grad(ddp.module)

    ddp_grads("global tokens")  # iteration 1: DDP rebuilds its buckets in the order gradients arrived
    # a profiler trace of one more backward: when each all-reduce really ran, against backward's work
    ddp.zero_grad(set_to_none=True)
    loss = summed_token_loss(ddp, local) * world / n_global
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    result["overlap"] = overlap_from_trace(prof, device.type == "cuda")
    # post-accumulate-grad hooks fire as each parameter's .grad is final: the backward's timeline
    ready_ms: dict[str, float] = {}
    handles = [p.register_post_accumulate_grad_hook(
        lambda p, n=n: ready_ms.__setitem__(n, (time.perf_counter() - recorder.backward_start) * 1e3))
        for n, p in ddp.module.named_parameters()]
    g_global = ddp_grads("global tokens")
    for h in handles:
        h.remove()
    calls_one_step = list(recorder.calls)
    g_mean = ddp_grads("per-rank mean")

    reference = None
    if rank == 0:
        single = build_model(shape, device=device, seed=0)
        single(**combined).loss.backward()  # the combined batch's mean over its loss tokens
        reference = flat_grad(single)
        result["ddp_vs_single"] = rel_error(g_global, reference)
        result["per_rank_mean_vs_single"] = rel_error(g_mean, reference)
        result["loss_tokens_per_rank"] = [int(c) for c in counts]
    say(rank, f"{per_rank} of {args.batch} sequences, {int(local_tokens)} of {n_global} loss tokens")

    # -- 2. buckets, and when their all-reduces start ---------------------------------------------
    param_bytes = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
    result["param_bytes"] = param_bytes
    result["n_params"] = len(names)
    result["buckets"] = [{k: c[k] for k in ("bucket", "bytes", "params", "t_ms")} for c in calls_one_step]
    result["grad_ready_ms"] = ready_ms
    result["launch_ms"] = [c["t_ms"] for c in calls_one_step]
    last_grad_ms = max(ready_ms.values())
    before = sum(c["t_ms"] < last_grad_ms for c in calls_one_step)
    result["launched_before_last_grad"] = before
    say(rank, f"bucket_cap_mb={args.bucket_cap_mb:g}: {len(calls_one_step)} buckets for {len(names)} parameters "
              f"({param_bytes / 2**20:.2f} MiB); {before} of them launched before backward's last gradient")

    # -- 3. no_sync: accumulate k micro-batches locally, all-reduce once ---------------------------
    micro = per_rank // args.micro
    mbs = [{k: v[i * micro:(i + 1) * micro] for k, v in local.items()} for i in range(args.micro)]
    all_reduces = {}
    for how in ("sync every micro-batch", "no_sync for k-1"):
        ddp.zero_grad(set_to_none=True)
        recorder.calls.clear()
        for i, mb in enumerate(mbs):
            # no_sync must cover the forward too: DDP decides there whether the backward will sync
            skip = how == "no_sync for k-1" and i < len(mbs) - 1
            with ddp.no_sync() if skip else contextlib.nullcontext():
                loss = summed_token_loss(ddp, mb) * world / n_global  # the same global normalisation
                loss.backward()  # without sync: gradients add up in .grad, no hook, no all-reduce
        all_reduces[how] = len(recorder.calls)
        if reference is not None:  # rank 0
            result[f"accumulated ({how}) vs single"] = rel_error(flat_grad(ddp.module), reference)
    result["all_reduces"] = all_reduces
    result["micro_batches"] = args.micro
    say(rank, f"{args.micro} micro-batches of {micro} sequences: all-reduces "
              + ", ".join(f"{n} ({how})" for how, n in all_reduces.items()))

    # -- 5. the precision gradients travel in, under autocast, without and with bf16_compress_hook ---
    sent = {}
    grads = {}
    for how in ("default (fp32 buckets)", "bf16_compress_hook"):
        module = build_model(shape, device=device, seed=0)
        model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                    bucket_cap_mb=args.bucket_cap_mb)
        if how == "bf16_compress_hook":
            model.register_comm_hook(state=None, hook=bf16_compress)
        else:  # what DDP does without a hook, through dist.all_reduce so that it is counted the same way
            model.register_comm_hook(CommRecorder({id(p): n for n, p in module.named_parameters()}),
                                     record_and_allreduce)
        for _ in range(2):  # the second iteration runs on the rebuilt buckets
            model.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):  # bf16 matmuls, fp32 parameters
                loss = summed_token_loss(model, local) * world / n_global
            with AllReduceBytes() as counter:
                loss.backward()
        sent[how] = {"bytes": sum(b for b, _ in counter.calls), "calls": len(counter.calls),
                     "dtypes": sorted({d for _, d in counter.calls}),
                     "grad_dtypes": sorted({str(p.grad.dtype) for p in model.module.parameters()})}
        grads[how] = flat_grad(model.module)
    result["compression"] = sent
    result["bf16_hook_vs_fp32_allreduce"] = rel_error(grads["bf16_compress_hook"], grads["default (fp32 buckets)"])
    say(rank, "under autocast: " + "; ".join(f"{how}: {v['calls']} all-reduces, {v['bytes']:,} bytes in {v['dtypes']}"
                                             for how, v in sent.items()))

    finish(result, args.out)


if __name__ == "__main__":
    main()
