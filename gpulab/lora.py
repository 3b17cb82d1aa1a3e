"""LoRA from scratch: a frozen linear layer plus a trainable low-rank update (Hu et al. 2021).

`LoRALinear(base, rank, alpha)` computes `base(x) + (alpha / rank) * B(A(x))` with A (rank x in) and
B (out x rank); B starts at zero, so the wrapped layer first computes exactly what `base` did. The math
and the initialisation follow `peft`'s `LoraLayer` (A Kaiming-uniform, B zero, no dropout), so the lab
can copy A and B between the two and get the same outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """`base` (frozen) plus a rank-`rank` update scaled by `alpha / rank`.

    Shapes: x (..., in_features) -> (..., out_features); A (rank, in_features), B (out_features, rank).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be at least 1, got {rank}")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear (and peft) initialise A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # two thin matmuls: never form the (out x in) product B @ A during training
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """The update this adapter adds to the base weight: (alpha / rank) * B @ A, (out, in)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def merged(self) -> nn.Linear:
        """`base` with the update folded into its weight: one plain linear layer, no extra cost."""
        with torch.no_grad():
            self.base.weight += self.delta_weight().to(self.base.weight.dtype)
        return self.base


def add_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] | list[str]) -> list[LoRALinear]:
    """Freeze every parameter of `model`, then wrap each `nn.Linear` whose attribute name is in `targets`
    (e.g. "q_proj", "v_proj") in a `LoRALinear`, in place. Returns the wrappers, in module order."""
    for p in model.parameters():
        p.requires_grad_(False)
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    if not found:
        raise ValueError(f"no nn.Linear named one of {list(targets)} in the model")
    wrapped = []
    for name, module in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lora = LoRALinear(module, rank, alpha)
        setattr(parent, attr, lora)
        wrapped.append(lora)
    return wrapped


def merge_lora(model: nn.Module) -> int:
    """Replace every `LoRALinear` in `model` by its merged base layer, in place; returns how many."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, module in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, module.merged())
    return len(found)


def trainable_params(model: nn.Module) -> int:
    """Number of parameters with `requires_grad` (what the optimizer updates)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
