"""The calculator's `peak` is the most bytes alive during a whole training step, measured tensor by tensor.

A step here is what a training loop does after its first step: forward and backward of each
micro-batch, `optimizer.step()`, `zero_grad(set_to_none=True)`. The weights and AdamW's states exist
before it; `LiveBytes` sees everything the step allocates, gradients and the optimizer's temporaries
included. The sum of the parts (`total`) is off by up to a fifth either way; the peak is within 1%
(what it leaves out: a layer's own gradients while its backward runs). Under mixed precision
(`measured_mixed_step_peak`) the step also updates fp32 master weights and copies them into the bf16 ones.
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


def micro_batches(shape, setup):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(4, shape.vocab_size, (setup.batch_size, setup.seq_len), generator=gen)
            for _ in range(setup.grad_accumulation)]


def forward_backward(model, setup, batches, tracker=None):
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


def measured_step_peak(shape, setup):
    """(peak bytes of the second training step, the tracker's phase at the peak)."""
    model = build_model(shape, dtype=DTYPES[setup.precision])
    if setup.checkpointing:
        checkpoint_in_segments(model, setup.checkpoint_every)
    # "adamw" is the fused kernel; "adamw-foreach" PyTorch's multi-tensor AdamW, its default on CUDA
    # (a CPU defaults to a per-tensor loop)
    fused = setup.optimizer == "adamw"
    optimizer = torch.optim.AdamW(model.parameters(), fused=fused or None, foreach=None if fused else True)
    batches = micro_batches(shape, setup)

    def step(tracker=None):
        forward_backward(model, setup, batches, tracker)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step creates AdamW's states
    before = measure.parameter_bytes(model) + measure.optimizer_state_bytes(optimizer)
    with LiveBytes() as tracker:
        step(tracker)
    peak = tracker.peak()
    return before + peak.bytes, peak.phase


LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 1e-2  # torch.optim.AdamW's defaults
# a fused mixed-precision AdamW reads each 16-bit gradient and widens it in registers; torch's fused
# kernel wants fp32 gradients for fp32 weights, so it gets them a block of this many values at a time
# (4 KB of fp32, a stand-in for registers). Upcasting a whole tensor at a time instead puts the largest
# one's fp32 copy on top of the gradients (WIDE's 512 KB LM head: 3.4% above the peak at 2 x 16 tokens)
FUSED_BLOCK_VALUES = 1024


def fused_adamw(masters, grads, exp_avgs, exp_avg_sqs, steps):
    torch._foreach_add_(steps, 1)
    for master, grad, exp_avg, exp_avg_sq, step in zip(masters, grads, exp_avgs, exp_avg_sqs, steps):
        for start in range(0, master.numel(), FUSED_BLOCK_VALUES):
            block = slice(start, start + FUSED_BLOCK_VALUES)
            torch._fused_adamw_([master.view(-1)[block]], [grad.view(-1)[block].float()],
                                [exp_avg.view(-1)[block]], [exp_avg_sq.view(-1)[block]], [], [step],
                                lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=WEIGHT_DECAY, eps=EPS,
                                amsgrad=False, maximize=False)


def foreach_adamw(masters, grads, exp_avgs, exp_avg_sqs, steps):
    # torch.optim.AdamW's multi-tensor step (`_multi_tensor_adam`), with the 16-bit gradients read by
    # in-place ops on the fp32 moments (mixed dtypes: no lerp_); the square roots of all the second
    # moments are its one new list, fp32 here
    torch._foreach_add_(steps, 1)
    torch._foreach_mul_(masters, 1 - LR * WEIGHT_DECAY)
    torch._foreach_mul_(exp_avgs, BETA1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - BETA1)
    torch._foreach_mul_(exp_avg_sqs, BETA2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - BETA2)
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denominators, [(1 - BETA2 ** s.item()) ** 0.5 for s in steps])
    torch._foreach_add_(denominators, EPS)
    torch._foreach_addcdiv_(masters, exp_avgs, denominators, [-LR / (1 - BETA1 ** s.item()) for s in steps])


MASTER_UPDATES = {"adamw": fused_adamw, "adamw-foreach": foreach_adamw}


def measured_mixed_step_peak(shape, setup, fp32_gradients=False):
    """`measured_step_peak` under mixed precision ("bf16"): bf16 weights and gradients, AdamW over fp32
    master weights with fp32 moments, reading the bf16 gradients, the masters then copied into the
    weights. `fp32_gradients`: the update reads an fp32 copy of all the gradients (DeepSpeed's ZeRO)."""
    model = build_model(shape, dtype=torch.bfloat16)
    if setup.checkpointing:
        checkpoint_in_segments(model, setup.checkpoint_every)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters]
    steps = [torch.tensor(0.0) for _ in masters]  # fp32 scalars, as torch keeps them
    update = MASTER_UPDATES[setup.optimizer]
    batches = micro_batches(shape, setup)

    def step(tracker=None):
        forward_backward(model, setup, batches, tracker)
        grads = [p.grad.float() if fp32_gradients else p.grad for p in params]
        update(masters, grads, exp_avgs, exp_avg_sqs, steps)
        del grads
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        for p in params:
            p.grad = None

    step()
    before = measure.tensor_bytes(params + masters + exp_avgs + exp_avg_sqs + steps)
    with LiveBytes() as tracker:
        step(tracker)
    peak = tracker.peak()
    return before + peak.bytes, peak.phase


# fp32, and bf16 with fp32 master weights, where the calculator's update reads the 16-bit gradients
MEASURED_STEP = {"fp32": measured_step_peak, "bf16": measured_mixed_step_peak}


@pytest.mark.parametrize("precision", list(MEASURED_STEP))
@pytest.mark.parametrize("shape", [SMALL, WIDE, TIED], ids=["small-vocab", "wide-vocab", "tied"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw-foreach"])
@pytest.mark.parametrize("checkpointing, accumulation, batch, seq", [
    (False, 1, 2, 16), (False, 1, 4, 64), (True, 1, 4, 64), (False, 2, 2, 16), (True, 2, 4, 64)])
def test_peak_is_the_step_peak(precision, shape, optimizer, checkpointing, accumulation, batch, seq):
    setup = TrainingSetup(precision=precision, optimizer=optimizer, batch_size=batch, seq_len=seq,
                          checkpointing=checkpointing, grad_accumulation=accumulation)
    est = estimate(shape, setup)
    measured, phase = MEASURED_STEP[precision](shape, setup)
    assert est.peak <= measured <= 1.01 * est.peak, (est.peak_moment, phase)


@pytest.mark.parametrize("shape", [SMALL, TIED], ids=["small-vocab", "tied"])
def test_an_fp32_copy_of_the_gradients_adds_what_the_note_says(shape):
    # DeepSpeed's ZeRO optimizer widens every gradient before its fused update: with few activations
    # the step is then the peak, every part alive and the note's 4 bytes per parameter on top
    setup = TrainingSetup(precision="bf16", optimizer="adamw", batch_size=2, seq_len=16)
    est = estimate(shape, setup)
    measured, phase = measured_mixed_step_peak(shape, setup, fp32_gradients=True)
    assert phase == "optimizer step" and measured > est.peak
    assert measured == est.parameters + est.optimizer + est.gradients + 4 * est.trainable_params
    assert any("DeepSpeed" in n and "fp32" in n for n in est.notes)


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
