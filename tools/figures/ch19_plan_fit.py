"""The capstone's plan: the memory calculator's peak for each rung of the ladder and each Llama-3
shape, for one micro-batch of one 2048-token sequence, coloured by the smallest GPU it fits with 10%
of the card left free (the lab's HEADROOM).

Rows: Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B (their published config.json shapes). Columns: fp32
full fine-tuning; bf16 mixed precision (autocast over fp32 weights, as `Trainer(bf16=True)` runs it);
+ activation checkpointing; + 8-bit AdamW; LoRA r=16 on every linear layer of a bf16 base; QLoRA (NF4
with double quantization, plus peft's fp32 upcast of the embeddings and norms); + the chunked
cross-entropy (1024 tokens per chunk). GPU memory as nvidia-smi reports it (24,564 and 81,559 MiB).
All values from `gpulab.capstone.rung_setups` and `predicted_bytes`.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from figures.style import new_figure
from gpulab.capstone import predicted_bytes, rung_setups
from gpulab.hardware import gpu_memory_bytes
from gpulab.memory.shapes import KNOWN_SHAPES

SEQ = 2048
MODELS = {"Llama-3.2-1B": "llama3-1b", "Llama-3.2-3B": "llama3-3b", "Llama-3.1-8B": "llama3-8b"}
CARDS = (("24 GB", "RTX 4090"), ("80 GB", "H100 80GB"))
COLORS = ["#55A868", "#F2C45A", "#C44E52"]  # fits 24 GB, fits only 80 GB, fits neither
LABELS = ["fits 24 GB", "fits 80 GB only", "fits neither"]
HEADROOM = 0.9  # as lab 19 plans: the CUDA context, the allocator's cache and workspaces take the rest


def draw() -> Figure:
    setups = rung_setups(1, SEQ)
    names = list(setups)
    peaks = np.array([[predicted_bytes(KNOWN_SHAPES[key], setups[n]) / 1e9 for n in names]
                      for key in MODELS.values()])
    small, large = (HEADROOM * gpu_memory_bytes(card) / 1e9 for _, card in CARDS)
    klass = np.where(peaks <= small, 0, np.where(peaks <= large, 1, 2))
    fig, ax = new_figure(height_in=3.1)
    ax.imshow(klass, cmap=ListedColormap(COLORS), vmin=0, vmax=2, aspect="auto")
    for i in range(len(MODELS)):
        for j in range(len(names)):
            ax.text(j, i, f"{peaks[i, j]:.1f}", ha="center", va="center", fontsize=9.5)
    ax.set_xticks(range(len(names)), [n.replace("+ ", "+").replace(" ", "\n") for n in names])
    ax.set_yticks(range(len(MODELS)), list(MODELS))
    ax.tick_params(length=0)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"Calculator peak in GB, one {SEQ}-token sequence per micro-batch\n"
                 f"(90% of a 24 GB card: {small:.1f} GB; of an 80 GB card: {large:.1f} GB)", loc="left")
    ax.legend(handles=[Patch(color=c, label=lab) for c, lab in zip(COLORS, LABELS)], ncol=3, frameon=False,
              loc="upper center", bbox_to_anchor=(0.5, -0.32))
    fig.tight_layout()
    return fig
