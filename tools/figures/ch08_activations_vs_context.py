"""Saved activations against sequence length for one Llama-3 8B sequence in bf16: eager attention
(quadratic) against fused SDPA attention (linear).

Both curves are `gpulab.memory.activation_bytes` for the published Llama-3 8B shape, batch 1, bf16
mixed precision, no checkpointing. The shaded gap between them is what eager attention adds: the
attention probabilities, heads x s^2 per layer, kept in fp32 and as a bf16 copy (6 bytes each). The
horizontal line is the 80 GB budget of the chapter's exercise; the dot on it marks, for each kind of
attention, the longest sequence (in tokens, any whole number) whose activations stay under it, where
the curve crosses the budget. GB = 10^9 bytes.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from figures.style import PART_COLORS, new_figure
from gpulab.memory import KNOWN_SHAPES, TrainingSetup, activation_bytes

GB = 1e9
BUDGET_GB = 80
SHAPE = KNOWN_SHAPES["llama3-8b"]


def activations_gb(seq_len: int, attention: str) -> float:
    return activation_bytes(SHAPE, TrainingSetup(precision="bf16", seq_len=seq_len, attention=attention)) / GB


def longest_under(budget_gb: float, attention: str) -> int:
    """The longest sequence, in tokens, whose activations stay under the budget (bisection)."""
    lo, hi = 1, 1
    while activations_gb(hi, attention) < budget_gb:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if activations_gb(mid, attention) < budget_gb:
            lo = mid
        else:
            hi = mid
    return lo


def draw() -> Figure:
    seqs = np.arange(256, 16384 + 1, 256)
    sdpa = np.array([activations_gb(int(s), "sdpa") for s in seqs])
    eager = np.array([activations_gb(int(s), "eager") for s in seqs])
    color = PART_COLORS["activations"]

    fig, ax = new_figure(height_in=3.3)
    ax.fill_between(seqs, sdpa, eager, color=color, alpha=0.15, linewidth=0)
    ax.plot(seqs, eager, color=color, linestyle="--", linewidth=1.8, label="eager attention")
    ax.plot(seqs, sdpa, color=color, linewidth=1.8, label="SDPA (fused attention)")
    ax.axhline(BUDGET_GB, color="0.3", linewidth=1, linestyle=":")
    ax.text(16384, BUDGET_GB - 5, f"{BUDGET_GB} GB budget", ha="right", va="top", fontsize=9, color="0.3")
    for attention, curve_color in (("eager", color), ("sdpa", color)):
        s = longest_under(BUDGET_GB, attention)
        y = BUDGET_GB  # where the curve crosses the budget
        ax.plot([s], [y], "o", color=curve_color, markersize=5)
        if attention == "sdpa":
            ax.annotate(f"{s:,} tokens", (s, y), xytext=(0, 12), textcoords="offset points", fontsize=9,
                        ha="center")
        else:  # above the budget line, with a leader: the corner by the axis is crowded
            ax.annotate(f"{s:,} tokens", (s, y), xytext=(250, 125), textcoords="data", fontsize=9,
                        va="center", arrowprops={"arrowstyle": "-", "color": "0.3", "lw": 0.8})
    s8k = 8192
    for attention, offset, text in (("eager", (10, 0), "{:.1f} GB at 8K tokens"), ("sdpa", (0, -10), "{:.1f} GB")):
        y = activations_gb(s8k, attention)
        ax.plot([s8k], [y], "s", color=color, markersize=4)
        ax.annotate(text.format(y), (s8k, y), xytext=offset, textcoords="offset points", fontsize=9,
                    ha="left" if attention == "eager" else "center", va="center" if attention == "eager" else "top")
    ax.text(9600, 190, "kept attention probabilities:\nlayers × heads × s² × 6 bytes\n(grows with s²)",
            fontsize=9, ha="left", va="center", color="0.2")
    ax.set_xlim(0, 16384)
    ax.set_ylim(0, 500)
    ax.set_xticks([0, 2048, 4096, 8192, 12288, 16384], ["0", "2K", "4K", "8K", "12K", "16K"])
    ax.set_xlabel("sequence length (tokens), batch 1")
    ax.set_ylabel("activations saved for\nbackward (GB, 10⁹ bytes)")
    ax.legend(loc="upper left", frameon=False)
    return fig
