"""`python -m gpulab.memory`: the training-memory calculator on the command line.

    python -m gpulab.memory --params 7e9 --dtype bf16 --optimizer adamw --zero 3 --gpus 8 [--json]
    python -m gpulab.memory --model llama3-8b --batch 1 --seq 4096 --checkpointing --lora-rank 16 --quant nf4
    python -m gpulab.memory --model llama3-70b --seq 4096 --tp 8 --sp --zero 3 --gpus 8

Bad arguments print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from gpulab.memory.calculator import ALL_LINEARS, TrainingSetup, estimate
from gpulab.memory.policy import OPTIMIZERS, PRECISIONS
from gpulab.memory.shapes import KNOWN_SHAPES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m gpulab.memory",
                description="Predict training memory per GPU by part (GB = 10^9 bytes).")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    what.add_argument("--model", choices=sorted(KNOWN_SHAPES), help="a published model shape")
    p.add_argument("--dtype", default="bf16", help=f"precision policy: {', '.join(PRECISIONS)}")
    p.add_argument("--optimizer", default="adamw", help=f"one of: {', '.join(OPTIMIZERS)}")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel world size")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (GPUs per layer)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp above 1)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch per GPU (needs --model)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (gradients then live through backward)")
    p.add_argument("--seq", type=int, default=0, help="sequence length for activations (needs --model)")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="cross-entropy in checkpointed chunks of this many tokens (0: all at once)")
    p.add_argument("--attention", default="sdpa", help="sdpa or eager")
    p.add_argument("--padded", action="store_true", help="batches padded with an attention mask")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="layers per checkpointed segment (1: every layer; ~sqrt(layers): the sqrt(n) rule)")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (needs --model)")
    p.add_argument("--lora-targets", default=",".join(ALL_LINEARS), help="comma-separated projections")
    p.add_argument("--quant", default=None, help="frozen base weights in nf4, fp4 or int8 (QLoRA)")
    p.add_argument("--no-double-quant", action="store_true", help="4-bit without double quantization")
    p.add_argument("--kv-context", type=int, default=0, help="tokens of KV cache (needs --model)")
    p.add_argument("--kv-batch", type=int, default=1, help="sequences in the KV cache")
    p.add_argument("--unit", default="GB", choices=["GB", "GiB", "MB", "MiB"])
    p.add_argument("--json", action="store_true", help="print byte counts as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # a finite count a machine could hold (also refuses nan, inf and 1e400, which float() reads as inf)
        if args.params is not None and not 1 <= args.params < 1e16:
            raise ValueError(f"--params must be a parameter count from 1 to below 1e16, got {args.params:g}")
        setup = TrainingSetup(
            precision=args.dtype, optimizer=args.optimizer, zero_stage=args.zero, world_size=args.gpus,
            batch_size=args.batch, grad_accumulation=args.grad_accum, seq_len=args.seq, attention=args.attention,
            padding_mask=args.padded, loss_chunk_tokens=args.loss_chunk,
            checkpointing=args.checkpointing, checkpoint_every=args.checkpoint_every,
            lora_rank=args.lora_rank, lora_targets=tuple(t for t in args.lora_targets.split(",") if t),
            quantization=args.quant, double_quant=not args.no_double_quant, kv_cache_len=args.kv_context,
            kv_cache_batch=args.kv_batch, tp_degree=args.tp, sequence_parallel=args.sp)
        result = estimate(KNOWN_SHAPES[args.model] if args.model else args.params, setup)
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.table(args.unit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
