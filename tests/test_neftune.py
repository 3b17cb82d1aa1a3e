"""gpulab.neftune: the noise has NEFTune's scale and norm, matches transformers' hook draw for draw, and is
off in eval mode."""

import math

import pytest
import torch
from torch import nn
from transformers.integrations.neftune import neftune_post_forward_hook

from gpulab.memory import ModelShape
from gpulab.models import build_model
from gpulab.neftune import add_neftune, expected_token_noise_norm, neftune_noise, noise_half_width

SHAPE = ModelShape(vocab_size=200, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2)


def test_half_width_and_expected_norm_follow_the_formula():
    assert math.isclose(float(noise_half_width(5.0, 40, 256)), 5 / math.sqrt(40 * 256), rel_tol=1e-6)
    assert math.isclose(expected_token_noise_norm(5.0, 40), 5 / math.sqrt(120))
    # a sequence's noise: L tokens of alpha^2 / (3L) each, alpha / sqrt(3) whatever L
    assert math.isclose(math.sqrt(40) * expected_token_noise_norm(5.0, 40), 5 / math.sqrt(3))


@pytest.mark.parametrize("seq_len", [1, 3, 37, 40, 128, 1000])
def test_same_draws_as_transformers_hook(seq_len):
    emb = nn.Embedding(50, 32).train()
    emb.neftune_noise_alpha = 5.0  # what transformers' hook reads
    ids = torch.randint(0, 50, (4, seq_len), generator=torch.Generator().manual_seed(seq_len))
    clean = emb(ids).detach()
    torch.manual_seed(7)
    theirs = neftune_post_forward_hook(emb, (ids,), clean)
    torch.manual_seed(7)
    ours = clean + neftune_noise(clean, 5.0)
    assert torch.equal(ours, theirs)


def test_noise_is_bounded_and_has_the_expected_norm():
    torch.manual_seed(0)
    embeds = torch.zeros(16, 64, 256)
    noise = neftune_noise(embeds, 10.0)
    a = float(noise_half_width(10.0, 64, 256))
    assert noise.abs().max() <= a
    rms = noise.pow(2).sum(-1).mean().sqrt().item()
    assert abs(rms / expected_token_noise_norm(10.0, 64) - 1) < 0.01


def test_masked_noise_uses_each_sequence_length_and_skips_padding():
    torch.manual_seed(0)
    embeds = torch.zeros(2, 100, 512)
    mask = torch.zeros(2, 100, dtype=torch.long)
    mask[0, :25], mask[1, :100] = 1, 1
    noise = neftune_noise(embeds, 5.0, attention_mask=mask)
    assert torch.count_nonzero(noise[0, 25:]) == 0
    # the paper's training script: U(-1, 1), masked, times alpha / sqrt(real tokens x d) per sequence
    torch.manual_seed(0)
    unit = torch.zeros(2, 100, 512).uniform_(-1, 1)
    per_row = torch.tensor([5 / math.sqrt(25 * 512), 5 / math.sqrt(100 * 512)]).view(2, 1, 1)
    torch.testing.assert_close(noise, unit * mask[..., None] * per_row, rtol=1e-6, atol=0)
    for row, length in ((0, 25), (1, 100)):
        rms = noise[row, :length].pow(2).sum(-1).mean().sqrt().item()
        assert abs(rms / expected_token_noise_norm(5.0, length) - 1) < 0.05


def test_hook_noises_training_only_and_removes_cleanly():
    model = build_model(SHAPE)
    ids = torch.randint(4, SHAPE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    emb = model.get_input_embeddings()
    clean = emb(ids).detach()
    handle = add_neftune(model, 5.0)
    torch.manual_seed(1)
    noised = emb(ids)
    torch.manual_seed(1)
    assert torch.equal(noised, clean + neftune_noise(clean, 5.0)), "the hook adds NEFTune's noise at alpha 5"
    assert not torch.equal(noised, clean)
    model.eval()
    assert torch.equal(emb(ids), clean)
    model.train()
    handle.remove()
    assert torch.equal(emb(ids), clean)


def test_add_neftune_rejects_bad_arguments():
    with pytest.raises(ValueError):
        add_neftune(nn.Embedding(4, 4), 0.0)
    with pytest.raises(TypeError):
        add_neftune(nn.Linear(4, 4), 5.0)
