"""Memory-lean optimizers written out to teach them: Lion, and a LOMO-style update fused into backward.

The libraries people use are bitsandbytes (`bnb.optim.Lion`, `bnb.optim.AdamW8bit`) and
`torch.optim.Adafactor`; lab 07 checks these from-scratch versions against them (Lion against
bitsandbytes, LOMO against `torch.optim.SGD`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from gpulab.memory.measure import gradient_bytes


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, arXiv 2302.06675): one momentum buffer, a sign update.

    Per step, with gradient g and momentum m (one tensor the size of the parameter):
        p <- p * (1 - lr * weight_decay)
        p <- p - lr * sign(beta1 * m + (1 - beta1) * g)
        m <- beta2 * m + (1 - beta2) * g
    Every entry moves by exactly lr, so lr is typically 3-10x smaller than AdamW's.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"need lr > 0 and betas in [0, 1), got lr={lr}, betas={betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m, g = state["exp_avg"], p.grad
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(m.mul(beta1).add_(g, alpha=1 - beta1).sign_(), alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1 - beta2)
        return loss


class FusedSGD(torch.optim.Optimizer):
    """LOMO-style training (Lv et al. 2023, arXiv 2306.09782): SGD applied inside backward.

    A post-accumulate-grad hook on every parameter updates it as soon as its gradient is complete and
    frees the gradient, so no full set of gradients ever exists and there is no optimizer state.
    `loss.backward()` therefore *is* the step: `step()` and `zero_grad()` do nothing, which lets the
    usual training loop run unchanged; dropping the optimizer (or `remove()`) takes the hooks off.
    Gradient clipping by the global norm is not possible here (the norm is known only after the whole
    backward); the LOMO paper runs a second backward for it.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float) -> None:
        if lr <= 0:
            raise ValueError(f"need lr > 0, got {lr}")
        super().__init__(params, {"lr": lr})
        self._handles: list[RemovableHandle] = []
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(index)))
        # once the optimizer is gone, its hooks go too (as remove() would), and the model trains normally
        weakref.finalize(self, _remove_handles, self._handles)

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        # a weak reference: the hook lives on the parameter, and a strong one would close a cycle
        # (parameter -> hook -> optimizer -> parameter) that Python's gc does not collect through a
        # tensor's hooks, keeping the model alive after both were dropped
        optimizer = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            this = optimizer()
            if this is None:  # being collected: its finalizer removes this hook
                return
            with torch.no_grad():
                p.add_(p.grad, alpha=-this.param_groups[index]["lr"])  # type: ignore[arg-type]
            p.grad = None  # freed now, before the rest of backward runs

        return hook

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Nothing to do: backward already updated every parameter."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the hooks already freed every gradient."""

    def remove(self) -> None:
        """Take the hooks off the parameters (the model then trains normally again)."""
        _remove_handles(self._handles)


def _remove_handles(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


@dataclass
class GradientPeak:
    """Filled by `watch_gradients`: the most gradient bytes alive at once during backward."""

    bytes: int = 0


@contextmanager
def watch_gradients(model: torch.nn.Module) -> Iterator[GradientPeak]:
    """Record the peak of `gradient_bytes(model)` each time a parameter's gradient is complete.

    Enter it *before* creating a fused optimizer: hooks run in the order they were registered, so this
    one sees each gradient before a fused update frees it. Exact and device-independent.
    """
    peak = GradientPeak()

    def hook(_: torch.Tensor) -> None:
        peak.bytes = max(peak.bytes, gradient_bytes(model))

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters() if p.requires_grad]
    try:
        yield peak
    finally:
        for handle in handles:
            handle.remove()
