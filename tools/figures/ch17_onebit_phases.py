"""1-bit Adam's bytes, per step and over a run, for Llama 3.1 8B data-parallel on 64 GPUs.

Left: the bytes each GPU sends per step (ring algorithms, GB = 1e9 bytes) with an fp32 all-reduce of
the gradients, PyTorch's bf16 hook, 1-bit Adam after its warm-up (one fp32 scale per 256 values) and
PowerSGD at rank 4 (its own rule for which tensors it compresses), on a log scale. Right: the two
phases of a 10,000-step run whose warm-up is 20% of the steps (inside DeepSpeed's suggested 15-25%):
the cumulative bytes of Adam grow at the fp32 rate throughout; 1-bit Adam's at that rate during the
warm-up (v updated, exact Adam), then at 1/32 + 1/256 of it (v frozen, momentum in 1 bit), so the whole
run sends 4.4x less, not 28x. All values from `gpulab.onebit_adam`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from matplotlib.figure import Figure

from figures.style import new_figure
from gpulab.memory.shapes import KNOWN_SHAPES
from gpulab.onebit_adam import (FlatLayout, llama_tensor_shapes, onebit_allreduce_bytes, powersgd_allreduce_bytes,
                                ring_allreduce_bytes)

GPUS, BLOCK, RANK = 64, 256, 4
STEPS, WARMUP = 10_000, 2_000
ADAM_COLOR, ONEBIT_COLOR = "#4C72B0", "#C44E52"


def per_step_gb() -> dict[str, float]:
    shapes = llama_tensor_shapes(KNOWN_SHAPES["llama3-8b"])
    d = sum(math.prod(s) for s in shapes)
    padded = FlatLayout.build([torch.empty(s, device="meta") for s in shapes], BLOCK, GPUS).padded_numel
    return {"fp32 all-reduce": ring_allreduce_bytes(4 * d, GPUS) / 1e9,
            "bf16 hook": ring_allreduce_bytes(2 * d, GPUS) / 1e9,
            "1-bit Adam\n(after warm-up)": onebit_allreduce_bytes(padded, GPUS, BLOCK) / 1e9,
            f"PowerSGD, rank {RANK}": powersgd_allreduce_bytes(shapes, RANK, GPUS) / 1e9}


def draw() -> Figure:
    fig, (left, right) = new_figure(height_in=3.3, ncols=2, gridspec_kw={"width_ratios": [1, 1.15]})
    gb = per_step_gb()
    names = list(gb)
    colors = [ADAM_COLOR, "#DD8452", ONEBIT_COLOR, "#55A868"]
    y = np.arange(len(names))[::-1]
    left.barh(y, [gb[n] for n in names], color=colors, height=0.6)
    for yi, n in zip(y, names):
        left.text(gb[n] * 1.3, yi, f"{gb[n]:.2f} GB" if gb[n] >= 0.1 else f"{gb[n] * 1e3:.0f} MB",
                  va="center", fontsize=9)
    left.set_xscale("log")
    left.set_xlim(0.03, 1e3)
    left.set_yticks(y)
    left.set_yticklabels(names)
    left.set_xlabel("GB sent per GPU and step (log)")
    left.set_title(f"Llama 3.1 8B, {GPUS} GPUs", loc="left")

    steps = np.linspace(0, STEPS, 201)
    fp32_gb = gb["fp32 all-reduce"]
    ratio = 1 / 32 + 1 / BLOCK
    adam_tb = steps * fp32_gb / 1e3
    onebit_tb = np.where(steps <= WARMUP, steps, WARMUP + (steps - WARMUP) * ratio) * fp32_gb / 1e3
    right.axvspan(0, WARMUP / 1e3, color="0.92")
    right.plot(steps / 1e3, adam_tb, color=ADAM_COLOR, lw=1.8, label="Adam, fp32 all-reduce")
    right.plot(steps / 1e3, onebit_tb, color=ONEBIT_COLOR, lw=1.8, label="1-bit Adam")
    right.text(0.15, adam_tb[-1] * 0.5, "warm-up:\nexact Adam,\nv updated", ha="left", fontsize=9)
    right.text((WARMUP + STEPS) / 2e3, onebit_tb[-1] * 0.35, "v frozen, momentum\nin 1 bit + scales",
               ha="center", fontsize=9)
    total = 1 / (WARMUP / STEPS + (1 - WARMUP / STEPS) * ratio)
    right.annotate(f"{total:.1f}x less\nover the run", xy=(STEPS / 1e3, onebit_tb[-1]),
                   xytext=(STEPS / 1e3 * 0.66, adam_tb[-1] * 0.42), fontsize=9,
                   arrowprops={"arrowstyle": "->", "color": "0.3"})
    right.set_xlim(0, STEPS / 1e3)
    right.set_ylim(0, adam_tb[-1] * 1.05)
    right.set_xlabel("training step (thousands)")
    right.set_ylabel("TB sent per GPU, cumulative")
    right.set_title(f"Warm-up {WARMUP / STEPS:.0%} of {STEPS:,} steps", loc="left")
    right.legend(loc="upper left", frameon=False)
    fig.tight_layout(w_pad=1.0)
    return fig
