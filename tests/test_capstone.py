"""The capstone's pieces: the chat-formatted data, the opt-in checkpoint loader, the chunked-loss Trainer."""

import dataclasses

import pytest
import torch
from transformers import DataCollatorForSeq2Seq, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from gpulab.capstone import (CHECKPOINT_ENV, ChunkedLossTrainer, StepProbe, TokenCounter, chat_tokenizer,
                             checkpoint_path, checkpoint_shape, encode_chat, load_base, predicted_bytes,
                             release_bitsandbytes_state, rung_setups, trainer_8bit_embedding_bytes)
from gpulab.data import make_examples
from gpulab.memory import estimate
from gpulab.presets import PRESETS

SHAPE = dataclasses.replace(PRESETS["tiny"].shape, num_layers=2)


def test_load_base_reads_a_checkpoint_the_test_saved_itself(tmp_path):
    """The lab's opt-in path: a LlamaForCausalLM saved as safetensors, loaded with trust_remote_code=False."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    loaded = load_base(str(tmp_path), SHAPE, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    # the shape the calculator plans for is the checkpoint's own, read from its config.json
    shape = checkpoint_shape(str(tmp_path))
    assert (shape.vocab_size, shape.hidden_size, shape.intermediate_size, shape.num_layers, shape.num_heads,
            shape.num_kv_heads) == (128, 64, 128, 2, 4, 2)
    assert shape.num_params == sum(p.numel() for p in model.parameters())


def test_load_base_without_a_checkpoint_is_random_init_of_the_shape():
    model = load_base(None, SHAPE, seed=3)
    assert sum(p.numel() for p in model.parameters()) == SHAPE.num_params
    again = load_base(None, SHAPE, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    with pytest.raises(ValueError):
        load_base(None, SHAPE, quantization_config=object())


def test_checkpoint_path_reads_the_environment(monkeypatch):
    monkeypatch.delenv(CHECKPOINT_ENV, raising=False)
    assert checkpoint_path() is None
    monkeypatch.setenv(CHECKPOINT_ENV, "")
    assert checkpoint_path() is None
    monkeypatch.setenv(CHECKPOINT_ENV, "some/dir")
    assert checkpoint_path() == "some/dir"
    assert checkpoint_path("") is None


def test_chat_template_masks_the_prompt_and_keeps_the_response():
    examples = make_examples(50, seed=0)
    tok = chat_tokenizer(examples, vocab_size=300)
    features = encode_chat(examples[:5], tok, max_len=64)
    for ex, f in zip(examples, features):
        assert f["input_ids"][0] == tok.bos_token_id and f["input_ids"][-1] == tok.eos_token_id
        learned = [t for t, label in zip(f["input_ids"], f["labels"]) if label != -100]
        assert tok.decode(learned, skip_special_tokens=True) == ex.response
        prompt = tok.decode([t for t, label in zip(f["input_ids"], f["labels"]) if label == -100],
                            skip_special_tokens=True)
        assert prompt == ex.prompt


def _trainer(kind, model, features, collator, accumulation, tmp_path, **extra):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, optim="sgd", learning_rate=1.0,
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                             per_device_train_batch_size=8 // accumulation, gradient_accumulation_steps=accumulation,
                             save_strategy="no", report_to=[], seed=0, data_seed=0, use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False)
    return kind(model=model, args=args, train_dataset=features, data_collator=collator, **extra)


def test_chunked_loss_trainer_matches_trainer_with_accumulation(tmp_path):
    examples = make_examples(16, seed=0)
    tok = chat_tokenizer(examples, vocab_size=300)
    shape = dataclasses.replace(SHAPE, vocab_size=len(tok))
    features = encode_chat(examples, tok, max_len=64)
    collator = DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=-100)
    deltas = []
    for kind, accumulation, extra in ((Trainer, 1, {}), (ChunkedLossTrainer, 4, {"chunk_tokens": 16})):
        model = load_base(None, shape, seed=0)
        before = [p.detach().clone() for p in model.parameters()]
        counter = TokenCounter(collator)
        probe = StepProbe(tracked=1)
        trainer = _trainer(kind, model, features, counter, accumulation, tmp_path, callbacks=[probe], **extra)
        trainer.train()
        deltas.append([b - p.detach() for b, p in zip(before, model.parameters())])
        # the data loader may collate one micro-batch ahead; each has the step's micro-batch rows
        assert len(counter.shapes) >= accumulation and {rows for rows, _ in counter.shapes} == {8 // accumulation}
        assert probe.peak_bytes() > 0
    scale = max(d.abs().max() for d in deltas[0])
    gap = max((a - b).abs().max() for a, b in zip(*deltas))
    assert gap / scale < 1e-4


def test_release_bitsandbytes_state_drops_the_old_models():
    # the Trainer registers each run's embeddings with bitsandbytes' process-wide manager; without a
    # release the manager keeps every earlier run's embedding alive
    import bitsandbytes as bnb

    manager = bnb.optim.GlobalOptimManager.get_instance()
    embedding = torch.nn.Embedding(16, 4)
    manager.register_module_override(embedding, "weight", {"optim_bits": 32})
    bnb.functional.GlobalPageManager.get_instance().paged_tensors.append(torch.zeros(1))
    release_bitsandbytes_state()
    assert manager.module_weight_config_triple == [] and manager.pid2config == {}
    assert bnb.functional.GlobalPageManager.get_instance().paged_tensors == []


def _adamw8bit_state_bytes(shape, keep_32_bits):
    """bitsandbytes' AdamW8bit state for one embedding table after a step, with or without the override
    that `transformers.Trainer` registers for every `nn.Embedding`."""
    import bitsandbytes as bnb

    release_bitsandbytes_state()
    embedding = torch.nn.Embedding(shape.vocab_size, shape.hidden_size)
    if keep_32_bits:
        bnb.optim.GlobalOptimManager.get_instance().register_module_override(embedding, "weight",
                                                                             {"optim_bits": 32})
    optimizer = bnb.optim.AdamW8bit(embedding.parameters(), lr=1e-3)
    embedding.weight.sum().backward()
    optimizer.step()
    release_bitsandbytes_state()
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


def test_trainer_8bit_embedding_bytes_is_what_the_override_adds_in_bitsandbytes():
    # 8-bit state also holds two 256-entry fp32 quantization maps per tensor (2 KiB), which the
    # calculator leaves out: the override adds exactly the function's bytes less those maps
    added = _adamw8bit_state_bytes(SHAPE, True) - _adamw8bit_state_bytes(SHAPE, False)
    assert added == trainer_8bit_embedding_bytes(SHAPE) - 2 * 256 * 4


def test_predicted_bytes_adds_the_embedding_states_to_full_fine_tuning_with_8bit_adamw_only():
    rungs = rung_setups(1, 64, lora_rank=8)
    extra = {name: predicted_bytes(SHAPE, setup) - estimate(SHAPE, setup).peak
             for name, setup in rungs.items() if not setup.quantization}
    assert extra == {"fp32": 0, "bf16 mixed": 0, "+ checkpointing": 0,
                     "+ 8-bit AdamW": trainer_8bit_embedding_bytes(SHAPE), "LoRA": 0}
