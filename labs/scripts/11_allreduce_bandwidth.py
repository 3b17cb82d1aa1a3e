"""All-reduce bandwidth against message size, reported the way nccl-tests reports it.

For each size, every rank all-reduces (sums) a float32 tensor of that many bytes; the time is the
median over repeats of the slowest rank. Two bandwidths follow:

- algorithm bandwidth  algbw = bytes / time;
- bus bandwidth        busbw = algbw * 2 (n - 1) / n   (n ranks).

A ring all-reduce sends and receives 2 (n - 1) / n of the buffer on every link, so busbw is the rate the
busiest link achieved, comparable across rank counts and with the link's peak. Every rank checks the sum.

Run it by hand on one machine (gloo over CPU processes, or NCCL with a GPU per process):

    torchrun --nproc-per-node=2 labs/scripts/11_allreduce_bandwidth.py --out bw.json

on two machines (the same line on each; host is one of them, and the rendezvous numbers the nodes):

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=host:29500 labs/scripts/11_allreduce_bandwidth.py --out bw.json
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from gpulab.distributed import finish, init, say


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file rank 0 writes the measurements to")
    parser.add_argument("--min-bytes", type=int, default=2**10)
    parser.add_argument("--max-bytes", type=int, default=2**26)
    parser.add_argument("--factor", type=int, default=4, help="size step between measurements")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed all-reduces per size (median): on shared cores five left small sizes at the scheduler's mercy")
    args = parser.parse_args()

    me = init()
    rank, world, device, backend = me.rank, me.world, me.device, me.backend

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows, all_correct = [], True
    size_bytes = args.min_bytes
    while size_bytes <= args.max_bytes:
        x = torch.empty(size_bytes // 4, dtype=torch.float32, device=device)
        times_s = []
        for i in range(args.repeats + 1):  # the first is a warm-up (connection set-up, allocation)
            x.fill_(rank + 1)
            sync()
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            sync()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # an all-reduce ends when its slowest rank does
            if i:
                times_s.append(float(elapsed))
        # small integers sum exactly in fp32: every element must be 1 + 2 + ... + world
        all_correct &= bool((x == world * (world + 1) / 2).all())
        t = statistics.median(times_s)
        algbw = size_bytes / t
        rows.append({"bytes": size_bytes, "time_us": t * 1e6, "algbw_gbs": algbw / 1e9,
                     "busbw_gbs": algbw * 2 * (world - 1) / world / 1e9})
        size_bytes *= args.factor

    ok = torch.tensor(int(all_correct), device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    say(rank, f"{len(rows)} sizes from {args.min_bytes} to {rows[-1]['bytes']} bytes: "
              f"sums {'correct on every rank' if int(ok) else 'WRONG'}")
    finish({"backend": backend, "world": world, "rows": rows, "correct": bool(int(ok))}, args.out,
           exit_code=0 if int(ok) else 1)


if __name__ == "__main__":
    main()
