"""Lab plots as the book shows them: PNGs sharp enough and no wider than the text column, text legible.

The stored outputs are what readers see, so this reads them: every PNG must carry at least
gpulab.plots.DPI pixels per inch and be at most COLUMN_IN inches wide (wider ones are shrunk to the
column, text and all). Font sizes cannot be read back from a PNG, so the lab sources are checked for
sizes below MIN_FONT_PT instead (the rcParams in gpulab.plots keep every default at or above it).
"""

import base64
import json
import re
import struct
from pathlib import Path

import pytest

from gpulab.plots import COLUMN_IN, DPI, MIN_FONT_PT

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted((ROOT / "labs").glob("[0-9][0-9]-*.ipynb"))
# matplotlib's named sizes relative to font.size 10: "small" is 8.3 pt
SMALL_NAMES = ("xx-small", "x-small", "small")


def png_size(png: bytes) -> tuple[int, int, float | None]:
    """Width and height in pixels and the pHYs chunk's pixels per inch (None when absent)."""
    width_px, height_px = struct.unpack(">II", png[16:24])
    at = png.find(b"pHYs")
    if at < 0:
        return width_px, height_px, None
    per_metre, _, unit = struct.unpack(">IIB", png[at + 4:at + 13])
    return width_px, height_px, per_metre * 0.0254 if unit == 1 else None


def stored_pngs(lab: Path) -> list[bytes]:
    cells = json.loads(lab.read_text())["cells"]
    return [base64.b64decode(out["data"]["image/png"])
            for cell in cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]


def test_png_reader():
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(4, 2), dpi=DPI)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    width_px, height_px, dpi = png_size(buf.getvalue())
    assert (width_px, height_px) == (4 * DPI, 2 * DPI) and round(dpi) == DPI


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name)
def test_stored_plots_are_sharp_and_fit_the_column(lab):
    pngs = stored_pngs(lab)
    assert pngs, f"{lab.name} stores no plot"
    for index, png in enumerate(pngs):
        width_px, _, dpi = png_size(png)
        assert dpi is not None and dpi >= DPI - 0.5, f"{lab.name} plot {index}: {dpi} dpi, want {DPI}"
        width_in = width_px / dpi
        # bbox_inches="tight" trims the figure's margins; a few hundredths over means a label stuck out
        assert width_in <= COLUMN_IN + 0.05, f"{lab.name} plot {index} is {width_in:.2f} in wide"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name)
def test_lab_sources_set_no_small_text(lab):
    cells = json.loads(lab.read_text())["cells"]
    source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    sizes = [float(s) for s in re.findall(r"(?<![\w.])(?:fontsize|labelsize|size)\s*=\s*([\d.]+)\b", source)]
    small = [s for s in sizes if s < MIN_FONT_PT]
    named = re.findall(r"""(?:fontsize|labelsize)\s*=\s*["'](%s)["']""" % "|".join(SMALL_NAMES), source)
    assert not small and not named, f"{lab.name} sets text below {MIN_FONT_PT} pt: {small + named}"
    assert "rcParams" not in source, f"{lab.name} changes rcParams: gpulab.plots sets them for every lab"


def test_plain_log_axis_writes_plain_numbers():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gpulab.plots import plain_log_axis

    def labels(low, high):
        fig, ax = plt.subplots()
        ax.set_yscale("log")
        plain_log_axis(ax, "y")  # before the data: the labels are decided when the figure is drawn
        ax.plot([0, 1], [low, high])
        ax.set_ylim(low, high)
        fig.canvas.draw()
        shown = [t.get_text() for t in ax.get_yticklabels() + ax.get_yminorticklabels()
                 if t.get_text() and low <= t.get_position()[1] <= high]
        plt.close(fig)
        return shown

    assert labels(0.25, 2.5) == ["1", "0.3", "0.5", "2"]  # under two decades: 2, 3 and 5 too
    assert labels(0.001, 10) == ["0.001", "0.01", "0.1", "1", "10"]  # wider: the decades only
