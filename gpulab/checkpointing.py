"""Activation checkpointing of a `transformers` Llama in segments of k decoder layers.

`transformers` checkpoints each decoder layer on its own (`model.activation_checkpointing_enable()`), and
its `every_n_layers=n` checkpoints every n-th layer while the others keep all their activations. The
segments of Chen et al. (2016) are different: k consecutive layers run as one checkpointed unit, which
keeps only its input and recomputes all k layers in backward. `checkpoint_in_segments` builds them.

`step_live_bytes` measures what a training step really holds at its peak (live tensor bytes through
forward and backward, `gpulab.live_bytes`), and says in which phase the peak comes: forward, the start
of backward (the loss's fp32 gradients of the logits' size, `loss_gradient_bytes`), or backward through
a layer or segment (a checkpointed segment's recomputation with its gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from gpulab.live_bytes import Allocation, LiveBytes, Peak
from gpulab.memory.calculator import TrainingSetup, activation_terms
from gpulab.memory.measure import SavedTensors, record_saved_tensors
from gpulab.memory.shapes import ModelShape


class CheckpointedSegment(torch.nn.Module):
    """k decoder layers run as one unit under `torch.utils.checkpoint` (non-reentrant).

    Called like a decoder layer: `segment(hidden_states, **layer_kwargs)`, hidden states (batch, seq,
    hidden). In training with grad enabled only `hidden_states` is saved for backward; backward runs
    the k layers again to rebuild their activations. In eval or under `no_grad` it is a plain loop.
    """

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def _run(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states, **kwargs)
        return hidden_states

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            # non-reentrant: keyword arguments, inputs without grad and nested autograd all work
            out = checkpoint(self._run, hidden_states, use_reentrant=False, **kwargs)
            assert isinstance(out, torch.Tensor)
            return out
        return self._run(hidden_states, **kwargs)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a `LlamaForCausalLM` (or of its inner `LlamaModel`)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `.model.layers` or `.layers` ModuleList")
    return layers


def enable_transformers_checkpointing(model: torch.nn.Module, every_n_layers: int = 1) -> None:
    """Turn on `transformers`' own per-layer checkpointing (non-reentrant), on every version we test.

    transformers 5.23 names it `activation_checkpointing_enable` and deprecates
    `gradient_checkpointing_enable`; 5.17 (the GPU machine's) has only the older name. Both take
    `every_n_layers`.
    """
    # getattr: nn.Module's typing says an unknown attribute is a Tensor or a Module, not a method
    if hasattr(model, "activation_checkpointing_enable"):
        getattr(model, "activation_checkpointing_enable")(
            activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n_layers)
    else:
        getattr(model, "gradient_checkpointing_enable")(
            gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n_layers)


def checkpoint_in_segments(model: torch.nn.Module, every: int) -> int:
    """Group the decoder layers into checkpointed segments of `every` layers; returns the segment count.

    The last segment is shorter when `every` does not divide the layer count. Parameters keep their
    order (`model.parameters()`), but their names gain a level: `layers.0.layers.1.mlp...`.
    """
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    inner = getattr(model, "model", model)
    layers = list(decoder_layers(model))
    if any(isinstance(layer, CheckpointedSegment) for layer in layers):
        raise ValueError("the model is already checkpointed in segments")
    segments = [CheckpointedSegment(layers[i:i + every]) for i in range(0, len(layers), every)]
    inner.layers = torch.nn.ModuleList(segments)
    return len(segments)


@contextmanager
def record_layers(layers: list[torch.nn.Module], exclude: list[torch.Tensor]) -> Iterator[SavedTensors]:
    """Count what autograd saves while `layers` run (from the first one's start to the last one's end).

    With consecutive decoder layers of a model without checkpointing, this is what one checkpointed
    segment of those layers holds while backward recomputes it. Pass the parameters as `exclude`.
    """
    result = SavedTensors()
    active: list[Any] = []  # the open record_saved_tensors context and what it fills

    def start(module: torch.nn.Module, args: Any) -> None:
        if not active:
            context = record_saved_tensors(exclude=exclude)
            active.extend([context, context.__enter__()])

    def stop(module: torch.nn.Module, args: Any, output: Any) -> None:
        if active:
            context, saved = active
            context.__exit__(None, None, None)
            result.bytes, result.count = saved.bytes, saved.count
            active.clear()

    handles = [layers[0].register_forward_pre_hook(start), layers[-1].register_forward_hook(stop)]
    try:
        yield result
    finally:
        for handle in handles:
            handle.remove()
        if active:  # the forward stopped early: close the hooks anyway
            active[0].__exit__(None, None, None)


def max_grad_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """max |grad_a - grad_b| / max |grad_a| over all parameters, in the order `parameters()` yields them."""
    pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    if any(pa.grad is None or pb.grad is None for pa, pb in pairs):
        raise ValueError("every parameter needs a gradient: run backward on both models first")
    scale = max(float(pa.grad.abs().max()) for pa, _ in pairs)  # type: ignore[union-attr]
    diff = max(float((pa.grad - pb.grad).abs().max()) for pa, pb in pairs)  # type: ignore[operator]
    return diff / scale if scale else diff


def run_forward_backward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], float]:
    """A closure for timing: one forward and backward on `batch`, gradients cleared; returns the loss."""

    def step() -> float:
        loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


FORWARD, START_OF_BACKWARD = "forward", "start of backward"
KEPT, RECOMPUTED, TEMPORARIES = "kept from forward", "recomputed", "backward temporaries"


def loss_gradient_bytes(batch_size: int, seq_len: int, vocab_size: int) -> int:
    """Bytes of the two fp32 gradients the loss's backward creates at once: of the log-probabilities
    (`nll_loss`'s backward, dense) and of the logits (`log_softmax`'s backward), batch x seq x vocab each.

    They exist together at the start of backward, with everything forward saved still alive; with a
    vocabulary of 128,256 and 4096 tokens that is 2 x 2.1 GB.
    """
    return 2 * batch_size * seq_len * vocab_size * 4


def allocation_kind(a: Allocation) -> str:
    """What an allocation of `step_live_bytes` is: kept from forward, recomputed in backward (grad mode
    on: a checkpoint's recomputation), or a temporary of backward's own operations (gradients)."""
    if a.phase == FORWARD:
        return KEPT
    return RECOMPUTED if a.grad_enabled else TEMPORARIES


@dataclass
class StepPeak:
    """Live bytes over one forward and backward (weights and the batch excluded: they existed before).

    `peak` leaves the parameters' gradients out (they are gradient memory, not activations);
    `peak_with_gradients` keeps them, as the CUDA allocator's peak above the weights does.
    """

    tracker: LiveBytes
    gradients: set[int]  # allocation indices of the parameters' gradients
    peak: Peak
    phases: dict[str, int]  # the peak of each phase, in the order they ran
    peak_with_gradients: int
    gradient_bytes: int  # the parameters' gradients at the end
    end_of_forward: int  # bytes alive when the forward pass has returned the loss

    def at_peak(self) -> dict[str, int]:
        """Bytes alive at the peak by kind: kept from forward, recomputed, backward temporaries."""
        kinds = {KEPT: 0, RECOMPUTED: 0, TEMPORARIES: 0}
        for a in self.peak.live:
            kinds[allocation_kind(a)] += a.nbytes
        return kinds


def step_live_bytes(model: torch.nn.Module, batch: dict[str, Any],
                    units: list[torch.nn.Module] | None = None) -> StepPeak:
    """One forward and backward of `model(**batch).loss` under `LiveBytes`, with phases marked.

    Phases: "forward"; "start of backward" (the loss, the LM head, the final norm) until the gradient
    reaches the last of `units` (default: the decoder layers or segments); then "backward of layer j"
    or "backward of segment j" (1-based) from the moment the gradient reaches that unit's output,
    which for a checkpointed segment is when its recomputation starts. Gradients are cleared first
    and kept afterwards. Only the loss is kept from the model's output, as a training loop should.
    """
    units = list(decoder_layers(model)) if units is None else units
    model.zero_grad(set_to_none=True)
    tracker = LiveBytes()

    def mark(label: str) -> Callable[[torch.nn.Module, Any, Any], None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            # only in forward: a recomputation runs the layers again, inside backward
            if tracker.phase == FORWARD and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: setattr(tracker, "phase", label))
        return hook

    names = [f"backward of {'segment' if isinstance(u, CheckpointedSegment) else 'layer'} {j + 1}"
             for j, u in enumerate(units)]
    handles = [u.register_forward_hook(mark(name)) for u, name in zip(units, names)]
    try:
        with tracker:
            tracker.phase = FORWARD
            loss = model(**batch).loss
            tracker.phase = START_OF_BACKWARD
            with torch.no_grad():
                seed = torch.ones_like(loss)  # made here, so that it counts as a backward temporary
            loss.backward(seed)
            gradients = tracker.indices_of(p.grad for p in model.parameters())
            del loss, seed
    finally:
        for handle in handles:
            handle.remove()
    phases = {phase: tracker.peak(exclude=gradients, where=phase.__eq__).bytes
              for phase in dict.fromkeys(a.phase for a in tracker.allocations)}  # in the order they ran
    backward_starts = next(n for n, label in tracker.marks if label == START_OF_BACKWARD)
    return StepPeak(tracker, gradients, tracker.peak(exclude=gradients), phases, tracker.peak().bytes,
                    sum(tracker.allocations[i].nbytes for i in gradients), tracker.live_at(backward_starts))


@dataclass(frozen=True)
class PhaseEstimate:
    """Activation bytes in the phases of one training step, from the calculator (`activation_terms`).

    `start_of_backward`: what forward keeps (segment inputs, the head's log-softmax and norm, RoPE's
    tables, the checkpoints' arguments) plus the loss's two fp32 gradients. `recomputed_segment`: the
    backward of the last segment, its k layers rebuilt, with the segment inputs and the gradients of
    its last layer's MLP backward (without checkpointing: the last layer's backward, with all layers'
    saved tensors). `end_of_forward`: what forward keeps, with autocast's weight cache. Each matches
    live bytes to the byte in fp32 on a CPU (lab 6, tests). `naive_sum`: forward's keeps plus one
    segment's recomputation, as if they coexisted (they never do): the sum a peak is not.
    """

    start_of_backward: float
    recomputed_segment: float
    naive_sum: float
    end_of_forward: float = 0.0

    @property
    def peak(self) -> float:
        """The largest phase: the peak is a max over phases, not a sum (`activation_bytes` with checkpointing)."""
        return max(self.start_of_backward, self.recomputed_segment, self.end_of_forward)

    @property
    def phase(self) -> str:
        if self.peak == self.start_of_backward:
            return START_OF_BACKWARD
        return "recomputed segment" if self.peak == self.recomputed_segment else "end of forward"


def calculator_terms(shape: ModelShape, setup: TrainingSetup) -> tuple[float, float, float]:
    """(one segment input, one layer's saved tensors, the head with RoPE's tables) in bytes, from the
    calculator's `activation_terms`."""
    terms = activation_terms(shape, setup)
    return terms.input, terms.layer, terms.head + terms.shared


def estimate_phases(shape: ModelShape, setup: TrainingSetup) -> PhaseEstimate:
    """The phases of one training step with `setup` (checkpointed in segments of `setup.checkpoint_every`
    layers, or not at all), from the calculator's terms."""
    terms = activation_terms(shape, setup)
    return PhaseEstimate(terms.start_of_backward, terms.backward_of_layers, terms.saved, terms.end_of_forward)
