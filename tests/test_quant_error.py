"""gpulab.quant_error: the from-scratch int4 quantizer and the error measures the QLoRA lab compares formats with."""

import pytest
import torch

from gpulab.quant_error import (dequantize_int4, excess_kurtosis, int4_roundtrip, quantize_int4,
                                relative_errors)


@pytest.mark.parametrize("shape", [(256, 128), (256, 688), (33, 7)])
def test_int4_codes_and_error_bound(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape) * 0.02
    codes, absmax = quantize_int4(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 7 and codes.numel() == w.numel()
    assert absmax.numel() == -(-w.numel() // 64)
    back = dequantize_int4(codes, absmax, w.shape)
    # every weight within half a step of the grid: absmax / 14 of its block
    err = (back - w).reshape(-1)
    bound = (absmax / 14).repeat_interleave(64)[: w.numel()]
    assert torch.all(err.abs() <= bound * (1 + 1e-6))
    # the block's largest weight is exact (it sits on +-7/7)
    assert torch.allclose(back.reshape(-1).abs().max(), w.abs().max())


def test_int4_zero_block_and_exact_grid():
    w = torch.zeros(2, 64)
    w[1] = torch.arange(-32, 32) / 32
    back = int4_roundtrip(w)
    assert torch.equal(back[0], torch.zeros(64)), "an all-zero block comes back zero (absmax 0: no 0/0)"
    assert (back[1] - w[1]).abs().max() <= 1 / 14 * (1 + 1e-6), "its neighbour within half a step"
    assert torch.equal(int4_roundtrip(torch.zeros(3, 64)), torch.zeros(3, 64))
    grid = (torch.arange(-7, 8).float() / 7).repeat(5)[:64].reshape(1, 64)
    assert torch.allclose(int4_roundtrip(grid), grid)


def test_relative_errors_pool_tensors():
    w = [torch.ones(4), 2 * torch.ones(4)]
    approx = [torch.ones(4) * 1.5, 2 * torch.ones(4)]
    mean, rms = relative_errors(w, approx)
    assert mean == pytest.approx(2.0 / 12.0)
    assert rms == pytest.approx((4 * 0.25 / (4 + 16)) ** 0.5)
    assert relative_errors(w, w) == (0.0, 0.0)
    with pytest.raises(ValueError):
        relative_errors(w, approx[:1])


def test_nf4_beats_int4_on_normal_weights_and_kurtosis():
    F = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    w = torch.randn(512, 512) * 0.02
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    nf4 = relative_errors([w], [F.dequantize_4bit(packed, state)])
    int4 = relative_errors([w], [int4_roundtrip(w)])
    assert nf4[0] < int4[0] and nf4[1] < int4[1]
    assert abs(excess_kurtosis([w])) < 0.1
    assert excess_kurtosis([torch.rand(100_000)]) == pytest.approx(-1.2, abs=0.05)  # uniform
