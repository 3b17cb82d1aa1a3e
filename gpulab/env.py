"""The lab header: which device to use, what is installed, and reproducible seeds."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import random

import torch

from gpulab.plots import use_book_style

PACKAGES = ("torch", "transformers", "peft", "bitsandbytes")


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def pick_device(prefer: str | None = None) -> torch.device:
    """CUDA, then Apple MPS, then CPU; `prefer` (or $GPULAB_DEVICE) forces one, e.g. "cpu"."""
    prefer = prefer or os.environ.get("GPULAB_DEVICE") or None
    if prefer:
        try:
            device = torch.device(prefer)
        except RuntimeError:  # torch's own message lists some twenty device types
            raise ValueError(f"GPULAB_DEVICE={prefer!r} is not a device: use cpu, cuda (or cuda:N) or mps, "
                             "or unset it to let the lab choose") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("GPULAB_DEVICE asks for cuda but torch sees no CUDA GPU "
                               f"(torch {torch.__version__}); unset it to run on the CPU")
        if device.type == "mps" and not _mps_available():
            raise RuntimeError("GPULAB_DEVICE asks for mps but torch sees no Apple GPU; unset it to run on the CPU")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def device_name(device: torch.device) -> str:
    """A human name: the GPU's product name, or the CPU's architecture and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple GPU (MPS)"
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device; None elsewhere (and for a CUDA device where torch has no CUDA)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return None


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 at full speed: a CUDA GPU with bf16 tensor cores (compute capability
    8.0 and later: A100, H100, RTX 30xx on) or an AMD GPU; a CPU or Apple GPU counts too (lab 0 measures
    what bf16 costs there). Below 8.0 (Colab's T4, a V100) torch emulates bf16: it runs, but slower than
    fp32, SDPA has no fused bf16 attention kernel (it falls back to math) and Inductor does not compile
    bf16 graphs. There the labs' checks of bf16's speed and fused attention say SKIP, and lab 4 fuses
    fp16 instead."""
    if device.type != "cuda":
        return True
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device)[0] >= 8


def require_memory(need_bytes: float, device: torch.device, what: str, fraction: float = 0.9) -> None:
    """Stop with a clear message when `what` needs more than `fraction` of the GPU's memory (by the
    memory calculator), before CUDA fails mid-lab with a bare out-of-memory error. No-op on a CPU."""
    have = device_memory_bytes(device)
    if have is not None and need_bytes > fraction * have:
        raise MemoryError(f"{what} needs about {need_bytes / 1e9:.0f} GB (the memory calculator), more than "
                          f"{fraction:.0%} of this GPU's {have / 1e9:.0f} GB: choose a smaller preset, "
                          f"e.g. GPULAB_PRESET=small")


def banner(device: torch.device) -> str:
    """The lines every lab prints first: device, memory and the versions that matter."""
    lines = [f"device: {device.type} - {device_name(device)}"]
    mem = device_memory_bytes(device)
    if mem is not None:
        cap = torch.cuda.get_device_capability(device)
        lines.append(f"GPU memory: {mem / 2**30:.1f} GiB, compute capability {cap[0]}.{cap[1]}")
    else:
        lines.append("no CUDA GPU: labs run their CPU preset and say what they cannot show")
    lines.append(f"python {platform.python_version()}, " +
                 ", ".join(f"{p} {package_version(p)}" for p in PACKAGES))
    return "\n".join(lines)


def seed_everything(seed: int = 0) -> None:
    """Seed Python, torch (CPU and every GPU) and numpy when present."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def setup(seed: int = 0, prefer: str | None = None) -> torch.device:
    """Pick the device, seed everything, set the plot style, print the banner; returns the device."""
    device = pick_device(prefer)
    seed_everything(seed)
    use_book_style()
    print(banner(device))
    return device
