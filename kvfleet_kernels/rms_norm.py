"""rms_norm: RMSNorm with an optional fused residual add (one program per row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden]
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (read when HAS_RESIDUAL)
    residual_out_ptr,  # [num_tokens, hidden] x + residual (written when HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    eps,
    x_stride,
    residual_stride,
    out_stride,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    mask = columns < HIDDEN
    x = tl.load(x_ptr + row * x_stride + columns, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * residual_stride + columns, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * HIDDEN + columns, x, mask=mask)
    hidden = x.to(tl.float32)
    normed = hidden * tl.rsqrt(tl.sum(hidden * hidden, axis=0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + columns, mask=mask)
    tl.store(out_ptr + row * out_stride + columns, weight * normed.to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Same contract as kvfleet_kernels.reference.rms_norm."""
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            out, x, residual if residual is not None else x, residual_out, weight, eps, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None)
    return out if residual is None else (out, residual_out)
