"""`python -m gpulab.memory` as a user runs it."""

import json
import subprocess
import sys

import pytest

from gpulab.memory.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "gpulab.memory", *args], capture_output=True, text=True)


def test_json_keys_and_zero_example():
    proc = run("--params", "7.5e9", "--dtype", "bf16", "--optimizer", "adamw-foreach", "--zero", "3", "--gpus", "64",
               "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) == {"parameters", "gradients", "optimizer", "activations", "backward_extra", "kv_cache", "total",
                         "peak", "peak_moment"}
    assert round(data["total"] / 1e9, 1) == 1.9
    assert data["peak_moment"] == "optimizer step" and data["peak"] > data["total"]  # AdamW's temporaries
    assert all(isinstance(v, int) for k, v in data.items() if k != "peak_moment")


def test_table_output(capsys):
    assert main(["--params", "7e9", "--dtype", "bf16", "--optimizer", "adamw-foreach"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "total" in out and "112.000" in out
    assert "peak at: optimizer step" in out


def test_grad_accumulation_option():
    args = ["--model", "llama3-1b", "--seq", "2048", "--optimizer", "adamw", "--json"]
    one, four = (json.loads(run(*args, *extra).stdout) for extra in ([], ["--grad-accum", "4"]))
    assert four["peak"] - one["peak"] == one["gradients"] and four["total"] == one["total"]


@pytest.mark.parametrize("args", [
    ["--params", "7e9", "--optimizer", "rmsprop"],
    ["--params", "-7e9"],
    ["--params", "inf"],
    ["--params", "1e400"],
    ["--params", "nan"],
    ["--params", "1e-3"],
    ["--params", "7e9", "--zero", "4"],
    ["--params", "7e9", "--dtype", "int3"],
    ["--params", "1e9", "--lora-rank", "8"],
    [],
])
def test_bad_arguments_exit_2_with_one_line(args):
    proc = run(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_model_with_activations_and_kv():
    proc = run("--model", "llama3-8b", "--seq", "2048", "--kv-context", "8192", "--json")
    data = json.loads(proc.stdout)
    assert data["activations"] > 0 and data["kv_cache"] == 131072 * 8192
