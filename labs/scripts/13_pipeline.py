"""Pipeline parallelism on K = 2 stages: GPipe and 1F1B written by hand with send/recv, then
`torch.distributed.pipelining` (ScheduleGPipe, Schedule1F1B, and with two model chunks per rank
ScheduleInterleaved1F1B and, where the installed torch has them and can run them on this backend,
ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble); gradients against one process; a timeline of
every stage's forward and backward; saved-activation bytes held per stage; and a one-process baseline:
the same model and micro-batches run on one rank without pipelining, timed while the other rank waits.

One node:   torchrun --nproc-per-node=2 labs/scripts/13_pipeline.py --out pipeline.json
Two nodes (one stage per node; the same line on each, the rendezvous numbers the nodes):
            torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \
                     --rdzv-endpoint=host:29500 labs/scripts/13_pipeline.py --out pipeline.json

The model is a plain stack of Linear + GELU blocks (the pipelining API wants plain modules), split in
equal halves so both stages do the same work. Rank r runs stage r. Every rank builds the whole model
from the same seed, computes the single-process reference gradients on the full batch itself and
compares its own stage's gradients with them. Rank 0 writes all results to --out as JSON; the
`[rankN]` lines are deterministic (verdicts), timings go only to the JSON file.
"""

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from gpulab.distributed import finish, gather, init, say


