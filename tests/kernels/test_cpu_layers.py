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
