"""2-D parallelism on four processes: FSDP2 over one mesh dimension, tensor parallelism over the other.

The ranks form a (dp, tp) = (2, 2) device mesh: ranks {0, 1} and {2, 3} are tensor-parallel pairs,
{0, 2} and {1, 3} data-parallel pairs. Each pair of tensor-parallel ranks splits every layer
(gpulab.tensor_parallel's plan, with or without sequence parallelism); FSDP2 then shards each rank's
tensor-parallel shards again over the data-parallel dimension, and each data-parallel group takes half
of every batch. The reference is one process averaging the two half-batch losses, as data parallelism
does (lab 12). Per-rank bytes are counted from the local shards; the notebook compares them with the
memory calculator (`tp_degree=2`, ZeRO stage 3 over `world_size=2`).

    torchrun --nproc-per-node=4 labs/scripts/14_2d.py --out 2d.json
"""

from __future__ import annotations

import argparse
import time

T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from gpulab.data import load_task  # noqa: E402
from gpulab.distributed import finish, gather, init, say  # noqa: E402
from gpulab.models import build_model  # noqa: E402
from gpulab.presets import PRESETS  # noqa: E402
from gpulab.tensor_parallel import CollectiveCounter, held_bytes, local, parallelize_llama  # noqa: E402

TP = 2  # tensor-parallel degree: the inner (fastest-varying) mesh dimension, a node's GPUs in practice


def reference(batches: list[dict], dp: int, device: torch.device, lr: float) -> list[float]:
    model = build_model(PRESETS["tiny"].shape, device=device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        parts = [{k: v.chunk(dp)[r] for k, v in batch.items()} for r in range(dp)]
        loss = sum(model(**p).loss for p in parts) / dp
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def run(sequence_parallel: bool, batches: list[dict], device: torch.device, lr: float) -> dict:
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // TP, TP), mesh_dim_names=("dp", "tp"))
    model = build_model(PRESETS["tiny"].shape, device=device, seed=0)
    parallelize_llama(model, mesh["tp"], sequence_parallel=sequence_parallel)  # tensor parallelism first,
    for layer in model.model.layers:  # then FSDP2 over the data-parallel dimension, per layer and root
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    out: dict = {"losses": [], "step_s": []}
    for i, batch in enumerate(batches):
        mine = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
        positions = torch.arange(mine["input_ids"].shape[1], device=device).unsqueeze(0)
        start = time.perf_counter()
        counter = CollectiveCounter()
        with counter:
            loss = model(**mine, position_ids=positions).loss
            counter.phase = "backward"
            loss.backward()
            counter.phase = "optimizer"
            if i == 0:
                out["grad_bytes"] = held_bytes(p.grad for p in params)
            opt.step()
        opt.zero_grad(set_to_none=True)
        out["step_s"].append(time.perf_counter() - start)
        if i == 0:
            out["collectives"] = counter.summary()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())  # the same on both tensor-parallel ranks
        out["losses"].append(mean.item() / dp)
    states = [(k, local(v)) for s in opt.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)]
    out.update(param_bytes=held_bytes(params),
               moment_bytes=sum(v.numel() * v.element_size() for k, v in states if k != "step"),
               step_bytes=sum(v.numel() * v.element_size() for k, v in states if k == "step"),
               mesh_coordinate=[dp_rank, mesh["tp"].get_local_rank()])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over the dp groups")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default=None, help="write the results here as JSON (rank 0 writes)")
    args = parser.parse_args()

    me = init()
    if me.world % TP:
        raise SystemExit(f"the world size ({me.world}) must be a multiple of the tensor-parallel degree {TP}")
    task = load_task(seq_len=PRESETS["tiny"].seq_len)
    stream = task.batches(args.batch_size, seed=0)
    # no padding mask: causal attention keeps each row's trailing padding away from its tokens
    batches = [{k: v.to(me.device) for k, v in next(stream).items() if k != "attention_mask"}
               for _ in range(args.steps)]
    results: dict = {"world_size": me.world, "backend": me.backend, "mesh": [me.world // TP, TP],
                     "steps": args.steps, "setup_s": time.perf_counter() - T0}
    if me.rank == 0:
        results["reference"] = reference(batches, me.world // TP, me.device, args.lr)
    for name, sp in (("fsdp_tp", False), ("fsdp_tp_sp", True)):
        torch.manual_seed(0)
        r = run(sp, batches, me.device, args.lr)
        results[name] = gather(r)
        say(me.rank, f"{name:<11} mesh (dp, tp) = {tuple(r['mesh_coordinate'])}  params {r['param_bytes']:>9,} B  "
                     f"grads {r['grad_bytes']:>9,} B  optimizer {r['moment_bytes'] + r['step_bytes']:>9,} B")
    results["total_s"] = time.perf_counter() - T0
    finish(results, args.out)


if __name__ == "__main__":
    main()
