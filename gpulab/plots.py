"""One look for every lab's plots: legible at the book's column width, sharp on a high-density screen.

The book shows a lab's stored PNGs at most one text column wide (about 7 in at a 1280-px window). A
figure drawn wider is shrunk to fit, and its text with it; so figures stay within ``COLUMN_IN`` inches,
text stays at or above ``MIN_FONT_PT`` points, and PNGs carry ``DPI`` pixels per inch.
"""

from __future__ import annotations

import math

COLUMN_IN = 7.0  # the book's text column at a 1280-px window is about 7.2 in (690 px at 96 px/in)
MIN_FONT_PT = 9.0  # smallest legible text at the column's width
DPI = 150  # at or above this a PNG stays sharp when the browser scales it to the column

RC: dict[str, object] = {
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.title_fontsize": 9,
    "figure.titlesize": 10.5,
    "figure.figsize": (6.5, 3.2),
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
}


def use_book_style() -> None:
    """Apply the course's plot settings to matplotlib, if it is installed (labs call it through setup).

    In a notebook the inline backend draws PNGs at ``figure.dpi``; ``%matplotlib inline`` resets
    some rcParams when it runs, so this runs after it (``gpulab.env.setup`` is each lab's first call).
    """
    try:
        import matplotlib as mpl
    except ImportError:  # gpulab's units need no plotting
        return
    import matplotlib.style

    matplotlib.style.use(RC)


def plain_log_axis(ax, which: str = "y") -> None:
    """Label a log axis with plain numbers (0.1, 0.2, 0.3) instead of 10^-1 and 3 x 10^-1.

    Matplotlib labels a log axis that spans less than a decade with minor ticks in scientific form,
    which reads as clutter; this writes the ticks as `%g` numbers. Minor ticks at 2, 3 and 5 get labels
    while the axis spans less than two decades, decided when the figure is drawn (so it may be called
    before the data is plotted).
    """
    from matplotlib.ticker import FuncFormatter

    axis = ax.yaxis if which == "y" else ax.xaxis

    def minor(value: float, _: object) -> str:
        low, high = sorted(abs(v) for v in axis.get_view_interval())
        if value <= 0 or low <= 0 or high / low >= 100:
            return ""
        mantissa = round(value / 10 ** math.floor(math.log10(value) + 1e-9))
        return f"{value:g}" if mantissa in (2, 3, 5) else ""  # 6, 7, 8, 9 would crowd below the next 10

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))
