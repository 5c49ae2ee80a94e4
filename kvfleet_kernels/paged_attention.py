"""paged_attention: decode attention, one query token per sequence, reading K/V
straight from the paged cache through each sequence's block table (no gather).

One program per (sequence, KV head) handles all the query heads of that KV head
(GQA/MQA), streaming the context block by block with an online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int
    context_lens_ptr,  # [num_seqs] int
    sinks_ptr,  # [num_heads] (HAS_SINKS) or any pointer
    scale,
    sliding_window,  # 0: none
    query_seq_stride,
    query_head_stride,
    out_seq_stride,
    out_head_stride,
    block_table_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_BLOCK: tl.constexpr,  # NUM_QUERIES_PER_KV rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    group = tl.arange(0, GROUP_BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK_SIZE)
    group_mask = group < NUM_QUERIES_PER_KV
    heads = kv_head * NUM_QUERIES_PER_KV + group
    query = tl.load(query_ptr + seq * query_seq_stride + heads[:, None] * query_head_stride + dims[None, :],
                    mask=group_mask[:, None], other=0.0).to(tl.float32)  # [G, D]

    first = tl.where(sliding_window > 0, tl.maximum(context_len - sliding_window, 0), 0)
    if HAS_SINKS:  # the sink is a first logit with no value: the sum starts at e^0 from it
        running_max = tl.load(sinks_ptr + heads, mask=group_mask, other=0.0).to(tl.float32)
        running_sum = tl.full([GROUP_BLOCK], 1.0, tl.float32)
    else:
        running_max = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_BLOCK], tl.float32)
    acc = tl.zeros([GROUP_BLOCK, HEAD_DIM], tl.float32)
    for block_index in range(first // BLOCK_SIZE, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * block_table_stride + block_index).to(tl.int64)
        positions = block_index * BLOCK_SIZE + slots
        valid = (positions < context_len) & (positions >= first)
        offsets = block * cache_block_stride + slots[:, None] * cache_slot_stride + kv_head * cache_head_stride \
            + dims[None, :]
        key = tl.load(key_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)  # [B, D]
        scores = tl.sum(query[:, None, :] * key[None, :, :], axis=2) * scale  # [G, B]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        value = tl.load(value_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)  # [B, D]
        acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * value[None, :, :], axis=1)
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=group_mask[:, None])


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, out: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kvfleet_kernels.reference.paged_decode_attention."""
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim and value_cache.shape == key_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim == triton.next_power_of_2(head_dim) and block_size == triton.next_power_of_2(block_size)
    assert query.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1
    assert context_lens.shape == (num_seqs,)
    assert query.dtype == key_cache.dtype == value_cache.dtype
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.is_contiguous())
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.stride(2) == 1
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, context_lens, query if sinks is None else sinks, scale,
        sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_QUERIES_PER_KV=group, GROUP_BLOCK=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, HAS_SINKS=sinks is not None)
    return out
