"""A synthetic instruction-following task and a tokenizer trained on it, locally.

Each example asks for one of a few list operations ("reverse", "sort", "copy", "first"/"last") on a
short list of letters, in a chat-like template. The template and the operations are learnable by a
4-layer model in a few dozen CPU steps, so every lab can show training that visibly works, and
nothing is downloaded. The loss is computed on the response only (prompt tokens are labelled -100).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, as the model configs expect
IGNORE_INDEX = -100
LETTERS = "abcdefghijklmnopqrstuvwxyz"

TASKS: dict[str, Callable[[list[str]], list[str]]] = {
    "reverse": lambda xs: xs[::-1],
    "sort": sorted,
    "copy": lambda xs: xs,
    "first two": lambda xs: xs[:2],
    "last two": lambda xs: xs[-2:],
}


@dataclass(frozen=True)
class Example:
    instruction: str
    response: str

    @property
    def prompt(self) -> str:
        return f"### Instruction:\n{self.instruction}\n### Response:\n"


def make_examples(n: int, seed: int = 0, min_len: int = 3, max_len: int = 8) -> list[Example]:
    """`n` random examples; the same seed always gives the same examples."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = rng.choice(list(TASKS))
        xs = [rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len))]
        out.append(Example(f"{task}: {' '.join(xs)}", " ".join(TASKS[task](xs))))
    return out


def train_tokenizer(examples: list[Example], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the examples in milliseconds; no hub access."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((e.prompt + e.response for e in examples), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def encode(examples: list[Example], tokenizer: PreTrainedTokenizerFast, seq_len: int) -> dict[str, torch.Tensor]:
    """Fixed-length tensors: input_ids and attention_mask (n, seq_len), labels with the prompt and
    padding set to -100 so the loss counts response tokens only. Too-long examples are cut."""
    ids = torch.full((len(examples), seq_len), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    mask = torch.zeros_like(ids)
    for row, ex in enumerate(examples):
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(ex.prompt, add_special_tokens=False)
        answer = tokenizer.encode(ex.response, add_special_tokens=False) + [tokenizer.eos_token_id]
        seq = (prompt + answer)[:seq_len]
        n = len(seq)
        ids[row, :n] = torch.tensor(seq)
        mask[row, :n] = 1
        labels[row, len(prompt):n] = ids[row, len(prompt):n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@dataclass
class Task:
    """Everything a lab needs to train: the tokenizer and encoded train/eval splits."""

    tokenizer: PreTrainedTokenizerFast
    train: dict[str, torch.Tensor]
    eval: dict[str, torch.Tensor]
    eval_examples: list[Example]

    def batches(self, batch_size: int, seed: int = 0, device: torch.device | str = "cpu"):
        """An endless stream of shuffled training batches (dicts of tensors on `device`)."""
        gen = torch.Generator().manual_seed(seed)
        n = self.train["input_ids"].shape[0]
        while True:
            order = torch.randperm(n, generator=gen)
            for start in range(0, n - batch_size + 1, batch_size):
                idx = order[start:start + batch_size]
                yield {k: v[idx].to(device) for k, v in self.train.items()}


def load_task(seq_len: int = 64, n_train: int = 2000, n_eval: int = 200, vocab_size: int = 512,
              seed: int = 0) -> Task:
    """The course's standard task: tokenizer trained on the train split, eval split held out."""
    train_ex = make_examples(n_train, seed=seed)
    eval_ex = make_examples(n_eval, seed=seed + 1)
    tok = train_tokenizer(train_ex, vocab_size)
    return Task(tok, encode(train_ex, tok, seq_len), encode(eval_ex, tok, seq_len), eval_ex)
