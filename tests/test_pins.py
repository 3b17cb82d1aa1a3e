"""The exact versions in the constraints files lie inside the ranges of the package metadata.

`make` installs with constraints.txt and the other environments with a constraints file on top of it
(Makefile: a line of the second replaces the same package's line of the first). A pin outside the range
that pyproject.toml gives would make that install fail, and a range that no pin reaches would claim a
version nobody tested at its top.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# each environment's files on top of constraints.txt: make's own, then the Makefile's GPU_CONSTRAINTS ones
ENVIRONMENTS = [[], ["constraints-gpu-image.txt"], ["constraints-gpu-image.txt", "constraints-gpu-torch.txt"],
                ["constraints-latest.txt"]]


def pins(*names: str) -> dict[str, Version]:
    """constraints.txt with each named file's lines replacing the same packages' lines, as the Makefile does."""
    found: dict[str, Version] = {}
    for name in ("constraints.txt", *names):
        for line in (ROOT / name).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                package, version = line.split("==")
                found[canonicalize_name(package)] = Version(version.strip())
    return found


def requirements() -> list[Requirement]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in meta["optional-dependencies"].values() for r in group]
    return [Requirement(r) for r in meta["dependencies"] + extras]


@pytest.mark.parametrize("overlay", ENVIRONMENTS, ids=lambda o: "+".join(["constraints.txt", *o]))
def test_every_pin_is_inside_its_range(overlay):
    pinned = pins(*overlay)
    versions = [(r, pinned.get(canonicalize_name(r.name))) for r in requirements()]
    outside = [f"{r.name} {v} not in {r.specifier}" for r, v in versions
               if v is not None and not r.specifier.contains(v, prereleases=True)]
    assert not outside, outside


@pytest.mark.parametrize("package", ["torch", "transformers"])
def test_the_top_of_each_range_is_pinned_somewhere(package):
    """torch's and transformers' upper bounds sit just above a tested release (one minor version up)."""
    (req,) = [r for r in requirements() if r.name == package]
    tested = {pins(*o)[package] for o in ENVIRONMENTS}
    top = max(tested)
    upper = [Version(s.version) for s in req.specifier if s.operator == "<"]
    assert upper == [Version(f"{top.major}.{top.minor + 1}")], (req.specifier, sorted(tested))
