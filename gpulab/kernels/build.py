"""Build the fused SwiGLU kernels with torch.utils.cpp_extension.load_inline, and check them with NVRTC.

The first build compiles C++ (CPU: ~15 s on 2 cores; CUDA: ~1 min) and is cached in
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR): later builds of the same source load in a second.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gpulab.kernels import nvrtc

KERNEL_DIR = Path(__file__).resolve().parent
CUDA_ARCHS = ("sm_80", "sm_90")  # A100; H100 and H200
# The (type, VEC) pairs swiglu_cuda.cu launches: 16-byte packs, and single elements for unaligned data.
CUDA_INSTANCES = (("float", 4), ("float", 1), ("__half", 8), ("__half", 1), ("__nv_bfloat16", 8),
                  ("__nv_bfloat16", 1))


@dataclass(frozen=True)
class SwiGLUKernels:
    """A forward `(gate, up) -> out` and a backward `(grad, gate, up) -> (d_gate, d_up)` implementation."""

    name: str
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def extension_name(base: str) -> str:
    """The name load_inline builds under (and its folder in the cache), one per torch version.

    torch 2.14 and later lock a build with an advisory lock and leave the folder's `lock` file behind;
    torch 2.13 and earlier wait for as long as that file exists. Two versions sharing one folder (the
    cache is keyed by Python and CUDA version only) would hang the older one's build with no message.
    """
    return f"{base}_torch{re.sub(r'[^0-9a-zA-Z]', '_', torch.__version__)}"


def source(name: str) -> str:
    """The text of a kernel source file in gpulab/kernels, e.g. "swiglu_kernels.cuh"."""
    return (KERNEL_DIR / name).read_text()


def cpu_flags() -> list[str]:
    # -march=native: the extension is built on the machine that runs it, so use all its vector units;
    # -fopenmp: at::parallel_for's OpenMP pragmas; macOS' clang has no OpenMP, so there it runs serially.
    flags = ["-O3", "-ffast-math"]
    if platform.system() == "Linux":
        flags += ["-march=native", "-fopenmp"]
    return flags


def ensure_ninja() -> str:
    """The path of the `ninja` that torch's cpp_extension will run: it looks for `ninja` on PATH only.

    The `ninja` wheel (a dependency of gpulab) puts its binary beside the Python that installed it, which
    is not on PATH when a venv's python runs without activation (`.venv/bin/python -m pytest`, a notebook
    kernel started by its full path) or when the wheel went into a `pip install --target` folder (the GPU
    run's carried wheels): put that folder first on PATH, or say what to install."""
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja
    except ImportError:
        folders: list[str] = []
    else:
        # ninja.BIN_DIR: the scripts folder of this Python, or "" when the binary is elsewhere;
        # <target>/bin: where `pip install --target <target>` puts it, beside the package's folder
        folders = [ninja.BIN_DIR, str(Path(ninja.__file__).resolve().parent.parent / "bin")]
    for folder in folders:
        if folder and os.access(os.path.join(folder, "ninja"), os.X_OK):
            os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
            return os.path.join(folder, "ninja")
    raise RuntimeError("ninja not found: torch builds C++ extensions with it. Install it with "
                       "`pip install ninja` (or `apt-get install ninja-build`)")


def load_cpu(verbose: bool = False) -> SwiGLUKernels:
    """Compile swiglu_cpu.cpp and return its operators (float32 CPU tensors)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise RuntimeError("no C++ compiler found: install g++ (Debian/Ubuntu: apt-get install g++)")
    # no_implicit_headers: load_inline would otherwise prepend <torch/extension.h> (pybind11 and all of
    # torch's C++ API), which triples the build time; the operators are registered with TORCH_LIBRARY.
    ensure_ninja()
    from torch.utils.cpp_extension import load_inline

    load_inline(
        name=extension_name("gpulab_swiglu_cpu"), cpp_sources=[source("swiglu_cpu.cpp")], extra_cflags=cpu_flags(),
        is_python_module=False, no_implicit_headers=True, verbose=verbose)
    ops = torch.ops.gpulab_cpu
    return SwiGLUKernels("C++ (CPU)", ops.swiglu_forward, ops.swiglu_backward)


def load_cuda(verbose: bool = False) -> SwiGLUKernels:
    """Compile swiglu_cuda.cu with nvcc for this GPU and return its operators (CUDA tensors)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA kernel needs a CUDA GPU and a CUDA build of torch "
                           f"(this is torch {torch.__version__}); on a CPU, check it with check_cuda_sources()")
    build_cuda(verbose)
    ops = torch.ops.gpulab_cuda
    return SwiGLUKernels("CUDA C++", ops.swiglu_forward, ops.swiglu_backward)


def build_cuda(verbose: bool = False) -> None:
    """Compile and link the CUDA extension with nvcc against this torch, and load it: no GPU is needed
    for that, only a CUDA build of torch (tests build it so, for the architectures in
    TORCH_CUDA_ARCH_LIST). Its operators are then torch.ops.gpulab_cuda.*."""
    from torch.utils.cpp_extension import CUDA_HOME, load_inline

    if CUDA_HOME is None:
        raise RuntimeError("nvcc not found: install the CUDA toolkit (or `pip install nvidia-cuda-nvcc`) "
                           "and set CUDA_HOME to the folder that holds bin/nvcc")
    ensure_ninja()
    load_inline(
        name=extension_name("gpulab_swiglu_cuda"), cpp_sources=[source("swiglu_cuda_ops.cpp")],
        cuda_sources=[source("swiglu_cuda.cu")], extra_include_paths=[str(KERNEL_DIR)],
        extra_cuda_cflags=["-O3"], is_python_module=False, no_implicit_headers=True, verbose=verbose)


def cuda_kernel_names() -> list[str]:
    """The template instances swiglu_cuda.cu launches, as NVRTC name expressions."""
    return [f"gpulab::swiglu_{direction}_kernel<{dtype}, {vec}>"
            for direction in ("forward", "backward") for dtype, vec in CUDA_INSTANCES]


def check_cuda_sources(archs: tuple[str, ...] = CUDA_ARCHS,
                       kernel_source: str | None = None) -> list[nvrtc.CompileResult]:
    """Compile the CUDA kernels (every instance the host code launches) for each arch with NVRTC."""
    text = source("swiglu_kernels.cuh") if kernel_source is None else kernel_source
    return [nvrtc.compile_cuda(text, arch, cuda_kernel_names(), filename="swiglu_kernels.cuh") for arch in archs]
