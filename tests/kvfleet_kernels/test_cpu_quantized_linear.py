"""The CPU linear on quantized weights (kvfleet_kernels/cpu_quantized_linear.py) against its
definition: y = x @ (a * code - b)^T + bias, computed in float64 from the weight's own codes and
scales. Against the activations as the kernel rounds them (int16 per 32 features) it is exact
but for fp32 summation; against the unrounded activations, within int16's rounding."""

from __future__ import annotations

import pytest
import torch

from kvfleet_kernels import cpu_quantized_linear as kernels
from tests.kvfleet_kernels.native import native_cpu

pytestmark = native_cpu

CASES = [  # bits, group size, out features, in features, rows
    (4, 32, 100, 256, 1), (4, 16, 64, 128, 3), (8, 32, 48, 64, 9), (8, 16, 33, 96, 17),
    (4, 128, 70, 512, 70), (8, 256, 16, 512, 2), (4, 32, 17, 32, 6), (8, 32, 200, 96, 131),
    (6, 16, 40, 96, 5), (6, 32, 33, 64, 20), (6, 64, 16, 256, 1),
]


def random_weight(bits: int, group: int, n: int, k: int, generator: torch.Generator) -> kernels.QuantizedWeight:
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(n, k // group, generator=generator) * 0.02).half()
    offset = (torch.randn(n, k // group, generator=generator) * 0.05).half()
    return kernels.QuantizedWeight(codes, scale, offset, bits)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per 32 features s = max|x| / 32512, round(x / s) * s (float64)."""
    blocks = x.double().view(x.shape[0], -1, 32)
    s = (blocks.abs().amax(-1, keepdim=True).float() / 32512).double()
    return (torch.round(blocks / s.clamp_min(1e-300)) * s).view(x.shape)


@pytest.mark.parametrize(("bits", "group", "n", "k", "rows"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_product_is_the_dequantized_weights_in_float64(bits, group, n, k, rows, dtype):
    generator = torch.Generator().manual_seed(bits * 1000 + n)
    weight = random_weight(bits, group, n, k, generator)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator)
    out = torch.empty(rows, n, dtype=dtype)
    kernels.linear(kernels.quantize_activations(x), kernels.pack_weight(weight), bias, out)
    dense = weight.dequantize().double()
    exact = rounded_activations(x) @ dense.T + bias.double()
    unrounded = x.double() @ dense.T + bias.double()
    scale = unrounded.abs().max()
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8  # bf16 output: one rounding of the result
    assert (out.double() - exact).abs().max() <= tolerance * scale
    assert (out.double() - unrounded).abs().max() <= max(tolerance, 1e-4) * scale


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 16), (6, 16), (6, 32), (8, 32), (8, 16)])
def test_the_largest_codes_and_digits_sum_without_saturating(bits, group):
    """Every code at its largest and every activation's digits at their extremes (q = +-32384:
    high digit +-127, low -128 or 128 - 256): the sums the integer dot products hold at their
    fullest (AVX2's int16 pair sums over a unit) still give the exact product."""
    n, k = 32, 128
    weight = kernels.QuantizedWeight(torch.full((n, k), 2 ** bits - 1, dtype=torch.uint8),
                                     torch.full((n, k // group), 0.5).half(), torch.zeros(n, k // group).half(), bits)
    x = torch.full((4, k), 32384 / 32512)
    x[:, ::32] = 1.0  # each block's max, so that q = 32512 there and 32384 elsewhere
    x[1::2] *= -1
    out = torch.empty(4, n)
    kernels.linear(kernels.quantize_activations(x), kernels.pack_weight(weight), None, out)
    expected = rounded_activations(x) @ weight.dequantize().double().T
    assert (out.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_parts_write_their_own_columns_of_a_wider_output_and_nothing_else():
    generator = torch.Generator().manual_seed(7)
    first, second = random_weight(4, 32, 48, 128, generator), random_weight(8, 16, 20, 128, generator)
    x = torch.randn(5, 128, generator=generator)
    out = torch.full((5, 80), float("nan"))
    activations = kernels.quantize_activations(x)
    kernels.linear(activations, kernels.pack_weight(first), None, out[:, :48])
    kernels.linear(activations, kernels.pack_weight(second), None, out[:, 48:68])
    assert out[:, 68:].isnan().all()
    expected = rounded_activations(x) @ torch.cat([first.dequantize(), second.dequantize()]).double().T
    assert torch.allclose(out[:, :68].double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


def activation_digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations' definition: per 32 features s = max|x| / 32512, q = round(x * (32512 /
    max|x|)) in fp32, ties to even, as two digits h = floor((q + 128) / 256), l = q - 256 h (a row: every
    h, then every l); meta: s per 32, s * sum(q) per 32, s * sum(q) per 16."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # tensor / tensor: torch computes a number / tensor as a reciprocal times the number, which
    # rounds twice and parts from the kernel's one division now and then
    inverse = torch.where(amax > 0, torch.full_like(amax, 32512.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse).to(torch.int32)
    high = torch.div(q + 128, 256, rounding_mode="floor")
    digits = torch.cat([high.flatten(1), (q - 256 * high).flatten(1)], dim=1).to(torch.int8)
    s = (amax / 32512).squeeze(-1)
    halves = q.view(x.shape[0], -1, 2, 16).sum(-1).float()  # [rows, K / 32, 2]
    meta = torch.cat([s, s * halves.sum(-1), (s[..., None] * halves).flatten(1)], dim=1)
    return digits, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("rows", "k"), [(1, 32), (3, 576), (9, 1536)])
def test_activations_round_to_their_two_digits_exactly(dtype, rows, k):
    generator = torch.Generator().manual_seed(rows * k)
    wide = (torch.randn(rows, 2 * k, generator=generator) * 3).to(dtype)
    x = wide[:, :k]  # rows 2K apart
    x[0, :32] = 0  # a block of zeros: s = 0, every digit 0
    if k > 32:  # a tie: 0.5 * (32512 / 256) = 63.5 rounds to even, 64
        x[0, 32:64] = torch.tensor([256.0] + [0.5] * 31).to(dtype)
    xq, xmeta = kernels.quantize_activations(x)
    digits, meta = activation_digits(x)
    assert torch.equal(xq, digits)
    torch.testing.assert_close(xmeta, meta, rtol=1e-6, atol=0)  # s * sum: the same fp32 products


PATHS = ["integer", pytest.param("amx", marks=pytest.mark.skipif(not kernels.amx_available(),
                                                                 reason="the AMX path needs amx_bf16"))]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 3, 70])  # 70: two blocks of rows
def test_parts_in_one_call_are_each_part_alone_side_by_side(rows, path):
    """A merged projection's parts of mixed bits, groups, widths and held offsets (a Q4_K_M qkv:
    4-bit q and k, 6-bit v) in one call: each part's columns are what it computes alone, bit for
    bit, and the bias lands on the right columns; on the integer products and on AMX tiles."""
    generator = torch.Generator().manual_seed(rows)
    weights = [random_weight(4, 32, 48, 128, generator), random_weight(4, 16, 20, 128, generator),
               random_weight(6, 16, 33, 128, generator), random_weight(8, 32, 16, 128, generator)]
    symmetric = weights[3]
    symmetric.offset = (symmetric.scale.float() * 128).half()  # b = 128 a: held without offsets
    packed = [kernels.pack_weight(weight) for weight in weights]
    assert packed[3].zero_point == 128 and packed[0].zero_point is None
    x, bias = torch.randn(rows, 128, generator=generator), torch.randn(117, generator=generator)
    activations, parts, alone_linear = (kernels.quantize_activations(x), kernels.linear_parts, kernels.linear) \
        if path == "integer" else (x.bfloat16(), kernels.linear_amx_parts, kernels.linear_amx)
    for dtype in (torch.float32, torch.bfloat16):
        together = parts(activations, packed, bias, torch.empty(rows, 117, dtype=dtype))
        alone, start = torch.full((rows, 117), float("nan"), dtype=dtype), 0
        for weight in packed:
            end = start + weight.out_features
            alone_linear(activations, weight, bias[start:end], alone[:, start:end])
            start = end
        assert torch.equal(together, alone)
    with pytest.raises(RuntimeError, match="out must have the parts' 117 columns"):
        parts(activations, packed, None, torch.empty(rows, 116))


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 16), (4, 128), (6, 16), (6, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_whole_weights_and_single_rows_dequantize_exactly(bits, group, dtype):
    generator = torch.Generator().manual_seed(group)
    weight = random_weight(bits, group, 37, 256, generator)
    packed = kernels.pack_weight(weight)
    dense = weight.dequantize()
    out = torch.empty(37, 256, dtype=dtype)
    assert torch.equal(kernels.dequantize_weight(packed, out), dense.to(dtype))
    ids = torch.tensor([36, 0, 17, 17, 16])
    assert torch.equal(kernels.dequantize_rows(packed, ids), dense[ids])


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_the_packed_weight_is_the_codes_bits_and_two_fp16_a_group(bits):
    weight = random_weight(bits, 32, 64, 256, torch.Generator().manual_seed(0))
    packed = kernels.pack_weight(weight)
    assert packed.nbytes == 64 * 256 * bits // 8 + 64 * (256 // 32) * 2 * 2


@pytest.mark.parametrize(("bits", "group", "zero_point"), [(4, 32, 8), (6, 16, 32), (8, 32, 128), (4, 16, 1)])
def test_a_symmetric_weight_is_held_without_its_offsets_and_computes_the_same(bits, group, zero_point):
    """b = z a everywhere (GGUF's Q4_0, Q6_K, Q8_0; GPTQ's sym): the packed form keeps a alone, half the
    scale bytes, and its product, whole dequantization and row lookups are the definition's."""
    generator = torch.Generator().manual_seed(bits + zero_point)
    weight = random_weight(bits, group, 40, 128, generator)
    weight.offset = (weight.scale.float() * zero_point).half()
    packed = kernels.pack_weight(weight)
    assert packed.zero_point == zero_point
    assert packed.scales.numel() == 3 * 16 * (128 // group)  # 3 panels, one fp16 a group and column
    x = torch.randn(7, 128, generator=generator)
    out = torch.empty(7, 40)
    kernels.linear(kernels.quantize_activations(x), packed, None, out)
    dense = weight.dequantize()
    expected = rounded_activations(x) @ dense.double().T
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(kernels.dequantize_weight(packed, torch.empty(40, 128)), dense)
    ids = torch.tensor([39, 0, 21])
    assert torch.equal(kernels.dequantize_rows(packed, ids), dense[ids])
    if kernels.amx_available():
        out_amx = torch.empty(7, 40)
        kernels.linear_amx(x.bfloat16(), packed, None, out_amx)
        bf16 = x.bfloat16().double() @ dense.bfloat16().double().T
        assert (out_amx.double() - bf16).abs().max() <= 1e-6 * bf16.abs().max()


def test_a_bad_shape_is_an_error_not_a_crash():
    weight = random_weight(4, 32, 16, 64, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.quantize_activations(torch.randn(2, 48))
    with pytest.raises(RuntimeError, match="below 2\\^bits"):
        kernels.pack_weight(kernels.QuantizedWeight(torch.full((16, 64), 64, dtype=torch.uint8), weight.scale,
                                                    weight.offset, 6))
    with pytest.raises(RuntimeError, match="must come from pack_quantized_weight"):  # K 32, weight 64
        kernels.linear(kernels.quantize_activations(torch.randn(2, 32)), kernels.pack_weight(weight), None,
                       torch.empty(2, 16))


@pytest.mark.skipif(not kernels.amx_available(), reason="the AMX path needs amx_bf16")
@pytest.mark.parametrize(("bits", "group", "n", "k", "rows"), CASES)
def test_on_amx_tiles_the_product_is_the_weight_dequantized_to_bf16(bits, group, n, k, rows):
    """x stays bf16 and the weight is rounded once to bf16, panel by panel: the product equals
    x @ W_bf16^T summed in fp32, within summation order."""
    generator = torch.Generator().manual_seed(bits * 100 + rows)
    weight = random_weight(bits, group, n, k, generator)
    packed = kernels.pack_weight(weight)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator)
    out = torch.full((rows, n + 3), float("nan"))
    kernels.linear_amx(x, packed, bias, out[:, :n])
    dense = kernels.dequantize_weight(packed, torch.empty(n, k, dtype=torch.bfloat16))
    assert torch.equal(dense, weight.dequantize().bfloat16())
    expected = x.double() @ dense.double().T + bias.double()
    assert out[:, n:].isnan().all()
    assert (out[:, :n].double() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_groups_of_rows_each_times_its_own_weight_in_one_call():
    # An MoE layer's experts: rows [0, 3) times group 0's two parts, none for group 1, [3, 70) (two
    # blocks of 64 rows) times group 2's: each group's rows as linear_parts computes them alone.
    generator = torch.Generator().manual_seed(11)
    k, offsets = 96, [0, 3, 3, 70]
    groups = [[kernels.pack_weight(random_weight(bits, group, n, k, generator)) for bits, group, n in parts]
              for parts in ([(4, 32, 40), (6, 16, 24)], [(8, 32, 40), (4, 16, 24)], [(8, 16, 40), (4, 32, 24)])]
    x = torch.randn(70, k, generator=generator)
    activations = kernels.quantize_activations(x)
    out = torch.full((70, 64), float("nan"))
    kernels.linear_grouped(activations, offsets, groups, out)
    for g, parts in enumerate(groups):
        rows = slice(offsets[g], offsets[g + 1])
        alone = torch.empty(offsets[g + 1] - offsets[g], 64)
        kernels.linear_parts(kernels.quantize_activations(x[rows]), parts, None, alone)
        assert torch.equal(out[rows], alone), g
    with pytest.raises(RuntimeError, match="row_offsets must run from 0 to x's 70 rows"):
        kernels.linear_grouped(activations, [0, 3, 3, 69], groups, out)
    narrow = kernels.pack_weight(random_weight(4, 16, 16, k, generator))
    with pytest.raises(RuntimeError, match="group 1's parts have 56 columns, out 64"):
        kernels.linear_grouped(activations, offsets, [groups[0], [groups[1][0], narrow], groups[2]], out)
