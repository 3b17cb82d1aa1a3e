"""The KV cache a `transformers` model holds during generation: its tensors, bytes and length.

In transformers 5 `generate(..., return_dict_in_generate=True).past_key_values` (and a forward pass
with `use_cache=True`) returns a `Cache` object, such as `DynamicCache`, whose `layers[i].keys` and
`layers[i].values` are `(batch, kv_heads, cached_tokens, head_dim)` tensors. Older code passes a tuple
of `(key, value)` pairs per layer; both are read here, so the lab's numbers come from the tensors
themselves and can be held against `gpulab.memory.kv_cache_bytes`.
"""

from __future__ import annotations

from typing import Any

import torch

from gpulab.memory.measure import tensor_bytes


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of every layer, each `(batch, kv_heads, cached_tokens, head_dim)`."""
    if cache is None:
        raise ValueError("no cache: was the model run with use_cache=True?")
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers 5 (and late 4.x): a Cache holds one layer object per layer
        pairs = [(layer.keys, layer.values) for layer in layers]
    else:  # the legacy format: a tuple of (key, value) per layer
        pairs = [(k, v) for k, v in cache]
    if any(k is None or v is None for k, v in pairs):
        raise ValueError("a cache layer holds no tensors yet (nothing was cached)")
    return pairs


def cache_bytes(cache: Any) -> int:
    """Bytes of the storages behind every cached key and value (shared storage counted once)."""
    return tensor_bytes(t for pair in cache_tensors(cache) for t in pair)


def cache_length(cache: Any) -> int:
    """Tokens cached, read from the first layer's keys (the sequence axis, -2)."""
    return int(cache_tensors(cache)[0][0].shape[-2])
