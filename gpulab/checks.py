"""Verdict lines: the lines nbval compares between the stored run and a re-run on any machine."""

from __future__ import annotations


def check(ok: bool, claim: str, measured: str | None = None, skip: str | None = None) -> None:
    """Assert `ok` and print `PASS: claim [measured: ...]`, or print `SKIP: claim [why]` and assert nothing.

    `claim` must read the same on every device; machine-dependent figures go in `measured`, which
    the repo's nbval sanitizer replaces, so a CPU re-run still matches a GPU's stored output. `skip`
    says why the claim cannot be tested on this device (no CUDA GPU, one GPU only): the line then
    says SKIP, never PASS, and `ok` is not looked at. The sanitizer reads a stored PASS and a re-run
    SKIP of the same claim as equal; a FAIL raises, so it fails on every device.
    """
    if skip:
        print(f"SKIP: {claim} [{skip}]")
        return
    detail = f" [measured: {measured}]" if measured else ""
    if not ok:
        raise AssertionError(f"FAIL: {claim}{detail}")
    print(f"PASS: {claim}{detail}")


def target(met: bool, goal: str, measured: str, skip: str | None = None) -> None:
    """Print `MET: goal [measured: ...]` or `MISSED: goal [measured: ...]`, or `SKIP: goal [why]`; never raise.

    For a speed target (a fused kernel's share of the copy bandwidth, its gain over eager), not for a
    claim about what the code computes: a kernel that misses its target is still correct, and the
    figures of the miss are the result to report, so the lab goes on to the sections after it. A
    correctness claim, or a physical bound, stays a `check`. `goal`, `measured` and `skip` follow
    `check`'s rules, and the sanitizer reads MET, MISSED, PASS and SKIP of one goal as the same line.
    """
    if skip:
        print(f"SKIP: {goal} [{skip}]")
        return
    print(f"{'MET' if met else 'MISSED'}: {goal} [measured: {measured}]")
