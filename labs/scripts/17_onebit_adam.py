"""Four ways to average over data-parallel ranks, on the course's tiny Llama: bytes sent and loss.

Every run trains the same model from the same weights on the same batches, with DDP on all ranks:

- `adam`:     DDP's fp32 all-reduce (the `allreduce_hook`, which PyTorch documents as DDP's default)
              and `torch.optim.Adam`;
- `bf16`:     the built-in `bf16_compress_hook` (gradients cast to bf16 for the all-reduce) and Adam;
- `powersgd`: the built-in `powerSGD_hook` (rank-r factors with error feedback, fp32 all-reduce for
              the first `--warmup` steps) and Adam;
- `onebit`:   `gpulab.onebit_adam.OneBitAdam` with its hook: fp32 all-reduce and exact Adam for
              `--warmup` steps, then no gradient all-reduce and the momentum averaged in 1 bit.
- `onebit-noef` (only when asked for with --runs): the same without error feedback.

The bytes each rank sends are counted by wrapping torch.distributed's all_reduce, all_to_all_single
and all_gather during backward and the optimizer step, at the cost of ring algorithms: an all-reduce of
B bytes sends 2 (n - 1) / n * B, an all-to-all (n - 1) / n * B, an all-gather of B (n - 1) * B.

    torchrun --nproc-per-node=2 labs/scripts/17_onebit_adam.py --steps 60 --warmup 15 --out onebit.json

gloo over CPU processes, or NCCL with a GPU per process. Rank 0 writes JSON to --out; every rank
prints `[rankN] ...` lines.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from gpulab.data import load_task
from gpulab.distributed import finish, init, say
from gpulab.models import build_model
from gpulab.onebit_adam import (FlatLayout, OneBitAdam, WireCounter, onebit_allreduce_bytes, onebit_ddp_hook,
                                powersgd_allreduce_bytes, ring_allreduce_bytes)
from gpulab.presets import PRESETS
from gpulab.train import eval_loss

RUNS = ("adam", "bf16", "powersgd", "onebit")


def count_collectives(counter: WireCounter) -> None:
    """Wrap the collectives the hooks and the optimizer call (they look them up on `dist` at call time)."""
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_to_all_single", "all_gather_single",
                                                        "all_gather_into_tensor") if hasattr(dist, name)}

    def all_reduce(tensor, *args, **kwargs):
        counter.all_reduce(tensor)
        return originals["all_reduce"](tensor, *args, **kwargs)

    def all_to_all_single(output, input, *args, **kwargs):
        counter.all_to_all(input)
        return originals["all_to_all_single"](output, input, *args, **kwargs)

    def gather(name):
        def all_gather(output, input, *args, **kwargs):
            counter.all_gather(input)
            return originals[name](output, input, *args, **kwargs)
        return all_gather

    dist.all_reduce = all_reduce
    dist.all_to_all_single = all_to_all_single
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if name in originals:
            setattr(dist, name, gather(name))


def bf16_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's `bf16_compress_hook`, called under another name: DDP refuses to register the hook itself
    unless PyTorch is built with CUDA and NCCL 2.10+ (or XPU and XCCL), but gloo all-reduces bf16 as well."""
    return default_hooks.bf16_compress_hook(state, bucket)


