"""Compile CUDA device code without a GPU, with NVRTC (NVIDIA's runtime compiler library).

NVRTC is a shared library (pip: ``nvidia-cuda-nvrtc``; its headers ``cuda_fp16.h``/``cuda_bf16.h`` come
with ``nvidia-cuda-runtime``), called here through ctypes. It needs no driver and no GPU, so CI can
compile a kernel for sm_80 (A100) and sm_90 (H100/H200) and fail on a syntax or type error the way
nvcc would, long before the code meets a GPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

# The macros PyTorch passes to nvcc for extensions: compiling with them here checks the same code.
TORCH_NVCC_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
)


@dataclass(frozen=True)
class CompileResult:
    arch: str
    ok: bool
    log: str
    cubin_bytes: int = 0
    lowered_names: dict[str, str] = field(default_factory=dict)  # C++ name -> mangled symbol


def _cuda_roots() -> list[Path]:
    """Folders that may hold lib/libnvrtc.so* and include/cuda_fp16.h: the pip wheels, then a toolkit."""
    roots: list[Path] = []
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        roots += sorted(p for p in Path(base).iterdir() if p.is_dir())  # nvidia/cu13, nvidia/cuda_nvrtc, ...
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            roots.append(Path(os.environ[env]))
    roots.append(Path("/usr/local/cuda"))
    return roots


def include_dirs() -> list[str]:
    """Folders with the CUDA headers that device code includes (cuda_fp16.h, cuda_bf16.h)."""
    found = [str(r / "include") for r in _cuda_roots() if (r / "include" / "cuda_bf16.h").exists()]
    return found[:1]  # one CUDA version's headers: mixing two breaks


@cache
def _library() -> ctypes.CDLL:
    for root in _cuda_roots():
        for lib in ("lib", "lib64"):
            found = sorted((root / lib).glob("libnvrtc.so*")) if (root / lib).is_dir() else []
            for path in (p for p in found if "builtins" not in p.name):
                # NVRTC opens libnvrtc-builtins by name when it compiles. The 13.5 wheel's libnvrtc finds
                # it beside itself (RPATH $ORIGIN); the 13.0 wheel's, which torch 2.13's CUDA build
                # pins, has no RPATH. A library already loaded under that soname satisfies the lookup.
                for builtins in sorted((root / lib).glob("libnvrtc-builtins.so*")):
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(str(path))
    raise RuntimeError("NVRTC not found: `pip install nvidia-cuda-nvrtc nvidia-cuda-runtime` "
                       "(or install the CUDA toolkit and set CUDA_HOME)")


def available() -> bool:
    try:
        _library()
    except (RuntimeError, OSError):
        return False
    return bool(include_dirs())


def version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return f"{major.value}.{minor.value}"


def _check(status: int, what: str) -> None:
    if status != 0:
        nvrtc = _library()
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what} failed: {nvrtc.nvrtcGetErrorString(status).decode()}")


def compile_cuda(source: str, arch: str, name_expressions: Sequence[str] = (), options: Sequence[str] = (),
                 filename: str = "kernel.cu") -> CompileResult:
    """Compile `source` for `arch` (e.g. "sm_90") to a cubin; a compile error gives ok=False and the log.

    `name_expressions` instantiate templates, e.g. "gpulab::swiglu_forward_kernel<float, 4>", so their
    bodies are compiled too (an uninstantiated template is barely checked)."""
    nvrtc = _library()
    prog = ctypes.c_void_p()
    _check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()), f"nvrtcAddNameExpression({expr})")
        opts = [f"--gpu-architecture={arch}", "-std=c++17", *TORCH_NVCC_DEFINES,
                *(f"-I{d}" for d in include_dirs()), *options]
        c_opts = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), c_opts)
        log_size = ctypes.c_size_t()
        _check(nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size)), "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(log_size.value)
        _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log_text = log.value.decode(errors="replace").strip()
        if status != 0:
            return CompileResult(arch, False, log_text)
        cubin_size = ctypes.c_size_t()
        _check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(cubin_size)), "nvrtcGetCUBINSize")
        lowered = {}
        for expr in name_expressions:
            name = ctypes.c_char_p()
            _check(nvrtc.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(name)), "nvrtcGetLoweredName")
            lowered[expr] = (name.value or b"").decode()
        return CompileResult(arch, True, log_text, cubin_size.value, lowered)
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
