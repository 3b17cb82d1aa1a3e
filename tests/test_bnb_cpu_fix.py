"""gpulab.bnb_cpu_fix: the reference 4-bit dequantization, the gap measure, and the CPU kernel it registers."""

import pytest
import torch

from gpulab.nf4 import dequantize_nf4, quantize_nf4

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")
fix = pytest.importorskip("gpulab.bnb_cpu_fix")


def linear4bit(out_f, in_f, quant_type="nf4", double_quant=True):
    torch.manual_seed(0)
    dense = torch.nn.Linear(in_f, out_f, bias=False)
    torch.nn.init.normal_(dense.weight, std=0.02)
    layer = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.float32, quant_type=quant_type,
                              compress_statistics=double_quant)
    layer.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type=quant_type,
                                     compress_statistics=double_quant)
    layer = layer.to("cpu")  # quantizes
    layer.support_avx512bf16_for_cpu = False
    return dense, layer


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_reference_matches_table_lookup(quant_type, double_quant):
    dense, layer = linear4bit(64, 128, quant_type, double_quant)
    w = layer.weight
    ref = fix.reference_dequantize(w.data, w.quant_state)
    assert ref.shape == dense.weight.shape and ref.dtype == torch.float32
    # a 4-bit grid keeps every weight within its block's absmax of the original
    assert (ref - dense.weight).abs().max() < dense.weight.abs().max()
    # rows of 128, a multiple of 64, where bitsandbytes' own kernel is right: the same weights (bit for bit
    # on this CPU; 1e-6 leaves room for another CPU's rounding order). With double quantization this checks
    # that the 8-bit constants are restored as bitsandbytes does (without their mean, 0.05 here, some are 148% off)
    torch.testing.assert_close(ref, F.dequantize_4bit(w.data, w.quant_state), rtol=1e-6, atol=0)
    if quant_type == "nf4" and not double_quant:
        packed, absmax = quantize_nf4(dense.weight)
        assert torch.equal(ref, dequantize_nf4(packed, absmax, dense.weight.shape,
                                               levels=F.get_4bit_type("nf4", device="cpu")))


def test_reference_kernel_makes_ragged_rows_right():
    fix.use_reference_cpu_dequantize()
    try:
        for shape in [(32, 688), (64, 128)]:  # rows of 688 are not a multiple of 64
            _, layer = linear4bit(*shape)
            assert max(fix.dequantize_gaps(torch.nn.Sequential(layer)).values()) == 0.0
            x = torch.randn(3, shape[1])
            ref = x @ fix.reference_dequantize(layer.weight.data, layer.weight.quant_state).t()
            torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-6)
    finally:
        fix.restore_bnb_cpu_dequantize()


def test_reference_kernel_can_be_undone():
    # without the bug the reference kernel and bitsandbytes' agree, so undoing it cannot be seen
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        pytest.skip(f"bitsandbytes' CPU kernel is right here: the bug is in its AVX512 path, torch reports "
                    f"{capability}")
    # rows of 688 (not a multiple of 64): the layer bitsandbytes 0.50.2's AVX-512 CPU kernel gets wrong
    _, ragged = linear4bit(32, 688)
    before = max(fix.dequantize_gaps(torch.nn.Sequential(ragged)).values())
    assert before > 0.1  # the bug shows (and no reference kernel is left registered by another test)
    fix.use_reference_cpu_dequantize()
    try:
        assert max(fix.dequantize_gaps(torch.nn.Sequential(ragged)).values()) == 0.0
    finally:
        fix.restore_bnb_cpu_dequantize()
    # bitsandbytes' own kernel is back: the same gap as before
    assert max(fix.dequantize_gaps(torch.nn.Sequential(ragged)).values()) == before