def build_model(width: int, depth: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


class Recorder:
    """Events (stage, micro-batch, 'F'/'B', start_s, end_s) in seconds from rank 0's clock at the step's
    start, and the saved-activation bytes each in-flight micro-batch holds on this stage."""

    def __init__(self, stage: int, params: list[torch.Tensor], sync, device: torch.device) -> None:
        self.stage, self.sync, self.device, self.events = stage, sync, device, []
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.held_bytes: dict[int, int] = {}
        self.peak_bytes = 0
        self.t0 = 0.0

    def start(self) -> None:
        """Clear, then agree on t0: rank 0's clock just after a barrier, broadcast. Ranks leave a barrier
        at slightly different times, so each rank's own clock would shift its events; time.time() is the
        same clock for every process of a node (and NTP-close across nodes)."""
        self.events, self.held_bytes, self.peak_bytes = [], {}, 0
        self.sync()
        dist.barrier()
        t0 = torch.tensor([time.time()], dtype=torch.float64, device=self.device)
        dist.broadcast(t0, src=0)
        self.t0 = t0.item()

    def forward(self, mb: int, fn):
        seen: set[tuple[int, ...]] = set()
        self.held_bytes[mb] = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() in self.param_ptrs:  # weights are not activations
                return t
            # A tensor saved whole counts its storage once. A slice of a larger buffer (stage 0's
            # micro-batch of the input batch, the last stage's of the targets) counts its own bytes:
            # the buffer is shared by every micro-batch, so its whole size per micro-batch would count
            # it M times.
            view_bytes = t.numel() * t.element_size()
            whole = view_bytes >= storage.nbytes()
            key = (storage.data_ptr(),) if whole else (storage.data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                self.held_bytes[mb] += storage.nbytes() if whole else view_bytes
            return t

        start = time.time()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        self.sync()
        self.events.append((self.stage, mb, "F", start - self.t0, time.time() - self.t0))
        self.peak_bytes = max(self.peak_bytes, sum(self.held_bytes.values()))
        return out

    def backward(self, mb: int, fn) -> None:
        start = time.time()
        fn()
        self.sync()
        self.events.append((self.stage, mb, "B", start - self.t0, time.time() - self.t0))
        del self.held_bytes[mb]  # backward freed this micro-batch's graph


def schedule_order(kind: str, rank: int, world: int, m: int) -> list[tuple[str, int]]:
    """This stage's operations in order, ('F', i) or ('B', i) for micro-batch i. GPipe: every forward,
    then every backward. 1F1B: K - rank - 1 warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards, so at most K - rank micro-batches are in flight."""
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(world - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", i + warmup), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def run_schedule(kind: str, stage: nn.Module, rank: int, world: int, x: torch.Tensor, y: torch.Tensor,
                 m: int, rec: Recorder, device: torch.device) -> None:
    """One training step's forward and backward passes on this stage, by hand, in `kind`'s order.

    Communication happens between operations. What the last operation produced (an activation for the
    next stage, or an input gradient for the previous one) is sent together with what the next
    operation must receive, in one `batch_isend_irecv`: in 1F1B a stage sends an activation forward
    while its neighbour sends a gradient back, and two blocking sends facing each other would deadlock
    (on NCCL, with messages larger than its buffers). A batch with nothing to receive is not waited for;
    its sends are waited for at the end of the step."""
    first, last = rank == 0, rank == world - 1
    xs, ys = x.chunk(m), y.chunk(m)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    in_flight: list = []  # send handles not yet waited for
    outgoing: list = []  # what the last operation produced, to send before the next one

    def communicate(recv: dist.P2POp | None) -> None:
        ops = outgoing + ([recv] if recv else [])
        outgoing.clear()
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if recv is None:
            in_flight.extend(works)
            return
        for work in works:  # waiting for data is idle time: outside the timed operations
            work.wait()
        rec.sync()

    for op, i in schedule_order(kind, rank, world, m):
        if op == "F":
            if first:
                communicate(None)
                inp = xs[i]
            else:
                inp = torch.empty(xs[i].shape[0], x.shape[1], device=device)
                communicate(dist.P2POp(dist.irecv, inp, rank - 1))
                inp.requires_grad_(True)
            inputs[i] = inp

            def compute(inp=inp, i=i):
                out = stage(inp)
                # each micro-batch's loss is 1/M of the full batch's mean: gradients add up to the batch's
                return loss_fn(out, ys[i]) / m if last else out

            outputs[i] = rec.forward(i, compute)
            if not last:
                outgoing.append(dist.P2POp(dist.isend, outputs[i].detach(), rank + 1))
        else:
            grad = None
            if last:
                communicate(None)
            else:
                grad = torch.empty_like(outputs[i])
                communicate(dist.P2POp(dist.irecv, grad, rank + 1))
            rec.backward(i, lambda: outputs[i].backward(grad))
            if not first:
                outgoing.append(dist.P2POp(dist.isend, inputs[i].grad, rank - 1))
            del inputs[i], outputs[i]
    communicate(None)
    for work in in_flight:
        work.wait()


def library_schedule(name: str, full: nn.Sequential, rank: int, world: int, m: int,
                     device: torch.device) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], list[nn.Module]]:
    """A torch.distributed.pipelining schedule over this rank's chunks: (a function that runs one step
    on a batch and its targets, this rank's model chunks).

    Single-stage schedules give rank r the r-th of K chunks. The multi-stage ones cut the model into
    2K chunks, two per rank: in a loop (rank r holds chunks r and r + K) for the interleaved schedules,
    in a V (rank r holds chunks r and 2K - 1 - r) for ScheduleZBVZeroBubble. The schedule's first step
    also sets it up (a peer-to-peer warm-up, a forward that infers the shapes each stage sends)."""
    import torch.distributed.pipelining as pp

    cls = getattr(pp, name)
    multi = name not in ("ScheduleGPipe", "Schedule1F1B")
    n_chunks = 2 * world if multi else world
    size = len(full) // n_chunks
    if not multi:
        mine = [rank]
    elif name == "ScheduleZBVZeroBubble":
        mine = [rank, 2 * world - 1 - rank]
    else:
        mine = [rank, rank + world]
    chunks = [full[c * size:(c + 1) * size] for c in mine]
    stages = [pp.PipelineStage(chunk, c, n_chunks, device) for chunk, c in zip(chunks, mine)]
    # loss_fn is the mean over a micro-batch; scale_grads (default True) divides the summed
    # gradients by M, which gives the full batch's mean again.
    schedule = cls(stages if multi else stages[0], n_microbatches=m, loss_fn=loss_fn)
    has_first, has_last = 0 in mine, n_chunks - 1 in mine

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        kwargs = {"target": y, "losses": []} if has_last else {}
        if has_first:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)

    return step, chunks


