"""gpulab.lora: the from-scratch LoRA matches peft and the memory calculator, and merges exactly."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from gpulab.lora import LoRALinear, add_lora, merge_lora, trainable_params
from gpulab.memory import ModelShape, TrainingSetup, estimate
from gpulab.models import build_model

SHAPE = ModelShape(vocab_size=200, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2)
IDS = torch.randint(4, SHAPE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def test_fresh_adapter_is_the_identity_and_only_a_b_train():
    torch.manual_seed(0)
    base = nn.Linear(8, 5)
    x = torch.randn(3, 8)
    expected = base(x)
    lora = LoRALinear(base, rank=2, alpha=4)
    assert torch.equal(lora(x), expected)
    assert lora.scaling == 2.0 and lora.lora_A.shape == (2, 8) and lora.lora_B.shape == (5, 2)
    assert [n for n, p in lora.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    with pytest.raises(ValueError):
        LoRALinear(nn.Linear(8, 5), rank=0, alpha=1)


def test_merge_folds_the_update_into_the_weight():
    torch.manual_seed(0)
    lora = LoRALinear(nn.Linear(8, 5), rank=2, alpha=4)
    nn.init.normal_(lora.lora_B)
    x = torch.randn(3, 8)
    before = lora(x)
    assert torch.linalg.matrix_rank(lora.delta_weight().detach()) == 2  # B A at rank r = 2
    merged = lora.merged()
    assert isinstance(merged, nn.Linear)
    torch.testing.assert_close(merged(x), before)


@pytest.mark.parametrize("rank, targets", [(4, ("q_proj", "v_proj")), (2, ("gate_proj", "down_proj", "o_proj"))])
def test_counts_match_peft_and_the_calculator(rank, targets):
    ours = build_model(SHAPE)
    wrapped = add_lora(ours, rank, 2 * rank, targets)
    theirs = get_peft_model(build_model(SHAPE), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                           lora_dropout=0.0))
    predicted = estimate(SHAPE, TrainingSetup(precision="fp32", lora_rank=rank, lora_targets=targets))
    assert len(wrapped) == SHAPE.num_layers * len(targets)
    assert trainable_params(ours) == trainable_params(theirs) == predicted.trainable_params


def test_same_weights_same_outputs_as_peft_and_merge_keeps_them():
    ours = build_model(SHAPE)
    add_lora(ours, 4, 8, ("q_proj", "v_proj"))
    theirs = get_peft_model(build_model(SHAPE), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0))
    for name, m in ours.named_modules():
        if isinstance(m, LoRALinear):
            nn.init.normal_(m.lora_B, std=0.1)
            target = theirs.base_model.model.get_submodule(name)
            with torch.no_grad():
                target.lora_A["default"].weight.copy_(m.lora_A)
                target.lora_B["default"].weight.copy_(m.lora_B)
    ours.eval(), theirs.eval()
    with torch.no_grad():
        out = ours(input_ids=IDS).logits
        torch.testing.assert_close(theirs(input_ids=IDS).logits, out)
        assert merge_lora(ours) == 4
        assert not any(isinstance(m, LoRALinear) for m in ours.modules())
        torch.testing.assert_close(ours(input_ids=IDS).logits, out, atol=1e-5, rtol=1e-5)


def test_add_lora_rejects_unknown_targets():
    with pytest.raises(ValueError):
        add_lora(build_model(SHAPE), 2, 4, ("qkv",))
