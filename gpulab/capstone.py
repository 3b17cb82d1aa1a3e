"""The capstone's pieces: a chat-formatted instruction set, the loader for an opt-in checkpoint, the
memory and speed probes that ride along `transformers.Trainer`, and a Trainer with chunked loss.

The training itself is `transformers.Trainer` with `TrainingArguments` and a peft `LoraConfig`, as a
practitioner writes it; these helpers only measure it (`StepProbe`, `TokenCounter`), feed it
(`chat_tokenizer`, `encode_chat`) and swap its loss for `gpulab.losses.chunked_lm_loss`
(`ChunkedLossTrainer`), which is what Liger's or Cut Cross-Entropy's fused losses do with kernels.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedTokenizerBase, Trainer, TrainerCallback

from gpulab.data import IGNORE_INDEX, Example, train_tokenizer
from gpulab.kbit_upcast import kbit_upcast_bytes
from gpulab.live_bytes import LiveBytes
from gpulab.losses import chunked_lm_loss
from gpulab.memory.calculator import TrainingSetup, estimate
from gpulab.memory.policy import get_optimizer, get_precision, optimizer_state_bytes
from gpulab.memory.shapes import ModelShape
from gpulab.models import build_model, load_pretrained
from gpulab.timing import synchronize

CHECKPOINT_ENV = "GPULAB_CHECKPOINT"

# The course's prompt format (`gpulab.data.Example.prompt`) as a Jinja chat template, the form in which
# a tokenizer carries its format: `apply_chat_template` renders a conversation with it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "### Instruction:\n{{ m['content'] }}\n### Response:\n"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def rung_setups(batch: int, seq: int, lora_rank: int = 16, padded: bool = False,
                chunk_tokens: int = 1024) -> dict[str, TrainingSetup]:
    """The calculator's setup for each rung of the ladder that changes the bytes of one micro-batch.

    Full fine-tuning rungs keep fp32 weights (`Trainer(bf16=True)` is autocast: "bf16-autocast");
    LoRA and QLoRA freeze a bf16 base; "+ chunked CE" is QLoRA with the loss in chunks of
    `chunk_tokens`. The optimizer "adamw" is a fused AdamW, the Trainer's default (`adamw_torch_fused`).
    """
    micro = TrainingSetup(batch_size=batch, seq_len=seq, padding_mask=padded)
    bf16 = replace(micro, precision="bf16-autocast")
    lora = replace(micro, precision="bf16", checkpointing=True, optimizer="adamw-8bit", lora_rank=lora_rank)
    qlora = replace(lora, quantization="nf4", double_quant=True)
    return {"fp32": replace(micro, precision="fp32"), "bf16 mixed": bf16,
            "+ checkpointing": replace(bf16, checkpointing=True),
            "+ 8-bit AdamW": replace(bf16, checkpointing=True, optimizer="adamw-8bit"),
            "LoRA": lora, "QLoRA": qlora, "+ chunked CE": replace(qlora, loss_chunk_tokens=chunk_tokens)}


def trainer_8bit_embedding_bytes(shape: ModelShape) -> int:
    """What `transformers.Trainer` adds to the calculator's 8-bit AdamW states in full fine-tuning.

    With a bitsandbytes 8-bit optimizer the Trainer registers every `nn.Embedding` with
    `GlobalOptimManager` to keep its states in 32 bits (`{"optim_bits": 32}`): two fp32 moments, where
    the calculator counts its 8-bit state (`optimizer_state_bytes`). One table: an untied LM head is an
    `nn.Linear` and keeps 8-bit states."""
    table = (shape.vocab_size, shape.hidden_size)
    eight_bit = optimizer_state_bytes(get_optimizer("adamw-8bit"), get_precision("fp32"), [table], 0.0)
    return 2 * 4 * table[0] * table[1] - int(eight_bit)


def predicted_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """The calculator's peak, plus what the libraries add to it.

    - Full fine-tuning with 8-bit AdamW: the Trainer's 32-bit states for the embedding
      (`trainer_8bit_embedding_bytes`).
    - A quantized base: `prepare_model_for_kbit_training`'s fp32 upcast of the embeddings, norms and LM
      head (over a 16-bit base), and, with the loss over all tokens at once, the 16-bit copy of the
      upcast LM head that autocast (`Trainer(bf16=True)`) saves for backward, alive at the start of
      backward where such a step peaks."""
    peak = estimate(shape, setup).peak
    if setup.optimizer == "adamw-8bit" and not setup.lora_rank:
        peak += trainer_8bit_embedding_bytes(shape)
    if setup.quantization:
        peak += kbit_upcast_bytes(shape, 2)
        if not setup.loss_chunk_tokens:
            peak += shape.vocab_size * shape.hidden_size * 2
    return peak


def chat_tokenizer(examples: Sequence[Example], vocab_size: int = 512) -> PreTrainedTokenizerBase:
    """The course's BPE tokenizer trained locally on `examples`, with `CHAT_TEMPLATE` attached."""
    tok = train_tokenizer(list(examples), vocab_size)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def messages(example: Example) -> list[dict[str, str]]:
    return [{"role": "user", "content": example.instruction}, {"role": "assistant", "content": example.response}]


