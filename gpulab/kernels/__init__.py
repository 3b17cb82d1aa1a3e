"""Fused kernels for lab 4: SwiGLU (`silu(gate) * up`) in CUDA C++, in C++ for the CPU, and in Triton.

- `swiglu`: the eager reference, its backward, the autograd Function, `fuse_swiglu(model, kernels)`.
- `build`: `load_cuda()`, `load_cpu()` (torch.utils.cpp_extension.load_inline), `check_cuda_sources()`.
- `nvrtc`: compile CUDA device code without a GPU.
- `swiglu_triton`: the Triton version (import it after setting TRITON_INTERPRET=1 on a CPU).
"""

import os

# Triton 3.9 warns, when this is unset, that its default will change; its current default (fused
# multiply-adds on) is what Triton 3.6, the GPU machine's, does without asking. Set here, before any
# kernel of the package is compiled.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from gpulab.kernels.build import SwiGLUKernels, check_cuda_sources, load_cpu, load_cuda, source  # noqa: E402
from gpulab.kernels.swiglu import (SwiGLUFunction, fuse_swiglu, swiglu_backward_reference, swiglu_eager,  # noqa: E402
                                   swiglu_fused)

__all__ = ["SwiGLUFunction", "SwiGLUKernels", "check_cuda_sources", "fuse_swiglu", "load_cpu", "load_cuda",
           "source", "swiglu_backward_reference", "swiglu_eager", "swiglu_fused"]
