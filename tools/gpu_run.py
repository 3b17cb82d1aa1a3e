"""Execute labs in place, one after another, each in its own process with a time limit; log and pack.

Run through `tools/gpu-run.sh`, which installs the carried wheels and sets the environment first:

    tools/gpu-run.sh                        # every lab, in order
    tools/gpu-run.sh 03 04 --lab-timeout 300 --deadline 540 --archive $OUT/labs.tar.gz
    tools/gpu-run.sh --lane 00,02,03,04 --lane 01,05,06    # lanes run side by side (for a diagnosis:
                                                            # timings taken side by side are not clean)
    tools/gpu-run.sh --lane 02,03 --lane 11,after:03,05    # lab 5 starts once lab 3 has ended
    tools/gpu-run.sh --plan --lab-timeout 330 --deadline 520 --archive $OUT/labs.tar.gz  # lanes of PLAN

Each lab runs in a child process (`python tools/gpu_run.py --one LAB`) that executes it with nbclient and
writes the notebook back even when a cell fails, so the error is stored in the lab; the cells after a
failed one run too, so that one call shows every failure. The parent kills a child that outlives its
limit, stops starting labs at the deadline, and after every lab rewrites the log (`gpu-run.json`, one
record per lab: status, wall time, device, versions, every error) and the archive of every executed lab
so far: whoever runs it gets back every lab that finished, even when a later one fails or the whole
command is cut off.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "triton", "accelerate", "nbclient", "ipykernel")


# One device session holds 15 minutes of GPU time, a machine's start (a minute or two) included: one call
# of under ten minutes runs every lab. The labs whose timings the chapters quote (02 mixed precision,
# 03 copies, 04 kernels) run first, beside only the labs whose processes run on the CPU (gloo, one thread
# each: 11-14, 17); the other lanes wait for them. Wall times on an H100 with `small` (2026-11-25) were
# 25-160 s a lab; the lanes are balanced on those and on guesses for the labs added since (14-19), the
# long ones (7 and 9 train several seeds) first once the timed labs are done. The call:
#   tools/gpu-run.sh --plan --lab-timeout 330 --deadline 520 --archive $OUT/gpu-run.tar.gz \
#       --log $OUT/gpu-run.json          # with the device call's timeout_s at 590
# Lab 19 runs alone, last: its largest rung takes over 60 GB of an 80 GB card (the calculator: a 1B
# model in bf16, 16 conversations of up to 1024 tokens), and another lab beside it would run it out of
# memory. `--plan 19 ...` keeps only the labs named.
# MIN_S: seconds a lab needs at the least on an H100/H200 with `small` (estimates; lab 19's code reads as
# 200-260 s on an H200). With less left before the deadline a lab is not started and the log says so: cut
# off at its limit it would be stored half-run, which cannot be imported; not started, it goes first in
# the next session's call.
MIN_S = {"19-capstone.ipynb": 240}
MAX_ERRORS = 20  # errors a lab's log record lists (a failure early in a lab can make many cells after it fail)
PLAN = ["02,03,04,00,01,05,18", "11,12,13,after:04,07", "14,17,after:04,09,08", "after:04,10,06",
        "after:04,15,16", "after:18,after:07,after:08,after:06,after:16,19"]


def command_line(argv: list[str]) -> str:
    """The command as the run log shows it: tools/gpu-run.sh's name where that wrapper started this (it says
    so in GPU_RUN_ENTRY), else this script's path within the repository, then the arguments."""
    entry = os.environ.get("GPU_RUN_ENTRY")
    if not entry:
        script = Path(argv[0]).resolve()
        entry = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else argv[0]
    return " ".join([entry, *argv[1:]])


