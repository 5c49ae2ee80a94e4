"""rotary: rotary position embedding, rotate-half (GPT-NeoX) style, the one
Llama, Mistral and Qwen2 use (OPT has learned positions instead). Applied in place
to the query and key heads of each token (one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, token, token_stride, head_stride, num_heads, cos, sin, HALF: tl.constexpr,
            HEADS_BLOCK: tl.constexpr):
    heads = tl.arange(0, HEADS_BLOCK)
    dims = tl.arange(0, HALF)
    mask = heads[:, None] < num_heads
    first = x_ptr + token * token_stride + heads[:, None] * head_stride + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)  # [heads, HALF]
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_ptr,  # [num_tokens, head_dim] (the two halves are equal)
    sin_ptr,  # [num_tokens, head_dim]
    query_token_stride,
    query_head_stride,
    key_token_stride,
    key_head_stride,
    table_stride,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + token * table_stride + dims)
    sin = tl.load(sin_ptr + token * table_stride + dims)
    _rotate(query_ptr, token, query_token_stride, query_head_stride, num_heads, cos, sin, HALF, HEADS_BLOCK)
    _rotate(key_ptr, token, key_token_stride, key_head_stride, num_kv_heads, cos, sin, HALF, HEADS_BLOCK)


def rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """In place on query [T, Hq, D] and key [T, Hkv, D]; cos/sin [T, D]. Returns (query, key)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim
    assert cos.shape == sin.shape == (num_tokens, head_dim) and cos.stride() == sin.stride()
    assert head_dim == triton.next_power_of_2(head_dim), "head_dim must be a power of two"
    assert query.stride(2) == 1 and key.stride(2) == 1 and cos.stride(1) == 1
    assert query.dtype == key.dtype == cos.dtype == sin.dtype
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            query, key, cos, sin, query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0),
            num_heads, num_kv_heads, HALF=head_dim // 2, HEADS_BLOCK=triton.next_power_of_2(max(num_heads,
                                                                                              num_kv_heads)))
    return query, key
