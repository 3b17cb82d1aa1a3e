"""Verdict lines: the lines nbval compares between the stored run and a re-run on any machine."""

from __future__ import annotations


def check(ok: bool, claim: str, measured: str | None = None) -> None:
    """Assert `ok` and print `PASS: claim [measured: ...]`.

    `claim` must read the same on every device; machine-dependent figures go in `measured`, which
    the repo's nbval sanitizer replaces, so a CPU re-run still matches a GPU's stored output.
    """
    detail = f" [measured: {measured}]" if measured else ""
    if not ok:
        raise AssertionError(f"FAIL: {claim}{detail}")
    print(f"PASS: {claim}{detail}")
