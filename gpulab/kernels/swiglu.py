"""SwiGLU, the activation of Llama's MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`.

The eager reference, its backward written out, an autograd Function that runs any fused forward and
backward pair, and `fuse_swiglu` to drop such a pair into a transformers Llama model.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from gpulab.kernels.build import SwiGLUKernels


def swiglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as PyTorch runs it eagerly: two kernels, and silu(gate) goes through memory."""
    return F.silu(gate) * up


def swiglu_backward_reference(grad: torch.Tensor, gate: torch.Tensor,
                              up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients the fused kernels compute, in fp32: with s = sigmoid(gate),
    d_gate = grad * up * s * (1 + gate * (1 - s)) and d_up = grad * gate * s."""
    g, u, dy = gate.float(), up.float(), grad.float()
    s = torch.sigmoid(g)
    return (dy * u * s * (1 + g * (1 - s))).to(gate.dtype), (dy * g * s).to(up.dtype)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd for a fused kernel pair: saves only gate and up (eager also saves silu(gate))."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, kernels: SwiGLUKernels) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.kernels = kernels
        return kernels.forward(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gate, up = ctx.saved_tensors
        d_gate, d_up = ctx.kernels.backward(grad.contiguous(), gate, up)
        return d_gate, d_up, None


def swiglu_fused(gate: torch.Tensor, up: torch.Tensor, kernels: SwiGLUKernels) -> torch.Tensor:
    """silu(gate) * up through `kernels`, differentiable. The kernels want contiguous inputs."""
    out: torch.Tensor = SwiGLUFunction.apply(gate.contiguous(), up.contiguous(), kernels)
    return out


def fuse_swiglu(model: torch.nn.Module, kernels: SwiGLUKernels) -> int:
    """Make every Llama MLP of `model` compute its activation with `kernels`; returns how many it changed.

    The weights stay where they are: only each MLP's forward changes, so the model still saves and
    loads as before."""
    count = 0
    for module in model.modules():
        if all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            if "silu" not in type(module.act_fn).__name__.lower():  # nn.SiLU, transformers' SiLUActivation
                raise ValueError(f"{type(module).__name__} uses {type(module.act_fn).__name__}, not SiLU: "
                                 "the fused kernel computes silu(gate) * up only")

            def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
                return self.down_proj(swiglu_fused(self.gate_proj(x), self.up_proj(x), kernels))

            module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
            count += 1
    if count == 0:
        raise ValueError("no Llama-style MLP (gate_proj, up_proj, down_proj, act_fn) found in the model")
    return count
