"""Two (or more) processes each hold a tensor; all_reduce leaves the sum on every rank.

Run it with `torchrun --nproc-per-node=2 labs/scripts/allreduce.py` (gloo on CPU, NCCL with a GPU per
process). Lab 00 launches it through `gpulab.launch.torchrun` to check the machine can run the
distributed labs.
"""

import os

import torch
import torch.distributed as dist


def main() -> None:
    backend = os.environ.get("GPULAB_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    x = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    print(f"[rank{rank}] before all_reduce: {x.tolist()}", flush=True)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    expected = sum(torch.arange(4, dtype=torch.float32) + 10 * r for r in range(world))
    ok = torch.equal(x.cpu(), expected)
    print(f"[rank{rank}] after all_reduce:  {x.tolist()} (sum over {world} ranks: {'ok' if ok else 'WRONG'})",
          flush=True)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
