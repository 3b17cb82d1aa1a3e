"""Tensor and sequence parallelism on two processes: Megatron's layers by hand, then PyTorch's DTensor plan.

One launch does everything lab 14 needs from two processes, on the course's tiny Llama (fp32, AdamW,
a batch of 8 sequences of 64 tokens, causal attention without a padding mask: the padding sits at
the end of each row, where it changes no earlier token, and its labels are -100):

- `reference`      one process, the whole model (every rank computes it: nothing to communicate);
- `scratch_tp`     Megatron-style tensor parallelism written here (Shoeybi et al. 2019): q/k/v and gate/up
                   split by columns, o and down by rows, with the conjugate operators f (identity forward,
                   all-reduce backward) and g (all-reduce forward, identity backward) around each block;
- `scratch_sp`     the same with sequence parallelism (Korthikanti et al. 2022): the norms and the residual
                   stream hold 1/t of the sequence; each block all-gathers its input and reduce-scatters its
                   output, and keeps only its input's shard for backward (gathered again there, as
                   Megatron-LM's linear layer does);
- `torch_tp`       `parallelize_module` with `ColwiseParallel` / `RowwiseParallel` (gpulab.tensor_parallel);
- `torch_tp_plain` the same plan without `PrepareModuleInput`: each projection takes its own copy of the
                   block's input, so backward reduces its gradient once per projection;
- `torch_sp`       the DTensor plan with `SequenceParallel` norms.

For each: the losses of a few AdamW steps, the first step's gradients and logits against the reference,
the bytes autograd saved in the first forward, the bytes of parameters, gradients and optimizer state
this rank holds, the collectives of the first forward, backward and optimizer step (count and bytes),
step times, and on GPUs the CUDA allocator's peak over the first step.

    torchrun --nproc-per-node=2 labs/scripts/14_tensor_parallel.py --out tp.json
"""

from __future__ import annotations

import argparse
import statistics
import time

T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from gpulab.data import load_task  # noqa: E402
from gpulab.distributed import finish, gather, init, say  # noqa: E402
from gpulab.models import build_model  # noqa: E402
from gpulab.presets import PRESETS  # noqa: E402
from gpulab.tensor_parallel import CollectiveCounter, held_bytes, local, parallelize_llama, record_saved  # noqa: E402

SEQ = 1  # the sequence dimension of (batch, sequence, hidden)
# torch 2.13 names these all_gather_single / reduce_scatter_single (and warns about the old names, which
# torch 2.11, the GPU machine's, still uses); same (output, input) arguments
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
VARIANTS = ("scratch_tp", "scratch_sp", "torch_tp", "torch_tp_plain", "torch_sp")


# --- Collectives along the sequence: all_gather_into_tensor and reduce_scatter_tensor work on dim 0 ---------

def all_gather_seq(x: torch.Tensor) -> torch.Tensor:
    t = dist.get_world_size()
    out = torch.empty((t * x.shape[SEQ], x.shape[0], *x.shape[2:]), dtype=x.dtype, device=x.device)
    ALL_GATHER(out, x.transpose(0, SEQ).contiguous())
    return out.transpose(0, SEQ).contiguous()


