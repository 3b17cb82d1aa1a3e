"""1-bit Adam (Tang et al. 2021): exact Adam for a warm-up, then a frozen variance and 1-bit momentum.

Adam's update divides the momentum m by sqrt(v). Compressing the gradient with error feedback works for
SGD-like updates that are linear in the gradient; v is not. Tang et al. observed that v settles early in
training, so after `warmup_steps` of exact Adam (gradients all-reduced in fp32) the variance is frozen and
Adam becomes momentum SGD with a fixed per-coordinate step size lr / (sqrt(v_hat) + eps). From then on
the gradients are not all-reduced at all: each worker folds its *local* gradient into its momentum, and
the workers average their momenta with a compressed all-reduce, in two stages as in DeepSpeed's
`compressed_allreduce`:

1. every worker adds its worker error to its momentum, compresses it to signs and one scale per block,
   keeps the compression error for next time, and sends chunk j of the packed signs to worker j
   (all-to-all);
2. worker j (the "server" of chunk j) decompresses the n chunks it received, averages them, adds its
   server error, compresses again (keeping that error) and sends the result to everyone (all-gather).

A sign costs one bit, packed eight to a byte (torch has no 1-bit dtype); a block of `block` values also
sends its fp32 scale, the mean of |x| over the block (the scale that minimises the squared error of
`scale * sign(x)`, and the one that keeps the block's l1 norm; DeepSpeed uses one scale per tensor,
||x||_2 / sqrt(numel)). Per worker, both stages send 2 (n - 1) / n * (D/8 + 4 D / block) bytes for D
values (padded), against 2 (n - 1) / n * 4 d for a ring all-reduce of d fp32 values: 1/32 + 1/block of it.

Differences from DeepSpeed's `OnebitAdam`, on purpose: the warm-up is exactly `torch.optim.Adam` (with
bias correction; DeepSpeed's warm-up divides m by sqrt(v) uncorrected), the frozen denominator is the
bias-corrected one of the last warm-up step, and one flat buffer with per-block scales replaces
DeepSpeed's per-tensor buffers and scales (fewer, larger messages).
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # the first value of a group of eight is the high bit


# -- bits -------------------------------------------------------------------------------------------

def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Signs of `x` (numel a multiple of 8) as bits in uint8, eight to a byte: 1 for x >= 0, 0 below.

    Zero counts as positive, as in DeepSpeed (`sign().add_(1).bool()`): one bit cannot say "zero"."""
    if x.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 values, got {x.numel()}")
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8)
    weights = torch.tensor(BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The +1/-1 values packed by `pack_signs` (8 per byte), in `dtype`."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed.reshape(-1, 1) >> shifts) & 1
    return bits.reshape(-1).to(dtype) * 2 - 1


# -- compression with error feedback ----------------------------------------------------------------

def block_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """One fp32 scale per block of `block` consecutive values: the mean of |x| over the block."""
    return x.reshape(-1, block).abs().mean(dim=1).float()


def compress(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit compression of `x` (numel a multiple of `block`, `block` a multiple of 8): packed signs
    (uint8, numel / 8) and per-block scales (fp32, numel / block)."""
    if block % 8 or x.numel() % block:
        raise ValueError(f"need block % 8 == 0 and numel % block == 0; got block {block}, numel {x.numel()}")
    return pack_signs(x), block_scales(x, block)


def decompress(packed: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """scale * sign, block by block: the inverse of `compress` up to its error."""
    return (unpack_signs(packed).reshape(-1, block) * scales.reshape(-1, 1)).reshape(-1)


def compress_with_feedback(x: torch.Tensor, error: torch.Tensor, block: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress x + error; store what the compression lost in `error` (in place) for the next call.

    Returns (packed signs, scales, the decompressed value). Over T calls the decompressed values add up to
    the sum of the inputs minus the last error: nothing is lost for good, it is only sent late."""
    corrected = x + error
    packed, scales = compress(corrected, block)
    # what the receivers will decompress, computed without unpacking: +scale where x >= 0, else -scale
    per_block = corrected.reshape(-1, block)
    sent = torch.where(per_block >= 0, scales.reshape(-1, 1), -scales.reshape(-1, 1)).reshape(-1)
    error.copy_(corrected - sent)
    return packed, scales, sent


# -- bytes on the wire ------------------------------------------------------------------------------

def ring_allreduce_bytes(nbytes: int, world: int) -> float:
    """Bytes each rank sends in a ring (bandwidth-optimal) all-reduce of an `nbytes` buffer:
    2 (n - 1) / n * nbytes (reduce-scatter, then all-gather)."""
    return 2 * (world - 1) / world * nbytes


def onebit_allreduce_bytes(padded_numel: int, world: int, block: int) -> float:
    """Bytes each rank sends in the two-stage compressed all-reduce of `padded_numel` values:
    stage 1 sends (n - 1) / n of the packed signs and scales, stage 2 its own chunk to n - 1 ranks."""
    payload = padded_numel / 8 + 4 * padded_numel / block
    return 2 * (world - 1) / world * payload


def llama_tensor_shapes(shape) -> list[tuple[int, ...]]:
    """The parameter shapes of a Llama decoder with `shape` (a `gpulab.memory.ModelShape`), in model order:
    what a gradient all-reduce carries, and what PowerSGD sees as matrices."""
    h, f, kv = shape.hidden_size, shape.intermediate_size, shape.hidden_size // shape.num_heads * shape.num_kv_heads
    layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    head = [] if shape.tie_embeddings else [(shape.vocab_size, h)]
    return [(shape.vocab_size, h)] + layer * shape.num_layers + [(h,)] + head


def powersgd_allreduce_bytes(shapes: Iterable[tuple[int, ...]], rank: int, world: int,
                             min_compression_rate: float = 2.0) -> float:
    """Bytes each rank sends per step with PyTorch's `powerSGD_hook` once it compresses: every gradient
    is viewed as a matrix (shape[0], rest); one that compresses by more than `min_compression_rate` sends
    its fp32 factors P (n x r) and Q (m x r), the others go out whole in fp32 (the hook's own rule)."""
    elements = 0
    for shape in shapes:
        n = shape[0]
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        elements += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return ring_allreduce_bytes(4 * elements, world)


@dataclass
class WireCounter:
    """Counts the bytes this rank sends, by the textbook cost of each collective (ring algorithms)."""

    world: int = 1
    sent_bytes: float = 0.0
    calls: int = 0
    active: bool = True

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self.active:
            self.sent_bytes += ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world)
            self.calls += 1

    def all_to_all(self, tensor: torch.Tensor) -> None:
        """all_to_all_single of `tensor` (split in `world` equal chunks): n - 1 chunks leave."""
        if self.active:
            self.sent_bytes += (self.world - 1) / self.world * tensor.numel() * tensor.element_size()
            self.calls += 1

    def all_gather(self, tensor: torch.Tensor) -> None:
        """all_gather of this rank's `tensor`: it reaches the n - 1 others."""
        if self.active:
            self.sent_bytes += (self.world - 1) * tensor.numel() * tensor.element_size()
            self.calls += 1


# -- the flat momentum buffer ---------------------------------------------------------------------------

@dataclass
class FlatLayout:
    """Where each parameter's values sit in one flat buffer: each starts on a block boundary (so no
    block, and no scale, mixes two tensors) and the buffer splits into `world` chunks of whole blocks."""

    numels: list[int]
    offsets: list[int]
    padded_numel: int
    block: int
    world: int

    @classmethod
    def build(cls, params: Iterable[torch.Tensor], block: int, world: int) -> "FlatLayout":
        if block % 8:
            raise ValueError(f"block must be a multiple of 8 (whole bytes of signs), got {block}")
        numels, offsets, at = [], [], 0
        for p in params:
            numels.append(p.numel())
            offsets.append(at)
            at += math.ceil(p.numel() / block) * block
        padded = math.ceil(at / (block * world)) * block * world
        return cls(numels, offsets, padded, block, world)

    @property
    def numel(self) -> int:
        """Values of the parameters themselves, without padding."""
        return sum(self.numels)

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=tensors[0].device)
        for t, at, n in zip(tensors, self.offsets, self.numels):
            flat[at:at + n] = t.reshape(-1)
        return flat

    def unflatten_into(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        for t, at, n in zip(tensors, self.offsets, self.numels):
            t.copy_(flat[at:at + n].view_as(t))


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-gather into one tensor: `all_gather_single` where torch has it (2.13 deprecates the older
    name), `all_gather_into_tensor` before."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def compressed_allreduce(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         block: int, counter: WireCounter | None = None,
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The average of `buffer` over the ranks, compressed to 1 bit in two stages with error feedback.

    `buffer` and `worker_error` hold the whole padded buffer (D values, D a multiple of world * block);
    `server_error` holds this rank's chunk (D / world). Both errors are updated in place. Returns the
    same (decompressed) average on every rank."""
    world = dist.get_world_size(group)
    chunk = buffer.numel() // world
    packed, scales, _ = compress_with_feedback(buffer, worker_error, block)
    # stage 1: chunk j of every rank's signs and scales goes to rank j, the server of chunk j
    recv_signs, recv_scales = torch.empty_like(packed), torch.empty_like(scales)
    dist.all_to_all_single(recv_signs, packed, group=group)
    dist.all_to_all_single(recv_scales, scales, group=group)
    if counter is not None:
        counter.all_to_all(packed)
        counter.all_to_all(scales)
    average = decompress(recv_signs, recv_scales, block).reshape(world, chunk).mean(dim=0)
    # stage 2: the server compresses its averaged chunk (with its own error feedback) and all-gathers it
    server_packed, server_scales, _ = compress_with_feedback(average, server_error, block)
    all_signs = torch.empty(world * server_packed.numel(), dtype=torch.uint8, device=buffer.device)
    all_scales = torch.empty(world * server_scales.numel(), dtype=server_scales.dtype, device=buffer.device)
    _all_gather(all_signs, server_packed, group)
    _all_gather(all_scales, server_scales, group)
    if counter is not None:
        counter.all_gather(server_packed)
        counter.all_gather(server_scales)
    return decompress(all_signs, all_scales, block)


# -- the optimizer -------------------------------------------------------------------------------------

@dataclass
class _Errors:
    worker: torch.Tensor
    server: torch.Tensor
    layout: FlatLayout = field(repr=False)


class OneBitAdam(torch.optim.Optimizer):
    """Adam for `warmup_steps` (exactly `torch.optim.Adam`'s single-tensor update, no weight decay),
    then the variance frozen and the momentum averaged over the ranks with 1-bit compression.

    With DDP, register `onebit_ddp_hook` with this optimizer as its state: during the warm-up it
    all-reduces (averages) the gradients as DDP does; afterwards it sends nothing, the gradients stay
    local and `step()` runs the compressed all-reduce of the momentum instead. Without a process group,
    or with one rank, nothing is communicated and after the warm-up it is Adam with a frozen variance.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, warmup_steps: int = 100, block: int = 256,
                 counter: WireCounter | None = None, group: dist.ProcessGroup | None = None,
                 error_feedback: bool = True) -> None:
        if warmup_steps < 1:
            raise ValueError("1-bit Adam needs at least one warm-up step to estimate the variance")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.warmup_steps = warmup_steps
        self.block = block
        self.counter = counter
        self.group = group
        self.error_feedback = error_feedback  # False: the ablation, compression errors dropped every step
        self.steps_taken = 0
        self.errors: _Errors | None = None

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    @property
    def compressing(self) -> bool:
        """True once the warm-up is over: the variance is frozen and the momentum goes out in 1 bit."""
        return self.steps_taken >= self.warmup_steps

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compress_now = self.compressing
        self.steps_taken += 1
        t = self.steps_taken
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                # the momentum, from the averaged gradient (warm-up) or this rank's own (compressing)
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                if not compress_now:  # the variance is updated only during the warm-up
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    if t == self.warmup_steps:  # freeze: the bias-corrected denominator of this step
                        state["frozen_denom"] = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** t) ** 0.5).add_(
                            group["eps"])
        if compress_now and self.world > 1:
            self._average_momentum()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            step_size = group["lr"] / (1 - beta1 ** t)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if compress_now or t == self.warmup_steps:
                    denom = state["frozen_denom"]
                else:
                    denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** t) ** 0.5).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-step_size)
        return loss

    def _average_momentum(self) -> None:
        params = self._params()
        momenta = [self.state[p]["exp_avg"] for p in params]
        if self.errors is None:  # the first compressed step: error buffers start at zero
            layout = FlatLayout.build(params, self.block, self.world)
            device = params[0].device
            self.errors = _Errors(torch.zeros(layout.padded_numel, device=device),
                                  torch.zeros(layout.padded_numel // layout.world, device=device), layout)
        layout = self.errors.layout
        if not self.error_feedback:
            self.errors.worker.zero_()
            self.errors.server.zero_()
        averaged = compressed_allreduce(layout.flatten(momenta), self.errors.worker, self.errors.server,
                                        self.block, self.counter, self.group)
        layout.unflatten_into(averaged, momenta)

    def wire_bytes_per_step(self) -> float:
        """Bytes this rank sends per step once compressing (the formula; see `onebit_allreduce_bytes`)."""
        layout = FlatLayout.build(self._params() or [p for g in self.param_groups for p in g["params"]],
                                  self.block, self.world)
        return onebit_allreduce_bytes(layout.padded_numel, self.world, self.block)


def onebit_ddp_hook(state: OneBitAdam, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook paired with `OneBitAdam`: average the bucket (fp32 all-reduce, as DDP
    does) during the warm-up; once compressing, return the local gradient and send nothing.

    (DDP checks the annotations of a hook at run time: this module keeps them real types, without
    `from __future__ import annotations`.)"""
    buffer = bucket.buffer()
    if state.compressing:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    if state.counter is not None:
        state.counter.all_reduce(buffer)
    buffer.div_(dist.get_world_size(state.group))
    return dist.all_reduce(buffer, group=state.group, async_op=True).get_future().then(lambda f: f.value()[0])
