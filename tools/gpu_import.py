"""Bring a GPU run's executed labs into labs/, each only once strict nbval passes against it on this machine.

`tools/gpu-run.sh --archive gpu-run.tar.gz` brings back the run's log and every lab it executed. This does
the README's steps 3 to 5 for that archive:

1. the labs the log says ran without error are laid over a scratch copy of the working tree and checked
   there with strict nbval on the CPU, with the default preset, as CI will check them;
2. those that pass are copied into labs/; a lab that failed there, or on the GPU, or whose cells have
   changed here since the run, keeps its stored outputs and the report says why;
3. the report ends with the run's section for chapters/gpu-runs.md, drafted from the log (date, GPU,
   driver, versions, command, each lab's wall time), and with tools/stale_numbers.py for each chapter
   whose lab was imported: the figures it quotes that the new outputs no longer print.

    python tools/gpu_import.py gpu-run.tar.gz              # check, import, report
    python tools/gpu_import.py gpu-run.tar.gz 02 03        # only these labs
    python tools/gpu_import.py gpu-run.tar.gz --check-only # check and report; labs/ is not touched
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAB_MEMBER = re.compile(r"labs/(\d\d-[\w-]+\.ipynb)")  # what gpu_run.py packs, and nothing else is read
ANSI = re.compile(r"(\x1b|#x1B)\[[0-9;]*m")  # nbval colours its report; junit keeps the escapes
SOFTWARE = ("torch", "transformers", "peft", "bitsandbytes", "triton", "accelerate")


def read_archive(archive: Path) -> tuple[dict, dict[str, bytes]]:
    """The run log (the archive's one top-level .json) and the executed labs by file name. Members are
    read, never extracted: a path outside labs/ in the archive cannot write anywhere."""
    log, labs = None, {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member) if member.isfile() else None
            if data is None:
                continue
            lab = LAB_MEMBER.fullmatch(member.name)
            if lab:
                labs[lab.group(1)] = data.read()
            elif "/" not in member.name and member.name.endswith(".json"):
                log = json.loads(data.read())
    if log is None:
        raise SystemExit(f"gpu-import: {archive} holds no run log (a top-level .json from tools/gpu_run.py)")
    return log, labs


def changed_cell(executed: bytes, here: bytes) -> int | str | None:
    """The first cell whose type or source differs between a run's lab and the working tree's, or None."""
    cells = [[(c.get("cell_type"), "".join(c.get("source", ""))) for c in json.loads(nb)["cells"]]
             for nb in (executed, here)]
    for i, (ran, now) in enumerate(zip(*cells)):
        if ran != now:
            return i
    return None if len(cells[0]) == len(cells[1]) else f"{min(map(len, cells))} (cells added or removed)"


def scratch_copy(root: Path, into: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, not ignored ones), copied file by file."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if (root / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, into / name)


def nbval_failures(scratch: Path, labs: list[str], python: str) -> dict[str, str]:
    """Strict nbval on the CPU with the default preset over `labs` (file names) in `scratch`: the first
    failing cell and its message for each lab that fails; the labs that pass are absent."""
    junit = scratch / "nbval.xml"
    env = {k: v for k, v in os.environ.items() if k != "GPULAB_PRESET"}
    env.update(GPULAB_DEVICE="cpu", PYTHONPATH=str(scratch))
    subprocess.run([python, "-m", "pytest", "--nbval", "--nbval-current-env", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={junit}", *[f"labs/{lab}" for lab in labs]], cwd=scratch, env=env)
    if not junit.exists():
        raise SystemExit("gpu-import: pytest wrote no report; run it by hand in a clone to see why")
    failures: dict[str, str] = {}
    for case in ET.parse(junit).iter("testcase"):
        bad = case.find("failure")
        bad = case.find("error") if bad is None else bad
        lab = next((lab for lab in labs if Path(lab).stem in case.get("classname", "")), None)
        if bad is not None and lab and lab not in failures:
            text = ANSI.sub("", bad.text or bad.get("message") or "")
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            # nbval's report: "Cell outputs differ", then "mismatch 'stdout'" and the two texts
            why = next((line for line in lines if "mismatch" in line or "Error" in line), lines[0] if lines else "")
            failures[lab] = f"{case.get('name')}: {why[:300] or 'failed'}"
    return failures


def notebook_cells(notebook: bytes) -> list[dict]:
    """A notebook's cells from its bytes; none where they are not a notebook."""
    try:
        cells = json.loads(notebook)["cells"]
    except (ValueError, KeyError, TypeError):
        return []
    return cells if isinstance(cells, list) else []


def lab_title(lab: str, notebook: bytes) -> str:
    """"03 Feeding the GPU", from the lab's heading ("# Lab 3: Feeding the GPU"); from its file name where
    it has none."""
    cells = notebook_cells(notebook)
    heading = "".join(cells[0]["source"]).splitlines()[0] if cells and cells[0].get("source") else ""
    match = re.match(r"#\s+Lab \d+:\s*(.+)", heading)
    return f"{lab[:2]} {match.group(1).strip() if match else lab[3:].removesuffix('.ipynb').replace('-', ' ')}"


def missed_targets(notebook: bytes) -> list[str]:
    """The speed targets a lab's run missed (`gpulab.checks.target` prints them as MISSED: lines): a chapter
    must say so, with the figure and why."""
    return [line for cell in notebook_cells(notebook) for out in cell.get("outputs", [])
            if out.get("name") == "stdout"
            for line in "".join(out.get("text", "")).splitlines() if line.startswith("MISSED: ")]


def run_section(log: dict, verdicts: dict[str, str], titles: dict[str, str] | None = None) -> str:
    """The run's section for chapters/gpu-runs.md, from its log: a person adds what the run taught."""
    versions = log.get("versions", {})
    software = ", ".join([f"Python {versions.get('python', '?')}"]
                         + [f"{name} {versions[name]}" for name in SOFTWARE if name in versions])
    preset = log.get("env", {}).get("GPULAB_PRESET") or "chosen by the labs (`small` on CUDA)"
    lines = [f"## {log.get('date', '?')[:10]}: {log.get('device', '?')}", "", "| | |", "|---|---|",
             f"| GPU | {log.get('device', '?')}" + (f" ({log['memory']})" if log.get("memory") else "")
             + f", driver {log.get('driver', '?')} |",
             f"| software | {software} |", f"| preset | {preset} |", "",
             "| lab | on the GPU | wall time | stored |", "|---|---|---|---|"]
    for record in sorted(log.get("labs", []), key=lambda r: r["lab"]):
        lab = record["lab"]
        title = (titles or {}).get(lab) or lab_title(lab, b"")
        lines.append(f"| {title} | {record['status']} | {record.get('wall_s', 0):.1f} s | {verdicts.get(lab, '—')} |")
    lines += ["", "The command:", "", "```bash", log.get("command", "?"), "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive", type=Path, help="the .tar.gz that tools/gpu-run.sh --archive wrote")
    ap.add_argument("labs", nargs="*", help="only these labs (numbers like 03); default: every lab in the archive")
    ap.add_argument("--check-only", action="store_true", help="check and report; copy nothing into labs/")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # the tests' own small tree
    args = ap.parse_args(argv)
    root = args.root.resolve()
    log, executed = read_archive(args.archive)
    records = {r["lab"]: r for r in log.get("labs", [])}
    wanted = [lab for lab in sorted(executed) if not args.labs or lab[:2] in args.labs]
    verdicts: dict[str, str] = {}
    for lab in wanted:
        record = records.get(lab, {"status": "not in the log"})
        if not (root / "labs" / lab).exists():
            verdicts[lab] = "no: no such lab here (renamed since the run?)"
        elif (cell := changed_cell(executed[lab], (root / "labs" / lab).read_bytes())) is not None:
            verdicts[lab] = f"no: cell {cell} has changed here since the run (importing would undo that)"
        elif record["status"] != "ok":
            if errors := record.get("errors"):  # every cell that failed, in order: the first may cause the rest
                error = errors[0] + (f"; {len(errors) - 1} more in the log" if len(errors) > 1 else "")
            else:  # a log from before the run listed errors, or a lab stopped without one (a timeout)
                tail = record.get("stderr_tail", [])
                error = next((line for line in reversed(tail) if line.startswith(f"gpu-run: {lab}:")),
                             tail[-1] if tail else "see the log")
            verdicts[lab] = f"no: {record['status']} on the GPU ({error[:200]})"
    to_check = [lab for lab in wanted if lab not in verdicts]
    if to_check:
        with tempfile.TemporaryDirectory(prefix="gpu-import-") as tmp:
            scratch = Path(tmp)
            scratch_copy(root, scratch)
            for lab in to_check:
                (scratch / "labs" / lab).write_bytes(executed[lab])
            failures = nbval_failures(scratch, to_check, sys.executable)
    else:
        failures = {}
    imported = []
    for lab in to_check:
        if lab in failures:
            verdicts[lab] = f"no: strict nbval on the CPU failed at {failures[lab]}"
        else:
            verdicts[lab] = "yes" if not args.check_only else "would be (--check-only)"
            if not args.check_only:
                (root / "labs" / lab).write_bytes(executed[lab])
                imported.append(lab)
    print(f"gpu-import: {args.archive}: {log.get('device', '?')}, {len(executed)} labs in the archive")
    for lab in wanted:
        print(f"  {lab:40s} {verdicts[lab]}")
    missed = [(lab, line) for lab in wanted if not verdicts[lab].startswith("no")
              for line in missed_targets(executed[lab])]
    if missed:
        print("\nSpeed targets missed (the chapter says so, with the figure and why):")
        for lab, line in missed:
            print(f"  {lab[:2]}: {line}")
    print("\nThe run's section for chapters/gpu-runs.md (add what it taught):\n")
    print(run_section(log, verdicts, {lab: lab_title(lab, data) for lab, data in executed.items()}))
    stale = root / "tools" / "stale_numbers.py"
    if imported and stale.exists():
        print("\nFigures the chapters quote that the imported labs no longer print:\n", flush=True)
        subprocess.run([sys.executable, str(stale), *[lab[:2] for lab in imported]], cwd=root)
    return 1 if any(v.startswith("no") for v in verdicts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
