"""Verdict lines and the nbval sanitizer: PASS and SKIP of one claim compare equal, whatever the figures
in their brackets, and so do a speed target's MET and MISSED; a different claim, or a FAIL, does not."""

import re
from pathlib import Path

import pytest

from gpulab.checks import check, target

ROOT = Path(__file__).resolve().parents[1]


def sanitize(text: str) -> str:
    # the rules as nbval reads them from the file
    rules = re.findall(r"^regex: (.*)$\n^replace: (.*)$", (ROOT / "nbval_sanitize.cfg").read_text(), flags=re.M)
    assert rules, "no rules in nbval_sanitize.cfg"
    for regex, replace in rules:
        text = re.sub(regex, replace, text)
    return text


def test_skip_prints_why_and_asserts_nothing(capsys):
    check(False, "on a CUDA GPU, fused beats eager", measured="0.5x", skip="no CUDA GPU")
    assert capsys.readouterr().out == "SKIP: on a CUDA GPU, fused beats eager [no CUDA GPU]\n"
    with pytest.raises(AssertionError, match=r"FAIL: on a CUDA GPU, fused beats eager \[measured: 0.5x\]"):
        check(False, "on a CUDA GPU, fused beats eager", measured="0.5x")


def test_sanitizer_equates_pass_and_skip_of_one_claim():
    stored_gpu = "PASS: fused beats eager [measured: 2.1x, peaks [3, 4] MiB]\nPASS: plain claim\n"
    rerun_cpu = "SKIP: fused beats eager [no CUDA GPU]\nPASS: plain claim\n"
    assert sanitize(stored_gpu) == sanitize(rerun_cpu)
    assert sanitize("PASS: fused beats eager [measured: 1x]") != sanitize("PASS: fused beats unfused [measured: 1x]")
    assert sanitize("FAIL: fused beats eager [measured: 1x]") != sanitize("PASS: fused beats eager [measured: 1x]")
    # figures outside a verdict line are left alone
    assert sanitize("loss 2.885\n") == "loss 2.885\n"


def test_target_reports_a_miss_and_goes_on(capsys):
    target(True, "fused reaches 70% of the copy bandwidth", measured="84%")
    target(False, "fused reaches 70% of the copy bandwidth", measured="55%")  # no exception: the lab goes on
    target(False, "fused reaches 70% of the copy bandwidth", measured="55%", skip="no CUDA GPU")
    assert capsys.readouterr().out.splitlines() == [
        "MET: fused reaches 70% of the copy bandwidth [measured: 84%]",
        "MISSED: fused reaches 70% of the copy bandwidth [measured: 55%]",
        "SKIP: fused reaches 70% of the copy bandwidth [no CUDA GPU]",
    ]


def test_sanitizer_equates_met_missed_and_skip_of_one_target():
    skipped = sanitize("SKIP: fused is 1.5x eager [no CUDA GPU]")
    assert sanitize("MET: fused is 1.5x eager [measured: 1.8x]") == skipped
    assert sanitize("MISSED: fused is 1.5x eager [measured: 1.3x]") == skipped
    other_goal = sanitize("MISSED: fused is 2x eager [measured: 1.3x]")
    assert sanitize("MISSED: fused is 1.5x eager [measured: 1.3x]") != other_goal
