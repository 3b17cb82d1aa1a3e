"""Lab 12's gloo ranks measure one step's memory from the CPU profiler's allocator events. A gloo worker
thread records events only while it runs a collective; what it frees afterwards goes unseen. The script
runs FSDP2's collectives to completion in spans that end once gloo has let go of them
(`settled` in labs/scripts/12_zero_fsdp.py), so the figures must not depend on when the workers run.

Here the workers are starved on purpose (the lowest scheduling class, every thread on one CPU). Before
that fix this made the boundary between forward and backward megabytes high (a layer's gathered
parameters or more, on both ranks) and once put ZeRO-3's peak above ZeRO-2's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "labs" / "scripts" / "12_zero_fsdp.py"
STARVE = """
import os, runpy, sys, threading
sys.argv = [{script!r}] + sys.argv[1:]
script = runpy.run_path({script!r}, run_name="script")
cpu = min(os.sched_getaffinity(0))


def run(*args, **kwargs):  # before each run: gloo's workers (every thread but this one) at SCHED_IDLE
    me = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        os.sched_setaffinity(tid, {{cpu}})
        if tid != me:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    return real_run(*args, **kwargs)


real_run = script["run"]
script["main"].__globals__["run"] = run
script["main"]()
"""


def step_memory(tmp_path: Path, starve: bool) -> list[dict]:
    out = tmp_path / f"zero-{starve}.json"
    entry = tmp_path / "starve.py"
    entry.write_text(STARVE.format(script=str(SCRIPT)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(entry if starve else SCRIPT), "--steps", "1", "--runs", "zero2,zero3", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GPULAB_BACKEND="gloo")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    return [r["step_memory"] for kind in ("zero2", "zero3") for r in res[kind]]


def test_step_memory_does_not_depend_on_when_gloo_threads_run(tmp_path):
    normal = step_memory(tmp_path, starve=False)
    starved = step_memory(tmp_path, starve=True)
    print("normal ", normal)
    print("starved", starved)
    assert starved == normal
    z2, z3 = normal[:2], normal[2:]
    assert z2[0] == z2[1] and z3[0] == z3[1], "both ranks hold the same bytes"
    assert all(a["peak_bytes"] > b["peak_bytes"] for a, b in zip(z2, z3))
