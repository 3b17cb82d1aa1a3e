"""One batch of four sequences against four micro-batches of one, accumulated into one gradient.

Top: the passes on a schematic time axis (a backward takes about twice a forward; the same
arithmetic in both schedules, so the same length here; in practice small micro-batches run at a
lower fraction of peak). Each micro-batch's backward adds into `.grad`; one optimizer step and one
`zero_grad` follow the last. Bottom: the saved activations over the same time, in GB (10^9 bytes),
from `gpulab.memory.activation_bytes` for Llama-3 8B in bf16 with 4096-token sequences; the model
states (weights, gradients, AdamW) are the same in both and not drawn.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from figures.style import PART_COLORS, new_figure
from gpulab.memory import KNOWN_SHAPES, TrainingSetup, activation_bytes

K, SEQ_LEN = 4, 4096
FWD, BWD, STEP = 1.0, 2.0, 1.0  # schematic time per sequence (forward, backward) and per step
FWD_COLOR, BWD_COLOR, STEP_COLOR = "#8FB3D9", "#4C72B0", "#55A868"
FULL_COLOR, MICRO_COLOR = "#C44E52", "#8172B3"


def activations_gb(batch: int) -> float:
    return activation_bytes(KNOWN_SHAPES["llama3-8b"], TrainingSetup(seq_len=SEQ_LEN, batch_size=batch)) / 1e9


def full_schedule() -> list[tuple[str, str, float, float]]:
    """(kind, label, start, end) for one batch of K sequences."""
    f_end = K * FWD
    b_end = f_end + K * BWD
    return [("fwd", f"forward,\n{K} sequences", 0.0, f_end), ("bwd", f"backward, {K} sequences", f_end, b_end),
            ("step", "step", b_end, b_end + STEP)]


def micro_schedule() -> list[tuple[str, str, float, float]]:
    out, t = [], 0.0
    for j in range(1, K + 1):
        out += [("fwd", f"F{j}", t, t + FWD), ("bwd", f"B{j}", t + FWD, t + FWD + BWD)]
        t += FWD + BWD
    return out + [("step", "step", t, t + STEP)]


def _activation_trace(schedule, per_pass_gb: float, t: np.ndarray) -> np.ndarray:
    """Saved activations: rise through each forward, fall through its backward."""
    y = np.zeros_like(t)
    for kind, _, start, end in schedule:
        inside = (t >= start) & (t <= end)
        frac = np.clip((t - start) / (end - start), 0, 1)
        if kind == "fwd":
            y = np.where(inside, per_pass_gb * frac, y)
        elif kind == "bwd":
            y = np.where(inside, per_pass_gb * (1 - frac), y)
    return y


def draw() -> Figure:
    fig, (top, bottom) = new_figure(height_in=4.6, nrows=2, sharex=True,
                                    gridspec_kw={"height_ratios": [1.25, 1]})
    full, micro = full_schedule(), micro_schedule()
    colors = {"fwd": FWD_COLOR, "bwd": BWD_COLOR, "step": STEP_COLOR}
    for y, schedule in [(3.0, full), (1.9, micro)]:
        for kind, label, start, end in schedule:
            top.barh(y, end - start, left=start, height=0.6, color=colors[kind], ec="white", lw=1.2)
            top.text((start + end) / 2, y, label, ha="center", va="center", fontsize=9,
                     color="white" if kind != "fwd" else "black")
    # the gradient buffer of the accumulating run: each backward adds its micro-batch's gradient,
    # the step reads the sum, zero_grad frees it
    t_end = micro[-1][3]
    bwd_ends = [end for kind, _, _, end in micro if kind == "bwd"]
    stops = bwd_ends[1:] + [t_end]
    labels = ["g1", "g1+g2", "g1+g2+g3", "Σ g"]
    for j, (start, stop) in enumerate(zip(bwd_ends, stops)):
        top.barh(1.0, stop - start, left=start, height=0.45, color=PART_COLORS["gradients"],
                 alpha=0.35 + 0.65 * (j + 1) / K, lw=0)
        top.text((start + stop) / 2, 1.0, labels[j], ha="center", va="center", fontsize=9)
    top.annotate("zero_grad", (t_end, 0.78), (t_end - 0.3, 0.42), fontsize=9, va="center", ha="right",
                 arrowprops=dict(arrowstyle="-", color="#555555", lw=0.8))
    top.set_yticks([3.0, 1.9, 1.0], [f"one batch of {K}", f"{K} micro-batches\nof 1", ".grad (accumulating)"])
    top.tick_params(axis="y", length=0)
    top.spines["left"].set_visible(False)
    top.spines["bottom"].set_visible(False)
    top.tick_params(axis="x", length=0)
    top.set_ylim(0.3, 3.5)
    top.set_title("Schematic time; one optimizer step in both", loc="left")

    t = np.linspace(0, t_end, int(round(t_end / 0.05)) + 1)  # every 0.05: the kinks (whole units) exactly
    full_gb, micro_gb = activations_gb(K), activations_gb(1)
    bottom.fill_between(t, _activation_trace(full, full_gb, t), color=FULL_COLOR, alpha=0.25, lw=0)
    bottom.plot(t, _activation_trace(full, full_gb, t), color=FULL_COLOR, lw=1.6,
                label=f"one batch of {K}: at most {full_gb:.1f} GB")
    bottom.fill_between(t, _activation_trace(micro, micro_gb, t), color=MICRO_COLOR, alpha=0.35, lw=0)
    bottom.plot(t, _activation_trace(micro, micro_gb, t), color=MICRO_COLOR, lw=1.6,
                label=f"{K} micro-batches of 1: at most {micro_gb:.1f} GB")
    bottom.set_ylabel("saved activations\n(GB = 10$^9$ bytes)")
    bottom.set_xlabel("time (schematic: a backward takes twice a forward)")
    bottom.set_xticks([])
    bottom.set_ylim(0, full_gb * 1.15)
    bottom.set_xlim(0, t_end + 0.05)
    bottom.legend(loc="upper right", frameon=False)
    bottom.set_title(f"Llama-3 8B in bf16, {SEQ_LEN}-token sequences; model states (same in both) not drawn",
                     loc="left", fontsize=9)
    fig.tight_layout(h_pad=0.3)
    return fig
