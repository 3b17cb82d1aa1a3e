"""gpulab.nf4 against bitsandbytes: the same NF4 levels, codes, absmax and dequantized values."""

import pytest
import torch

from gpulab.memory.calculator import quantized_bytes_per_param
from gpulab.nf4 import constant_bits_per_param, dequantize_nf4, nf4_levels, quantize_nf4

F = pytest.importorskip("bitsandbytes.functional")


def test_levels_are_normal_quantiles_matching_bitsandbytes():
    levels = nf4_levels()
    assert levels.shape == (16,) and levels[0] == -1 and levels[-1] == 1 and levels[7] == 0
    assert torch.all(levels[1:] > levels[:-1])
    # bitsandbytes hard-codes the table the paper prints; ours is built, within one float32 ulp
    torch.testing.assert_close(levels, F.get_4bit_type("nf4", device="cpu"), rtol=0, atol=1.2e-7)


@pytest.mark.parametrize("shape", [(256, 128), (688, 256), (33, 7)])
def test_codes_and_absmax_equal_bitsandbytes(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape) * 0.02
    packed, absmax = quantize_nf4(w)
    ref, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(packed, ref) and torch.equal(absmax, state.absmax)
    table = F.get_4bit_type("nf4", device="cpu")
    assert torch.equal(dequantize_nf4(packed, absmax, w.shape, levels=table), F.dequantize_4bit(ref, state))


def test_round_trip_error_is_within_half_a_level_gap():
    torch.manual_seed(1)
    w = torch.randn(64, 64)
    packed, absmax = quantize_nf4(w)
    err = (dequantize_nf4(packed, absmax, w.shape) - w).abs().view(-1, 64)
    gaps = nf4_levels().diff().max()
    assert torch.all(err <= absmax[:, None] * gaps / 2 + 1e-6)


def test_constant_bits_match_the_paper_and_the_calculator():
    assert constant_bits_per_param(False) == 0.5
    assert constant_bits_per_param(True) == pytest.approx(0.127, abs=5e-4)
    for dq in (False, True):
        assert 4 + constant_bits_per_param(dq) == pytest.approx(8 * quantized_bytes_per_param("nf4", dq))
