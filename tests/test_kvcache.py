"""The KV cache read from a transformers Cache object matches the calculator's formula to the byte."""

from dataclasses import replace

import pytest
import torch

from gpulab.kvcache import cache_bytes, cache_length, cache_tensors
from gpulab.memory import kv_cache_bytes
from gpulab.models import build_model
from gpulab.presets import PRESETS

SHAPE = PRESETS["tiny"].shape


def forward_cache(shape, dtype=torch.float32, batch=2, tokens=10):
    model = build_model(shape, dtype=dtype).eval()
    ids = torch.randint(3, shape.vocab_size, (batch, tokens))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True).past_key_values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_match_the_formula(dtype):
    cache = forward_cache(SHAPE, dtype)
    assert cache_length(cache) == 10
    assert len(cache_tensors(cache)) == SHAPE.num_layers
    assert cache_bytes(cache) == kv_cache_bytes(SHAPE, 10, 2, dtype.itemsize)


def test_grouped_query_attention_shrinks_the_cache_by_heads_over_kv_heads():
    mha = cache_bytes(forward_cache(replace(SHAPE, num_kv_heads=SHAPE.num_heads)))
    gqa = cache_bytes(forward_cache(SHAPE))
    assert mha * SHAPE.num_kv_heads == gqa * SHAPE.num_heads


def test_legacy_tuples_and_missing_cache():
    k = torch.zeros(1, 2, 5, 8)
    legacy = ((k, k.clone()), (k.clone(), k.clone()))
    assert cache_length(legacy) == 5 and cache_bytes(legacy) == 4 * k.numel() * 4
    with pytest.raises(ValueError):
        cache_bytes(None)
