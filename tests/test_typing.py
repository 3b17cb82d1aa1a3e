"""gpulab is typed: mypy finds no error in it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_clean():
    if shutil.which("mypy") is None and not Path(sys.executable).with_name("mypy").exists():
        pytest.skip("mypy not installed (it is in the `test` extra)")
    proc = subprocess.run([sys.executable, "-m", "mypy", "gpulab"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