def reduce_scatter_seq(x: torch.Tensor) -> torch.Tensor:
    t = dist.get_world_size()
    out = torch.empty((x.shape[SEQ] // t, x.shape[0], *x.shape[2:]), dtype=x.dtype, device=x.device)
    REDUCE_SCATTER(out, x.transpose(0, SEQ).contiguous())
    return out.transpose(0, SEQ).contiguous()


def my_chunk(x: torch.Tensor) -> torch.Tensor:
    return x.chunk(dist.get_world_size(), dim=SEQ)[dist.get_rank()].contiguous()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


# --- The conjugate operators: each is the other's transpose, so autograd stays exact ---------------------------

class CopyToRegion(torch.autograd.Function):
    """f: identity forward; backward sums the input gradients of the ranks' column shards."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad)


class ReduceFromRegion(torch.autograd.Function):
    """g: sums the ranks' partial outputs of a row-parallel linear; identity backward."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's g (Korthikanti et al.'s g-bar): reduce-scatter forward (sum and split the sequence),
    all-gather backward."""

    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad)


class SplitSequence(torch.autograd.Function):
    """Into the sequence-parallel region from replicated work (the embedding): keep my chunk; gather back."""

    @staticmethod
    def forward(ctx, x):
        return my_chunk(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad)


class GatherSequence(torch.autograd.Function):
    """Out of it into replicated work (the LM head): all-gather; every rank's gradient is the same, keep mine."""

    @staticmethod
    def forward(ctx, x):
        return all_gather_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return my_chunk(grad)


class GatheredLinears(torch.autograd.Function):
    """Sequence parallelism's f (Korthikanti et al.'s g) with the block's first (column-parallel) linears:
    all-gather the input on the sequence, multiply it by each weight shard, and keep only the input's shard
    for backward, where it is gathered again (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication
    does the same). The input gradient, summed over the linears, is reduce-scattered back to the sequence
    shards."""

    @staticmethod
    def forward(ctx, x_shard, *weights):
        ctx.save_for_backward(x_shard, *weights)
        x = all_gather_seq(x_shard)
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x_shard, *weights = ctx.saved_tensors
        x = all_gather_seq(x_shard)  # the extra all-gather that buys 1/t of this activation
        grad_x = sum(g @ w for g, w in zip(grads, weights))
        grad_ws = [g.flatten(0, 1).T @ x.flatten(0, 1) for g in grads]
        return (reduce_scatter_seq(grad_x), *grad_ws)


# --- Sharding the course's Llama by hand ----------------------------------------------------------------------

def shard_linear(linear: nn.Linear, dim: int) -> nn.Linear:
    """This rank's 1/t of `linear`: dim 0 (output features, column-parallel) or dim 1 (input, row-parallel)."""
    weight = linear.weight.detach().chunk(dist.get_world_size(), dim=dim)[dist.get_rank()].contiguous()
    part = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    part.weight.data.copy_(weight)
    part.weight.tp_dim = dim  # type: ignore[attr-defined]  # to compare with the reference's slice
    return part


class ParallelAttention(nn.Module):
    """Attention over this rank's heads: q, k, v column-parallel (whole heads), o_proj row-parallel."""

    def __init__(self, attn: nn.Module, sequence_parallel: bool):
        super().__init__()
        t = dist.get_world_size()
        self.q_proj, self.k_proj, self.v_proj = (shard_linear(getattr(attn, n), 0)
                                                 for n in ("q_proj", "k_proj", "v_proj"))
        self.o_proj = shard_linear(attn.o_proj, 1)
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.gqa = attn.config.num_attention_heads // t > attn.config.num_key_value_heads // t
        self.sp = sequence_parallel

    def forward(self, hidden_states, position_embeddings, **_):  # causal, no padding mask (see the docstring)
        if self.sp:
            q, k, v = GatheredLinears.apply(hidden_states, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        else:
            x = CopyToRegion.apply(hidden_states)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[:2]
        q, k, v = (y.view(b, s, -1, self.head_dim).transpose(1, 2) for y in (q, k, v))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.gqa)
        out = self.o_proj(out.transpose(1, 2).contiguous().reshape(b, s, -1))  # partial sums of the output
        return (ScatterToSequence.apply(out) if self.sp else ReduceFromRegion.apply(out)), None


class ParallelMLP(nn.Module):
    """SwiGLU over this rank's channels: gate and up column-parallel, down row-parallel."""

    def __init__(self, mlp: nn.Module, sequence_parallel: bool):
        super().__init__()
        self.gate_proj, self.up_proj = shard_linear(mlp.gate_proj, 0), shard_linear(mlp.up_proj, 0)
        self.down_proj = shard_linear(mlp.down_proj, 1)
        self.sp = sequence_parallel

    def forward(self, x):
        if self.sp:
            gate, up = GatheredLinears.apply(x, self.gate_proj.weight, self.up_proj.weight)
        else:
            x = CopyToRegion.apply(x)
            gate, up = self.gate_proj(x), self.up_proj(x)
        out = self.down_proj(F.silu(gate) * up)
        return ScatterToSequence.apply(out) if self.sp else ReduceFromRegion.apply(out)


def megatron(model: nn.Module, sequence_parallel: bool) -> nn.Module:
    """Shard every decoder layer's attention and MLP in place; embedding, norms and LM head stay whole.
    With sequence parallelism the embedding's output is split on the sequence and the final norm's
    output gathered for the LM head."""
    for layer in model.model.layers:
        layer.self_attn = ParallelAttention(layer.self_attn, sequence_parallel)
        layer.mlp = ParallelMLP(layer.mlp, sequence_parallel)
    if sequence_parallel:
        model.model.embed_tokens.register_forward_hook(lambda m, args, out: SplitSequence.apply(out))
        model.model.norm.register_forward_hook(lambda m, args, out: GatherSequence.apply(out))
    return model


def norm_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if n.endswith("norm.weight")]


def sync_sequence_parallel_grads(model: nn.Module) -> None:
    """Each rank's norms saw 1/t of the tokens: sum their weight gradients over the group (one all-reduce)."""
    params = norm_weights(model)
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


# --- One run ---------------------------------------------------------------------------------------------------

def build(kind: str, device: torch.device) -> nn.Module:
    model = build_model(PRESETS["tiny"].shape, device=device, seed=0)  # same seed: same weights everywhere
    if kind.startswith("scratch"):
        return megatron(model, sequence_parallel=kind == "scratch_sp")
    if kind.startswith("torch"):
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return parallelize_llama(model, mesh, sequence_parallel=kind == "torch_sp",
                                 prepare_inputs=kind != "torch_tp_plain")
    return model


def grad_error(model: nn.Module, ref_grads: dict[str, torch.Tensor]) -> float:
    """Largest max|g - g_ref| / max|g_ref| over the parameters (a shard against the reference's slice)."""
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = ref_grads[name]
        if hasattr(p, "tp_dim"):
            want = want.chunk(dist.get_world_size(), dim=p.tp_dim)[dist.get_rank()]
        worst = max(worst, ((g - want).abs().max() / want.abs().max()).item())
    return worst


def run(kind: str, batches: list[dict], device: torch.device, ref: dict | None = None) -> dict:
    cuda = device.type == "cuda"
    if cuda:  # on GPUs (NCCL) the allocator's peak over the first step: model, activations, gradients, state
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0  # the reference's gradients, kept for comparing
    model = build(kind, device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    where = ["outside the layers"]  # which part of the model is running: saved bytes are split by it
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, args: where.__setitem__(0, "layers"))
        layer.register_forward_hook(lambda m, args, output: where.__setitem__(0, "outside the layers"))
    out: dict = {"losses": [], "step_s": []}
    for i, batch in enumerate(batches):
        # with sequence parallelism the model sees 1/t of the embeddings: give it the full positions
        positions = torch.arange(batch["input_ids"].shape[1], device=device).unsqueeze(0)
        start = time.perf_counter()
        if i == 0:
            counter = CollectiveCounter()
            with counter, record_saved(exclude=params, region=lambda: where[0]) as saved:
                result = model(**batch, position_ids=positions)
                counter.phase = "backward"
                result.loss.backward()
                if kind == "scratch_sp":
                    counter.phase = "norm_grads"
                    sync_sequence_parallel_grads(model)
            out["saved_bytes"], out["saved_tensors"], out["saved_by_region"] = saved.bytes, saved.count, saved.by_region
            out["grad_bytes"] = held_bytes(p.grad for p in params)
            if ref is not None:
                out["grad_error"] = grad_error(model, ref["grads"])
                logits = local(result.logits.detach())
                out["logits_error"] = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
            else:
                out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                out["logits"] = result.logits.detach().clone()
        else:
            loss = model(**batch, position_ids=positions).loss
            loss.backward()
            if kind == "scratch_sp":
                sync_sequence_parallel_grads(model)
            result = None
        if i == 0:
            with counter:
                counter.phase = "optimizer"  # DTensor may reduce a Partial gradient here
                opt.step()
            out["collectives"] = counter.summary()
            out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base if cuda else None
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        out["step_s"].append(time.perf_counter() - start)
        out["losses"].append((result.loss if result is not None else loss).item())
    states = [(k, local(v)) for s in opt.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)]
    out.update(param_bytes=held_bytes(params),
               moment_bytes=sum(v.numel() * v.element_size() for k, v in states if k != "step"),
               step_bytes=sum(v.numel() * v.element_size() for k, v in states if k == "step"),
               median_step_s=statistics.median(out["step_s"][1:] or out["step_s"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None, help="write the results here as JSON (rank 0 writes)")
    args = parser.parse_args()

    me = init()
    task = load_task(seq_len=PRESETS["tiny"].seq_len)
    stream = task.batches(args.batch_size, seed=0)
    # no padding mask: causal attention keeps each row's trailing padding away from its tokens
    batches = [{k: v.to(me.device) for k, v in next(stream).items() if k != "attention_mask"}
               for _ in range(args.steps)]
    results: dict = {"world_size": me.world, "backend": me.backend, "steps": args.steps,
                     "batch_size": args.batch_size, "seq_len": PRESETS["tiny"].seq_len,
                     "setup_s": time.perf_counter() - T0}
    ref = run("reference", batches, me.device)
    summary = {k: v for k, v in ref.items() if k not in ("grads", "logits")}
    results["reference"] = [summary] * me.world
    say(me.rank, f"{'reference':<15} loss {ref['losses'][0]:.4f}  saved {ref['saved_bytes']:>11,} B")
    for kind in args.variants.split(","):
        torch.manual_seed(0)
        r = run(kind, batches, me.device, ref)
        results[kind] = gather(r)
        say(me.rank, f"{kind:<15} loss {r['losses'][0]:.4f}  saved {r['saved_bytes']:>11,} B  "
                     f"grad error {r['grad_error']:.1e}")
    results["total_s"] = time.perf_counter() - T0
    finish(results, args.out)


if __name__ == "__main__":
    main()
