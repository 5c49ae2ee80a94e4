"""paged_attention: decode attention, one query token per sequence, reading K/V
straight from the paged cache through each sequence's block table (no gather).

One program per (sequence, KV head, partition) handles all the query heads of that KV
head (GQA/MQA, padded to the 16 rows tl.dot needs), streaming its part of the context
TILE tokens at a time (several cache blocks: more bytes in flight than one block's
load-then-compute chain) with an online softmax.

Split-K (flash-decoding): when a batch has too few (sequence, KV head) pairs to fill
the GPU, the context is cut into partitions of PARTITION tiles; each program leaves
its running max, sum and unnormalized output in fp32 scratch, and a second kernel
combines the partitions of each head. With one partition the first kernel writes the
output itself.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvfleet_kernels import cdiv
from kvfleet_kernels.kv_fp8 import fp8_kind, load_kv
from kvfleet_kernels.reference import as_bytes

# Tokens a program reads per iteration (whole cache blocks). On an H200 (bf16, Llama-8B heads,
# 16-token blocks, batch 64 x 4096): 128 reads at 98% of the copy bandwidth, 64 at 74%, 32 at
# 90%; the query group reduced on CUDA cores instead of tl.dot, 7-13%; the kernel before this
# one, a block at a time on CUDA cores, 15%.
TILE_TOKENS = 128
PARTITION_TOKENS = 512  # context a program reads when the context is split (vLLM's v2 size)
MIN_ROWS = 16  # tl.dot's smallest M: the query heads of one KV head, padded


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_ptr,  # SPLIT: [num_seqs, num_heads, num_partitions, head_dim + 2] fp32 (acc, max, sum)
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: its bytes)
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (FP8: its bytes)
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int
    context_lens_ptr,  # [num_seqs] int
    sinks_ptr,  # [num_heads] (HAS_SINKS) or any pointer
    scale, sliding_window,  # sliding_window 0: none
    k_scale, v_scale,  # an fp8 cache's (kvfleet_kernels/kv_fp8.py), else 1
    query_seq_stride, query_head_stride, out_seq_stride, out_head_stride, block_table_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride,
    NUM_QUERIES_PER_KV: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, PARTITION_TILES: tl.constexpr, SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    seq, kv_head, partition = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_partitions = tl.num_programs(2)
    context_len = tl.load(context_lens_ptr + seq)
    rows, dims, tokens = tl.arange(0, ROWS), tl.arange(0, HEAD_DIM), tl.arange(0, TILE)
    row_mask = rows < NUM_QUERIES_PER_KV
    heads = kv_head * NUM_QUERIES_PER_KV + rows
    query = tl.load(query_ptr + seq * query_seq_stride + heads[:, None] * query_head_stride + dims[None, :],
                    mask=row_mask[:, None], other=0.0)  # [M, D]
    first = tl.where(sliding_window > 0, tl.maximum(context_len - sliding_window, 0), 0)
    start_tile, end_tile = first // TILE, tl.cdiv(context_len, TILE)
    if SPLIT:
        start_tile = tl.maximum(start_tile, partition * PARTITION_TILES)
        end_tile = tl.minimum(end_tile, (partition + 1) * PARTITION_TILES)
    if HAS_SINKS and not SPLIT:  # the sink is a first logit with no value: the sum starts at e^0 from it
        running_max = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32)
        running_sum = tl.full([ROWS], 1.0, tl.float32)
    else:  # split: the combining kernel adds the sink once
        running_max = tl.full([ROWS], float("-inf"), tl.float32)
        running_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    slot_offsets = (tokens % BLOCK_SIZE)[:, None] * cache_slot_stride + kv_head * cache_head_stride + dims[None, :]
    for tile in range(start_tile, end_tile):
        positions = tile * TILE + tokens
        valid = (positions < context_len) & (positions >= first)
        blocks = tl.load(block_tables_ptr + seq * block_table_stride + positions // BLOCK_SIZE, mask=valid,
                         other=0).to(tl.int64)  # [TILE]: each token's cache block
        offsets = blocks[:, None] * cache_block_stride + slot_offsets  # [TILE, D]
        key = load_kv(key_cache_ptr, offsets, valid[:, None], k_scale, FP8, query.dtype)
        value = load_kv(value_cache_ptr, offsets, valid[:, None], v_scale, FP8, query.dtype)
        scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale  # [M, TILE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(value.dtype), value, input_precision=DOT_PRECISION)
        running_max = new_max
    if SPLIT:  # an empty partition leaves max -inf and sum 0, which the combine weighs to nothing
        num_heads = tl.num_programs(1) * NUM_QUERIES_PER_KV
        row_base = ((seq * num_heads + heads) * num_partitions + partition) * (HEAD_DIM + 2)  # [M]
        tl.store(partial_ptr + row_base[:, None] + dims[None, :], acc, mask=row_mask[:, None])
        tl.store(partial_ptr + row_base + HEAD_DIM, running_max, mask=row_mask)
        tl.store(partial_ptr + row_base + HEAD_DIM + 1, running_sum, mask=row_mask)
    else:
        out = acc / running_sum[:, None]
        tl.store(out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def _combine_partitions_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_ptr,  # [num_seqs, num_heads, num_partitions, head_dim + 2] fp32
    sinks_ptr,  # [num_heads] (HAS_SINKS) or any pointer
    num_heads, num_partitions, out_seq_stride, out_head_stride,
    HEAD_DIM: tl.constexpr, PARTITIONS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    parts, dims = tl.arange(0, PARTITIONS), tl.arange(0, HEAD_DIM)
    part_mask = parts < num_partitions
    rows = ((seq * num_heads + head) * num_partitions + parts) * (HEAD_DIM + 2)  # [P]
    maxes = tl.load(partial_ptr + rows + HEAD_DIM, mask=part_mask, other=float("-inf"))
    sums = tl.load(partial_ptr + rows + HEAD_DIM + 1, mask=part_mask, other=0.0)
    accs = tl.load(partial_ptr + rows[:, None] + dims[None, :], mask=part_mask[:, None], other=0.0)  # [P, D]
    global_max = tl.max(maxes, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        global_max = tl.maximum(global_max, sink)
    weights = tl.where(part_mask, tl.exp(maxes - global_max), 0.0)  # [P]; an empty partition: e^-inf = 0
    total = tl.sum(weights * sums, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - global_max)
    out = tl.sum(weights[:, None] * accs, axis=0) / total  # [D]
    tl.store(out_ptr + seq * out_seq_stride + head * out_head_stride + dims, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_plan(num_seqs: int, num_kv_heads: int, block_size: int, max_blocks_per_seq: int, num_multiprocessors: int,
                partition_tokens: int | None = None, tile_tokens: int | None = None) -> tuple[int, int, int]:
    """(tile tokens, partition tokens, partitions per sequence) for a batch, from host-side
    sizes only: the block table's width bounds every context, so there is no device sync.
    Split when the (sequence, KV head) pairs are fewer than two per multiprocessor and the
    contexts span partitions. partition_tokens (0: never split) and tile_tokens override
    the choice, for tests and benchmarks."""
    tile = tile_tokens or max(block_size, TILE_TOKENS)
    assert tile % block_size == 0 and tile == triton.next_power_of_2(tile), (tile, block_size)
    max_tokens = max_blocks_per_seq * block_size
    if partition_tokens is None:
        few_programs = num_seqs * num_kv_heads < 2 * num_multiprocessors
        partition_tokens = PARTITION_TOKENS if few_programs else 0
    if not partition_tokens or max_tokens <= partition_tokens:
        return tile, 0, 1
    tile = min(tile, partition_tokens)
    assert partition_tokens % tile == 0, (partition_tokens, tile)
    return tile, partition_tokens, cdiv(max_tokens, partition_tokens)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, out: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None, partition_tokens: int | None = None,
                           tile_tokens: int | None = None, num_warps: int = 4,
                           kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Same contract as kvfleet_kernels.reference.paged_decode_attention (fp8 caches times
    kv_scales included). partition_tokens, tile_tokens and num_warps override the plan
    (decode_plan) for tests and benchmarks."""
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim and value_cache.shape == key_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim == triton.next_power_of_2(head_dim) and block_size == triton.next_power_of_2(block_size)
    assert query.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1
    assert context_lens.shape == (num_seqs,)
    assert key_cache.dtype == value_cache.dtype and (query.dtype == key_cache.dtype or fp8_kind(key_cache))
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.is_contiguous())
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.stride(2) == 1
    if num_seqs == 0:
        return out
    fp8 = fp8_kind(key_cache)
    tile, partition_tokens, num_partitions = decode_plan(num_seqs, num_kv_heads, block_size, block_tables.shape[1],
                                                         _num_multiprocessors(query.device), partition_tokens,
                                                         tile_tokens)
    split, group, sink_ptr = num_partitions > 1, num_heads // num_kv_heads, query if sinks is None else sinks
    partial = query.new_empty((num_seqs, num_heads, num_partitions, head_dim + 2), dtype=torch.float32) \
        if split else query  # (acc, max, sum) per partition of each head
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, partial, query, as_bytes(key_cache), as_bytes(value_cache), block_tables, context_lens, sink_ptr,
        scale, sliding_window or 0, float(kv_scales[0]), float(kv_scales[1]),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_QUERIES_PER_KV=group, ROWS=max(MIN_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=tile, PARTITION_TILES=partition_tokens // tile if split else 1, SPLIT=split,
        HAS_SINKS=sinks is not None, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", FP8=fp8,
        num_warps=num_warps)
    if split:
        _combine_partitions_kernel[(num_seqs, num_heads)](
            out, partial, sink_ptr, num_heads, num_partitions, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            PARTITIONS=triton.next_power_of_2(num_partitions), HAS_SINKS=sinks is not None)
    return out