def powersgd_in_order(state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket
                      ) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's `powerSGD_hook`, finished before the next bucket's hook starts. Its callbacks launch the
    all-reduces of P and Q from the backend's thread while backward goes on launching the next bucket's
    all-reduce: on gloo the ranks can then issue them in different orders and abort (seen here in 2 of 5
    launches). Waiting costs the overlap, which two CPU processes cannot show anyway."""
    fut = powerSGD_hook.powerSGD_hook(state, bucket)
    fut.wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(fut.value())
    return done


def train(name: str, args, me, shape, task, counter: WireCounter, seed: int) -> dict:
    model = build_model(shape, device=me.device, seed=seed)
    ddp = DDP(model, device_ids=[me.device.index] if me.device.type == "cuda" else None)
    if name in ("onebit", "onebit-noef"):
        opt = OneBitAdam(ddp.parameters(), lr=args.lr, warmup_steps=args.warmup, block=args.block,
                         error_feedback=name == "onebit")
        ddp.register_comm_hook(opt, onebit_ddp_hook)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=args.lr, foreach=False)
        if name == "adam":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif name == "bf16":
            ddp.register_comm_hook(None, bf16_hook)
        elif name == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                                start_powerSGD_iter=args.warmup, random_seed=seed)
            ddp.register_comm_hook(state, powersgd_in_order)
        else:
            raise ValueError(f"unknown run {name!r}")
    per_rank = args.batch
    batches = task.batches(per_rank * me.world, seed=seed, device=me.device)  # one stream, sliced by rank
    out: dict = {"train_loss": [], "bytes": [], "step_ms": [], "eval": []}
    if me.rank == 0:
        out["eval"].append((0, eval_loss(model, task.eval)))
    dist.barrier()
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        combined = next(batches)
        local = {k: v[me.rank * per_rank:(me.rank + 1) * per_rank] for k, v in combined.items()}
        start = time.perf_counter()
        counter.sent_bytes, counter.active = 0.0, True
        loss = ddp(**local).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counter.active = False
        if me.device.type == "cuda":
            torch.cuda.synchronize()
        out["step_ms"].append((time.perf_counter() - start) * 1e3)
        out["bytes"].append(counter.sent_bytes)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # not counted: for the curve only
        out["train_loss"].append(float(mean_loss) / me.world)
        if step == args.warmup:
            out["params_after_warmup"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        if step % args.eval_every == 0 or step == args.steps:
            if me.rank == 0:
                out["eval"].append((step, eval_loss(model, task.eval)))
            dist.barrier()
    out["train_s"] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file rank 0 writes the measurements to")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help=f"any of {RUNS} and onebit-noef")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="weights and data order")
    parser.add_argument("--preset", default="tiny", help="the model's shape: a gpulab preset")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15, help="exact-Adam steps of 1-bit Adam (freeze_step), "
                                                               "and PowerSGD's start_powerSGD_iter")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=None, help="default: the preset's")
    parser.add_argument("--block", type=int, default=256, help="values per 1-bit scale")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--n-eval", type=int, default=64, help="held-out examples")
    args = parser.parse_args()

    me = init()
    preset = PRESETS[args.preset]
    args.lr = args.lr or preset.lr
    shape = preset.shape
    task = load_task(seq_len=args.seq_len, vocab_size=shape.vocab_size, n_train=2000, n_eval=args.n_eval)
    counter = WireCounter(world=me.world, active=False)
    count_collectives(counter)

    params = list(build_model(shape, seed=0).parameters())
    numel = sum(p.numel() for p in params)
    layout = FlatLayout.build(params, args.block, me.world)
    result: dict = {
        "backend": me.backend, "world": me.world, "preset": args.preset, "steps": args.steps,
        "warmup": args.warmup, "lr": args.lr, "block": args.block, "powersgd_rank": args.powersgd_rank,
        "batch_per_rank": args.batch, "seq_len": args.seq_len, "seeds": args.seeds,
        "numel": numel, "padded_numel": layout.padded_numel,
        "formula": {"fp32": ring_allreduce_bytes(4 * numel, me.world),
                    "bf16": ring_allreduce_bytes(2 * numel, me.world),
                    "powersgd": powersgd_allreduce_bytes([tuple(p.shape) for p in params], args.powersgd_rank,
                                                         me.world),
                    "onebit": onebit_allreduce_bytes(layout.padded_numel, me.world, args.block)},
        "runs": {name: {} for name in args.runs},
    }
    for seed in args.seeds:
        reference = None
        for name in args.runs:
            run = train(name, args, me, shape, task, counter, seed)
            after = run.pop("params_after_warmup")
            if name == "adam":
                reference = after
            elif name.startswith("onebit") and reference is not None:
                run["warmup_max_abs_diff"] = float((after - reference).abs().max())
                run["warmup_losses_equal"] = run["train_loss"][:args.warmup] == \
                    result["runs"]["adam"][str(seed)]["train_loss"][:args.warmup]
            result["runs"][name][str(seed)] = run
            warm, late = run["bytes"][:args.warmup], run["bytes"][args.warmup:]
            final = run["eval"][-1][1] if run["eval"] else float("nan")
            say(me.rank, f"seed {seed} {name:11s}: bytes sent per step {statistics.median(warm) / 2**20:6.3f} MiB "
                         f"(warm-up), {statistics.median(late) / 2**20:6.3f} MiB (after)"
                + (f"; held-out loss after {args.steps} steps {final:.3f}" if me.rank == 0 else ""))
    finish(result, args.out)


if __name__ == "__main__":
    main()
