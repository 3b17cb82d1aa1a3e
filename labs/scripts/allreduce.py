"""Two (or more) processes each hold a tensor; all_reduce leaves the sum on every rank.

Run it with `torchrun --nproc-per-node=2 labs/scripts/allreduce.py` (gloo on CPU, NCCL with a GPU per
process). Lab 00 launches it through `gpulab.launch.torchrun` to check the machine can run the
distributed labs.
"""

import os
import sys

import torch
import torch.distributed as dist


def say(rank: int, text: str) -> None:
    """Print one `[rankN]` line in a single write: print() writes the text and the newline separately,
    and two ranks sharing the launcher's pipe can interleave between the two writes."""
    sys.stdout.write(f"[rank{rank}] {text}\n")
    sys.stdout.flush()


def main() -> None:
    backend = os.environ.get("GPULAB_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
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
