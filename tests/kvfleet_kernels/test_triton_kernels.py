"""Every Triton kernel against its torch reference (TRITON_INTERPRET=1 on the CPU),
fp32, max abs error <= 1e-4, over GQA ratios, head dims, block sizes, ragged and
exact context lengths, batch sizes, and shuffled block tables."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet_kernels import reference
from kvfleet_kernels.paged_attention import decode_plan, paged_decode_attention
from kvfleet_kernels.prefill_attention import prefill_attention
from kvfleet_kernels.rms_norm import rms_norm
from kvfleet_kernels.rotary import rotary
from kvfleet_kernels.store_kv import store_kv
from tests.kvfleet_kernels.test_reference import attention_sinks, paged_setup

TOLERANCE = 1e-4
GQA = [(4, 4), (4, 2), (8, 2)]  # ratios 1, 2, 4


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("context_lens", [[1], [32], [1, 16, 33, 64, 70]])
def test_paged_decode_attention(num_heads, num_kv_heads, head_dim, block_size, context_lens):
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, block_size, num_kv_heads, head_dim)
    query = torch.randn(len(context_lens), num_heads, head_dim)
    lens = torch.tensor(context_lens)
    scale = 1 / math.sqrt(head_dim)
    expected = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, scale)
    got = paged_decode_attention(query, key_cache, value_cache, block_tables, lens, scale)
    assert (got - expected).abs().max() <= TOLERANCE


def test_paged_decode_attention_sliding_window():
    context_lens = [5, 40, 77]
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, 16, 2, 64, seed=3)
    query = torch.randn(3, 4, 64)
    lens = torch.tensor(context_lens)
    expected = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.125, 24)
    got = paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.125, 24)
    assert (got - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_paged_decode_attention_sinks(num_heads, num_kv_heads, sliding_window):
    context_lens = [1, 5, 40, 77]
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, 16, num_kv_heads, 64, seed=5)
    query, lens, sinks = torch.randn(4, num_heads, 64), torch.tensor(context_lens), attention_sinks(num_heads)
    expected = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.125,
                                                sliding_window, sinks=sinks)
    got = paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.125, sliding_window,
                                 sinks=sinks)
    assert (got - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("partition_tokens, tile_tokens", [(32, 16), (64, 32), (64, 64), (0, 32), (0, 16), (128, 128)])
@pytest.mark.parametrize("sliding_window, with_sinks", [(None, False), (24, False), (None, True), (40, True)])
def test_paged_decode_attention_split_and_tiles(num_heads, num_kv_heads, partition_tokens, tile_tokens,
                                                sliding_window, with_sinks):
    """The split-K path (partitions combined by the second kernel) and multi-block tiles give
    the reference's output: contexts shorter than one partition (the other partitions empty),
    ending mid-tile and mid-block, a window that starts partitions late, sinks added once."""
    context_lens = [1, 15, 31, 33, 64, 100, 130]
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, 16, num_kv_heads, 64, seed=7)
    query, lens = torch.randn(len(context_lens), num_heads, 64), torch.tensor(context_lens)
    sinks = attention_sinks(num_heads) if with_sinks else None
    expected = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.125,
                                                sliding_window, sinks=sinks)
    got = paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.125, sliding_window,
                                 sinks=sinks, partition_tokens=partition_tokens, tile_tokens=tile_tokens)
    assert (got - expected).abs().max() <= TOLERANCE


def test_decode_plan_splits_only_small_batches_with_long_contexts():
    h200 = 132  # multiprocessors
    assert decode_plan(1, 8, 16, 256, h200) == (128, 512, 8)  # 8 programs: 4096 tokens in 8 partitions
    assert decode_plan(16, 8, 16, 257, h200) == (128, 512, 9)  # 128 < 264
    assert decode_plan(64, 8, 16, 256, h200) == (128, 0, 1)  # 512 programs fill it
    assert decode_plan(1, 8, 16, 32, h200) == (128, 0, 1)  # 512 tokens: one partition holds them
    assert decode_plan(1, 8, 16, 33, h200) == (128, 512, 2)
    assert decode_plan(1, 8, 256, 2, h200) == (256, 0, 1)  # a tile is at least one block
    assert decode_plan(1, 8, 256, 4, h200) == (256, 512, 2)
    assert decode_plan(1, 8, 16, 256, 1) == (128, 0, 1)  # the CPU interpreter: one "multiprocessor"
    assert decode_plan(64, 8, 16, 256, h200, partition_tokens=0) == (128, 0, 1)
    assert decode_plan(3, 2, 16, 9, h200, partition_tokens=64, tile_tokens=16) == (16, 64, 3)
    assert decode_plan(3, 2, 16, 9, h200, partition_tokens=32, tile_tokens=64) == (32, 32, 5)  # tile <= partition
    with pytest.raises(AssertionError):
        decode_plan(3, 2, 16, 9, h200, tile_tokens=8)  # smaller than a block


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_prefill_attention_sinks(num_heads, num_kv_heads, sliding_window):
    got, expected = prefill_case([(0, 50), (20, 30), (3, 1)], num_heads, num_kv_heads, 64, 16, sliding_window,
                                 sinks=attention_sinks(num_heads))
    assert (got - expected).abs().max() <= TOLERANCE


def prefill_case(spans, num_heads, num_kv_heads, head_dim, block_size, sliding_window=None, sinks=None, **plan):
    """spans: (cached, new) tokens per sequence; plan: prefill_attention's overrides. Returns (got, expected)."""
    context_lens = [cached + new for cached, new in spans]
    key_cache, value_cache, tables, block_tables = paged_setup(context_lens, block_size, num_kv_heads, head_dim)
    num_tokens = sum(new for _, new in spans)
    query = torch.randn(num_tokens, num_heads, head_dim)
    starts = torch.tensor([0] + list(torch.tensor([n for _, n in spans]).cumsum(0)))
    scale = 1 / math.sqrt(head_dim)
    expected = torch.empty_like(query)
    for i, (cached, new) in enumerate(spans):
        keys = reference.gather_kv(key_cache, torch.tensor(tables[i]), cached + new)
        values = reference.gather_kv(value_cache, torch.tensor(tables[i]), cached + new)
        rows = slice(int(starts[i]), int(starts[i + 1]))
        expected[rows] = reference.prefill_attention(query[rows], keys, values, scale, sliding_window, sinks=sinks)
    got = prefill_attention(query, key_cache, value_cache, block_tables, starts, torch.tensor(context_lens),
                            max(n for _, n in spans), scale, sliding_window, sinks=sinks, **plan)
    return got, expected