def cannot_run(name: str, backend: str) -> str | None:
    """Why a library schedule cannot run on this torch and backend, or None when it can.

    Before torch 2.13 a schedule's first step warms up its peer-to-peer links with a send from each
    stage to its neighbours. In ScheduleZBVZeroBubble's V, the middle two chunks sit on one rank, so that
    rank sends to itself, which gloo refuses ("Pair is not connected"; seen with torch 2.11, the GPU
    machine's). torch 2.13 warms up by another protocol and runs it on gloo too.
    """
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if name == "ScheduleZBVZeroBubble" and backend == "gloo" and version < (2, 13):
        return f"torch {torch.__version__}'s warm-up sends from a rank to itself, which gloo refuses"
    return None


def one_process_step(full: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int) -> None:
    """The baseline: the whole model on one device, the same M micro-batches one after another
    (gradient accumulation), no pipeline and no communication."""
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        (loss_fn(full(xs), ys) / m).backward()


def grads_of(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


def rel_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON results, written by rank 0")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8, help="blocks in the whole model, split evenly")
    ap.add_argument("--batch", type=int, default=128, help="rows per step, split into M micro-batches")
    ap.add_argument("--check-m", type=int, default=4, help="micro-batches for the gradient checks")
    ap.add_argument("--sweep-m", default="1,2,4,8", help="micro-batch counts for the timings")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps after a warm-up; the fastest counts")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    args = ap.parse_args()

    # NCCL needs a GPU per process on each node; with fewer, the stages run as gloo processes on the CPU.
    me = init(threads=args.threads)
    rank, world, device, backend = me.rank, me.world, me.device, me.backend
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if args.depth % world:
        raise SystemExit(f"depth {args.depth} does not split into {world} equal stages")

    full = build_model(args.width, args.depth, seed=0).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen).to(device)
    y = torch.randn(args.batch, args.width, generator=gen).to(device)
    per_stage = args.depth // world
    lo, hi = rank * per_stage, (rank + 1) * per_stage
    stage = full[lo:hi]  # a view of the same modules: the reference below fills the same parameters

    # The single-process reference: the whole model on the whole batch.
    loss_fn(full(x), y).backward()
    ref = grads_of(stage)
    ref_of = {id(p): p.grad.detach().clone() for p in full.parameters()}  # for any chunk of the model
    full.zero_grad(set_to_none=True)
    say(rank, f"stage {rank} of {world}: blocks {lo}-{hi - 1}, {sum(p.numel() for p in stage.parameters()):,} "
              f"parameters, backend {backend}")

    rec = Recorder(rank, list(stage.parameters()), sync, device)
    results: dict = {"backend": backend, "world": world, "width": args.width, "depth": args.depth,
                     "batch": args.batch, "check_m": args.check_m, "grad_error": {}, "peak_saved_bytes": {},
                     "step_s": {}, "events": {}, "cuda_peak_bytes": {}, "library_step_s": {},
                     "one_process_step_s": {}, "library_schedules": []}

    # 1. By hand: gradients, and the activations each stage holds.
    m = args.check_m
    for kind in ("gpipe", "1f1b"):
        stage.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        rec.start()
        run_schedule(kind, stage, rank, world, x, y, m, rec, device)
        err = rel_error(grads_of(stage), ref)
        say(rank, f"hand-written {kind}, M={m}: gradients match one process within 1e-5: {err < 1e-5}")
        results["grad_error"][kind] = gather(err)
        results["peak_saved_bytes"][kind] = gather(rec.peak_bytes)
        if on_gpu:
            results["cuda_peak_bytes"][kind] = gather(torch.cuda.max_memory_allocated(device))
    # One micro-batch alone: the bytes a single in-flight micro-batch holds on each stage.
    rec.start()
    run_schedule("gpipe", stage, rank, world, x[: args.batch // m], y[: args.batch // m], 1, rec, device)
    results["saved_bytes_per_microbatch"] = gather(rec.peak_bytes)
    stage.zero_grad(set_to_none=True)

    # 2. The library: torch.distributed.pipelining with manual PipelineStages (one or two per rank).
    import torch.distributed.pipelining as pp

    names = [n for n in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                         "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble") if hasattr(pp, n)]
    skipped = {n: why for n in names if (why := cannot_run(n, backend))}
    schedules = [n for n in names if n not in skipped]
    results["library_schedules"], results["library_skipped"] = schedules, skipped
    for name in schedules:
        full.zero_grad(set_to_none=True)
        step, chunks = library_schedule(name, full, rank, world, m, device)
        step(x, y)
        params = [p for chunk in chunks for p in chunk.parameters()]
        err = rel_error([p.grad for p in params], [ref_of[id(p)] for p in params])
        say(rank, f"torch.distributed.pipelining {name}, M={m}: gradients match one process within 1e-5: "
                  f"{err < 1e-5}")
        results["grad_error"][name] = gather(err)
    full.zero_grad(set_to_none=True)

    # 3. Step time against M, and the timeline of every step (timings: JSON only).
    for kind in ("gpipe", "1f1b"):
        for mm in [int(v) for v in args.sweep_m.split(",")]:
            best, events = float("inf"), []
            for rep in range(args.repeats + 1):  # the first is a warm-up
                rec.start()
                run_schedule(kind, stage, rank, world, x, y, mm, rec, device)
                sync()
                dist.barrier()
                # the fastest step, on rank 0's decision so that every rank keeps the same step's events
                step_s = torch.tensor([time.time() - rec.t0], dtype=torch.float64, device=device)
                dist.broadcast(step_s, src=0)
                if rep and step_s.item() < best:
                    best, events = step_s.item(), rec.events
            stage.zero_grad(set_to_none=True)
            results["step_s"][f"{kind}/{mm}"] = gather(best)
            results["events"][f"{kind}/{mm}"] = [e for evs in gather(events) for e in evs]
    # 4. The library's schedules and the one-process baseline, timed on the same batch and M.
    for mm in [int(v) for v in args.sweep_m.split(",")]:
        for name in schedules:
            if mm < world or mm % world:
                continue  # the lab times M >= the number of ranks, a multiple (Schedule1F1B requires M >= ranks)
            times = []
            step, _ = library_schedule(name, full, rank, world, mm, device)
            for rep in range(args.repeats + 1):  # step 0, untimed, also sets the schedule up
                full.zero_grad(set_to_none=True)
                sync()
                dist.barrier()
                start = time.perf_counter()
                step(x, y)
                sync()
                dist.barrier()
                if rep:
                    times.append(time.perf_counter() - start)
            results["library_step_s"][f"{name}/{mm}"] = min(times)  # fastest: the least disturbed step
        # rank 0 alone runs the whole model; the others wait at the barrier, so it has the machine
        times = []
        for rep in range(args.repeats + 1):
            full.zero_grad(set_to_none=True)
            dist.barrier()
            if rank == 0:
                sync()
                start = time.perf_counter()
                one_process_step(full, x, y, mm)
                sync()
                if rep:
                    times.append(time.perf_counter() - start)
            dist.barrier()
        if rank == 0:
            results["one_process_step_s"][str(mm)] = min(times)
    full.zero_grad(set_to_none=True)
    say(rank, f"timed GPipe and 1F1B by hand, {len(schedules)} library schedules and one process, "
              f"for M in {args.sweep_m} ({args.repeats} steps each)")

    dist.barrier()
    finish(results, args.out)


if __name__ == "__main__":
    main()
