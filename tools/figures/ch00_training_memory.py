"""Training memory of Llama 3.1 8B and 70B by part, against the memory of one GPU.

From `gpulab.memory.estimate`: full fine-tuning with mixed-precision AdamW (16-bit weights and
gradients, fp32 master copy and moments: 16 bytes per parameter) and the activations of one
4096-token sequence without checkpointing, at the step's peak (what forward saves plus the loss's two
fp32 gradients at the start of backward). The bars add the parts up; a step never holds them all at
once, and the diamond marks its peak (`MemoryEstimate.peak`), from which the count of H100s follows.
GB = 10^9 bytes; the GPUs' memory is what nvidia-smi reports (`gpulab.hardware.gpu_memory_bytes`):
sold as 24 GB and 80 GB, they hold 25.8 and 85.5 GB.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from figures.style import PART_COLORS, new_figure
from gpulab.hardware import gpu_memory_bytes
from gpulab.memory import KNOWN_SHAPES, TrainingSetup, estimate

GB = 1e9
SEQ_LEN = 4096
MODELS = [("Llama 3.1 8B", "llama3-8b"), ("Llama 3.1 70B", "llama3-70b")]
PARTS = ("parameters", "gradients", "optimizer", "activations")
LABELS = {"parameters": "16-bit weights", "gradients": "16-bit gradients",
          "optimizer": "fp32 master + AdamW moments",
          "activations": f"activations at their peak (1 × {SEQ_LEN} tokens)"}
GPUS = [(f"{name}: {gpu_memory_bytes(key) / GB:.1f} GB", gpu_memory_bytes(key) / GB)
        for name, key in (("RTX 4090", "RTX 4090"), ("H100", "H100 80GB"))]


def estimates() -> list[tuple[str, dict[str, float], float]]:
    """(model, GB by part, GB at the step's peak) for each model."""
    setup = TrainingSetup(precision="bf16", optimizer="adamw", seq_len=SEQ_LEN)
    rows = []
    for label, key in MODELS:
        est = estimate(KNOWN_SHAPES[key], setup)
        parts = {part: getattr(est, part) / GB for part in PARTS}
        parts["activations"] += est.backward_extra / GB  # the loss's gradients at the start of backward
        rows.append((label, parts, est.peak / GB))
    return rows


def draw() -> Figure:
    fig, ax = new_figure(height_in=3.0)
    rows = estimates()
    for y, (label, parts, peak) in enumerate(reversed(rows)):
        left = 0.0
        for part in PARTS:
            width = parts[part]
            ax.barh(y, width, left=left, height=0.55, color=PART_COLORS[part], ec="white", lw=0.8,
                    label=LABELS[part] if y == 0 else None)
            if width > 100:
                ax.text(left + width / 2, y, f"{width:,.0f}", ha="center", va="center", fontsize=9,
                        color="white", fontweight="bold")
            left += width
        ax.plot([peak], [y], marker="D", color="black", markersize=6, ls="none",
                label="the step's peak" if y == 0 else None)
        gpus = math.ceil(peak / GPUS[-1][1])
        ax.text(left + 15, y, f"{left:,.0f} GB in all,\npeak {peak:,.0f} GB:\n≥ {gpus} H100s", ha="left",
                va="center", fontsize=9)
    # each GPU's line ends under its own label, the labels stacked so they do not cross the lines
    for (label, size), y_top in zip(GPUS, (1.95, 1.55)):  # the smaller GPU's label higher
        ax.plot([size, size], [-0.5, y_top], color="#333333", lw=0.9, ls="--", zorder=0)
        ax.text(size + 6, y_top, label, ha="left", va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)])
    ax.tick_params(axis="y", length=0)
    ax.set_ylim(-0.5, 2.1)
    ax.set_xlim(0, 1560)
    ax.set_xticks(range(0, 1201, 200))
    ax.set_xlabel("training memory, all of it on one device (GB = 10$^9$ bytes)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.45, 1.0), ncols=2, frameon=False, handlelength=1.4)
    fig.tight_layout()
    return fig
