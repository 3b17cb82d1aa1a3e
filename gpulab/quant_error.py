"""How much a 4-bit format loses: a plain int4 absmax quantizer from scratch, and the error measures
that compare it with NF4 and FP4.

int4 here is the simplest block-wise scheme: each block of `blocksize` consecutive weights (row-major,
as bitsandbytes blocks them) is divided by its absolute maximum and rounded to the nearest of the 15
evenly spaced levels -7/7 ... 7/7 (symmetric, so zero is exact; the 16th code, -8, is unused). NF4 puts
its 16 levels at normal quantiles instead, FP4 (E2M1) at powers of two and 1.5 times powers of two
(QLoRA, Dettmers et al. 2023).
"""

from __future__ import annotations

import torch

from gpulab.nf4 import absmax_blocks

INT4_MAX = 7  # symmetric: codes -7..7


def quantize_int4(weight: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise symmetric absmax int4: (codes, absmax).

    `codes` is int8 in [-7, 7], one per weight, flattened row-major (shape (numel,)); `absmax` is fp32,
    one per block. The last block may be short. An all-zero block keeps absmax 0 and codes 0.
    """
    padded, absmax = absmax_blocks(weight, blocksize)
    n = weight.numel()
    scale = absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None] / INT4_MAX
    codes = torch.round(padded / scale).clamp(-INT4_MAX, INT4_MAX).to(torch.int8)
    return codes.reshape(-1)[:n], absmax


def dequantize_int4(codes: torch.Tensor, absmax: torch.Tensor, shape: torch.Size | tuple[int, ...],
                    blocksize: int = 64) -> torch.Tensor:
    """Undo `quantize_int4`: code * absmax / 7 of the code's block, as fp32 of `shape`."""
    n = codes.numel()
    scale = (absmax.float() / INT4_MAX).repeat_interleave(blocksize)[:n]
    return (codes.float() * scale).view(*shape)


def int4_roundtrip(weight: torch.Tensor, blocksize: int = 64) -> torch.Tensor:
    """`weight` quantized to block-wise int4 and back (fp32, same shape)."""
    codes, absmax = quantize_int4(weight, blocksize)
    return dequantize_int4(codes, absmax, weight.shape, blocksize)


def relative_errors(weights: list[torch.Tensor], approx: list[torch.Tensor]) -> tuple[float, float]:
    """(mean, RMS) relative error of `approx` against `weights`, pooled over all the tensors.

    mean: sum |w_hat - w| / sum |w|; RMS: sqrt(sum (w_hat - w)^2 / sum w^2). Both are 0 for an exact
    copy; a tensor list lets a whole model's linear layers count as one population.
    """
    if len(weights) != len(approx) or not weights:
        raise ValueError("give as many approximations as weights (at least one)")
    abs_err = abs_w = sq_err = sq_w = 0.0
    for w, a in zip(weights, approx):
        w, e = w.detach().float(), a.detach().float().reshape(w.shape) - w.detach().float()
        abs_err += e.abs().sum().item()
        abs_w += w.abs().sum().item()
        sq_err += e.pow(2).sum().item()
        sq_w += w.pow(2).sum().item()
    return abs_err / abs_w, (sq_err / sq_w) ** 0.5


def excess_kurtosis(weights: list[torch.Tensor]) -> float:
    """E[z^4] - 3 of the pooled weights (z standardized): 0 for a normal, negative for lighter tails."""
    flat = torch.cat([w.detach().reshape(-1).double() for w in weights])
    z = (flat - flat.mean()) / flat.std()
    return float(z.pow(4).mean() - 3)
