"""The torch reference ops against naive per-token attention, on shuffled block tables."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvfleet_kernels import cdiv, reference


def naive_attention(q, keys, values, scale, first=0, sinks=None):
    """q [H, D]; keys/values [C, Hkv, D] -> [H, D], one head at a time. sinks [H]: spelled
    out as gpt-oss defines them, e^sink added to the softmax denominator."""
    num_heads, num_kv_heads = q.shape[0], keys.shape[1]
    out = torch.empty_like(q)
    for head in range(num_heads):
        kv = head // (num_heads // num_kv_heads)
        scores = (keys[first:, kv] @ q[head]) * scale
        if sinks is None:
            probs = torch.softmax(scores, 0)
        else:
            top = torch.maximum(scores.max(), sinks[head])
            numerators = torch.exp(scores - top)
            probs = numerators / (numerators.sum() + torch.exp(sinks[head] - top))
        out[head] = probs @ values[first:, kv]
    return out


def paged_setup(context_lens, block_size, num_kv_heads, head_dim, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)  # the same values on any device
    num_blocks = sum(cdiv(c, block_size) for c in context_lens) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator, device="cpu").to(torch.get_default_device())
    value_cache = torch.randn(shape, generator=generator, device="cpu").to(torch.get_default_device())
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)  # block tables neither contiguous nor in order
    tables, start = [], 0
    for c in context_lens:
        n = cdiv(c, block_size)
        tables.append(ids[start:start + n])
        start += n
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [ids[-1]] * (width - len(t)) for t in tables])
    return key_cache, value_cache, tables, block_tables


def attention_sinks(num_heads: int) -> torch.Tensor:
    """[num_heads] sink logits from well below to well above typical scores."""
    return torch.linspace(-4.0, 6.0, num_heads)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("context_lens", [[1], [1, 5, 17, 100, 33]])
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_paged_decode_with_attention_sinks_matches_naive_attention(num_heads, num_kv_heads, context_lens,
                                                                   sliding_window):
    key_cache, value_cache, tables, block_tables = paged_setup(context_lens, 16, num_kv_heads, 32, seed=2)
    query, sinks = torch.randn(len(context_lens), num_heads, 32), attention_sinks(num_heads)
    expected = []
    for i, c in enumerate(context_lens):
        keys, values = key_cache[tables[i]].flatten(0, 1)[:c], value_cache[tables[i]].flatten(0, 1)[:c]
        first = 0 if sliding_window is None else max(0, c - sliding_window)
        expected.append(naive_attention(query[i], keys, values, 0.2, first, sinks))
    got = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, torch.tensor(context_lens),
                                           0.2, sliding_window, sinks=sinks)
    assert (got - torch.stack(expected)).abs().max() < 1e-5
    plain = reference.paged_decode_attention(query, key_cache, value_cache, block_tables,
                                             torch.tensor(context_lens), 0.2, sliding_window)
    assert (got - plain).abs().max() > 1e-2  # the sinks took weight away


@pytest.mark.parametrize("num_cached, sliding_window", [(0, None), (9, None), (9, 6)])
def test_prefill_attention_with_attention_sinks(num_cached, sliding_window):
    num_new, num_heads, num_kv_heads, head_dim = 7, 4, 2, 16
    keys = torch.randn(num_cached + num_new, num_kv_heads, head_dim)
    values = torch.randn(num_cached + num_new, num_kv_heads, head_dim)
    query, sinks = torch.randn(num_new, num_heads, head_dim), attention_sinks(num_heads)
    out = reference.prefill_attention(query, keys, values, 0.25, sliding_window, sinks=sinks)
    for i in range(num_new):
        position = num_cached + i
        first = 0 if sliding_window is None else max(0, position + 1 - sliding_window)
        expected = naive_attention(query[i], keys[: position + 1], values[: position + 1], 0.25, first, sinks)
        assert (out[i] - expected).abs().max() < 1e-5


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("context_lens", [[1], [16, 16, 32], [1, 5, 17, 100, 33], [200, 3]])
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_paged_decode_both_paths_match_naive_attention(num_heads, num_kv_heads, context_lens, sliding_window):
    block_size, head_dim = 16, 32
    key_cache, value_cache, tables, block_tables = paged_setup(context_lens, block_size, num_kv_heads, head_dim)
    query = torch.randn(len(context_lens), num_heads, head_dim)
    scale = 1 / math.sqrt(head_dim)
    lens = torch.tensor(context_lens)
    expected = []
    for i, c in enumerate(context_lens):
        keys = key_cache[tables[i]].flatten(0, 1)[:c]
        values = value_cache[tables[i]].flatten(0, 1)[:c]
        first = 0 if sliding_window is None else max(0, c - sliding_window)
        expected.append(naive_attention(query[i], keys, values, scale, first))
    expected = torch.stack(expected)
    padded = reference._decode_padded(query, key_cache, value_cache, block_tables, lens, scale, sliding_window)
    looped = reference._decode_per_sequence(query, key_cache, value_cache, block_tables, context_lens, scale,
                                            sliding_window)
    assert (padded - expected).abs().max() < 1e-5
    assert (looped - expected).abs().max() < 1e-5
    chosen = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, scale,
                                              sliding_window)
    assert (chosen - expected).abs().max() < 1e-5


def test_store_kv_writes_exact_slots():
    key_cache = torch.zeros(4, 2, 1, 3)
    value_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    reference.store_kv(key, -key, key_cache, value_cache, torch.tensor([7, 0, 3]))
    assert key_cache[3, 1, 0].tolist() == [0, 1, 2]  # slot 7 = block 3, offset 1
    assert key_cache[0, 0, 0].tolist() == [3, 4, 5]
    assert key_cache[1, 1, 0].tolist() == [6, 7, 8]
    assert value_cache[1, 1, 0].tolist() == [-6, -7, -8]
    assert key_cache.abs().sum() == 36


@pytest.mark.parametrize("num_cached", [0, 5, 7, 8, 16])  # up to 7: unmasked (padded); above: masked
def test_prefill_attention_over_a_cached_prefix(num_cached):
    num_new, num_heads, num_kv_heads, head_dim = 7, 4, 2, 16
    keys = torch.randn(num_cached + num_new, num_kv_heads, head_dim)
    values = torch.randn(num_cached + num_new, num_kv_heads, head_dim)
    query = torch.randn(num_new, num_heads, head_dim)
    out = reference.prefill_attention(query, keys, values, 0.25)
    for i in range(num_new):
        position = num_cached + i
        expected = naive_attention(query[i], keys[: position + 1], values[: position + 1], 0.25)
        assert (out[i] - expected).abs().max() < 1e-5


def test_padded_decode_into_reused_buffers_matches_fresh_gather():
    context_lens = [30, 31, 29, 32]
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, 16, 2, 32, seed=4)
    query, lens = torch.randn(4, 4, 32), torch.tensor(context_lens)
    fresh = reference._decode_padded(query, key_cache, value_cache, block_tables, lens, 0.2, None)
    roomy = (torch.full((20, 16, 2, 32), float("nan")), torch.full((20, 16, 2, 32), float("nan")))
    small = (torch.empty(3, 16, 2, 32), torch.empty(3, 16, 2, 32))  # too small: gathers afresh
    assert torch.equal(reference._decode_padded(query, key_cache, value_cache, block_tables, lens, 0.2, None,
                                                roomy), fresh)
    assert torch.equal(reference._decode_padded(query, key_cache, value_cache, block_tables, lens, 0.2, None,
                                                small), fresh)
