"""tools/gpu_import.py on a small tree of its own: of a GPU run's archive, a lab that passes strict nbval
here is copied into labs/; one whose outputs nbval rejects, one that failed on the GPU and one whose cells
changed here since the run keep their own; the report says which and why, with the run's section for the
GPU run log."""

import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_import", ROOT / "tools" / "gpu_import.py")
gpu_import = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_import)


def lab(source: str, executed: bool = True) -> bytes:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if executed:
        NotebookClient(nb, kernel_name="python3").execute()
    return nbformat.writes(nb).encode()


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_only_labs_that_pass_nbval_here_are_imported(tmp_path, capsys):
    tree = tmp_path / "tree"
    (tree / "labs").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    names = ("00-agrees.ipynb", "01-differs.ipynb", "02-broke.ipynb", "03-fixed-since.ipynb", "04-broke-twice.ipynb")
    sources = ("print(6 * 7)", "print(6 * 7)", "raise ValueError('broken on purpose')", "print(6 * 7)  # fixed",
               "raise ValueError('broken on purpose')")
    for name, source in zip(names, sources):  # what the repository stores now: unexecuted
        (tree / "labs" / name).write_bytes(lab(source, executed=False))
    differs = nbformat.reads(lab("print(6 * 7)").decode(), as_version=4)
    differs.cells[0].outputs[0]["text"] = "43\n"  # an output this machine does not print: nbval fails
    log = {"date": "2026-11-28 10:00:00 UTC", "device": "NVIDIA H200", "driver": "580.1", "memory": "143771 MiB",
           "command": "tools/gpu_run.py --plan", "versions": {"python": "3.12.3", "torch": "2.11.0"},
           "env": {"GPULAB_PRESET": ""},
           "labs": [{"lab": names[0], "status": "ok", "wall_s": 12.5},
                    {"lab": names[1], "status": "ok", "wall_s": 3.0},
                    {"lab": names[2], "status": "error", "wall_s": 4.0,
                     "stderr_tail": ["gpu-run: 02-broke.ipynb: ValueError: broken on purpose"]},
                    {"lab": names[3], "status": "ok", "wall_s": 2.0},
                    {"lab": names[4], "status": "error", "wall_s": 4.0,  # a log that lists every failed cell
                     "errors": ["cell 0: ValueError: broken on purpose", "cell 2: NameError: name 'x' is not defined"],
                     "stderr_tail": ["gpu-run: 04-broke-twice.ipynb: cell 2: NameError: name 'x' is not defined"]}]}
    archive = tmp_path / "gpu-run.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        add(tar, "gpu-run.json", json.dumps(log).encode())
        add(tar, f"labs/{names[0]}", lab("print(6 * 7)"))
        add(tar, f"labs/{names[1]}", nbformat.writes(differs).encode())
        add(tar, f"labs/{names[2]}", lab("raise ValueError('broken on purpose')", executed=False))
        add(tar, f"labs/{names[3]}", lab("print(6 * 7)"))  # run before its cell was changed here
        add(tar, f"labs/{names[4]}", lab("raise ValueError('broken on purpose')", executed=False))
        add(tar, "elsewhere.ipynb", b"{}")  # not under labs/: never read, never written

    status = gpu_import.main([str(archive), "--root", str(tree)])
    report = capsys.readouterr().out
    print(report)
    assert status == 1, "four labs were not imported: the exit status says so"
    stored = {name: nbformat.read(tree / "labs" / name, as_version=4) for name in names}
    assert stored[names[0]].cells[0].outputs[0]["text"] == "42\n", "the lab that passed is imported"
    assert not any(stored[name].cells[0].outputs for name in names[1:]), \
        "the lab that nbval rejected, the one that failed on the GPU and the one changed since keep their own"
    assert stored[names[3]].cells[0].source == sources[3], "a change made since the run is not undone"
    assert not (tree / "elsewhere.ipynb").exists()
    assert "no: strict nbval on the CPU failed at Cell 0: mismatch 'stdout'" in report
    assert "no: error on the GPU (gpu-run: 02-broke.ipynb: ValueError: broken on purpose)" in report
    assert "no: error on the GPU (cell 0: ValueError: broken on purpose; 1 more in the log)" in report
    assert "no: cell 0 has changed here since the run" in report
    assert "| 00 agrees | ok | 12.5 s | yes |" in report, "the run log's table names what was stored"
    assert "| GPU | NVIDIA H200 (143771 MiB), driver 580.1 |" in report


def test_check_only_changes_nothing(tmp_path, capsys):
    tree = tmp_path / "tree"
    (tree / "labs").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    (tree / "labs" / "00-agrees.ipynb").write_bytes(before := lab("print(6 * 7)", executed=False))
    archive = tmp_path / "run.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        add(tar, "run.json", json.dumps({"labs": [{"lab": "00-agrees.ipynb", "status": "ok"}]}).encode())
        add(tar, "labs/00-agrees.ipynb", lab("print(6 * 7)"))
    assert gpu_import.main([str(archive), "--root", str(tree), "--check-only"]) == 0
    assert (tree / "labs" / "00-agrees.ipynb").read_bytes() == before
    assert "would be (--check-only)" in capsys.readouterr().out


def test_the_run_section_names_each_lab_by_its_heading():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Lab 3: Feeding the GPU\n\nCompanion to Chapter 3.")]
    headed = nbformat.writes(nb).encode()
    assert gpu_import.lab_title("03-feeding-the-gpu.ipynb", headed) == "03 Feeding the GPU"
    # no heading, or no notebook at all: the file name
    assert gpu_import.lab_title("03-feeding-the-gpu.ipynb", lab("print(1)", executed=False)) == "03 feeding the gpu"
    assert gpu_import.lab_title("03-feeding-the-gpu.ipynb", b"not json") == "03 feeding the gpu"
    log = {"labs": [{"lab": "03-feeding-the-gpu.ipynb", "status": "ok", "wall_s": 14.7}]}
    section = gpu_import.run_section(log, {"03-feeding-the-gpu.ipynb": "yes"},
                                     {"03-feeding-the-gpu.ipynb": "03 Feeding the GPU"})
    assert "| 03 Feeding the GPU | ok | 14.7 s | yes |" in section


def test_missed_speed_targets_are_listed():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("target(...)", outputs=[nbformat.v4.new_output(
        "stream", name="stdout", text="MET: fused reaches 70% [measured: 84%]\nMISSED: fused is 1.5x eager "
                                      "[measured: 1.3x]\nPASS: fused matches eager\n")])]
    assert gpu_import.missed_targets(nbformat.writes(nb).encode()) == ["MISSED: fused is 1.5x eager [measured: 1.3x]"]
    assert gpu_import.missed_targets(lab("print(6 * 7)")) == [] and gpu_import.missed_targets(b"not json") == []


def test_an_archive_without_a_log_is_refused(tmp_path):
    archive = tmp_path / "bare.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        add(tar, "labs/00-x.ipynb", b"{}")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_import.py"), str(archive)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "holds no run log" in result.stderr
