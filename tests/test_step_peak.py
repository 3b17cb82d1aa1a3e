"""The calculator's `peak` is the most bytes alive during a whole training step, measured tensor by tensor.

A step here is what a training loop does after its first step: forward and backward of each
micro-batch, `optimizer.step()`, `zero_grad(set_to_none=True)`. The weights and AdamW's states exist
before it; `LiveBytes` sees everything the step allocates, gradients and the optimizer's temporaries
included. The sum of the parts (`total`) is off by up to a fifth either way; the peak is within 1%
(what it leaves out: a layer's own gradients while its backward runs).
"""

import dataclasses

import pytest
import torch

from gpulab.checkpointing import checkpoint_in_segments
from gpulab.live_bytes import LiveBytes
from gpulab.losses import chunked_lm_loss
from gpulab.memory import ModelShape, TrainingSetup, estimate, measure
from gpulab.models import build_model

SMALL = ModelShape(vocab_size=200, hidden_size=64, intermediate_size=160, num_layers=4, num_heads=4, num_kv_heads=2)
WIDE = dataclasses.replace(SMALL, vocab_size=32 * SMALL.hidden_size)  # Llama-3's vocabulary / width
TIED = dataclasses.replace(WIDE, tie_embeddings=True)  # as Llama-3.2-1B
DTYPES = {"fp32": torch.float32, "bf16-pure": torch.bfloat16}


def measured_step_peak(shape, setup):
    """(peak bytes of the second training step, the tracker's phase at the peak)."""
    model = build_model(shape, dtype=DTYPES[setup.precision])
    if setup.checkpointing:
        checkpoint_in_segments(model, setup.checkpoint_every)
    # "adamw" is the fused kernel; "adamw-foreach" PyTorch's multi-tensor AdamW, its default on CUDA
    # (a CPU defaults to a per-tensor loop)
    fused = setup.optimizer == "adamw"
    optimizer = torch.optim.AdamW(model.parameters(), fused=fused or None, foreach=None if fused else True)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(4, shape.vocab_size, (setup.batch_size, setup.seq_len), generator=gen)
               for _ in range(setup.grad_accumulation)]

    def step(tracker=None):
        for ids in batches:
            if tracker is not None:
                tracker.phase = "forward and backward"
            if setup.loss_chunk_tokens:
                hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
                chunked_lm_loss(hidden, model.lm_head.weight, ids, chunk_tokens=setup.loss_chunk_tokens).backward()
                del hidden
            else:
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        if tracker is not None:
            tracker.phase = "optimizer step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step creates AdamW's states
    before = measure.parameter_bytes(model) + measure.optimizer_state_bytes(optimizer)
    with LiveBytes() as tracker:
        step(tracker)
    peak = tracker.peak()
    return before + peak.bytes, peak.phase


