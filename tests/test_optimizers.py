"""The from-scratch optimizers in gpulab.optimizers agree with the libraries and with the calculator."""

import gc
import weakref

import pytest
import torch

from gpulab.memory import ModelShape, TrainingSetup, estimate
from gpulab.memory import measure
from gpulab.models import build_model
from gpulab.optimizers import FusedSGD, Lion, watch_gradients

SHAPE = ModelShape(vocab_size=200, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2)


def batches(n):
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(4, SHAPE.vocab_size, (2, 12), generator=gen)
        yield {"input_ids": ids, "labels": ids}


def train(make, steps=3):
    model = build_model(SHAPE)
    optimizer = make(model.parameters())
    for batch in batches(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def max_gap(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_lion_matches_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    ours, opt = train(lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1))
    theirs, _ = train(lambda ps: bnb.optim.Lion(ps, lr=1e-3, weight_decay=0.1))
    assert max_gap(ours, theirs) <= 1e-6
    predicted = estimate(SHAPE, TrainingSetup(precision="fp32", optimizer="lion")).optimizer
    assert measure.optimizer_state_bytes(opt) == predicted


def test_lion_moves_every_entry_by_lr():
    w = torch.nn.Parameter(torch.zeros(100))
    opt = Lion([w], lr=0.01)
    w.grad = torch.randn(100)
    opt.step()
    assert torch.allclose(w.detach().abs(), torch.full((100,), 0.01))


def test_fused_sgd_matches_sgd_and_keeps_no_gradient():
    sgd, _ = train(lambda ps: torch.optim.SGD(ps, lr=0.1))
    fused, opt = train(lambda ps: FusedSGD(ps, lr=0.1))
    assert max_gap(sgd, fused) == 0
    assert measure.gradient_bytes(fused) == 0 and measure.optimizer_state_bytes(opt) == 0
    opt.remove()  # after it the model keeps its gradients again
    fused(**next(iter(batches(1)))).loss.backward()
    assert measure.gradient_bytes(fused) == measure.parameter_bytes(fused)


def test_watch_gradients_sees_one_tensor_at_a_time_under_fused_sgd():
    predicted = estimate(SHAPE, TrainingSetup(precision="fp32", optimizer="lomo")).gradients
    cases = ((lambda ps: FusedSGD(ps, lr=0.1), predicted), (lambda ps: torch.optim.SGD(ps, lr=0.1), None))
    for make, expected in cases:
        model = build_model(SHAPE)
        with watch_gradients(model) as peak:
            optimizer = make(model.parameters())  # kept: a FusedSGD's hooks go with it
            model(**next(iter(batches(1)))).loss.backward()
        del optimizer
        assert peak.bytes == (expected if expected is not None else measure.parameter_bytes(model))


def test_fused_sgd_keeps_no_model_alive():
    # its hooks live on the parameters; they must not keep the model (or the optimizer) alive once both
    # are dropped, and an optimizer dropped alone takes its hooks with it
    for remove in (False, True):
        model = build_model(SHAPE)
        weight = weakref.ref(model.lm_head.weight)
        optimizer = FusedSGD(model.parameters(), lr=0.1)
        model(**next(iter(batches(1)))).loss.backward()
        if remove:
            optimizer.remove()
        del model, optimizer
        gc.collect()
        assert weight() is None
    model = build_model(SHAPE)
    optimizer = FusedSGD(model.parameters(), lr=0.1)
    del optimizer
    model(**next(iter(batches(1)))).loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # no hook left: plain backward


def test_bad_arguments():
    with pytest.raises(ValueError):
        Lion([torch.nn.Parameter(torch.zeros(1))], lr=0)
    with pytest.raises(ValueError):
        FusedSGD([torch.nn.Parameter(torch.zeros(1))], lr=-1)
