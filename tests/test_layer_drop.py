"""gpulab.layer_drop: DeepSpeed's schedule, the paper's depth rule, and a gate that is the identity when it
skips, scales by 1/p when it runs, and changes nothing in eval."""

import copy
import math

import numpy as np
import pytest
import torch

from gpulab.checkpointing import decoder_layers
from gpulab.layer_drop import (LayerDropGate, add_layer_drop, expected_fraction, keep_probabilities, pld_theta,
                               remove_layer_drop)
from gpulab.memory import ModelShape
from gpulab.models import build_model

SHAPE = ModelShape(vocab_size=200, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4, num_kv_heads=2)
IDS = torch.randint(4, SHAPE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
BATCH = {"input_ids": IDS, "labels": IDS}


def deepspeed_theta(global_step, gamma, p):
    """deepspeed/runtime/progressive_layer_drop.py, `ProgressiveLayerDrop.update_state._prob`."""
    return (1. - p) * np.exp(-gamma * global_step) + p


@pytest.mark.parametrize("theta_bar", [0.1, 0.5, 0.9, 1.0])
def test_theta_is_deepspeeds_schedule(theta_bar):
    for step in [0, 1, 10, 999, 5000]:
        assert math.isclose(pld_theta(step, theta_bar, 0.001), deepspeed_theta(step, 0.001, theta_bar), rel_tol=1e-15)
    assert pld_theta(0, theta_bar, 0.001) == 1.0
    with pytest.raises(ValueError):
        pld_theta(-1, theta_bar, 0.001)
    with pytest.raises(ValueError):
        pld_theta(0, 0.0, 0.001)


def test_keep_probabilities_fall_linearly_with_depth():
    probs = keep_probabilities(0.5, 4)
    assert probs == pytest.approx([0.875, 0.75, 0.625, 0.5])
    assert keep_probabilities(1.0, 7) == [1.0] * 7
    for layers in [1, 4, 12, 24]:
        assert expected_fraction(0.5, layers) == pytest.approx(1 - (layers + 1) / (2 * layers) * 0.5)
    with pytest.raises(ValueError):
        keep_probabilities(0.5, 0)


def gated(seed=0):
    model = build_model(SHAPE)
    plain = copy.deepcopy(model)
    schedule = add_layer_drop(model, theta_bar=0.5, gamma=0.01, seed=seed)
    return model, plain, schedule


def test_eval_runs_every_layer_unscaled_and_matches_the_plain_model():
    model, plain, schedule = gated()
    schedule.set_theta(0.5)
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(model(**BATCH).logits, plain(**BATCH).logits)
    assert schedule.call_counts() == [0] * SHAPE.num_layers  # eval forwards are not training draws


def test_a_skipped_layer_is_the_identity_and_gets_no_gradient():
    model, plain, schedule = gated()
    gates = schedule.gates
    gates[1].force = False
    loss = model(**BATCH, use_cache=False).loss
    loss.backward()
    assert all(p.grad is None for p in gates[1].parameters())
    assert all(p.grad is not None for p in gates[0].parameters())
    shallow = copy.deepcopy(plain)
    shallow.model.layers = torch.nn.ModuleList([plain.model.layers[0], plain.model.layers[2]])
    with torch.no_grad():
        assert torch.equal(model(**BATCH, use_cache=False).logits, shallow(**BATCH, use_cache=False).logits)
    assert schedule.last_ran() == [True, False, True]


def test_a_layer_that_runs_scales_attention_and_mlp_by_one_over_p():
    model, plain, schedule = gated()
    p = 0.8
    for gate in schedule.gates:
        gate.keep_prob, gate.force = p, True
    # the same as dividing the last linear map of each branch by p (no biases in Llama's projections)
    scaled = copy.deepcopy(plain)
    with torch.no_grad():
        for layer in scaled.model.layers:
            layer.self_attn.o_proj.weight /= p
            layer.mlp.down_proj.weight /= p
        torch.testing.assert_close(model(**BATCH).logits, scaled(**BATCH).logits, rtol=1e-5, atol=1e-5)
        # and after the forward the hooks are inert again: eval equals the plain model exactly
        model.eval()
        plain.eval()
        assert torch.equal(model(**BATCH).logits, plain(**BATCH).logits)


class Attention(torch.nn.Module):
    def forward(self, x):
        return x, None  # (output, attention weights), like LlamaAttention


class Block(torch.nn.Module):
    """A pre-LN-shaped residual block, small enough to draw thousands of gates in milliseconds."""

    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attention(), torch.nn.Identity()

    def forward(self, x):
        h = x + self.self_attn(x)[0]
        return h + self.mlp(h)


def test_draws_follow_the_keep_probabilities():
    generator = torch.Generator().manual_seed(0)
    gates = [LayerDropGate(Block(), generator) for _ in range(4)]
    probs = keep_probabilities(0.4, len(gates))
    x, n = torch.ones(1), 2000
    for gate, p in zip(gates, probs):
        gate.keep_prob = p
        outs = sorted({float(gate(x)) for _ in range(n)})
        # skipped: x = 1; run: h = x + x/p (attention scaled), then h + h/p (MLP scaled) = (1 + 1/p)^2
        assert outs[0] == 1.0 and len(outs) == 2 and math.isclose(outs[1], (1 + 1 / p) ** 2, rel_tol=1e-6)
        assert gate.calls == n and abs(gate.runs - n * p) <= 4 * math.sqrt(n * p * (1 - p))


def test_same_seed_same_layers():
    draws = []
    for seed in (0, 0, 1):
        model, _, schedule = gated(seed)
        schedule.set_theta(0.5)
        seen = []
        with torch.no_grad():
            for _ in range(20):
                model(**BATCH)
                seen.append(tuple(schedule.last_ran()))
        draws.append(seen)
    assert draws[0] == draws[1]
    assert draws[0] != draws[2], "another seed, other layers"


def test_update_follows_the_schedule_and_remove_restores_the_model():
    model, plain, schedule = gated()
    assert schedule.update(100) == pytest.approx(pld_theta(100, 0.5, 0.01))
    assert schedule.keep_probs() == pytest.approx(keep_probabilities(schedule.theta, SHAPE.num_layers))
    with pytest.raises(ValueError):
        add_layer_drop(model)
    remove_layer_drop(model)
    assert not any(isinstance(layer, LayerDropGate) for layer in decoder_layers(model))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    with torch.no_grad():  # train mode, no gates, no hooks left behind
        assert torch.equal(model(**BATCH).logits, plain(**BATCH).logits)
    with pytest.raises(ValueError):
        remove_layer_drop(model)
