"""Measured bytes match the calculator exactly for a real transformers Llama in fp32."""

import pytest
import torch

from gpulab.memory import ModelShape, TrainingSetup, estimate
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


def test_cuda_peak_is_none_without_cuda():
    if torch.cuda.is_available():
        assert measure.cuda_peak_bytes() is not None
    else:
        assert measure.cuda_peak_bytes() is None


def test_autocast_weight_copies_are_counted():
    # autocast keeps a 16-bit copy of every linear weight for backward; fp32 has none
    fp32 = estimate(SHAPE, TrainingSetup(precision="fp32", seq_len=16)).activations
    amp = estimate(SHAPE, TrainingSetup(precision="bf16-autocast", seq_len=16)).activations
    pure = estimate(SHAPE, TrainingSetup(precision="bf16-pure", seq_len=16)).activations
    copies = 2 * (SHAPE.num_layers * SHAPE.layer_linear_params() + SHAPE.vocab_size * SHAPE.hidden_size)
    assert amp - pure == copies and pure < fp32


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_sequence_matches_calculator(attention):
    # with one sequence the loss's shifted labels keep their padded s + 1 storage (8 bytes more)
    model = build_model(SHAPE, attn_implementation=attention)
    ids = torch.randint(4, SHAPE.vocab_size, (1, 16))
    act_bytes, _ = measure.saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    setup = TrainingSetup(precision="fp32", batch_size=1, seq_len=16, attention=attention)
    assert act_bytes == estimate(SHAPE, setup).activations
