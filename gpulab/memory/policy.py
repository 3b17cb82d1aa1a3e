"""Precision policies and optimizers: how many bytes each part of training costs per parameter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    """Where each copy of the model lives, in bytes per element.

    `weight_bytes`/`grad_bytes` are the copies the forward and backward use; `master_bytes` is the
    fp32 copy the optimizer updates (0 when the weights themselves are fp32 or when there is none);
    `state_bytes` is the element size of optimizer moments; `act_bytes` of what matmuls and attention
    produce and save (the residual stream between layers has `weight_bytes`: see `activation_bytes`).
    `weight_copy_bytes`: autocast casts each fp32 weight a matmul uses to 16 bits and keeps that
    copy for backward, so it adds a 16-bit copy of the linear weights to what the forward saves.
    """

    name: str
    weight_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    act_bytes: int
    description: str
    weight_copy_bytes: int = 0


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in [
        Precision("fp32", 4, 4, 0, 4, 4, "everything in fp32"),
        # Mixed precision as in the ZeRO paper and Megatron: 16-bit weights and gradients for the
        # forward/backward, an fp32 master copy and fp32 moments inside the optimizer: (2+2+K) bytes.
        Precision("bf16", 2, 2, 4, 4, 2, "bf16 weights+grads, fp32 master weights and states"),
        Precision("fp16", 2, 2, 4, 4, 2, "fp16 weights+grads, fp32 master weights and states"),
        # torch.autocast keeps the parameters (and so the gradients) in fp32; only the ops run in
        # 16 bits, so the saving is in activations and speed, not in model states.
        Precision("bf16-autocast", 4, 4, 0, 4, 2, "fp32 weights+grads, bf16 activations (autocast)", 2),
        Precision("fp16-autocast", 4, 4, 0, 4, 2, "fp32 weights+grads, fp16 activations (autocast)", 2),
        Precision("bf16-pure", 2, 2, 0, 2, 2, "everything in bf16, no fp32 master copy"),
    ]
}


@dataclass(frozen=True)
class Optimizer:
    """Optimizer state per parameter: `moments` tensors the size of the parameter."""

    name: str
    moments: float
    description: str
    quantized: bool = False  # moments stored in 8 bits (bitsandbytes)
    factored: bool = False  # second moment factored into row and column statistics (Adafactor)
    step_counter: bool = False  # torch keeps a 4-byte fp32 `step` tensor per parameter tensor
    fused_update: bool = False  # the update runs inside backward, so gradients are not all kept (LOMO)
    # state-sized tensors the step allocates for all parameters at once: PyTorch's multi-tensor
    # (`foreach`) AdamW, its default on CUDA, takes the square root of every second moment into a new
    # list before it divides; a fused kernel or a per-tensor loop allocates none or one tensor's worth
    step_temporaries: float = 0.0


OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in [
        Optimizer("sgd", 0, "plain SGD: no state"),
        Optimizer("sgd-momentum", 1, "SGD with momentum: one buffer"),
        Optimizer("adamw", 2, "AdamW: first and second moments, updated by a fused kernel (fused=True, "
                  "Trainer's default, DeepSpeed's and Megatron's Adam)", step_counter=True),
        Optimizer("adamw-foreach", 2, "AdamW as torch.optim.AdamW runs it on CUDA by default (foreach): its "
                  "step adds one state-sized temporary per parameter", step_counter=True, step_temporaries=1.0),
        Optimizer("adamw-8bit", 2, "bitsandbytes AdamW8bit: two block-wise 8-bit moments", quantized=True),
        Optimizer("lion", 1, "Lion: momentum only"),
        Optimizer("adafactor", 0, "Adafactor: factored second moment, no momentum", factored=True, step_counter=True),
        Optimizer("lomo", 0, "LOMO: SGD applied in backward as each gradient is ready; no state, no kept gradients",
                  fused_update=True),
    ]
}

# bitsandbytes quantizes optimizer state in blocks of 256 values with one fp32 absmax each, and keeps
# tensors smaller than 4096 elements in 32-bit state (`min_8bit_size`).
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096


def _canonical(name: str) -> str:
    return name.strip().lower().replace("_", "-")


_OPTIMIZER_ALIASES = {"adamw8bit": "adamw-8bit", "adam8bit": "adamw-8bit", "sgdm": "sgd-momentum",
                      "momentum": "sgd-momentum", "adam": "adamw-foreach", "sgd+momentum": "sgd-momentum",
                      "adamw-fused": "adamw", "adamw-torch-fused": "adamw", "adamw-torch": "adamw-foreach"}


def get_precision(name: str) -> Precision:
    key = _canonical(name)
    if key not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[key]


def get_optimizer(name: str) -> Optimizer:
    key = _canonical(name)
    key = _OPTIMIZER_ALIASES.get(key, key)
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[key]


def optimizer_state_bytes(opt: Optimizer, prec: Precision, tensor_shapes: list[tuple[int, ...]] | None,
                          num_params: float) -> float:
    """Bytes of optimizer state (moments and counters, not the master copy) for trainable tensors.

    With `tensor_shapes` the count follows what the PyTorch/bitsandbytes implementations allocate;
    with only `num_params` it is the per-parameter rate (per-tensor extras are then left out).
    """
    state = prec.state_bytes
    if tensor_shapes is None:
        if opt.quantized:
            return num_params * opt.moments * (1 + 4 / BNB_BLOCK)
        return num_params * opt.moments * state  # a factored Adafactor state is ~0 bytes/param
    total = 0.0
    for shape in tensor_shapes:
        numel = 1
        for d in shape:
            numel *= d
        if opt.quantized:
            if numel < BNB_MIN_8BIT_SIZE:
                total += numel * opt.moments * 4
            else:
                blocks = -(-numel // BNB_BLOCK)
                total += opt.moments * (numel + 4 * blocks)
        elif opt.factored:
            # row and column statistics for matrices, the full second moment for vectors
            total += (shape[0] + shape[1]) * state if len(shape) >= 2 else numel * state
        else:
            total += numel * opt.moments * state
        if opt.step_counter:
            total += 4
    return total
