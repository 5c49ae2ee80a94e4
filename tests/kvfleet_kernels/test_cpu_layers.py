"""The native CPU layers against the torch reference (kvfleet_kernels/reference.py)."""

from __future__ import annotations

import pytest
import torch

from kvfleet_kernels import reference
from kvfleet_kernels.cpu_paged_attention import load_error

pytestmark = pytest.mark.skipif(load_error() is not None, reason="no C++ compiler: the native kernels cannot build")


# The tolerances of a kernel that rounds where the torch path does but sums or contracts in
# another order: a bf16/fp16 result one rounding apart at most; an fp32 one within a few ulps.
TOLERANCE = {torch.bfloat16: {"rtol": 2 ** -6, "atol": 1e-5}, torch.float16: {"rtol": 2 ** -9, "atol": 1e-5},
             torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (300, 64), (5, 4, 32)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_rounds_where_transformers_does(dtype, shape, with_residual):
    from kvfleet_kernels.cpu_layers import add_rms_norm  # noqa: PLC0415

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
    # product with the weight rounds again: two ulps at most (in fp32, every value may be an ulp off).
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert dtype == torch.float32 or (got == expected).float().mean() > 0.97


def test_add_rms_norm_refuses_fp64():
    from kvfleet_kernels.cpu_layers import add_rms_norm  # noqa: PLC0415

    with pytest.raises(RuntimeError, match="add_rms_norm runs bf16, fp16 and fp32, not Double"):
        add_rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 384), (37, 384), (300, 1024)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_layer_norm_is_the_fp32_torch_path_and_its_copy(x_dtype, low_dtype, shape, with_residual):
    """As bert.py's torch path computes it: x widened, plus the fp32 residual, LayerNorm in
    fp32; the low-precision copy is the fp32 result rounded to nearest even."""
    from kvfleet_kernels.cpu_layers import add_layer_norm  # noqa: PLC0415

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
    from kvfleet_kernels.cpu_layers import add_layer_norm  # noqa: PLC0415

    wide = torch.randn(6, 64)
    weight, bias = torch.ones(32), torch.zeros(32)
    got, _ = add_layer_norm(wide[:, :32], None, weight, bias, 1e-5, torch.bfloat16)  # rows 64 apart
    torch.testing.assert_close(got, torch.nn.functional.layer_norm(wide[:, :32], (32,), eps=1e-5))
    with pytest.raises(RuntimeError, match="weight and bias must be fp32"):
        add_layer_norm(wide[:, :32], None, weight.bfloat16(), bias, 1e-5, torch.bfloat16)
    with pytest.raises(RuntimeError, match="out_low must be bf16 or fp16"):
        add_layer_norm(wide[:, :32], None, weight, bias, 1e-5, torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, width", [(1, 1536), (37, 1536), (300, 40), (3, 7)])
def test_silu_and_mul_rounds_where_transformers_does(dtype, rows, width):
    """transformers' LlamaMLP: act(gate) * up on the halves of gate_up, each op rounding to the
    dtype. The kernel's exp is a polynomial: an fp32 SiLU sitting within its error of a
    rounding boundary may land one ulp away, and the product then up to two (relative to
    the bottom of its binade)."""
    from kvfleet_kernels.cpu_layers import silu_and_mul  # noqa: PLC0415

    generator = torch.Generator().manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -90.0, 90.0, -0.0])  # e^-|x| underflows at +-90: silu -> 0 and x
    expected = torch.nn.functional.silu(gate_up[:, :width]) * gate_up[:, width:]
    got = silu_and_mul(gate_up)
    assert got.shape == (rows, width) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, expected, **{**TOLERANCE[dtype], "atol": 1e-6})
    assert dtype == torch.float32 or (got == expected).float().mean() > 0.999
    strided = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * width]  # rows 4 * width apart
    assert torch.equal(silu_and_mul(strided), got)


def test_silu_and_mul_refuses_fp64():
    from kvfleet_kernels.cpu_layers import silu_and_mul  # noqa: PLC0415

    with pytest.raises(RuntimeError, match="silu_and_mul runs bf16, fp16 and fp32, not Double"):
        silu_and_mul(torch.ones(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 24])  # 24: the scalar tail only
def test_rotary_in_place_rounds_where_transformers_does(dtype, head_dim):
    """As the torch path computes it after RotaryEmbedding's cast: q * cos + rotate_half(q) * sin
    with cos/sin rounded to the dtype and every op rounding: exact in bf16/fp16, on strided views
    into one fused qkv tensor (only q and k turn; v is left as it was). In fp32 a product may
    fuse into the sum (FMA): an ulp or so apart."""
    from kvfleet_kernels.cpu_layers import rotary_in_place  # noqa: PLC0415

    num_tokens, num_heads, num_kv_heads = 19, 9, 3
    generator = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator)
    angles = torch.rand(4096, head_dim // 2, generator=generator) * 60
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)  # [4096, D] fp32
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator) * 3).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    expected_q, expected_k = reference.rotary(q, k, cos[positions].to(dtype), sin[positions].to(dtype))
    v_before = v.clone()
    got_q, got_k = rotary_in_place(positions, q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    if dtype == torch.float32:
        torch.testing.assert_close(got_q, expected_q, **TOLERANCE[dtype])
        torch.testing.assert_close(got_k, expected_k, **TOLERANCE[dtype])
    else:
        assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert torch.equal(v, v_before)


def test_rotary_in_place_refuses_a_position_past_its_table():
    from kvfleet_kernels.cpu_layers import rotary_in_place  # noqa: PLC0415

    q, k, table = torch.zeros(2, 1, 8, dtype=torch.bfloat16), torch.zeros(2, 1, 8, dtype=torch.bfloat16), torch.ones(4, 8)
    with pytest.raises(RuntimeError, match="position 4 is outside the rotary table"):
        rotary_in_place(torch.tensor([0, 4]), q, k, table, table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [5, 16, 49_152, 32_003])  # under a vector, one, SmolLM2's, a tail of 3
def test_argmax_rows_is_torch_argmax_with_its_first_index_rule(dtype, vocab):
    from kvfleet_kernels.cpu_layers import argmax_rows  # noqa: PLC0415

    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(24, vocab, generator=generator).to(dtype)
    top = float(torch.finfo(dtype).max)
    for row in range(6, 24):  # ties across lanes, vector steps and the tail, then special values
        tied = torch.randint(0, vocab, (3,), generator=generator)
        logits[row, tied] = 30.0 if row < 12 else top
    logits[12] = float("-inf")  # suppression left nothing: index 0
    logits[13] = float("-inf")
    logits[13, vocab - 1] = -1e4  # only the last (in the tail when there is one) is finite
    logits[14, [vocab // 2, vocab - 1]] = float("nan")  # torch.argmax: the first NaN
    logits[15, vocab - 1] = float("inf")
    logits[16, [0, vocab - 1]] = float("inf")
    logits[17] = 0.0  # all equal
    strided = torch.zeros(24, vocab + 7, dtype=dtype)[:, 3:vocab + 3]
    strided.copy_(logits)
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(argmax_rows(logits), expected)
    assert torch.equal(argmax_rows(strided), expected)
    assert argmax_rows(logits[:0]).shape == (0,)


def test_argmax_rows_refuses_integers():
    from kvfleet_kernels.cpu_layers import argmax_rows  # noqa: PLC0415

    with pytest.raises(RuntimeError, match="argmax_rows reads fp32, bf16 and fp16"):
        argmax_rows(torch.ones(2, 8, dtype=torch.int32))
