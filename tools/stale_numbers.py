"""List the figures a chapter quotes that its lab's stored outputs no longer print.

After a lab is executed again (on a GPU, or after a change), every measured figure its chapter quotes
must come from the new outputs. This lists, per chapter, each number in the prose (exercises, solutions
and figure captions included; not code blocks, equations or citations) that appears nowhere in the lab's outputs, with its line: what is left is
either stale, cited (REFERENCE-FIGURES), derived from other figures, or a setting, and a person decides.

    python tools/stale_numbers.py            # every chapter with a lab of the same number
    python tools/stale_numbers.py 02 04      # these chapters

Only numbers that look measured are listed: with a decimal point or thousands separators, or three
digits or more. A number matches an output that rounds to it at its decimals, in the same unit or
another (a factor of 1000, 1024, 100): "76.7" matches "0.0767" and "76.71".
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d{3,})(?![\w])")
FENCE = re.compile(r"^(```+|~~~+)")  # code; the prose inside ::: blocks (exercises, figures) is read
INLINE_SKIP = re.compile(r"`[^`]*`|\$[^$]*\$|\{cite[^}]*\}`[^`]*`|\[[^\]]*\]\([^)]*\)|\{ref\}`[^`]*`")


def prose_numbers(chapter: Path) -> list[tuple[int, str]]:
    """(line number, number as written) for the prose of a chapter."""
    found, fence, math = [], None, False
    for i, line in enumerate(chapter.read_text().splitlines(), 1):
        m = FENCE.match(line.strip())
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence:
            continue
        text = line.strip()
        if math:  # display maths over several lines, until the line that ends in $$
            math = not re.search(r"\$\$(\s*\(\S+\))?$", text)
            continue
        if text.startswith("$$"):  # "$$ x $$" opens and closes; "$$" or "$$ x" opens
            math = not re.fullmatch(r"\$\$.+\$\$(\s*\(\S+\))?", text)
            continue
        if text.startswith((":::", ":label:", ":width:", ":name:")):
            continue
        for n in NUMBER.findall(INLINE_SKIP.sub(" ", line)):
            if not re.fullmatch(r"(19|20)\d\d", n):  # years
                found.append((i, n))
    return found


def output_text(lab: Path) -> str:
    """Every text output of a lab: streams, text/plain, markdown and html."""
    parts = []
    for cell in json.loads(lab.read_text())["cells"]:
        for out in cell.get("outputs", []):
            if "text" in out:
                parts.append("".join(out["text"]))
            for kind in ("text/plain", "text/markdown", "text/html"):
                if kind in out.get("data", {}):
                    parts.append("".join(out["data"][kind]))
    return "\n".join(parts)


SCALES = (1, 1e3, 1e-3, 1e6, 1e-6, 1e9, 1e-9, 100, 1e-2, 2**10, 2**-10, 2**20, 2**-20, 2**30, 2**-30)


def output_values(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:e[+-]?\d+)?",
                                                          text)]


def printed(number: str, values: list[float]) -> bool:
    """Whether an output prints `number`, rounded to its decimals, in another unit too (0.0767 TFLOP/s
    for 76.7 GFLOP/s, 25.3 for 25.3%, bytes for MiB)."""
    decimals = len(number.split(".")[1]) if "." in number else 0
    want = float(number.replace(",", ""))
    return any(abs(round(v * scale, decimals) - want) < 10 ** -(decimals + 3) for v in values for scale in SCALES)


def main(argv: list[str]) -> int:
    chapters = sorted((ROOT / "chapters").glob("[0-9][0-9]-*.md"))
    if argv:
        chapters = [c for c in chapters if c.name[:2] in argv]
    for chapter in chapters:
        labs = list((ROOT / "labs").glob(f"{chapter.name[:2]}-*.ipynb"))
        if not labs:
            continue
        values = output_values(output_text(labs[0]))
        stale = [(i, n) for i, n in prose_numbers(chapter) if not printed(n, values)]
        print(f"{chapter.name}: {len(stale)} numbers not in {labs[0].name}'s outputs")
        for i, n in stale:
            print(f"  line {i}: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
