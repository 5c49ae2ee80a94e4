"""fused_moe: a mixture-of-experts layer's expert sum as two grouped GEMMs over tokens
sorted by expert, the layout of vLLM's fused_moe.

    topk_ids [T, k] --moe_align_block_size--> sorted_row_ids: the T * k (token, choice)
    rows grouped by expert, each expert's group padded to a multiple of BLOCK_M with an
    invalid id, so that a block of BLOCK_M rows belongs to one expert (expert_ids[block]).

    GEMM 1 (GATED): for a block of rows and BLOCK_N intermediate features, the gate and
        the up tiles of that expert's w13 accumulate side by side and the activation is
        applied in the epilogue: act(gate) * up lands in intermediate [T * k, I]; the
        [T * k, 2 * I] gate/up product never reaches memory.
    GEMM 2: intermediate rows @ the expert's w2, bias added, times the routing weight,
        into [T * k, H]; the k rows of a token are summed last.

Programs: (block of BLOCK_M sorted rows, block of BLOCK_N output features). An expert
with no rows has no block; one that every token chose has T blocks' worth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels import cdiv

ACTIVATIONS = {"silu": 0, "swigluoai": 1}


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [num_a_rows, K]: hidden states [T, H] (GEMM 1) or the intermediate [T * k, I] (GEMM 2)
    b_ptr,  # [E, N (x2 when GATED), K]: w13 or w2
    bias_ptr,  # [E, N (x2)] or a dummy when not HAS_BIAS
    c_ptr,  # [T * k, N]
    topk_weights_ptr,  # [T * k]
    sorted_row_ids_ptr,  # [num_padded]: row t * k + j, or num_rows for padding
    expert_ids_ptr,  # [num_padded / BLOCK_M]
    N,
    K,
    num_rows,  # T * k
    stride_am,
    stride_be,
    stride_bn,
    stride_bias_e,
    stride_cm,
    swiglu_alpha,
    swiglu_limit,
    ROWS_PER_A_ROW: tl.constexpr,  # k for GEMM 1 (a token's k rows read one hidden row), 1 for GEMM 2
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 silu, 1 swigluoai
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    rows = tl.load(sorted_row_ids_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [M]
    row_valid = rows < num_rows
    expert = tl.load(expert_ids_ptr + block_m).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    col_valid = cols < N
    a_rows = (rows // ROWS_PER_A_ROW).to(tl.int64)
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=row_valid[:, None] & k_valid[None, :],
                    other=0.0)  # [M, BK]
        b_mask = k_valid[:, None] & col_valid[None, :]
        b = tl.load(b_base + cols[None, :] * stride_bn + ks[:, None], mask=b_mask, other=0.0)  # [BK, N]
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if GATED:  # the up rows sit N rows after the gate rows
            b_up = tl.load(b_base + (cols[None, :] + N) * stride_bn + ks[:, None], mask=b_mask, other=0.0)
            acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + expert * stride_bias_e + N + cols, mask=col_valid,
                              other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == 0:
            acc = acc * tl.sigmoid(acc) * acc_up
        else:
            gate = tl.minimum(acc, swiglu_limit)
            up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
            acc = (up + 1.0) * (gate * tl.sigmoid(gate * swiglu_alpha))
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + rows, mask=row_valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """topk_ids [T, k] -> (sorted_row_ids [P], expert_ids [P / block_m]), P the padded row
    count: rows t * k + j grouped by expert in token order, each group padded with T * k
    up to a multiple of block_m."""
    flat = topk_ids.flatten()
    num_rows = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_rows, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    sorted_row_ids = torch.full((int(padded.sum()),), num_rows, dtype=torch.int64, device=flat.device)
    sorted_row_ids[padded_starts[sorted_experts] + rank_in_expert] = order
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    return sorted_row_ids, expert_ids


def _grouped_gemm(a, b, bias, out, topk_weights, sorted_row_ids, expert_ids, rows_per_a_row, gated, activation,
                  mul_routed_weight, block_m, activation_args):
    n = b.shape[1] // 2 if gated else b.shape[1]
    k = b.shape[2]
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (expert_ids.shape[0], cdiv(n, block_n))
    _fused_moe_kernel[grid](
        a, b, bias if bias is not None else b, out, topk_weights, sorted_row_ids, expert_ids, n, k,
        out.shape[0], a.stride(0), b.stride(0), b.stride(1), bias.stride(0) if bias is not None else 0,
        out.stride(0), activation_args.get("swiglu_alpha", 1.702), activation_args.get("swiglu_limit", 7.0),
        ROWS_PER_A_ROW=rows_per_a_row, GATED=gated, ACTIVATION=ACTIVATIONS[activation],
        HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=mul_routed_weight, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, **activation_args) -> torch.Tensor:
    """Same contract as kvfleet_kernels.reference.fused_moe."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    assert hidden.shape == (num_tokens, hidden_size) and w2.shape == (num_experts, hidden_size, two_i // 2)
    assert hidden.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    assert activation in ACTIVATIONS, f"MoE activation {activation!r}; supported: {sorted(ACTIVATIONS)}"
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    # 16 rows a block: tl.dot's smallest tile, and decode steps give experts few rows each.
    block_m = 16 if num_tokens * top_k <= 16 * num_experts * 4 else 64
    sorted_row_ids, expert_ids = moe_align_block_size(topk_ids, block_m, num_experts)
    weights = topk_weights.flatten().contiguous()
    intermediate = torch.empty(num_tokens * top_k, two_i // 2, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, w13_bias, intermediate, weights, sorted_row_ids, expert_ids, top_k, True, activation,
                  False, block_m, activation_args)
    out_rows = torch.empty(num_tokens * top_k, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(intermediate, w2, w2_bias, out_rows, weights, sorted_row_ids, expert_ids, 1, False, activation,
                  True, block_m, activation_args)
    return out_rows.view(num_tokens, top_k, hidden_size).sum(dim=1)
