import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from gpulab.checkpointing import (FORWARD, RECOMPUTED, START_OF_BACKWARD, CheckpointedSegment, checkpoint_in_segments,
                                  decoder_layers, estimate_phases, loss_gradient_bytes, max_grad_difference,
                                  record_layers, run_forward_backward, step_live_bytes)
from gpulab.memory import TrainingSetup, activation_terms, estimate, measure
from gpulab.memory.shapes import ModelShape
from gpulab.models import build_model

SHAPE = ModelShape(128, 64, 160, 4, 4, 2)  # vocab, hidden, intermediate, layers, heads, kv heads
BATCH, SEQ = 2, 16


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(0)
    return torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ))


def forward_backward(model, ids):
    saved, loss = measure.saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
    loss.backward()
    return saved, loss.item()


@pytest.mark.parametrize("every", [1, 2, 3, 4])
def test_segments_match_and_equal_the_calculator(ids, every):
    reference = build_model(SHAPE)
    with record_layers(list(decoder_layers(reference))[:every], exclude=list(reference.parameters())) as segment:
        _, ref_loss = forward_backward(reference, ids)
    model = build_model(SHAPE)
    n_segments = checkpoint_in_segments(model, every)
    assert n_segments == -(-SHAPE.num_layers // every)
    assert all(isinstance(s, CheckpointedSegment) for s in decoder_layers(model))
    saved, loss = forward_backward(model, ids)
    assert loss == ref_loss and max_grad_difference(reference, model) == 0.0
    predicted = activation_terms(SHAPE, TrainingSetup(precision="fp32", batch_size=BATCH, seq_len=SEQ,
                                                      checkpointing=True, checkpoint_every=every)).saved
    assert saved + segment.bytes == predicted  # what is saved: forward saves + one segment's recomputation


@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16-pure"])
@pytest.mark.parametrize("every", [1, 3])
def test_16bit_segments_equal_the_calculator(ids, precision, every):
    # under autocast a segment keeps its fp32 input and recomputes the weights' 16-bit copies too
    weights, amp = {"bf16-autocast": (torch.float32, torch.bfloat16), "bf16-pure": (torch.bfloat16, None)}[precision]

    def saved_in_forward(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None):
            saved, loss = measure.saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
        loss.backward()
        return saved

    reference = build_model(SHAPE, dtype=weights)
    with record_layers(list(decoder_layers(reference))[:every], exclude=list(reference.parameters())) as segment:
        saved_in_forward(reference)
    model = build_model(SHAPE, dtype=weights)
    checkpoint_in_segments(model, every)
    predicted = activation_terms(SHAPE, TrainingSetup(precision=precision, batch_size=BATCH, seq_len=SEQ,
                                                      checkpointing=True, checkpoint_every=every)).saved
    assert saved_in_forward(model) + segment.bytes == predicted


def test_eval_and_no_grad_run_without_checkpointing(ids, monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return torch_checkpoint(*args, **kwargs)

    model = build_model(SHAPE)
    n_segments = checkpoint_in_segments(model, 2)
    monkeypatch.setattr("gpulab.checkpointing.checkpoint", spy)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert calls == []  # no_grad, even in train mode: a plain loop
    model.eval()
    model(input_ids=ids)
    assert calls == []  # eval, even with grad enabled: a plain loop
    model.train()
    model(input_ids=ids)
    assert len(calls) == n_segments  # training with grad: each segment runs under checkpoint once
    reference = build_model(SHAPE)
    with torch.no_grad():
        assert torch.equal(logits, reference(input_ids=ids).logits)


def test_bad_arguments():
    model = build_model(SHAPE)
    with pytest.raises(ValueError):
        checkpoint_in_segments(model, 0)
    checkpoint_in_segments(model, 2)
    with pytest.raises(ValueError, match="already"):
        checkpoint_in_segments(model, 2)
    with pytest.raises(TypeError):
        decoder_layers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="gradient"):
        max_grad_difference(model, build_model(SHAPE))


def test_timing_closure_clears_gradients(ids):
    model = build_model(SHAPE)
    loss = run_forward_backward(model, {"input_ids": ids, "labels": ids})()
    assert loss > 0 and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("every", [0, 1, 2, 4])
def test_live_bytes_of_a_step_and_the_phase_estimate(ids, every):
    model = build_model(SHAPE)
    if every:
        checkpoint_in_segments(model, every)
    step = step_live_bytes(model, {"input_ids": ids, "labels": ids, "use_cache": False})
    n_units = -(-SHAPE.num_layers // every) if every else SHAPE.num_layers
    assert list(step.phases)[:2] == [FORWARD, START_OF_BACKWARD] and len(step.phases) == 2 + n_units
    # the start of backward: all that forward left alive, plus the loss's two fp32 gradients, less the
    # int64 copy of the shifted labels that nll_loss's backward frees before log_softmax's backward runs
    gradients = loss_gradient_bytes(BATCH, SEQ, SHAPE.vocab_size)
    assert step.phases[START_OF_BACKWARD] == step.end_of_forward + gradients - BATCH * SEQ * 8
    assert sum(step.at_peak().values()) == step.peak.bytes
    assert step.gradient_bytes == measure.parameter_bytes(model)  # every parameter got a gradient
    assert step.peak_with_gradients >= step.peak.bytes
    layers = max(v for k, v in step.phases.items() if k.startswith("backward of"))
    assert (step.at_peak()[RECOMPUTED] > 0) == (every > 0 and step.peak.phase.startswith("backward of segment"))

    setup = TrainingSetup(precision="fp32", batch_size=BATCH, seq_len=SEQ,
                          **({"checkpointing": True, "checkpoint_every": every} if every else {}))
    phases = estimate_phases(SHAPE, setup)
    assert phases.naive_sum == activation_terms(SHAPE, setup).saved
    # the calculator's phases are the measured ones, to the byte, and so is its peak, their max
    assert phases.start_of_backward == step.phases[START_OF_BACKWARD] and phases.recomputed_segment == layers
    assert phases.peak == step.peak.bytes
    if every:
        assert estimate(SHAPE, setup).activations == step.peak.bytes
