"""Measured bytes match the calculator exactly for a real transformers Llama, in fp32 and in 16 bits."""

import contextlib
import dataclasses
import gc
import weakref

import pytest
import torch

from gpulab.memory import ModelShape, TrainingSetup, activation_terms, estimate
from gpulab.memory import measure
from gpulab.models import build_model

SHAPE = ModelShape(vocab_size=200, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2)


def test_tensor_bytes_counts_shared_storage_once():
    x = torch.zeros(10, 10)
    assert measure.tensor_bytes([x, x[0], x.view(100)]) == 400


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
def test_training_step_matches_calculator(attention, padded):
    model = build_model(SHAPE, attn_implementation=attention)
    ids = torch.randint(4, SHAPE.vocab_size, (3, 16))
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0  # one padded sequence: the model now gets an explicit attention mask
    inputs = {"input_ids": ids, "labels": ids, **({"attention_mask": mask} if padded else {})}
    setup = TrainingSetup(precision="fp32", optimizer="adamw", batch_size=3, seq_len=16, attention=attention,
                          padding_mask=padded)
    predicted = estimate(SHAPE, setup)
    act_bytes, loss = measure.saved_activation_bytes(model, lambda: model(**inputs).loss)
    loss.backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    assert measure.parameter_bytes(model) == predicted.parameters
    assert measure.gradient_bytes(model) == predicted.gradients
    assert measure.optimizer_state_bytes(opt) == predicted.optimizer
    assert act_bytes == predicted.activations


def test_counting_saved_tensors_keeps_no_graph_alive():
    # a forward counted and then dropped, never run backward (as when a lab only measures what it saves):
    # tanh saves its own output, and a pack hook that kept it would keep the graph, and through its
    # AccumulateGrad nodes the parameters, alive past gc.collect()
    layer = torch.nn.Linear(8, 8)
    weight = weakref.ref(layer.weight)
    with measure.record_saved_tensors(exclude=layer.parameters()) as saved:
        out = torch.tanh(layer(torch.randn(2, 8)))
    assert saved.count == 2 and saved.bytes == 2 * 2 * 8 * 4  # the input and tanh's output
    del out, layer
    gc.collect()
    assert weight() is None


def test_counting_saved_tensors_leaves_gradients_unchanged():
    model = build_model(SHAPE)
    ids = torch.randint(4, SHAPE.vocab_size, (2, 12))
    grads = []
    for counted in (False, True):
        model.zero_grad(set_to_none=True)
        with measure.record_saved_tensors(exclude=model.parameters()) if counted else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_cuda_peak_is_none_without_cuda():
    if torch.cuda.is_available():
        assert measure.cuda_peak_bytes() is not None
    else:
        assert measure.cuda_peak_bytes() is None


# How each 16-bit policy runs the forward: the model's dtype and the autocast dtype (None: no autocast)
POLICIES = {
    "bf16-autocast": (torch.float32, torch.bfloat16),
    "fp16-autocast": (torch.float32, torch.float16),
    "bf16-pure": (torch.bfloat16, None),
    "bf16": (torch.bfloat16, None),  # mixed precision: the forward runs on the bf16 copy of the weights
    "fp16": (torch.float16, None),
}


