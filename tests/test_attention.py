"""Attention by tiles with an online softmax equals SDPA, and the SDPA kernel that runs is named."""

import pytest
import torch
import torch.nn.functional as F

from gpulab.attention import BACKENDS, blocked_attention, naive_attention, sdpa, sdpa_backend, try_backend


def qkv(seq=100, heads=2, dim=16, dtype=torch.float32, requires_grad=False):
    gen = torch.Generator().manual_seed(seq)
    return tuple(torch.randn(1, heads, seq, dim, generator=gen, dtype=dtype, requires_grad=requires_grad)
                 for _ in range(3))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 8), (7, 13), (128, 128)])
def test_blocked_attention_matches_sdpa(causal, blocks):
    q, k, v = qkv()
    out, lse = blocked_attention(q, k, v, *blocks, causal=causal)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal), atol=1e-5)
    scores = q @ k.transpose(-1, -2) / 4
    if causal:
        scores = scores.masked_fill(torch.ones(100, 100, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, scores.logsumexp(-1), atol=1e-5)
    assert torch.allclose(naive_attention(q, k, v, causal=causal), out, atol=1e-5)


def test_blocked_attention_keeps_the_input_dtype_and_a_scale():
    q, k, v = qkv(dtype=torch.bfloat16)
    out, lse = blocked_attention(q, k, v, 32, 32, scale=0.1)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.1)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # only the final rounding to bf16 is allowed: half a bf16 step (2**-8 relative), tiles computed in fp32
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-5)


def test_blocked_attention_rejects_bad_input():
    q, k, v = qkv()
    with pytest.raises(ValueError):
        blocked_attention(q, k[..., :50, :], v)
    with pytest.raises(ValueError):
        blocked_attention(q, k, v, block_q=0)


def test_the_cpu_kernels_are_named_and_refusals_explained():
    q, k, v = qkv(requires_grad=True)
    assert try_backend(None, sdpa(q, k, v, is_causal=True)).kernel == "flash (CPU)"
    assert try_backend(BACKENDS["math"], sdpa(q, k, v, is_causal=True)).kernel == "math"
    refused = try_backend(BACKENDS["flash"], sdpa(q, k, v, is_causal=True, dropout_p=0.5))
    assert not refused.ok and "dropout" in refused.reason
    # CUDA-only kernels cannot run on CPU tensors: a refusal, not an exception
    assert not try_backend(BACKENDS["memory-efficient"], sdpa(q, k, v)).ok


def test_sdpa_backend_needs_an_autograd_node():
    q, k, v = qkv()
    with pytest.raises(ValueError):
        sdpa_backend(F.scaled_dot_product_attention(q, k, v))