def find_labs(names: list[str]) -> list[Path]:
    """Lab notebooks by number prefix ("03"), file name or path; every lab when `names` is empty."""
    every = sorted(LABS.glob("[0-9][0-9]-*.ipynb"))
    if not names:
        return every
    found = []
    for name in names:
        if name.endswith(".ipynb") and Path(name).is_file():  # a notebook path, in labs/ or not
            found.append(Path(name).resolve())
            continue
        matches = [p for p in every if p.name.startswith(name)]
        if len(matches) != 1:
            raise SystemExit(f"gpu-run: {name!r} names {len(matches)} labs; use a number like 03 "
                             f"(labs: {', '.join(p.name[:2] for p in every)})")
        found.append(matches[0])
    return found


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def device() -> dict[str, str]:
    """The GPU and driver as nvidia-smi reports them, or the CPU."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True)
        name, driver, memory = (s.strip() for s in q.stdout.splitlines()[0].split(","))
        return {"device": name, "driver": driver, "memory": memory}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"device": f"CPU ({platform.machine()}, {os.cpu_count()} cores)", "driver": "none"}


def cell_errors(nb) -> list[str]:
    """Every error a lab's cells stored, in order, as "cell N: ename: evalue" (the value's first line)."""
    errors = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                value = (str(out.get("evalue") or "").splitlines() or [""])[0]
                errors.append(f"cell {i}: {out.get('ename')}: {value}"[:500])
    return errors


def read_lab(path: Path):
    """An executed lab as nbformat reads it, or None where the killed child left it unreadable (the log
    says so elsewhere)."""
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception:
        return None


def slowest_cells(nb, n: int = 3) -> list[list[float]]:
    """The `n` slowest cells of an executed lab as [cell index, seconds], from nbclient's timestamps."""
    from datetime import datetime

    times = []
    for i, cell in enumerate(nb.cells):
        run = cell.get("metadata", {}).get("execution", {})
        start, end = run.get("iopub.execute_input"), run.get("shell.execute_reply")
        if start and end:
            seconds = (datetime.fromisoformat(end.replace("Z", "+00:00"))
                       - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()
            times.append([i, round(seconds, 1)])
    return sorted(times, key=lambda t: -t[1])[:n]


def run_one(path: Path, limit_s: int) -> int:
    """Child process: execute one lab in place within `limit_s` for all its cells together; the notebook
    is written back whatever happens, so a lab stopped at its limit keeps the outputs of the cells that
    ran and their timings (nbclient records each cell's start and end in its metadata). A cell that
    fails does not stop the lab: the cells after it run too, so that one call on a GPU shows every
    failure of a lab, not only its first (later errors may follow from the first; the log lists them in
    order)."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    end = time.monotonic() + limit_s

    def cell_timeout_s(cell) -> int:  # what is left of the lab's limit (nbclient reads 0 as "no limit")
        return max(1, int(end - time.monotonic()))

    client = nbclient.NotebookClient(nb, timeout_func=cell_timeout_s, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(path.parent)}})
    status = 0
    try:
        client.execute()
    except nbclient.exceptions.CellTimeoutError as exc:  # the lab's limit: say in which cell
        print(f"gpu-run: {path.name}: stopped at its limit of {limit_s} s. {exc}"[:1500], file=sys.stderr)
        status = 3
    except Exception as exc:  # kernel died: store what ran and say why
        print(f"gpu-run: {path.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        status = 2
    finally:
        for cell in nb.cells:  # the install cell does nothing in a clone: store it as tools/sync_repo_url.py does
            if cell.get("id") == "install-gpulab" and not cell.get("outputs"):
                cell["execution_count"] = None
        nbformat.write(nb, path)
    errors = cell_errors(nb)
    for error in errors[:MAX_ERRORS]:
        print(f"gpu-run: {path.name}: {error}", file=sys.stderr)
    if len(errors) > MAX_ERRORS:
        print(f"gpu-run: {path.name}: {len(errors) - MAX_ERRORS} more errors, in the notebook", file=sys.stderr)
    return 1 if errors and status == 0 else status


@dataclasses.dataclass(frozen=True)
class Wait:
    """A lane's `after:NN`: start the lane's next lab only once lab NN has ended (in another lane), so
    that labs whose timings matter can run first without GPU-heavy labs beside them."""
    lab: Path


def parse_lanes(lanes: list[str], only: list[Path] | None = None) -> list[list[Path | Wait]]:
    """`--lane` values ("02,03,04" or "11,after:04,07") as lanes of labs and waits. With `only`, just those
    labs are kept, and the waits for labs left out are dropped. A wait must name a lab that some lane
    runs, and the waits must let every lane finish (none may wait, directly or not, for itself)."""
    parsed: list[list[Path | Wait]] = []
    for lane in lanes:
        items: list[Path | Wait] = []
        for name in (n for n in lane.split(",") if n):
            if name.startswith("after:"):
                items.append(Wait(find_labs([name.removeprefix("after:")])[0]))
            else:
                items.append(find_labs([name])[0])
        parsed.append(items)
    if only is not None:
        parsed = [[i for i in items if (i.lab if isinstance(i, Wait) else i) in only] for items in parsed]
        parsed = [items for items in parsed if any(isinstance(i, Path) for i in items)]
    planned = {i for items in parsed for i in items if isinstance(i, Path)}
    for items in parsed:
        for item in items:
            if isinstance(item, Wait) and item.lab not in planned:
                raise SystemExit(f"gpu-run: after:{item.lab.name[:2]} waits for a lab that no lane runs")
    # walk the lanes as they would run: a lane moves on past a wait once its lab has ended
    ended: set[Path] = set()
    at = [0] * len(parsed)
    while True:
        moved = False
        for k, items in enumerate(parsed):
            while at[k] < len(items):
                item = items[at[k]]
                if isinstance(item, Wait) and item.lab not in ended:
                    break
                if isinstance(item, Path):
                    ended.add(item)
                at[k] += 1
                moved = True
        if not moved:
            break
    stuck = [items[at[k]] for k, items in enumerate(parsed) if at[k] < len(items)]
    if stuck:
        raise SystemExit("gpu-run: these waits would never end: "
                         + ", ".join(f"after:{w.lab.name[:2]}" for w in stuck if isinstance(w, Wait)))
    return parsed


class Run:
    """The parent: lanes of labs, a log and an archive rewritten after every lab."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.monotonic()
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.paths: dict[str, Path] = {}
        self.ended: dict[str, threading.Event] = {}  # set when a lab has ended (or was never started)
        self.log_path = Path(args.log)
        self.header = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command_line(sys.argv),
                       **device(), "versions": versions(),
                       "env": {k: os.environ.get(k, "") for k in ("GPULAB_PRESET", "GPULAB_DEVICE")}}

    def left_s(self) -> float:
        return self.args.deadline - (time.monotonic() - self.start)

    def lab(self, path: Path) -> None:
        self.paths[path.name] = path
        limit_s = min(self.args.lab_timeout, self.left_s() - 10)
        record = {"lab": path.name, "status": "not started (deadline)", "wall_s": 0.0}
        if limit_s >= min(MIN_S.get(path.name, 20), self.args.lab_timeout):
            t0 = time.monotonic()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(path),
                   "--lab-limit", str(int(limit_s))]
            try:  # the child stops its lab at limit_s and stores it; the margin is for a hung kernel
                child = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s + 30)
                status = {0: "ok", 1: "error", 3: "timeout"}.get(child.returncode, "failed")
                tail = [l for l in child.stderr.strip().splitlines() if "running over TCP" not in l][-25:]
            except subprocess.TimeoutExpired:
                status, tail = "timeout", [f"killed after {limit_s + 30:.0f} s"]
            executed = read_lab(path)
            record = {"lab": path.name, "status": status, "wall_s": round(time.monotonic() - t0, 1),
                      "slowest_cells": slowest_cells(executed) if executed else [],
                      "errors": cell_errors(executed)[:MAX_ERRORS] if executed else [], "stderr_tail": tail}
        with self.lock:
            self.records.append(record)
            print(f"{record['lab']:40s} {record['status']:8s} {record['wall_s']:7.1f} s", flush=True)
            for line in record.get("stderr_tail", []) if record["status"] != "ok" else []:
                print(f"    {line}", flush=True)
            self.save()

    def save(self) -> None:
        self.log_path.write_text(json.dumps({**self.header, "labs": self.records}, indent=1) + "\n")
        if self.args.archive:
            done = [self.paths[r["lab"]] for r in self.records if r["status"] != "not started (deadline)"]
            part = Path(self.args.archive + ".part")
            with tarfile.open(part, "w:gz") as tar:
                tar.add(self.log_path, arcname=self.log_path.name)
                for p in done:
                    tar.add(p, arcname=f"labs/{p.name}")
            part.replace(self.args.archive)

    def lane(self, items: list[Path | Wait]) -> None:
        for item in items:
            if isinstance(item, Wait):  # until that lab has ended in its lane, or the deadline
                self.ended[item.lab.name].wait(timeout=max(0.0, self.left_s()))
            else:
                try:
                    self.lab(item)
                finally:
                    self.ended[item.name].set()

    def go(self, lanes: list[list[Path | Wait]]) -> int:
        h = self.header
        print(f"gpu-run: {h['device']} (driver {h['driver']}), " +
              ", ".join(f"{k} {v}" for k, v in h["versions"].items()), flush=True)
        self.ended = {p.name: threading.Event() for lane in lanes for p in lane if isinstance(p, Path)}
        with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
            list(pool.map(self.lane, lanes))
        self.save()
        bad = [r for r in self.records if r["status"] != "ok"]
        print(f"gpu-run: {len(self.records) - len(bad)} of {len(self.records)} labs ran without error "
              f"in {time.monotonic() - self.start:.0f} s; log {self.log_path}"
              + (f", archive {self.args.archive}" if self.args.archive else ""), flush=True)
        return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("labs", nargs="*", help="lab numbers (03) or notebook paths; default: every lab")
    ap.add_argument("--lane", action="append", default=[],
                    help="comma-separated labs run one after another beside the other lanes; "
                         "after:NN waits until lab NN has ended")
    ap.add_argument("--plan", action="store_true",
                    help="every lab in the lanes of PLAN (one device call), or only the labs named")
    ap.add_argument("--lab-timeout", type=float, default=600, help="seconds one lab may take")
    ap.add_argument("--deadline", type=float, default=3600, help="seconds after which no lab starts")
    ap.add_argument("--log", default="gpu-run.json")
    ap.add_argument("--archive", default="", help="a .tar.gz of the log and every executed lab")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--lab-limit", type=int, default=600, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return run_one(Path(args.one), args.lab_limit)
    if args.plan:  # the plan's lanes, or only the labs named in them
        lanes = parse_lanes(PLAN, find_labs(args.labs) if args.labs else None)
    else:
        lanes = parse_lanes(args.lane)
        if args.labs or not lanes:
            lanes.append(list(find_labs(args.labs)))
    return Run(args).go(lanes)


if __name__ == "__main__":
    sys.exit(main())
