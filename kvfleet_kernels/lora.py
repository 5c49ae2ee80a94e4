"""sgmv: the LoRA shrink and expand as one segmented gather matmul (punica's SGMV).

The step's tokens come in segments, one per sequence, each of one adapter slot. A program
takes one segment and one tile of output columns, walks the segment's rows a tile at a
time, and multiplies them by its slot's weights; a segment of slot -1 (the base model)
returns at once, and a slot no segment names costs nothing.

    shrink:  x [T, in]     weights lora_a [L, P * R, in]  -> out [T, P * R]
    expand:  x [T, R]      weights lora_b [L, out_p, R]   -> out [T, out_p] (accumulate)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sgmv_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [L, N, K]
    out_ptr,  # [T, N]
    seg_starts_ptr,  # [S + 1]
    seg_slots_ptr,  # [S]
    N,
    K,
    stride_xt,
    stride_xk,
    stride_wl,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_on,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32: tl.dot's default there is tf32 (10-bit mantissas)
):
    segment = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + segment)
    if slot >= 0:
        start = tl.load(seg_starts_ptr + segment)
        end = tl.load(seg_starts_ptr + segment + 1)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        inner = tl.arange(0, BLOCK_K)
        w_base = w_ptr + slot.to(tl.int64) * stride_wl
        for row_start in range(start, end, BLOCK_M):
            rows = row_start + tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_start in range(0, K, BLOCK_K):
                ks = k_start + inner
                x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xk,
                            mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
                w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                            mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
                acc += tl.dot(x.to(w.dtype), w, input_precision=DOT_PRECISION)
            out_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_on
            mask = (rows[:, None] < end) & (cols[None, :] < N)
            if ACCUMULATE:
                acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sgmv(x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, seg_starts: torch.Tensor,
         seg_slots: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """Same contract as kvfleet_kernels.reference.sgmv; `x`, `weights` and `out` may be strided views."""
    num_rows, inner = x.shape
    num_slots, num_cols, weight_inner = weights.shape
    assert weight_inner == inner and out.shape == (num_rows, num_cols)
    num_segments = len(seg_slots)
    if num_rows and num_segments:
        block_n = min(64, max(16, triton.next_power_of_2(num_cols)))
        block_k = min(64, max(16, triton.next_power_of_2(inner)))
        grid = (num_segments, triton.cdiv(num_cols, block_n))
        _sgmv_kernel[grid](x, weights, out, seg_starts, seg_slots, num_cols, inner, x.stride(0), x.stride(1),
                           weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0), out.stride(1),
                           ACCUMULATE=accumulate, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                           DOT_PRECISION="ieee" if weights.dtype == torch.float32 else "tf32")
    return out