def encode_chat(examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase,
                max_len: int) -> list[dict[str, list[int]]]:
    """One unpadded feature per example: input_ids of the rendered conversation and labels with the
    prompt (everything up to the generation prompt) set to -100, so only the response is learned.
    Conversations longer than `max_len` tokens are cut."""
    features = []
    for ex in examples:
        msgs = messages(ex)
        prompt = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(msgs, tokenize=False)
        assert isinstance(prompt, str) and isinstance(full, str) and full.startswith(prompt)
        n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ids = tokenizer(full, add_special_tokens=False)["input_ids"][:max_len]
        features.append({"input_ids": ids, "labels": [IGNORE_INDEX] * n_prompt + ids[n_prompt:]})
    return features


def checkpoint_path(value: str | None = None) -> str | None:
    """The opt-in checkpoint: `value`, else $GPULAB_CHECKPOINT; None (random init) when unset or empty."""
    path = value if value is not None else os.environ.get(CHECKPOINT_ENV, "")
    return path or None


def checkpoint_shape(checkpoint: str) -> ModelShape:
    """The shape of the checkpoint at `checkpoint`, from its config.json (no weights read, no remote code):
    what the calculator plans for when a lab fine-tunes a real checkpoint."""
    return ModelShape.from_config(AutoConfig.from_pretrained(checkpoint, trust_remote_code=False))


def load_base(checkpoint: str | None, shape: ModelShape, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs: Any) -> torch.nn.Module:
    """The model to fine-tune: the checkpoint at `checkpoint` (a local directory of safetensors, loaded
    with `trust_remote_code=False`; `kwargs` such as a `quantization_config` go to `from_pretrained`),
    or, without one, a randomly initialised Llama of `shape`."""
    if checkpoint:
        return load_pretrained(checkpoint, device=device, dtype=dtype, **kwargs)
    if kwargs:
        raise ValueError("from_pretrained options need a checkpoint on disk: save the model first")
    return build_model(shape, device=device, dtype=dtype, seed=seed)


class TokenCounter:
    """Wraps a data collator and records the real (non-padding) tokens of every micro-batch it makes."""

    def __init__(self, collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]):
        self.collator = collator
        self.tokens: list[int] = []
        self.shapes: list[tuple[int, int]] = []  # (rows, columns) of each micro-batch's input_ids

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        self.tokens.append(sum(len(f["input_ids"]) for f in features))
        batch = self.collator(features)
        rows, cols = batch["input_ids"].shape
        self.shapes.append((int(rows), int(cols)))
        return batch


class StepProbe(TrainerCallback):
    """Times every optimizer step and, on a CPU, counts live tensor bytes over the first `tracked` steps.

    On a CPU the peak is what `LiveBytes` sees alive during those steps (optimizer states, gradients,
    activations and temporaries made inside them) plus `static_bytes` (the weights and quantization
    constants, which exist before). Tracked steps run slower and are left out of `step_s`. On CUDA
    nothing is tracked: read `torch.cuda.max_memory_allocated` after training.
    """

    def __init__(self, tracked: int = 2):
        self.tracked = tracked
        self.tracker: LiveBytes | None = None
        self.step_s: list[float] = []  # untracked steps only
        self._t0 = 0.0
        self._step = 0

    def on_step_begin(self, args, state, control, **kwargs):
        if self._step == 0 and self.tracked:
            self.tracker = LiveBytes().__enter__()
        synchronize(args.device)
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(args.device)  # CUDA runs the step's kernels after the Python that queued them returned
        elapsed = time.perf_counter() - self._t0
        self._step += 1
        if self.tracker is not None and self._step == self.tracked:
            self.tracker.__exit__(None, None, None)
        if self._step > self.tracked:
            self.step_s.append(elapsed)

    def peak_bytes(self) -> int:
        return self.tracker.peak().bytes if self.tracker is not None else 0


def release_bitsandbytes_state() -> None:
    """Forget what bitsandbytes' process-wide managers hold from earlier optimizers.

    `transformers.Trainer` with a bitsandbytes 8-bit optimizer registers the embeddings with
    `GlobalOptimManager` (to keep their states in 32 bits), and paged optimizers list their buffers
    with `GlobalPageManager`. Both are singletons that only append: after `del trainer, model` the
    first still references the old model's embedding modules, whose weights stay allocated on the GPU,
    so a second Trainer in the same process starts with them. Call this after each run. (The paged
    buffers are CUDA managed memory, which bitsandbytes never frees; dropping the list only drops
    their Python references.)"""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return
    bnb.optim.GlobalOptimManager.get_instance().initialize()
    bnb.functional.GlobalPageManager.get_instance().initialize()


def lm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the decoder stack, the LM head) of a causal LM, through a peft wrapper if there is one."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    decoder, head = base.model, base.lm_head
    assert isinstance(decoder, torch.nn.Module) and isinstance(head, torch.nn.Module)
    return decoder, head


class ChunkedLossTrainer(Trainer):
    """`Trainer` whose loss runs the LM head and the cross-entropy `chunk_tokens` tokens at a time
    (`gpulab.losses.chunked_lm_loss`), so the (tokens, vocabulary) logits never exist in full."""

    def __init__(self, *args: Any, chunk_tokens: int = 1024, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.chunk_tokens = chunk_tokens

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        decoder, head = lm_parts(model)
        labels = inputs["labels"]
        hidden = decoder(**{k: v for k, v in inputs.items() if k != "labels"}).last_hidden_state
        loss = chunked_lm_loss(hidden, head.weight, labels, chunk_tokens=self.chunk_tokens)
        if num_items_in_batch is not None:  # Trainer's accumulation: a sum over the micro-batches' tokens
            counted = (labels[..., 1:] != IGNORE_INDEX).sum()
            loss = loss * counted / num_items_in_batch
        return (loss, None) if return_outputs else loss
