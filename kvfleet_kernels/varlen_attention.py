"""varlen_attention: attention over a packed batch of whole sequences, without a KV
cache and without padding (embedding models: every input is one prefill).

    query/key/value rows:  | seq 0 ........ | seq 1 ... | seq 2 ............ |
                           cu_seqlens[0]    [1]         [2]                  [3]

Each sequence attends only within itself: bidirectionally (encoders: BERT, XLM-R) or
causally (decoder embedding models). Programs: (sequence, query head, block of BLOCK_M
queries); keys stream in blocks of BLOCK_N with an online softmax, as flash-attention's
varlen forward does. A head size that is not a power of two (e.g. 48) is padded inside
the kernel, never in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _varlen_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cu_seqlens_ptr,  # [num_seqs + 1] int: first row of each sequence, then the total
    scale,
    head_dim,
    query_token_stride,
    query_head_stride,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    out_token_stride,
    out_head_stride,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # head_dim rounded up to a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    query_block = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start
    if query_block * BLOCK_M < seq_len:
        kv_head = head // NUM_QUERIES_PER_KV
        rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the sequence
        row_mask = rows < seq_len
        dims = tl.arange(0, HEAD_DIM)
        dim_mask = dims < head_dim
        query = tl.load(query_ptr + (start + rows[:, None]) * query_token_stride + head * query_head_stride
                        + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [M, D]
        # Causal: keys past the block's last query are never visible.
        num_keys = tl.minimum((query_block + 1) * BLOCK_M, seq_len) if IS_CAUSAL else seq_len
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for key_start in range(0, num_keys, BLOCK_N):
            cols = key_start + tl.arange(0, BLOCK_N)
            col_mask = cols < seq_len
            kv_mask = col_mask[:, None] & dim_mask[None, :]
            key = tl.load(key_ptr + (start + cols[:, None]) * key_token_stride + kv_head * key_head_stride
                          + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
            scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale  # [M, N]
            visible = col_mask[None, :]
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # Padded rows see nothing: shift by 0 there to avoid inf - inf.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp(scores - shift[:, None])
            correction = tl.exp(running_max - shift)
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            value = tl.load(value_ptr + (start + cols[:, None]) * value_token_stride + kv_head * value_head_stride
                            + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
            acc = acc * correction[:, None] + tl.dot(probs.to(value.dtype), value, input_precision=DOT_PRECISION)
            running_max = new_max
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(out_ptr + (start + rows[:, None]) * out_token_stride + head * out_head_stride + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, causal: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D], sequence i at rows cu_seqlens[i]:cu_seqlens[i + 1]
    (cu_seqlens [num_seqs + 1] int, on the device) -> [T, Hq, D] (kvfleet_kernels/reference.py: varlen_attention)"""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim), (query.shape, key.shape, value.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.stride(2) == key.stride(2) == value.stride(2) == 1
    assert query.dtype == key.dtype == value.dtype and cu_seqlens.dim() == 1
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.stride(2) == 1
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs == 0 or num_tokens == 0:
        return out
    block_m = 16 if max_seqlen <= 16 else 32 if max_seqlen <= 32 else 64
    grid = (num_seqs, num_heads, triton.cdiv(max_seqlen, block_m))
    _varlen_attention_kernel[grid](
        out, query, key, value, cu_seqlens, scale, head_dim,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1),
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_DIM=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=32, IS_CAUSAL=causal,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    return out
