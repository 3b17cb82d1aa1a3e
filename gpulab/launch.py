"""Run a multi-process script under torchrun from a notebook and show what every rank printed.

Notebook-defined functions cannot be spawned (they do not pickle), so distributed code lives in
`labs/scripts/*.py` and runs in a child `python -m torch.distributed.run`. The child's output is
captured and printed grouped by rank (rank 0 first), so a cell's output reads the same on every run
however the processes interleave; a failed rank raises with its output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

RANK_LINE = re.compile(r"^\[rank(\d+)\]")


def default_backend(nproc: int) -> str:
    """NCCL when there is a GPU per process, gloo over CPU processes otherwise."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"


def group_by_rank(text: str) -> tuple[list[str], list[str]]:
    """Split output into lines tagged `[rankN]` (stably sorted by N) and the launcher's other lines."""
    tagged: list[tuple[int, str]] = []
    other: list[tuple[int, str]] = []
    for line in text.splitlines():
        m = RANK_LINE.match(line)
        (tagged if m else other).append((int(m.group(1)) if m else 0, line))
    tagged.sort(key=lambda pair: pair[0])
    return [line for _, line in tagged], [line for _, line in other]


def torchrun(script: str | Path, nproc: int = 2, args: list[str] | None = None, backend: str | None = None,
             timeout_s: float = 300, show_untagged: bool = False) -> str:
    """Launch `script` on `nproc` local processes; print the ranks' `[rankN] ...` lines; return all output.

    The script reads the backend from $GPULAB_BACKEND (set here) and tags its prints with its rank.
    """
    script = Path(script)
    if not script.exists():
        raise FileNotFoundError(f"no script at {script}")
    backend = backend or default_backend(nproc)
    env = dict(os.environ, GPULAB_BACKEND=backend, PYTHONUNBUFFERED="1")
    # torchrun warns (with a timestamp) when it has to choose OMP_NUM_THREADS itself
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *(args or [])]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{script.name} did not finish within {timeout_s:.0f} s") from err
    output = proc.stdout + proc.stderr
    tagged, other = group_by_rank(output)
    print(f"torchrun {script.name}: {nproc} processes, backend {backend}")
    print("\n".join(tagged))
    if show_untagged and other:
        print("\n".join(other))
    if proc.returncode != 0:
        # a failed rank's own message (C++'s "terminate called ...") comes before torchrun's report
        tail = "\n".join(other[-80:])
        raise RuntimeError(f"{script.name} failed (exit status {proc.returncode}); launcher output:\n{tail}")
    return output
