"""Sequence-length warm-up with DeepSpeed's example settings: lengths from 8 to 1,024 tokens over
15,000 steps in multiples of 8, 4,096 sequences per step (the curriculum-learning tutorial's config).

Left: the length of each step, linear (`fixed_linear`) and square-root (`fixed_root`, degree 2)
pacing, from `gpulab.curriculum.seqlen_at`; the right axis reads the same curve as tokens per step
(batch x length). An inset shows the first steps, where rounding down to multiples of 8 makes stairs.
Right: tokens seen against steps. The baseline sees 4.2M tokens a step from the start; the curricula
see fewer in their first 15,000 steps, so at equal tokens they take more steps (each one cheaper).
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from figures.style import new_figure
from gpulab.curriculum import seqlen_at

MIN_LEN, MAX_LEN, STEP_SIZE = 8, 1024, 8
WARMUP_STEPS = 15_000
BATCH = 4096  # sequences per step
STEPS = 25_000
BASE_COLOR, LINEAR_COLOR, ROOT_COLOR = "#555555", "#4C72B0", "#DD8452"


def lengths(root_degree: float) -> np.ndarray:
    return np.array([seqlen_at(s, WARMUP_STEPS, MIN_LEN, MAX_LEN, STEP_SIZE, root_degree)
                     for s in range(1, STEPS + 1)])


def draw() -> Figure:
    fig, (left, right) = new_figure(height_in=3.3, ncols=2, gridspec_kw={"width_ratios": [1.15, 1]})
    steps = np.arange(1, STEPS + 1)
    linear, root = lengths(1), lengths(2)
    base = np.full(STEPS, MAX_LEN)

    left.plot(steps / 1e3, base, color=BASE_COLOR, lw=1.2, ls="--", label="baseline")
    left.plot(steps / 1e3, linear, color=LINEAR_COLOR, lw=1.6, label="linear")
    left.plot(steps / 1e3, root, color=ROOT_COLOR, lw=1.6, label="square root")
    left.set_xlabel("optimizer step (thousands)")
    left.set_ylabel("sequence length (tokens)")
    left.set_ylim(0, 1150)
    left.set_xlim(0, STEPS / 1e3)
    left.axvline(WARMUP_STEPS / 1e3, color="0.75", lw=0.8)
    tokens_axis = left.secondary_yaxis("right", functions=(lambda n: n * BATCH / 1e6, lambda m: m * 1e6 / BATCH))
    tokens_axis.set_ylabel("tokens per step (M)")
    left.set_title(f"Length per step, {BATCH:,} sequences a step", loc="left")
    # one legend for both panels, in the empty band under the baseline: on the right it would cover data
    left.legend(loc="upper right", bbox_to_anchor=(1.0, 0.87), frameon=False, fontsize=9, handlelength=1.4)

    inset = left.inset_axes([0.66, 0.11, 0.31, 0.32])
    first = 121
    inset.step(steps[:first], linear[:first], where="post", color=LINEAR_COLOR, lw=1.2)
    inset.step(steps[:first], root[:first], where="post", color=ROOT_COLOR, lw=1.2)
    inset.set_xlim(1, first - 1)
    inset.set_ylim(0, 130)
    inset.set_xticks([1, 60, 120])
    inset.set_yticks([8, 64, 128])
    inset.tick_params(labelsize=9)
    inset.set_title("steps 1-120", fontsize=9)

    for name, series, color, style in [("baseline", base, BASE_COLOR, "--"), ("linear", linear, LINEAR_COLOR, "-"),
                                       ("square root", root, ROOT_COLOR, "-")]:
        right.plot(steps / 1e3, np.cumsum(series) * BATCH / 1e9, color=color, lw=1.6 if style == "-" else 1.2,
                   ls=style, label=name)
    budget_b = WARMUP_STEPS * MAX_LEN * BATCH / 1e9
    reach = {name: int(np.searchsorted(np.cumsum(series) * BATCH / 1e9, budget_b)) + 1
             for name, series in [("linear", linear), ("square root", root)]}
    right.axhline(budget_b, color="0.75", lw=0.8)
    right.text(0.5, 118, f"{budget_b:.1f}B tokens: baseline at\nstep {WARMUP_STEPS:,}, linear at\n"
               f"{reach['linear']:,}, square root at {reach['square root']:,}", fontsize=9, va="top")
    right.set_xlabel("optimizer step (thousands)")
    right.set_ylabel("tokens seen (billions)")
    right.set_xlim(0, STEPS / 1e3)
    right.set_ylim(0, 120)
    right.set_title("Tokens seen", loc="left")
    fig.tight_layout(w_pad=1.0)
    return fig