@pytest.mark.parametrize("shape", [SMALL, WIDE, TIED], ids=["small-vocab", "wide-vocab", "tied"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw-foreach"])
@pytest.mark.parametrize("checkpointing, accumulation, batch, seq", [
    (False, 1, 2, 16), (False, 1, 4, 64), (True, 1, 4, 64), (False, 2, 2, 16), (True, 2, 4, 64)])
def test_peak_is_the_step_peak(shape, optimizer, checkpointing, accumulation, batch, seq):
    setup = TrainingSetup(precision="fp32", optimizer=optimizer, batch_size=batch, seq_len=seq,
                          checkpointing=checkpointing, grad_accumulation=accumulation)
    est = estimate(shape, setup)
    measured, phase = measured_step_peak(shape, setup)
    assert est.peak <= measured <= 1.01 * est.peak, (est.peak_moment, phase)


def test_peak_in_16_bits_and_with_segments_of_two():
    for shape, every in ((SMALL, 2), (TIED, 2)):
        setup = TrainingSetup(precision="bf16-pure", optimizer="adamw-foreach", batch_size=4, seq_len=64,
                              checkpointing=True, checkpoint_every=every)
        est = estimate(shape, setup)
        measured, _ = measured_step_peak(shape, setup)
        assert est.peak <= measured <= 1.01 * est.peak


@pytest.mark.parametrize("shape", [WIDE, TIED], ids=["wide-vocab", "tied"])
@pytest.mark.parametrize("chunk, accumulation", [(64, 1), (32, 1), (256, 1), (64, 2)])
def test_peak_with_a_chunked_loss(shape, chunk, accumulation):
    # the chunked cross-entropy of chapter 8 and the capstone: one chunk's logits at a time
    setup = TrainingSetup(precision="fp32", batch_size=2, seq_len=64, loss_chunk_tokens=chunk,
                          grad_accumulation=accumulation)
    est = estimate(shape, setup)
    measured, phase = measured_step_peak(shape, setup)
    assert est.peak <= measured <= 1.01 * est.peak, (est.peak_moment, phase)
    assert est.activations < estimate(shape, dataclasses.replace(setup, loss_chunk_tokens=0)).activations


def test_the_sum_of_the_parts_misses_the_peak_both_ways():
    # without accumulation the gradients and the loss's peak never meet (the sum is too high); the
    # multi-tensor AdamW's temporaries come on top of every gradient (the sum is too low)
    low = TrainingSetup(precision="fp32", optimizer="adamw", batch_size=4, seq_len=64)
    high = TrainingSetup(precision="fp32", optimizer="adamw-foreach", batch_size=2, seq_len=16, checkpointing=True)
    assert measured_step_peak(WIDE, low)[0] < 0.95 * estimate(WIDE, low).total
    assert measured_step_peak(SMALL, high)[0] > 1.1 * estimate(SMALL, high).total


def test_accumulation_keeps_the_gradients_through_backward():
    one = estimate(WIDE, TrainingSetup(precision="fp32", batch_size=4, seq_len=64, optimizer="adamw"))
    two = estimate(WIDE, TrainingSetup(precision="fp32", batch_size=4, seq_len=64, optimizer="adamw",
                                       grad_accumulation=2))
    assert one.peak_moment == two.peak_moment == "start of backward"
    assert two.peak - one.peak == one.gradients  # the first micro-batch's gradients wait for the second
    assert two.total == one.total  # the parts are the same sizes


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_accumulation_with_an_untied_head_peaks_in_its_backward(precision):
    # small micro-batches: the LM head's new gradient beside the one summed so far outweighs the loss
    setup = TrainingSetup(precision=precision, optimizer="adamw", batch_size=1, seq_len=8, grad_accumulation=2)
    est = estimate(WIDE, setup)
    measured, _ = measured_step_peak(WIDE, setup)
    assert est.peak_moment == "backward of the LM head"
    assert est.peak <= measured <= 1.01 * est.peak


def test_without_activations_the_peak_is_the_optimizer_step():
    # the ZeRO paper's 16 bytes per parameter are the parts; PyTorch's multi-tensor AdamW adds one
    # fp32 tensor per parameter in its step (the square roots of the second moments)
    setup = TrainingSetup(precision="bf16", optimizer="adamw-foreach")
    est = estimate(7.5e9, setup)
    assert est.total == 16 * 7.5e9 and est.peak_moment == "optimizer step"
    assert est.peak == est.total + 4 * 7.5e9
    fused = estimate(7.5e9, dataclasses.replace(setup, optimizer="adamw"))
    assert fused.peak == fused.total == est.total


def test_grad_accumulation_must_be_positive():
    with pytest.raises(ValueError, match="grad_accumulation"):
        TrainingSetup(grad_accumulation=0)


def test_ddp_buckets_hold_a_copy_of_the_gradients():
    # DDP (no ZeRO, several GPUs) copies every gradient into buckets that live through the step
    one = estimate(WIDE, TrainingSetup(precision="fp32", batch_size=4, seq_len=64))
    ddp = estimate(WIDE, TrainingSetup(precision="fp32", batch_size=4, seq_len=64, world_size=8))
    zero2 = estimate(WIDE, TrainingSetup(precision="fp32", batch_size=4, seq_len=64, world_size=8, zero_stage=2))
    assert ddp.peak == one.peak + one.gradients and any(n.startswith("DDP") for n in ddp.notes)
    assert zero2.peak < ddp.peak and not any(n.startswith("DDP") for n in zero2.notes)


def test_mixed_precision_names_the_fp32_gradient_copy_it_leaves_out():
    est = estimate(8e9, TrainingSetup(precision="bf16"))
    assert any("fp32" in n and "+32.000 GB" in n for n in est.notes)
    assert not any("DeepSpeed" in n for n in estimate(8e9, TrainingSetup(precision="fp32")).notes)
