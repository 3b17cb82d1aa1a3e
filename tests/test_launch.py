"""The torchrun launcher: two gloo processes, output grouped by rank, failures raised."""

from pathlib import Path

import pytest

from gpulab.launch import group_by_rank, torchrun

ROOT = Path(__file__).resolve().parents[1]


def test_group_by_rank_is_stable():
    tagged, other = group_by_rank("[rank1] b\nnoise\n[rank0] a\n[rank1] c\n")
    assert tagged == ["[rank0] a", "[rank1] b", "[rank1] c"] and other == ["noise"]


def test_allreduce_on_two_processes(capsys):
    out = torchrun(ROOT / "labs" / "scripts" / "allreduce.py", nproc=2, backend="gloo")
    printed = capsys.readouterr().out
    assert printed.count("sum over 2 ranks: ok") == 2
    assert "[rank0]" in out and "[rank1]" in out


def test_failing_script_raises(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("raise SystemExit('rank failed on purpose')\n")
    with pytest.raises(RuntimeError, match="failed"):
        torchrun(script, nproc=2, backend="gloo")