@pytest.mark.parametrize("block_m, tile_keys", [(16, 16), (32, 128), (128, 32)])
@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("sliding_window, with_sinks", [(None, False), (24, True)])
def test_prefill_attention_plans(block_m, tile_keys, block_size, sliding_window, with_sinks):
    """Query blocks and key tiles of the sizes gpu_check's sweep tries, over cache blocks smaller
    than, as large as and larger than a tile (tiles across several blocks, or within one), spans
    ending mid-tile and mid-block after cached prefixes, a window and sinks: the reference's output."""
    got, expected = prefill_case([(0, 50), (20, 30), (70, 3), (3, 1)], 4, 2, 64, block_size, sliding_window,
                                 sinks=attention_sinks(4) if with_sinks else None, block_m=block_m,
                                 tile_keys=tile_keys)
    assert (got - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("spans", [[(0, 1)], [(0, 32)], [(0, 20), (16, 5), (7, 40), (32, 1)]])
def test_prefill_attention_with_cached_prefixes(num_heads, num_kv_heads, head_dim, block_size, spans):
    got, expected = prefill_case(spans, num_heads, num_kv_heads, head_dim, block_size)
    assert (got - expected).abs().max() <= TOLERANCE


def test_prefill_attention_sliding_window():
    got, expected = prefill_case([(0, 50), (20, 30)], 4, 2, 64, 16, sliding_window=24)
    assert (got - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("num_kv_heads, head_dim", [(1, 64), (4, 64), (8, 128)])
def test_store_kv_matches_reference(num_kv_heads, head_dim):
    num_blocks, block_size = 6, 16
    key = torch.randn(10, num_kv_heads, head_dim)
    value = torch.randn(10, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:10]
    slots[3] = -1  # a padding token: written nowhere
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots)
    keep = slots >= 0
    reference.store_kv(key[keep], value[keep], caches[2], caches[3], slots[keep])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("hidden", [64, 100, 256])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_with_fused_residual(hidden, with_residual):
    x, residual, weight = torch.randn(7, hidden), torch.randn(7, hidden), torch.randn(hidden)
    if with_residual:
        got, got_residual = rms_norm(x, weight, 1e-6, residual)
        expected, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
        assert (got_residual - expected_residual).abs().max() <= TOLERANCE
    else:
        got, expected = rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)
    assert (got - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_matches_reference(num_heads, num_kv_heads, head_dim):
    positions = torch.tensor([0, 1, 7, 300, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    query, key = torch.randn(5, num_heads, head_dim), torch.randn(5, num_kv_heads, head_dim)
    expected_query, expected_key = reference.rotary(query, key, cos, sin)
    got_query, got_key = rotary(query.clone(), key.clone(), cos, sin)
    assert (got_query - expected_query).abs().max() <= TOLERANCE
    assert (got_key - expected_key).abs().max() <= TOLERANCE


def test_launchers_reject_bad_shapes():
    key_cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(AssertionError):
        paged_decode_attention(torch.randn(2, 3, 64), key_cache, key_cache, torch.zeros(2, 1, dtype=torch.int64),
                               torch.tensor([1, 1]), 0.1)  # 3 heads over 2 KV heads
    with pytest.raises(AssertionError):
        store_kv(torch.randn(2, 2, 64), torch.randn(2, 2, 64), key_cache, key_cache,
                 torch.tensor([0, 1], dtype=torch.int32))  # slots must be int64
    with pytest.raises(AssertionError):
        rotary(torch.randn(2, 2, 48), torch.randn(2, 2, 48), torch.randn(2, 48), torch.randn(2, 48))
