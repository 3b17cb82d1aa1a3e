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


FINISHING = """
import sys
from gpulab.distributed import finish, init, say
me = init()
say(me.rank, "before finish")
finish({"world": me.world}, sys.argv[1], exit_code=int(sys.argv[2]))
say(me.rank, "after finish")
"""


@pytest.mark.parametrize("exit_code", [0, 1])
def test_finish_writes_results_then_exits_with_its_code(tmp_path, exit_code):
    """`finish` leaves at once (no interpreter shutdown, where gloo can abort a rank) with the code it got:
    rank 0's JSON is on disk, nothing after the call runs, and a non-zero code fails the launch."""
    script, out = tmp_path / "finishing.py", tmp_path / "out.json"
    script.write_text(FINISHING)
    if exit_code:
        with pytest.raises(RuntimeError, match="exit status"):
            torchrun(script, nproc=2, backend="gloo", args=[str(out), "1"])
    else:
        output = torchrun(script, nproc=2, backend="gloo", args=[str(out), "0"])
        assert output.count("before finish") == 2 and "after finish" not in output
    assert out.read_text().replace(" ", "").replace("\n", "") == '{"world":2}'
