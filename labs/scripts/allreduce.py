"""Two (or more) processes each hold a tensor; all_reduce leaves the sum on every rank.

Run it with `torchrun --nproc-per-node=2 labs/scripts/allreduce.py` (gloo on CPU, NCCL with a GPU per
process). Lab 00 launches it through `gpulab.launch.torchrun` to check the machine can run the
distributed labs.
"""

import torch
import torch.distributed as dist

from gpulab.distributed import init, say


def main() -> None:
    me = init()
    rank, world, device = me.rank, me.world, me.device
    x = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    say(rank, f"before all_reduce: {x.tolist()}")
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    expected = sum(torch.arange(4, dtype=torch.float32) + 10 * r for r in range(world))
    ok = torch.equal(x.cpu(), expected)
    say(rank, f"after all_reduce:  {x.tolist()} (sum over {world} ranks: {'ok' if ok else 'WRONG'})")
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
