"""The one training loop the labs share, so each lab shows only what it changes."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tqdm import tqdm

PROGRESS_FORMAT = "{desc}: {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"


def progress(iterable, total: int, desc: str):
    """A text progress bar that prints once at the start and once at the end (stable for nbval)."""
    return tqdm(iterable, total=total, desc=desc, mininterval=float("inf"), bar_format=PROGRESS_FORMAT)


def train(model: torch.nn.Module, batches: Iterator[dict[str, torch.Tensor]], steps: int,
          optimizer: torch.optim.Optimizer, amp_dtype: torch.dtype | None = None,
          scaler: torch.amp.GradScaler | None = None, desc: str = "train") -> list[float]:
    """Run `steps` optimizer steps and return the loss of each.

    `amp_dtype` runs the forward under `torch.autocast` on the model's device type; `scaler`
    (a GradScaler, for fp16) scales the loss before backward and unscales before the step.
    """
    device_type = next(model.parameters()).device.type
    losses = []
    model.train()
    for _, batch in progress(zip(range(steps), batches), total=steps, desc=desc):
        with torch.autocast(device_type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = model(**batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@torch.no_grad()
def eval_loss(model: torch.nn.Module, data: dict[str, torch.Tensor], batch_size: int = 32) -> float:
    """Mean loss over response tokens of a whole split (weighted by token count)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    n = data["input_ids"].shape[0]
    for start in range(0, n, batch_size):
        batch = {k: v[start:start + batch_size].to(device) for k, v in data.items()}
        tokens = int((batch["labels"][:, 1:] != -100).sum())
        total += model(**batch).loss.float().item() * tokens
        count += tokens
    model.train(was_training)
    return total / count
