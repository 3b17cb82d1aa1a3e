"""Build Llama-architecture models from a shape (random init, nothing downloaded), or, opt-in, load a
real checkpoint by name."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from gpulab.memory.shapes import ModelShape


def llama_config(shape: ModelShape, attn_implementation: str = "sdpa", max_positions: int = 4096) -> LlamaConfig:
    return LlamaConfig(  # type: ignore[call-arg]  # attn_implementation is a PretrainedConfig kwarg
        **shape.to_config_kwargs(), attn_implementation=attn_implementation,
        max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_model(shape: ModelShape, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                attn_implementation: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` with `shape`, randomly initialised on `device` in `dtype`, in train mode."""
    torch.manual_seed(seed)
    config = llama_config(shape, attn_implementation)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype=dtype)  # type: ignore[call-arg]  # transformers wraps `to`; mypy misreads it
    return model.train()


def load_pretrained(name_or_path: str, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.bfloat16, **kwargs) -> torch.nn.Module:
    """Opt-in: a real checkpoint (e.g. "meta-llama/Llama-3.2-1B"), from a local path or the hub cache.

    Only safetensors weights are accepted and no code from the checkpoint runs.
    """
    return AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=dtype, device_map={"": str(device)}, trust_remote_code=False,
        use_safetensors=True, **kwargs)
