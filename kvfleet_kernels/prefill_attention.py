"""prefill_attention: causal attention for variable-length prompt chunks, reading
all K/V (the cached prefix and the chunk itself, already stored) from the paged cache.

    context of one sequence:  [ cached prefix ........ | new queries (this chunk) ]
                                0          context_len - num_queries        context_len
    query i sits at position context_len - num_queries + i and sees keys 0..that position.

Programs: (sequence, query head, block of BLOCK_M queries), each streaming its keys TILE at a
time (several cache blocks, each key's block looked up on its own, as the decode kernel does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.kv_fp8 import fp8_kind, load_kv
from kvfleet_kernels.reference import as_bytes

# Keys a program reads per iteration. One 16-token cache block an iteration ran at 131 TFLOP/s on
# an H200 (4 x 1,024 causal, bf16; SDPA 372); the decode kernel's move from one block to 128-token
# tiles took it from 15% to 98% of its bound. 64 until gpu_check's sweep (benchmarks/kernels_gpu.py:
# PREFILL_PLANS) has measured the choices.
TILE_KEYS = 64


@triton.jit
def _prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: its bytes)
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: its bytes)
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int
    query_starts_ptr,  # [num_seqs + 1] int: first row of each sequence in query/out
    context_lens_ptr,  # [num_seqs] int: cached + new tokens
    sinks_ptr,  # [num_heads] (HAS_SINKS) or any pointer
    scale,
    sliding_window,  # 0: none
    k_scale,  # an fp8 cache's scales (kvfleet_kernels/kv_fp8.py), else 1
    v_scale,
    query_token_stride,
    query_head_stride,
    out_token_stride,
    out_head_stride,
    block_table_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    query_block = tl.program_id(2)
    query_start = tl.load(query_starts_ptr + seq)
    num_queries = tl.load(query_starts_ptr + seq + 1) - query_start
    if query_block * BLOCK_M < num_queries:
        context_len = tl.load(context_lens_ptr + seq)
        kv_head = head // NUM_QUERIES_PER_KV
        rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < num_queries
        query_positions = context_len - num_queries + rows  # [M]
        dims, tokens = tl.arange(0, HEAD_DIM), tl.arange(0, TILE)
        query = tl.load(query_ptr + (query_start + rows[:, None]) * query_token_stride + head * query_head_stride
                        + dims[None, :], mask=row_mask[:, None], other=0.0)  # [M, D]

        last_position = tl.minimum(context_len - num_queries + (query_block + 1) * BLOCK_M, context_len)
        first = tl.where(sliding_window > 0,
                         tl.maximum(context_len - num_queries + query_block * BLOCK_M - sliding_window + 1, 0), 0)
        if HAS_SINKS:  # the sink is a first logit with no value: the sum starts at e^0 from it
            running_max = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + head).to(tl.float32)
            running_sum = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
            running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        head_offsets = kv_head * cache_head_stride + dims[None, :]
        for tile in range(first // TILE, tl.cdiv(last_position, TILE)):
            key_positions = tile * TILE + tokens  # [TILE]
            in_context = key_positions < context_len
            blocks = tl.load(block_tables_ptr + seq * block_table_stride + key_positions // BLOCK_SIZE,
                             mask=in_context, other=0).to(tl.int64)  # [TILE]: each key's cache block
            # [TILE, D]; each key's slot from its own position: a tile may be smaller than a block
            offsets = blocks[:, None] * cache_block_stride + (key_positions % BLOCK_SIZE)[:, None] * cache_slot_stride \
                + head_offsets
            key = load_kv(key_cache_ptr, offsets, in_context[:, None], k_scale, FP8, query.dtype)  # [TILE, D]
            scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale  # [M, TILE]
            visible = (key_positions[None, :] <= query_positions[:, None]) & in_context[None, :]
            visible &= (sliding_window == 0) | (key_positions[None, :] > query_positions[:, None] - sliding_window)
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # Rows with nothing visible yet keep a -inf max; shift by 0 there to avoid inf - inf.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp(scores - shift[:, None])
            correction = tl.exp(running_max - shift)
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            value = load_kv(value_cache_ptr, offsets, in_context[:, None], v_scale, FP8, query.dtype)  # [TILE, D]
            acc = acc * correction[:, None] + tl.dot(probs.to(value.dtype), value, input_precision=DOT_PRECISION)
            running_max = new_max
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # padded rows: 0, not 0/0
        tl.store(out_ptr + (query_start + rows[:, None]) * out_token_stride + head * out_head_stride
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                      max_num_queries: int, scale: float, sliding_window: int | None = None,
                      out: torch.Tensor | None = None, sinks: torch.Tensor | None = None, block_m: int | None = None,
                      tile_keys: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                      kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim], the new tokens of every sequence back to
    back (query_starts[i]:query_starts[i + 1]); their K/V must already be in the cache (an fp8
    cache's, read times kv_scales).
    sinks: [num_heads] or None (kvfleet_kernels/reference.py: prefill_attention). block_m,
    tile_keys, num_warps and num_stages override the launch plan, for tests and benchmarks."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    num_seqs = context_lens.shape[0]
    assert cache_head_dim == head_dim and value_cache.shape == key_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim == triton.next_power_of_2(head_dim) and block_size == triton.next_power_of_2(block_size)
    assert query.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert query_starts.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1 and key_cache.dtype == value_cache.dtype
    assert query.dtype == key_cache.dtype or fp8_kind(key_cache)
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.is_contiguous())
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.stride(2) == 1
    if num_seqs == 0 or num_tokens == 0:
        return out
    block_m = block_m or (16 if max_num_queries <= 16 else 32 if max_num_queries <= 32 else 64)
    tile = tile_keys or TILE_KEYS
    assert tile >= 16 and tile == triton.next_power_of_2(tile), "tl.dot needs at least 16 keys a tile"
    grid = (num_seqs, num_heads, triton.cdiv(max_num_queries, block_m))
    launch = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
    _prefill_kernel[grid](
        out, query, as_bytes(key_cache), as_bytes(value_cache), block_tables, query_starts, context_lens,
        query if sinks is None else sinks, scale, sliding_window or 0, float(kv_scales[0]), float(kv_scales[1]),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        TILE=tile, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", HAS_SINKS=sinks is not None,
        FP8=fp8_kind(key_cache), **launch)
    return out
