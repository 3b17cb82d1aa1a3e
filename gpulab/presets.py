"""Named presets: one notebook runs in CI on a CPU (`tiny`) and on a GPU with a bigger model.

A lab's parameters cell calls `get_preset()`; `$GPULAB_PRESET` overrides the choice, so
`GPULAB_PRESET=small jupyter nbconvert --execute ...` runs the GPU size without editing the notebook.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gpulab import env
from gpulab.memory.shapes import KNOWN_SHAPES, ModelShape


@dataclass(frozen=True)
class Preset:
    """A model shape and the batch geometry and step count the labs use with it."""

    name: str
    shape: ModelShape
    batch_size: int
    seq_len: int
    steps: int
    lr: float
    description: str


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("tiny", ModelShape(512, 256, 688, 4, 4, 2), 8, 64, 40, 3e-3,
               "3.2M params: seconds per lab on a laptop CPU"),
        Preset("small", ModelShape(32768, 768, 2048, 12, 12, 4), 16, 512, 200, 1e-3,
               "126M params: a GPU with 16 GB or more"),  # lab 1's fp32 AdamW step peaks near 11.3 GB
        Preset("1b", KNOWN_SHAPES["llama3-1b"], 8, 1024, 100, 3e-4,
               # fp32 AdamW on 8 x 1024 tokens peaks near 54 GB (the calculator); lab 5's whole batch of
               # 16 sequences needs 93 GB, and labs 2 and 6 keep several models alive at once
               "Llama-3.2-1B shape (random init): an 80 GB GPU, and more for labs 2, 5 and 6"),
    ]
}

ENV_VAR = "GPULAB_PRESET"
# The smallest GPU that `auto` gives `small`: lab 1's fp32 AdamW step on small peaks near 11.3 GB by
# the calculator, before the CUDA context. A card sold as 16 GB (a T4: 15,360 MiB) passes; 12 GB does not.
SMALL_MIN_GPU_BYTES = 14 * 10**9


def get_preset(name: str | None = None, device: torch.device | None = None) -> Preset:
    """The preset `name`, else $GPULAB_PRESET, else `tiny` on CPU/MPS and `small` on CUDA (`tiny`, with
    a note, on a GPU too small for `small`)."""
    name = name or os.environ.get(ENV_VAR) or "auto"
    if name == "auto":
        total = env.device_memory_bytes(device) if device is not None else None  # None off CUDA
        name = "small" if device is not None and device.type == "cuda" else "tiny"
        if total is not None and total < SMALL_MIN_GPU_BYTES:
            name = "tiny"
            print(f"note: this GPU has {total / 1e9:.1f} GB, less than the {SMALL_MIN_GPU_BYTES / 1e9:.0f} GB "
                  f"the 'small' preset needs; running 'tiny' instead (set {ENV_VAR}=small to try anyway).")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (from the parameters cell or ${ENV_VAR}); "
                         f"choose one of: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    if name != "tiny" and (device is None or device.type != "cuda"):
        print(f"note: preset {name!r} is sized for a CUDA GPU; on {device} it may take a long time. "
              f"Use {ENV_VAR}=tiny for a quick run.")
    return preset
