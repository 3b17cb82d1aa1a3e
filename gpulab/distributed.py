"""The start and the end of every program in labs/scripts/: the process group on the right backend and
device, rank-tagged output lines that `gpulab.launch.torchrun` groups by rank, every rank's result
gathered, and rank 0's JSON for the lab to read."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    device: torch.device
    backend: str


def say(rank: int, text: str) -> None:
    """Print one `[rankN]` line in a single write: print() writes the text and the newline separately,
    and two ranks sharing the launcher's pipe can interleave between the two writes."""
    sys.stdout.write(f"[rank{rank}] {text}\n")
    sys.stdout.flush()


def init(threads: int | None = 1) -> Rank:
    """`init_process_group` from torchrun's environment, and this rank's device.

    The backend is $GPULAB_BACKEND (set by `gpulab.launch.torchrun`), else NCCL when this node has a GPU
    per local process and gloo over CPU processes otherwise. `threads` sets torch's CPU threads per
    rank: the ranks of one machine share its cores, and OpenMP threads that find their core taken spin
    and slow everyone; None keeps torch's default.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = os.environ.get("GPULAB_BACKEND") or ("nccl" if torch.cuda.device_count() >= local_world else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    return Rank(dist.get_rank(), dist.get_world_size(), device, backend)


def gather(obj: T) -> list[T]:
    """Every rank's `obj` (anything picklable), in rank order, on every rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def finish(results: dict[str, Any], out: str | None, exit_code: int = 0) -> NoReturn:
    """Rank 0 writes `results` as JSON to `out` (when given) for the lab to read; every rank then leaves
    the process group and exits with `exit_code` at once.

    At once, without the interpreter's shutdown: `destroy_process_group` drops torch's own references to
    a group, but other objects (a DeviceMesh, say) can keep its gloo backend alive until then, and
    freeing it while the interpreter is torn down can find a worker thread still joinable. C++ then
    aborts the rank ("terminate called without an active exception"; pytorch/pytorch#179291 describes
    the mechanism) after its work is done: lab 14's script did, rarely, when CI ran it beside other
    labs. Nothing is left to clean up by then.
    """
    if dist.get_rank() == 0 and out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
