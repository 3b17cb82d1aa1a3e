"""tools/gpu-run.sh and tools/gpu_run.py, on the CPU: labs found by number, a failing lab stored with its
error, a time limit that stops a lab and stores what ran, and an archive and a log that hold every lab
that ran."""

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "tools" / "gpu_run.py")
gpu_run = importlib.util.module_from_spec(spec)
sys.modules["gpu_run"] = gpu_run  # dataclasses look their module up there
spec.loader.exec_module(gpu_run)


def notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_labs_are_found_by_number_and_a_bad_name_says_which_exist():
    assert [p.name[:2] for p in gpu_run.find_labs(["03", "00"])] == ["03", "00"]
    assert len(gpu_run.find_labs([])) == len(list((ROOT / "labs").glob("[0-9][0-9]-*.ipynb")))
    with pytest.raises(SystemExit, match="names 0 labs"):
        gpu_run.find_labs(["99"])


def test_run_logs_each_lab_and_archives_the_executed_notebooks(tmp_path):
    good = notebook(tmp_path / "good.ipynb", "print(6 * 7)")
    bad = notebook(tmp_path / "bad.ipynb", "print('before')", "raise ValueError('broken on purpose')", "print('after')",
                   "raise KeyError('also broken')")
    slow = notebook(tmp_path / "slow.ipynb", "print('started')", "import time; time.sleep(120)", "print('never')")
    log, archive = tmp_path / "run.json", tmp_path / "run.tar.gz"
    status = gpu_run.main([str(bad), str(good), str(slow), "--lab-timeout", "25", "--deadline", "200",
                           "--log", str(log), "--archive", str(archive)])
    assert status == 1  # not every lab ran cleanly
    records = {r["lab"]: r for r in json.loads(log.read_text())["labs"]}
    assert records["good.ipynb"]["status"] == "ok"
    assert records["bad.ipynb"]["status"] == "error"
    assert any("broken on purpose" in line for line in records["bad.ipynb"]["stderr_tail"])
    # a failing cell does not stop the lab: the cells after it run, and the log lists every error in order
    assert records["bad.ipynb"]["errors"] == ["cell 1: ValueError: broken on purpose",
                                              "cell 3: KeyError: 'also broken'"]
    # the slow lab is stopped at its limit and stored with the cells that ran, its slowest one named
    assert records["slow.ipynb"]["status"] == "timeout" and records["slow.ipynb"]["wall_s"] < 50
    assert any("stopped at its limit of 25 s" in line for line in records["slow.ipynb"]["stderr_tail"])
    assert nbformat.read(slow, as_version=4).cells[0].outputs[0]["text"] == "started\n"
    assert [i for i, _ in records["good.ipynb"]["slowest_cells"]] == [0]
    # executed in place: the good lab holds its output, the failing one its error and the cells before it
    assert nbformat.read(good, as_version=4).cells[0].outputs[0]["text"] == "42\n"
    bad_cells = nbformat.read(bad, as_version=4).cells
    assert bad_cells[0].outputs[0]["text"] == "before\n" and bad_cells[1].outputs[0]["output_type"] == "error"
    assert bad_cells[2].outputs[0]["text"] == "after\n" and bad_cells[3].outputs[0]["output_type"] == "error"
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["labs/bad.ipynb", "labs/good.ipynb", "labs/slow.ipynb", "run.json"]


def test_labs_past_the_deadline_are_logged_as_not_started(tmp_path):
    labs = [notebook(tmp_path / f"{i}.ipynb", "pass") for i in range(2)]
    log = tmp_path / "run.json"
    gpu_run.main([*map(str, labs), "--deadline", "5", "--log", str(log)])
    assert {r["status"] for r in json.loads(log.read_text())["labs"]} == {"not started (deadline)"}


def test_a_lab_is_not_started_with_less_time_left_than_it_needs(tmp_path, monkeypatch):
    labs = [notebook(tmp_path / f"{name}.ipynb", "pass") for name in ("quick", "long")]
    monkeypatch.setitem(gpu_run.MIN_S, "long.ipynb", 200)
    log = tmp_path / "run.json"
    gpu_run.main([*map(str, labs), "--deadline", "120", "--log", str(log)])
    assert {r["lab"]: r["status"] for r in json.loads(log.read_text())["labs"]} == \
        {"quick.ipynb": "ok", "long.ipynb": "not started (deadline)"}


