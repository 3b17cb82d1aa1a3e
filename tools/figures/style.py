"""One look for every chapter figure: sizes in inches at the book's text column, fonts in points."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display: figures are written to files
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

# the column's width and the smallest legible text, the same for the labs' plots (gpulab.plots)
from gpulab.plots import COLUMN_IN, MIN_FONT_PT  # noqa: E402,F401

RC = {
    "font.family": "DejaVu Sans",  # shipped with matplotlib: the same glyphs on every machine
    "font.size": 10,
    "axes.titlesize": 10.5,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "figure.dpi": 100,
    "svg.hashsalt": "gpulab",  # fixed ids: the same figure gives the same file
    "svg.fonttype": "path",  # glyphs as paths: no font needed to view the file
    "axes.spines.top": False,
    "axes.spines.right": False,
}

# Colours for the parts of training memory, the same in every figure that shows them
PART_COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "kv_cache": "#8172B3",
}


def new_figure(width_in: float = COLUMN_IN, height_in: float = 3.0, **subplot_kw) -> tuple[Figure, object]:
    """A figure no wider than the column, with the course's style; returns (fig, axes) like subplots."""
    if width_in > COLUMN_IN:
        raise ValueError(f"figure is {width_in} in wide; the column holds {COLUMN_IN} in")
    with plt.rc_context(RC):
        fig, axes = plt.subplots(figsize=(width_in, height_in), **subplot_kw)
    return fig, axes


def style() -> object:
    """A context manager that applies the course's rcParams while a figure is drawn."""
    return plt.rc_context(RC)
