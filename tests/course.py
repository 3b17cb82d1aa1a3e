"""What the tests need to know about the course's layout (imported by several test files)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def toc_docnames() -> list[str]:
    """Every document named in _toc.yml (root first), without suffix."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    names = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                names.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))

    walk(toc.get("parts"))
    walk(toc.get("chapters"))
    return [re.sub(r"\.(md|ipynb)$", "", n) for n in names]
