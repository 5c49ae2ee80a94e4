"""Shared layers against their torch.nn counterparts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.layers import OneDNNLinear, bucket_rows, can_use_onednn_linear


def test_row_buckets_keep_decode_sizes_and_bound_the_shapes():
    assert [bucket_rows(n) for n in (1, 7, 64)] == [1, 7, 64]
    assert [bucket_rows(n) for n in (65, 72, 73, 129, 1000, 8192)] == [72, 72, 80, 144, 1024, 8192]
    sizes = range(1, 8193)
    assert all(n <= bucket_rows(n) <= n * 1.125 for n in sizes)  # at most 12.5% padding
    assert len({bucket_rows(n) for n in sizes}) == 64 + 7 * 8  # what oneDNN sees: 120 shapes, not 8192


@pytest.mark.skipif(not can_use_onednn_linear(torch.device("cpu"), torch.float32), reason="needs oneDNN")
@pytest.mark.parametrize("num_rows", [1, 33, 64, 65, 100, 513])
def test_onednn_linear_equals_nn_linear_for_any_row_count(num_rows):
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    x = torch.randn(num_rows, 48)
    got = OneDNNLinear(linear, batch_size_hint=64)(x)
    assert got.shape == (num_rows, 40)
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


def brgemm_available() -> bool:
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415 (builds the native library)

    return cpu_linear.available()


needs_brgemm = pytest.mark.skipif(not brgemm_available(), reason="torch's brgemm has no bf16 on this CPU, or no compiler")


@needs_brgemm
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 64, 64), (17, 100, 576), (64, 960, 576),
                                                             (300, 3072, 576), (513, 70, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_brgemm_linear_rounds_the_fp32_product_to_bf16(rows, out_features, in_features, with_bias):
    """Row counts across the 256-row blocks, widths off the 64-column blocks: fp32 sums of exact
    bf16 products, rounded once to bf16 (with the bias added in fp32 first), as a bf16 matmul's
    are. Only the order of the fp32 sums differs from torch's, so an output sitting on a
    rounding boundary may land one bf16 ulp away: nearly all must be equal."""
    from engine.models.layers import BrgemmLinear  # noqa: PLC0415

    generator = torch.Generator().manual_seed(rows * out_features)
    linear = nn.Linear(in_features, out_features, bias=with_bias).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator))
        if with_bias:
            linear.bias.copy_(torch.randn(out_features, generator=generator))
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    expected = x.float() @ linear.weight.float().t()
    expected = (expected + linear.bias.float() if with_bias else expected).bfloat16()
    got = BrgemmLinear(linear)(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)
    assert (got == expected).float().mean() > 0.999
    strided = torch.cat([x, x], dim=1)[:, :in_features]  # rows 2 * in_features apart, read in place
    assert torch.equal(BrgemmLinear(linear)(strided), got)
    assert torch.equal(BrgemmLinear(linear)(x.float()), got)  # other dtypes are cast to bf16 first


@needs_brgemm
def test_brgemm_pack_refuses_what_it_cannot_lay_out():
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    with pytest.raises(RuntimeError, match="K must be even"):
        cpu_linear.pack_weight(torch.ones(64, 7))
    packed = cpu_linear.pack_weight(torch.ones(64, 8))
    with pytest.raises(RuntimeError, match="packed must come from pack_brgemm_weight for x's K"):
        cpu_linear.linear(torch.ones(2, 16, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(RuntimeError, match="N the packed weight's"):
        cpu_linear.linear(torch.ones(2, 8, dtype=torch.bfloat16), packed, 65)


@pytest.mark.parametrize("preferred", [False, True])
def test_bf16_linears_take_brgemm_exactly_where_preferred(monkeypatch, preferred):
    """bf16 weights with an even in_features go to BrgemmLinear on CPUs where it is preferred
    (AMX), everything else to OneDNNLinear; fp32 models always to OneDNNLinear."""
    from engine.models import layers  # noqa: PLC0415
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    if not can_use_onednn_linear(torch.device("cpu"), torch.bfloat16) or (preferred and not brgemm_available()):
        pytest.skip("needs oneDNN's bf16 matmul and torch's bf16 brgemm")
    monkeypatch.setattr(cpu_linear, "preferred", lambda: preferred)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 7), nn.Linear(7, 5)).bfloat16()
    layers.use_onednn_linears(model, batch_size_hint=8)
    brgemm = "BrgemmLinear" if preferred else "OneDNNLinear"
    assert [type(m).__name__ for m in model] == [brgemm, brgemm, "OneDNNLinear"]  # 7 inputs: no bf16 pairs
    fp32 = nn.Sequential(nn.Linear(64, 32))
    layers.use_onednn_linears(fp32, batch_size_hint=8)
    assert type(fp32[0]).__name__ == "OneDNNLinear"
