"""A bitsandbytes CPU bug in 4-bit dequantization, a test for it, and a workaround.

bitsandbytes quantizes a weight in blocks of 64 consecutive values of the *flattened* tensor, so when
a row's length (in_features) is not a multiple of 64 a block runs on into the next row: the tiny
preset's `down_proj` has rows of 688 = 10.75 x 64 weights. The AVX-512 CPU kernel of
`bitsandbytes::dequantize_4bit` in bitsandbytes 0.50.2 (taken when the row length is a multiple of 16)
looks the constants up per row instead, as absmax[row * (in_features // 64) + column // 64]: from the
second row on, most weights are scaled by another block's absmax. The codes and constants it stores
are right and CUDA's kernel reads them right; `Linear4bit`'s forward and backward on a CPU dequantize
through the faulty kernel, so such a layer computes with wrong weights and no error is raised.

`dequantize_gaps` measures it per layer against a table look-up of the same codes;
`use_reference_cpu_dequantize` registers that look-up (`gpulab.nf4.dequantize_nf4`, exact in fp32) as
bitsandbytes' CPU kernel, which changes nothing where the kernel was right and nothing on a GPU;
`restore_bnb_cpu_dequantize` undoes it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from gpulab.nf4 import dequantize_nf4


def reference_dequantize(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """A `Params4bit`'s weight as `level[code] * absmax` in fp32, then in the state's dtype.

    Double-quantized constants are restored as bitsandbytes restores them (8-bit absmax dequantized
    block-wise, plus the stored mean), so only the final look-up and scaling are ours.
    """
    import bitsandbytes.functional as bnbF

    absmax = quant_state.absmax
    if quant_state.nested:
        absmax = bnbF.dequantize_blockwise(quant_state.absmax, quant_state.state2) + quant_state.offset
    out = dequantize_nf4(packed.view(torch.uint8), absmax.float(), tuple(quant_state.shape),
                         quant_state.blocksize, levels=quant_state.code)
    return out.to(quant_state.dtype)


def dequantize_gaps(model: torch.nn.Module) -> dict[str, float]:
    """For every `bnb.nn.Linear4bit`: max |bitsandbytes' dequantized weight - reference| / max |reference|.

    0 (or one rounding step of the compute dtype) where bitsandbytes dequantizes correctly; of the
    order of 0.1 to 1 where a row takes another block's absmax.
    """
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF

    gaps = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w, state = module.weight, getattr(module.weight, "quant_state")  # a Params4bit's constants
            ref = reference_dequantize(w.data, state).float()
            got = bnbF.dequantize_4bit(w.data, state).float()
            gaps[name] = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return gaps


def _reference_kernel(A: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                      shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    import bitsandbytes.functional as bnbF

    table = bnbF.get_4bit_type(quant_type, device=A.device)
    return dequantize_nf4(A.view(torch.uint8), absmax.float(), tuple(shape), blocksize,
                          levels=table).to(dtype)


_registration: torch.library.Library | None = None  # keeps the kernel registered while it lives


def use_reference_cpu_dequantize() -> None:
    """Make bitsandbytes dequantize 4-bit weights on CPU tensors by the table look-up above.

    Registers a CPU kernel for the `bitsandbytes::dequantize_4bit` operator, which `Linear4bit`,
    `matmul_4bit` and `functional.dequantize_4bit` call; CUDA tensors keep bitsandbytes' kernel. torch
    warns that a kernel is overridden: that is the point, so the warning is silenced here. Calling it
    again does nothing; `restore_bnb_cpu_dequantize` gives bitsandbytes its own kernel back.
    """
    global _registration
    if _registration is not None:
        return
    import bitsandbytes  # noqa: F401  # defines the operator and its kernels first

    lib = torch.library.Library("bitsandbytes", "IMPL")
    with warnings.catch_warnings():
        # torch's message starts "Warning only once for all operators" and names the override below
        warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
        # allow_override: torch 2.11 (the GPU machine's) refuses by default to replace a kernel that
        # was registered from Python, as bitsandbytes' CPU kernel is; torch 2.13 allows it by default
        lib.impl("dequantize_4bit", _reference_kernel, "CPU", allow_override=True)
    _registration = lib


def restore_bnb_cpu_dequantize() -> None:
    """Undo `use_reference_cpu_dequantize`: bitsandbytes' own CPU kernel is used again."""
    global _registration
    if _registration is not None:
        _registration._destroy()
        _registration = None