def saved_bytes_16bit(policy, attention, ids, mask=None, model=None):
    weights, amp = POLICIES[policy]
    model = model or build_model(SHAPE, attn_implementation=attention, dtype=weights)
    inputs = {"input_ids": ids, "labels": ids, **({"attention_mask": mask} if mask is not None else {})}
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        act_bytes, loss = measure.saved_activation_bytes(model, lambda: model(**inputs).loss)
    return act_bytes, loss


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
def test_16bit_forward_matches_calculator(policy, attention, padded):
    # RMSNorm's fp32 upcasts, autocast's per-projection input casts and eager's second copy of the
    # probabilities are all counted: the prediction is exact, not a lower bound
    ids = torch.randint(4, SHAPE.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0
    act_bytes, loss = saved_bytes_16bit(policy, attention, ids, mask if padded else None)
    assert torch.isfinite(loss)
    setup = TrainingSetup(precision=policy, batch_size=3, seq_len=16, attention=attention, padding_mask=padded)
    assert act_bytes == estimate(SHAPE, setup).activations


@pytest.mark.parametrize("policy", ["bf16-autocast", "bf16-pure"])
def test_16bit_one_sequence_matches_calculator(policy):
    ids = torch.randint(4, SHAPE.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    act_bytes, _ = saved_bytes_16bit(policy, "sdpa", ids)
    assert act_bytes == estimate(SHAPE, TrainingSetup(precision=policy, batch_size=1, seq_len=16)).activations


def test_16bit_costs_more_than_half_of_fp32():
    # what the old lower bound missed: 16-bit activations are not half of fp32's
    fp32, amp, pure = (estimate(SHAPE, TrainingSetup(precision=p, batch_size=3, seq_len=16)).activations
                       for p in ("fp32", "bf16-autocast", "bf16-pure"))
    assert fp32 / 2 < pure < amp and amp > fp32  # autocast keeps fp32 norms and 16-bit weight copies


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_sequence_matches_calculator(attention):
    # with one sequence the loss's shifted labels keep their padded s + 1 storage (8 bytes more)
    model = build_model(SHAPE, attn_implementation=attention)
    ids = torch.randint(4, SHAPE.vocab_size, (1, 16))
    act_bytes, _ = measure.saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    setup = TrainingSetup(precision="fp32", batch_size=1, seq_len=16, attention=attention)
    assert act_bytes == estimate(SHAPE, setup).activations


# The checkpointed figure is a peak over phases; live tensor bytes through a whole step measure it.
STEP_SHAPE = ModelShape(vocab_size=200, hidden_size=64, intermediate_size=160, num_layers=4, num_heads=4,
                        num_kv_heads=2)
WIDE_VOCAB = 32 * STEP_SHAPE.hidden_size  # Llama-3 8B's vocabulary is 31x its hidden size


def live_step(shape, every, policy="fp32", attention="sdpa", batch=2, seq=16, padded=False):
    """(measured StepPeak, the calculator's ActivationTerms) for one training step."""
    from gpulab.checkpointing import checkpoint_in_segments, step_live_bytes

    weights, amp = POLICIES.get(policy, (torch.float32, None))
    model = build_model(shape, attn_implementation=attention, dtype=weights)
    if every:
        checkpoint_in_segments(model, every)
    if amp is not None:  # autocast around the forward only, as PyTorch recommends: backward runs outside it
        model.forward = torch.autocast("cpu", dtype=amp)(model.forward)
    ids = torch.randint(4, shape.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    if padded:
        mask = torch.ones_like(ids)
        mask[0, seq // 2:] = 0
        inputs["attention_mask"] = mask
    setup = TrainingSetup(precision=policy, batch_size=batch, seq_len=seq, attention=attention,
                          padding_mask=padded, checkpointing=bool(every), checkpoint_every=every or 1)
    return step_live_bytes(model, inputs), activation_terms(shape, setup), estimate(shape, setup)


def measured_phases(step):
    layers = max(v for phase, v in step.phases.items() if phase.startswith("backward of"))
    return step.phases["start of backward"], layers


@pytest.mark.parametrize("every, vocab, phase", [
    (1, STEP_SHAPE.vocab_size, "backward of the layers"),  # per layer: a recomputed layer holds the peak
    (2, STEP_SHAPE.vocab_size, "backward of the layers"),  # k = sqrt(4)
    (4, STEP_SHAPE.vocab_size, "backward of the layers"),  # one segment: the recomputation dominates
    (1, WIDE_VOCAB, "start of backward"),  # a Llama-like vocabulary: the head and the loss's gradients dominate
    (2, WIDE_VOCAB, "start of backward"),
    (4, WIDE_VOCAB, "start of backward"),
])
def test_checkpointed_peak_matches_live_bytes(every, vocab, phase):
    shape = dataclasses.replace(STEP_SHAPE, vocab_size=vocab)
    step, terms, est = live_step(shape, every)
    start, layers = measured_phases(step)
    assert (start, layers) == (terms.start_of_backward, terms.backward_of_layers)  # each phase, to the byte
    assert step.peak.bytes == est.activations == terms.peak and terms.phase == phase
    # the naive sum (forward's keeps + one segment) is off by the head or the gradients, either way
    assert terms.saved != terms.peak


@pytest.mark.parametrize("every", [0, 1, 2])
@pytest.mark.parametrize("policy, attention, batch, padded", [
    ("fp32", "sdpa", 2, True), ("fp32", "eager", 2, False), ("fp32", "sdpa", 1, False),
    ("bf16-pure", "sdpa", 2, False), ("bf16-pure", "eager", 2, True),
])
def test_step_phases_match_live_bytes(every, policy, attention, batch, padded):
    # exact in fp32 and in 16-bit models, with and without checkpointing (without it the calculator's
    # figure stays what forward saves; the start of backward adds the loss's gradients to it)
    step, terms, est = live_step(STEP_SHAPE, every, policy, attention, batch, padded=padded)
    assert measured_phases(step) == (terms.start_of_backward, terms.backward_of_layers)
    assert step.peak.bytes == terms.peak
    assert est.activations == (terms.peak if every else terms.saved)


@pytest.mark.parametrize("every", [1, 2])
def test_autocast_peak_is_a_close_lower_bound(every):
    # under autocast the weight cache lives through forward, which then holds the peak (as the loss is
    # computed); a layer's working set in forward and the gradients' 16-bit casts in backward are not
    # counted, so the prediction is a lower bound, within 10%
    step, terms, est = live_step(STEP_SHAPE, every, "bf16-autocast")
    start, layers = measured_phases(step)
    assert start == terms.start_of_backward
    assert terms.backward_of_layers <= layers <= 1.10 * terms.backward_of_layers
    assert est.activations <= step.peak.bytes <= 1.10 * est.activations
    assert terms.phase == "end of forward" and step.peak.phase == "forward"


def test_paged_state_bytes_counts_only_paged_tensors():
    # bitsandbytes marks a tensor it placed in CUDA managed memory with `is_paged`; the allocator's
    # peak does not see those, so a paged run adds them back
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 8)).sum().backward()
    opt.step()
    assert measure.paged_state_bytes(opt) == 0
    moment = opt.state[model.weight]["exp_avg"]
    moment.is_paged = True
    assert measure.paged_state_bytes(opt) == moment.numel() * moment.element_size()