def test_the_shell_entry_point_runs_and_names_missing_packages(tmp_path):
    script = str(ROOT / "tools" / "gpu-run.sh")
    env = {**os.environ, "PYTHON": sys.executable, "GPU_RUN_WHEELS": str(tmp_path)}
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "--lab-timeout" in proc.stdout
    # a python that sees no site-packages (-I -S) and no carried wheels: one line says what is missing
    bare = tmp_path / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    proc = subprocess.run([script], capture_output=True, text=True, env={**env, "PYTHON": str(bare)}, timeout=120)
    assert proc.returncode == 2 and "missing packages: torch" in proc.stderr and "tools/gpu-wheels.sh" in proc.stderr


def test_the_log_names_the_command_as_run_from_the_repository(monkeypatch):
    script = str(ROOT / "tools" / "gpu_run.py")  # gpu-run.sh runs it by its absolute path
    monkeypatch.delenv("GPU_RUN_ENTRY", raising=False)
    assert gpu_run.command_line([script, "--plan", "19"]) == "tools/gpu_run.py --plan 19"
    monkeypatch.setenv("GPU_RUN_ENTRY", "tools/gpu-run.sh")  # what the wrapper sets
    assert gpu_run.command_line([script, "--plan", "19"]) == "tools/gpu-run.sh --plan 19"


def test_a_lane_can_wait_until_a_lab_in_another_lane_has_ended(tmp_path):
    slow = notebook(tmp_path / "slow.ipynb", "import time; time.sleep(8)")
    quick = notebook(tmp_path / "quick.ipynb", "pass")
    log = tmp_path / "run.json"
    status = gpu_run.main(["--lane", str(slow), "--lane", f"after:{slow},{quick}", "--log", str(log)])
    assert status == 0
    # without the wait the quick lab would end first: records are appended as labs end
    assert [r["lab"] for r in json.loads(log.read_text())["labs"]] == ["slow.ipynb", "quick.ipynb"]
    with pytest.raises(SystemExit, match="no lane runs"):
        gpu_run.parse_lanes([f"after:{slow},{quick}"])


def test_the_plan_runs_every_lab_once_and_its_waits_can_end():
    lanes = gpu_run.parse_lanes(gpu_run.PLAN)  # refuses waits that would never end
    planned = [item.name for lane in lanes for item in lane if isinstance(item, Path)]
    assert sorted(planned) == [p.name for p in gpu_run.find_labs([])]  # a new lab must join a lane
    # lab 19 needs the GPU to itself: its lane waits for the last lab of every other lane
    last = {lane[-1].name for lane in lanes if lane[-1].name[:2] != "19"}
    waits_19 = {i.lab.name for lane in lanes if lane[-1].name[:2] == "19" for i in lane if isinstance(i, gpu_run.Wait)}
    assert last == waits_19
    # the plan cut down to a few labs keeps their order and drops the waits for the others
    few = gpu_run.parse_lanes(gpu_run.PLAN, gpu_run.find_labs(["19", "07", "04"]))
    assert [[getattr(i, "name", None) or "after:" + i.lab.name[:2] for i in lane] for lane in few] == [
        [gpu_run.find_labs(["04"])[0].name], ["after:04", gpu_run.find_labs(["07"])[0].name],
        ["after:07", gpu_run.find_labs(["19"])[0].name]]


def test_waits_that_would_never_end_are_refused():
    a, b = (f"{n}" for n in ("01", "02"))
    with pytest.raises(SystemExit, match="would never end"):
        gpu_run.parse_lanes([f"after:{b},{a}", f"after:{a},{b}"])  # each lane waits for the other
    with pytest.raises(SystemExit, match="would never end"):
        gpu_run.parse_lanes([f"after:{a},{a}"])  # a lane waits for its own later lab
