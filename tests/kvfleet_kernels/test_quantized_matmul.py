"""The Triton matmuls on quantized weights (kvfleet_kernels/quantized_matmul.py; TRITON_INTERPRET=1
on the CPU, compiled by make gpu-check) against the fp32 product of the weights they stand for:
QuantizedWeight.dequantize for the integer codes, the fp8 values times their scales."""

from __future__ import annotations

import pytest
import torch

from kvfleet_kernels.cpu_quantized_linear import QuantizedWeight
from kvfleet_kernels.quantized_matmul import fp8_matmul, pack_weight, quantized_matmul


def random_weight(out_features: int, in_features: int, bits: int, group_size: int, ordered: bool,
                  seed: int = 0) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    codes = torch.randint(0, 2**bits, (out_features, in_features), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(out_features, groups, generator=generator) * 0.05).half()
    offset = (torch.randn(out_features, groups, generator=generator) * 0.05).half()
    order = None if ordered else torch.randperm(in_features, generator=generator)  # GPTQ's desc_act
    return QuantizedWeight(codes.to(torch.get_default_device()), scale.to(torch.get_default_device()),
                           offset.to(torch.get_default_device()), bits,
                           None if order is None else order.to(torch.get_default_device()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 128])  # Q6_K, GGUF's legacy and K types, AWQ/GPTQ
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 70])
@pytest.mark.parametrize("ordered", [True, False])
def test_quantized_matmul_is_the_product_of_the_weights_the_codes_stand_for(bits, group_size, rows, ordered):
    weight = random_weight(72, 256, bits, group_size, ordered)  # 72: a partial tile of columns
    x = torch.randn(rows, 256)
    expected = x @ weight.dequantize().T
    got = quantized_matmul(x, pack_weight(weight))
    torch.testing.assert_close(got, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)


@pytest.mark.skipif(torch.get_default_device().type != "cuda",
                    reason="Triton's interpreter computes in fp32 only: bf16 runs under make gpu-check")
def test_quantized_matmul_keeps_bf16_inputs_in_bf16():
    weight = random_weight(64, 128, 4, 32, True)
    x = torch.randn(9, 128).bfloat16()
    got = quantized_matmul(x, pack_weight(weight))
    expected = x.float() @ weight.dequantize().T
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=0.02 * expected.abs().max().item(), rtol=0.02)


def test_four_bit_codes_take_half_a_byte_each():
    packed = pack_weight(random_weight(64, 256, 4, 128, True))
    assert packed.codes.shape == (64, 128) and packed.nbytes == 64 * 128 + 2 * 64 * 2 * 2
    with pytest.raises(ValueError, match="groups of a multiple of 16"):
        pack_weight(random_weight(64, 256, 4, 8, True))


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("rows, in_features", [(1, 200), (17, 128), (40, 72)])  # 200, 72: a partial last tile
def test_fp8_matmul_is_the_product_of_the_scaled_fp8_weights(per_channel, rows, in_features):
    weight = (torch.randn(40, in_features) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(40) + 0.5 if per_channel else torch.tensor(0.7)
    x = torch.randn(rows, in_features)
    expected = x @ (weight.float() * (scale.reshape(-1, 1) if per_channel else scale)).T
    torch.testing.assert_close(fp8_matmul(x, weight, scale), expected, atol=1e-4 * expected.abs().max().item(),
                               rtol=1e-4)
