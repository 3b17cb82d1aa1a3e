"""Fused SwiGLU in Triton: the same two kernels as swiglu_kernels.cuh, written per block of elements.

A Triton program handles BLOCK elements with vector operations; Triton picks the per-thread layout
and the vector loads that CUDA C++ spells out by hand. Without a GPU, set TRITON_INTERPRET=1 *before*
importing this module: `triton.jit` then returns an interpreter that runs each program with NumPy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpulab.kernels.build import SwiGLUKernels

BLOCK = 1024  # elements per program


@triton.jit
def swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n  # the last program may run past the end
    x = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    out = x * tl.sigmoid(x) * u
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(grad_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dy = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    x = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    s = tl.sigmoid(x)
    tl.store(d_gate_ptr + offsets, (dy * u * s * (1 + x * (1 - s))).to(d_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(d_up_ptr + offsets, (dy * x * s).to(d_up_ptr.dtype.element_ty), mask=mask)


def _check(*tensors: torch.Tensor) -> None:
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError("swiglu (Triton): inputs must share shape, dtype and device")
        if not t.is_contiguous():
            raise ValueError("swiglu (Triton): inputs must be contiguous")


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    out = torch.empty_like(gate)
    n = gate.numel()
    swiglu_forward_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK)
    return out


def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(grad, gate, up)
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    swiglu_backward_kernel[(triton.cdiv(n, BLOCK),)](grad, gate, up, d_gate, d_up, n, BLOCK=BLOCK)
    return d_gate, d_up


KERNELS = SwiGLUKernels("Triton", swiglu_forward, swiglu_backward)
