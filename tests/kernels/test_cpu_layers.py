"""The native CPU layers against the torch reference (kernels/reference.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.cpu_paged_attention import load_error

pytestmark = pytest.mark.skipif(load_error() is not None, reason="no C++ compiler: the native kernels cannot build")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (300, 64), (5, 4, 32)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_rounds_where_transformers_does(dtype, shape, with_residual):
    from kernels.cpu_layers import add_rms_norm  # noqa: PLC0415

    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    residual = (torch.randn(shape, generator=generator) * 3).to(dtype) if with_residual else None
    weight = torch.randn(shape[-1], generator=generator).to(dtype)
    expected = reference.rms_norm(x, weight, 1e-6, residual)
    got = add_rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], expected[1])  # the same rounding of x + residual
        got, expected = got[0], expected[0]
    assert got.shape == expected.shape and got.dtype == dtype
    # fp32 statistics summed in another order: the normed value may round one ulp apart, and the
    # product with the weight rounds again: two ulps at most.
    torch.testing.assert_close(got, expected, rtol=2 ** -6 if dtype == torch.bfloat16 else 2 ** -9, atol=1e-5)
    assert (got == expected).float().mean() > 0.97


def test_add_rms_norm_refuses_fp32():
    from kernels.cpu_layers import add_rms_norm  # noqa: PLC0415

    with pytest.raises(RuntimeError, match="add_rms_norm runs bf16 and fp16"):
        add_rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 384), (37, 384), (300, 1024)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_layer_norm_is_the_fp32_torch_path_and_its_copy(x_dtype, low_dtype, shape, with_residual):
    """As bert.py's torch path computes it: x widened, plus the fp32 residual, LayerNorm in
    fp32; the low-precision copy is the fp32 result rounded to nearest even."""
    from kernels.cpu_layers import add_layer_norm  # noqa: PLC0415

    generator = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=generator) * 2 + 0.5).to(x_dtype)
    residual = torch.randn(shape, generator=generator) * 3 if with_residual else None
    weight, bias = torch.randn(shape[-1], generator=generator), torch.randn(shape[-1], generator=generator)
    summed = x.float() + residual if with_residual else x.float()
    expected = torch.nn.functional.layer_norm(summed, shape[-1:], weight, bias, 1e-12)
    got, got_low = add_layer_norm(x, residual, weight, bias, 1e-12, low_dtype)
    assert got.dtype == torch.float32 and got_low.dtype == low_dtype and got_low.shape == shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # fp32 sums in another order
    assert torch.equal(got_low, got.to(low_dtype))


def test_add_layer_norm_reads_strided_rows_and_refuses_what_it_cannot():
    from kernels.cpu_layers import add_layer_norm  # noqa: PLC0415

    wide = torch.randn(6, 64)
    weight, bias = torch.ones(32), torch.zeros(32)
    got, _ = add_layer_norm(wide[:, :32], None, weight, bias, 1e-5, torch.bfloat16)  # rows 64 apart
    torch.testing.assert_close(got, torch.nn.functional.layer_norm(wide[:, :32], (32,), eps=1e-5))
    with pytest.raises(RuntimeError, match="weight and bias must be fp32"):
        add_layer_norm(wide[:, :32], None, weight.bfloat16(), bias, 1e-5, torch.bfloat16)
    with pytest.raises(RuntimeError, match="out_low must be bf16 or fp16"):
        add_layer_norm(wide[:, :32], None, weight, bias, 1e-5, torch.float64)
