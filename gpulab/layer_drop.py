"""Progressive layer dropping (PLD, Zhang and He 2020) for a `transformers` decoder.

In training, each decoder layer runs or is skipped at random, for a whole micro-batch at once. The
probability that layer i (1..L) runs at step t is

    theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar        (over time: 1 at t = 0, then down)
    p_i(t)   = 1 - (i / L) * (1 - theta(t))                         (over depth: deeper layers run less)

`theta(t)` is DeepSpeed's `ProgressiveLayerDrop.update_state` (`"progressive_layer_drop": {"theta":
theta_bar, "gamma": gamma}` in its config); the depth rule and the scaling below are the paper's.
DeepSpeedExamples' reference BERT (`modelingpreln_layerdrop.py`) draws layer j with 1 - (j - 1)s and
divides by 1 - js, so its first layer always runs (chapter 16, exercise 3). DeepSpeed computes theta(t)
only and hands it to the model's forward; the model decides which layers run.

A skipped layer is the identity, x -> x: with pre-LN residual blocks the residual stream passes
through untouched, and neither forward nor backward touches the layer (its parameters get no
gradient). A layer that runs scales its two residual branches, attention and MLP, by 1 / p_i, so
that for a given input the attention branch adds in expectation what it adds in eval, where every
layer runs unscaled; the MLP branch only approximately, since its input already carries the scaled
attention output (one draw gates both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpulab.checkpointing import decoder_layers


def pld_theta(step: float, theta_bar: float = 0.5, gamma: float = 0.001) -> float:
    """theta(step) = (1 - theta_bar) exp(-gamma step) + theta_bar: the last layer's keep probability at `step`
    (`keep_probabilities` spreads it over depth; the expected share of layers kept is larger).

    1 at step 0, falling to `theta_bar`; `gamma` (per step) sets how fast. DeepSpeed's defaults in its
    tutorial are theta_bar = 0.5, gamma = 0.001."""
    if not 0.0 < theta_bar <= 1.0 or gamma < 0 or step < 0:
        raise ValueError(f"need 0 < theta_bar <= 1, gamma >= 0, step >= 0; got {theta_bar}, {gamma}, {step}")
    return (1.0 - theta_bar) * math.exp(-gamma * step) + theta_bar


def keep_probabilities(theta: float, num_layers: int) -> list[float]:
    """p_i = 1 - (i / L) (1 - theta) for layers i = 1..L (returned in layer order, first layer first).

    The first layer runs with probability 1 - (1 - theta) / L, the last with probability theta."""
    if not 0.0 < theta <= 1.0 or num_layers < 1:
        raise ValueError(f"need 0 < theta <= 1 and num_layers >= 1; got {theta}, {num_layers}")
    return [1.0 - (i / num_layers) * (1.0 - theta) for i in range(1, num_layers + 1)]


def expected_fraction(theta: float, num_layers: int) -> float:
    """Expected share of the L layers that run: 1 - (1 - theta)(L + 1) / (2L)."""
    return sum(keep_probabilities(theta, num_layers)) / num_layers


class LayerDropGate(nn.Module):
    """One decoder layer behind a gate; called exactly like the layer it wraps.

    In training mode the gate draws "run" with probability `keep_prob` (on the host, from `generator`,
    so deciding needs no device synchronisation). Skipped: it returns `hidden_states` itself. Run: the
    attention and MLP outputs are multiplied by 1 / keep_prob inside the layer (forward hooks on
    `self_attn` and `mlp`), so hidden (batch, seq, hidden) -> x + attn/p, then + mlp/p. In eval mode, or
    with keep_prob = 1, the hooks change nothing and the layer computes exactly what it computes alone.
    """

    def __init__(self, layer: nn.Module, generator: torch.Generator) -> None:
        super().__init__()
        self.layer = layer
        self.generator = generator
        self.keep_prob = 1.0
        self.force: bool | None = None  # True or False overrides the draw (for tests and demonstrations)
        self.last_ran: bool | None = None  # the last training forward's decision
        self.calls = 0  # training forwards seen
        self.runs = 0  # ... of which the layer ran
        self._scale = 1.0
        branches = [getattr(layer, name, None) for name in ("self_attn", "mlp")]
        if not all(isinstance(b, nn.Module) for b in branches):
            raise TypeError(f"{type(layer).__name__} has no `self_attn` and `mlp`: not a decoder layer we know")
        attention, mlp = branches
        assert isinstance(attention, nn.Module) and isinstance(mlp, nn.Module)
        self._hooks = [attention.register_forward_hook(self._scale_attention),
                       mlp.register_forward_hook(self._scale_mlp)]

    def unwrap(self) -> nn.Module:
        """The wrapped layer, with this gate's hooks removed."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        return self.layer

    def _scale_attention(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._scale == 1.0:
            return None  # leave the output as it is: eval is bit-identical to the ungated layer
        if isinstance(output, tuple):  # LlamaAttention returns (output, attention weights)
            return (output[0] * self._scale,) + tuple(output[1:])
        return output * self._scale

    def _scale_mlp(self, module: nn.Module, args: Any, output: Any) -> Any:
        return None if self._scale == 1.0 else output * self._scale

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.training:
            return self.layer(hidden_states, *args, **kwargs)
        self.calls += 1
        if self.force is not None:
            run = self.force
        else:
            run = self.keep_prob >= 1.0 or float(torch.rand((), generator=self.generator)) < self.keep_prob
        self.last_ran = run
        if not run:
            return hidden_states  # the identity: no compute, no activations kept, no gradient
        self.runs += 1
        self._scale = 1.0 / self.keep_prob
        try:
            return self.layer(hidden_states, *args, **kwargs)
        finally:
            self._scale = 1.0


class ProgressiveLayerDrop:
    """The schedule and the gates of one model: `update(step)` before each training forward.

    `set_theta(theta)` takes theta directly, as DeepSpeed hands it over (`pld_theta` in the forward's
    keyword arguments when `progressive_layer_drop` is enabled in its config)."""

    def __init__(self, gates: Sequence[LayerDropGate], theta_bar: float, gamma: float) -> None:
        self.gates = list(gates)
        self.theta_bar, self.gamma = theta_bar, gamma
        self.theta = 1.0

    def set_theta(self, theta: float) -> None:
        self.theta = theta
        for gate, p in zip(self.gates, keep_probabilities(theta, len(self.gates))):
            gate.keep_prob = p

    def update(self, step: int) -> float:
        """Set every gate's keep probability for `step`; returns theta(step)."""
        self.set_theta(pld_theta(step, self.theta_bar, self.gamma))
        return self.theta

    def keep_probs(self) -> list[float]:
        return [g.keep_prob for g in self.gates]

    def last_ran(self) -> list[bool | None]:
        """Which layers the last training forward ran (None: no training forward yet)."""
        return [g.last_ran for g in self.gates]

    def run_counts(self) -> list[int]:
        return [g.runs for g in self.gates]

    def call_counts(self) -> list[int]:
        return [g.calls for g in self.gates]


def add_layer_drop(model: nn.Module, theta_bar: float = 0.5, gamma: float = 0.001,
                   seed: int = 0) -> ProgressiveLayerDrop:
    """Put every decoder layer of `model` behind a `LayerDropGate`; returns the schedule to step.

    The gates share one CPU generator seeded with `seed` (data-parallel ranks that pass the same seed
    skip the same layers). Parameters keep their order; their names gain a level
    (`layers.0.layer.self_attn...`): `remove_layer_drop` restores them before a checkpoint is saved.
    """
    inner = getattr(model, "model", model)
    layers = list(decoder_layers(model))
    if any(isinstance(layer, LayerDropGate) for layer in layers):
        raise ValueError("the model's layers are already gated")
    generator = torch.Generator().manual_seed(seed)
    gates = [LayerDropGate(layer, generator) for layer in layers]
    inner.layers = nn.ModuleList(gates)
    schedule = ProgressiveLayerDrop(gates, theta_bar, gamma)
    schedule.set_theta(1.0)
    return schedule


def remove_layer_drop(model: nn.Module) -> None:
    """Unwrap the gates (their hooks go with them): the model's layers and names are as before."""
    inner = getattr(model, "model", model)
    layers = list(decoder_layers(model))
    if not all(isinstance(layer, LayerDropGate) for layer in layers):
        raise ValueError("the model's layers are not gated")
    inner.layers = nn.ModuleList(gate.unwrap() for gate in layers if isinstance(gate, LayerDropGate))
