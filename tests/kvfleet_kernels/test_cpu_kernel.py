"""The native CPU decode kernel (kvfleet_kernels/csrc/paged_decode_cpu.cpp) against the torch
reference: the same grid as the Triton kernel plus a head size with no compiled
specialisation, sliding windows, half-precision caches, and its input checks."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet_kernels import reference
from kvfleet_kernels.cpu_paged_attention import (
    decode_amx_available,
    gather_keys,
    gather_values,
    key_cache_view,
    pack_key_cache,
    pack_value_cache,
    paged_decode_attention,
    store_kv,
    value_cache_view,
)
from tests.kvfleet_kernels.test_reference import attention_sinks, paged_setup

GQA = [(4, 4), (4, 2), (8, 2), (9, 3), (12, 2)]  # ratios 1, 2, 4, 3 (SmolLM2), 6: every V-pass tiling
# Few sequences run a work item per KV head, many (>= 4 per thread) a sequence at a time.
MANY = [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 129, 300, 7, 48]


def decode_case(context_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window=None,
                dtype=torch.float32, sinks=None):
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, block_size, num_kv_heads, head_dim)
    query = torch.randn(len(context_lens), num_heads, head_dim)
    lens = torch.tensor(context_lens)
    scale = 1 / math.sqrt(head_dim)
    expected = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, scale,
                                                sliding_window, sinks=sinks)
    got = paged_decode_attention(query.to(dtype), pack_key_cache(key_cache.to(dtype)),
                                 pack_value_cache(value_cache.to(dtype)), block_tables, lens, scale, sliding_window,
                                 sinks=None if sinks is None else sinks.to(dtype))
    assert got.dtype == dtype and got.shape == expected.shape
    return got.float(), expected


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: the run-time head size path
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("context_lens", [[1], [32], [1, 16, 33, 64, 70, 300], MANY])
def test_matches_reference(num_heads, num_kv_heads, head_dim, block_size, context_lens):
    got, expected = decode_case(context_lens, num_heads, num_kv_heads, head_dim, block_size)
    assert (got - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (12, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_under_a_run_of_16_slots(num_heads, num_kv_heads, dtype):
    """Blocks of 8 slots take the K pass's scalar loop over the key layout."""
    got, expected = decode_case([1, 8, 9, 40, 77, 130], num_heads, num_kv_heads, 64, 8, dtype=dtype)
    assert (got - expected).abs().max() <= (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("sliding_window", [1, 24, 64])
@pytest.mark.parametrize("context_lens", [[5, 24, 40, 77, 130], MANY])
def test_sliding_window(sliding_window, context_lens):
    got, expected = decode_case(context_lens, 4, 2, 64, 16, sliding_window)
    assert (got - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("context_lens", [[1, 5, 40, 77, 130], MANY])
def test_attention_sinks(num_heads, num_kv_heads, sliding_window, context_lens):
    got, expected = decode_case(context_lens, num_heads, num_kv_heads, 64, 16, sliding_window,
                                sinks=attention_sinks(num_heads))
    assert (got - expected).abs().max() <= 1e-5


def test_score_gaps_beyond_the_exponent_range():
    # Scores hundreds apart: the kernel's vector exp clamps its input at -87 and must still
    # give the (near-)one-hot softmax that torch's exp gives, including in the scalar tail.
    key_cache, value_cache, _, block_tables = paged_setup([37, 300], 16, 2, 64)
    query = 40 * torch.randn(2, 4, 64)
    lens = torch.tensor([37, 300])
    expected = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 0.125)
    got = paged_decode_attention(query, pack_key_cache(key_cache), pack_value_cache(value_cache), block_tables, lens,
                                 0.125)
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("context_lens", [[3, 50, 200], MANY])
def test_half_precision_caches_accumulate_in_fp32(dtype, context_lens):
    got, expected = decode_case(context_lens, 8, 2, 64, 16, dtype=dtype)
    # Inputs rounded to 8 (bf16) or 11 (fp16) mantissa bits; the sums themselves stay fp32.
    assert (got - expected).abs().max() <= (3e-2 if dtype == torch.bfloat16 else 4e-3)


def attention_with_bf16_probabilities(query, key_cache, value_cache, block_tables, lens, scale,
                                      sliding_window=None, sinks=None):
    """fp32 attention over the same bf16 values whose softmax numerators are rounded to bf16
    before the product with V (the 1/sum from the unrounded ones): what the kernel's bf16 V
    pass computes, [num_seqs, num_heads, head_dim] fp32. Also how far one bf16 ulp on every
    rounded numerator moves each output: the kernel's exp16 and torch's exp differ by < 2e-7
    relative, so a numerator on a rounding boundary may round the other way."""
    group = query.shape[1] // key_cache.shape[2]
    out, one_ulp_each = torch.empty(query.shape), torch.empty(query.shape)
    for seq, length in enumerate(lens.tolist()):
        first = max(length - sliding_window, 0) if sliding_window else 0
        keys = reference.gather_kv(key_cache, block_tables[seq], length).float()[first:]  # [C, Hkv, D]
        values = reference.gather_kv(value_cache, block_tables[seq], length).float()[first:]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [C, Hq, D]
        scores = torch.einsum("hd,chd->hc", query[seq].float(), keys) * scale  # [Hq, C]
        peak = scores.amax(-1, keepdim=True)
        if sinks is not None:
            peak = torch.maximum(peak, sinks[:, None])
        numerators = (scores - peak).exp()
        total = numerators.sum(-1, keepdim=True) + (0 if sinks is None else (sinks[:, None] - peak).exp())
        weights = numerators.bfloat16().float()
        out[seq] = torch.einsum("hc,chd->hd", weights, values) / total
        one_ulp_each[seq] = 2**-8 * torch.einsum("hc,chd->hd", weights, values.abs()) / total
    return out, one_ulp_each


def assert_close_to_bf16_probability_attention(got, expected, one_ulp_each):
    """Within the output's own bf16 rounding (and fp32 sum order) of the model, plus a flipped
    rounding of any numerator (see attention_with_bf16_probabilities)."""
    allowed = 2**-8 * expected.abs() + 1e-5 + one_ulp_each
    assert ((got - expected).abs() <= allowed).all(), (got - expected).abs().max()


@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="the bf16 V pass needs avx512_bf16")
@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sliding_window, with_sinks", [(None, False), (23, False), (40, True), (None, True)])
@pytest.mark.parametrize("allow_amx", [True, False])
def test_bf16_v_pass_over_windows_sinks_and_every_tiling(num_heads, num_kv_heads, head_dim, sliding_window,
                                                         with_sinks, allow_amx):
    """Odd window starts and ends (a pair with one position outside), every GQA tile, on AMX tiles
    where this CPU has them (allow_amx) and on the dot product."""
    context_lens = [1, 2, 17, 33, 64, 101, 130, 7]
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, 16, num_kv_heads, head_dim)
    key_cache, value_cache = key_cache.bfloat16(), value_cache.bfloat16()
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    sinks = attention_sinks(num_heads) if with_sinks else None
    lens, scale = torch.tensor(context_lens), 1 / math.sqrt(head_dim)
    got = paged_decode_attention(query, pack_key_cache(key_cache), pack_value_cache(value_cache), block_tables, lens,
                                 scale, sliding_window, sinks=sinks, allow_amx=allow_amx).float()
    expected, one_ulp_each = attention_with_bf16_probabilities(
        query, key_cache, value_cache, block_tables, lens, scale, sliding_window, None if sinks is None else sinks.float())
    assert_close_to_bf16_probability_attention(got, expected, one_ulp_each)


@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 64, 128: avx512_bf16's dot product where the CPU has it
@pytest.mark.parametrize("context_lens", [[3, 50, 200], MANY])
def test_bf16_kernel_is_fp32_attention_over_the_same_bf16_values(head_dim, context_lens):
    """Against fp32 attention fed the very bf16 values the kernel reads. On avx512_bf16 at head
    sizes 64 and 128 the probabilities meet V in bf16 (as torch's bf16 attention rounds them):
    the reference rounds them alike. What is left is the order of fp32 sums and the output's
    rounding to bf16 (half an ulp: 2^-9 relative). Either way it is no further from exact fp32
    attention than torch's own bf16 path."""
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, 16, 3, head_dim)
    key_cache, value_cache = key_cache.bfloat16(), value_cache.bfloat16()
    query = torch.randn(len(context_lens), 9, head_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    lens, scale = torch.tensor(context_lens), 1 / math.sqrt(head_dim)
    exact = reference.paged_decode_attention(query.float(), key_cache.float(), value_cache.float(), block_tables,
                                             lens, scale, None)
    got = paged_decode_attention(query, pack_key_cache(key_cache), pack_value_cache(value_cache), block_tables, lens,
                                 scale, None).float()
    if head_dim in (64, 128) and torch.cpu._is_avx512_bf16_supported():  # the probabilities are rounded
        assert_close_to_bf16_probability_attention(
            got, *attention_with_bf16_probabilities(query, key_cache, value_cache, block_tables, lens, scale))
    else:
        torch.testing.assert_close(got, exact, rtol=2**-8, atol=1e-5)
    torch_error = (reference.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, scale,
                                                    None).float() - exact).abs().max()
    assert (got - exact).abs().max() <= torch_error + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("allow_amx", [True, False])
@pytest.mark.parametrize("block_size", [16, 32])
def test_stale_slots_never_reach_the_output(dtype, allow_amx, block_size):
    """A reused block keeps a freed sequence's values, NaN included, in the slots past a context's
    end and before a window's first position. The bf16 passes read those slots in pairs and AMX
    tiles whole runs of them, under zero weights; 0 x NaN would be NaN: they must load them as zero."""
    context_lens, window = [1, 3, 17, 33, 50, 95], 21
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, block_size, 2, 64)
    query = torch.randn(len(context_lens), 6, 64, generator=torch.Generator().manual_seed(2))
    lens = torch.tensor(context_lens)
    poisoned_keys, poisoned_values = key_cache.clone(), value_cache.clone()
    for seq, length in enumerate(context_lens):
        for pos in [*range(max(length - window, 0)), *range(length, block_tables.shape[1] * block_size)]:
            block, slot = block_tables[seq, pos // block_size], pos % block_size
            poisoned_keys[block, slot] = poisoned_values[block, slot] = float("nan")
    expected = reference.paged_decode_attention(query, key_cache.to(dtype).float(), value_cache.to(dtype).float(),
                                                block_tables, lens, 0.125, window)
    got = paged_decode_attention(query.to(dtype), pack_key_cache(poisoned_keys.to(dtype)),
                                 pack_value_cache(poisoned_values.to(dtype)), block_tables, lens, 0.125, window,
                                 allow_amx=allow_amx).float()
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max() <= (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="AMX tiles: CPUs with amx_bf16")
def test_amx_decode_runs_here_and_leaves_torch_brgemm_its_tiles():
    """On a CPU with AMX the kernel is built with its tile passes and Linux lends them the tile
    state. The decode kernel loads its own tile palettes on torch's threads; the brgemm linears
    that run between attention layers on those threads still give the same output after it."""
    from kvfleet_kernels import cpu_linear

    assert decode_amx_available()
    if not cpu_linear.available("brgemm"):
        pytest.skip("torch's brgemm packs no bf16 here")
    generator = torch.Generator().manual_seed(4)
    weight, x = torch.randn(192, 576, generator=generator), torch.randn(3, 576, generator=generator).bfloat16()
    packed = cpu_linear.pack_weight(weight, "brgemm")
    before = cpu_linear.linear(x, packed, 192, None, "brgemm")
    got, expected = decode_case([5, 40, 130], 9, 3, 64, 16, dtype=torch.bfloat16)
    assert torch.equal(cpu_linear.linear(x, packed, 192, None, "brgemm"), before)
    assert (got - expected).abs().max() <= 3e-2


def test_writes_into_a_strided_out_and_reads_a_strided_query():
    key_cache, value_cache, _, block_tables = paged_setup([9, 40], 16, 2, 64)
    rows = torch.randn(5, 4, 64)  # the decode rows of a step sit after the prefill rows
    out = torch.full((5, 4, 64), 7.0)
    lens = torch.tensor([9, 40])
    paged_decode_attention(rows[3:], pack_key_cache(key_cache), pack_value_cache(value_cache), block_tables, lens,
                           0.125, out=out[3:])
    expected = reference.paged_decode_attention(rows[3:], key_cache, value_cache, block_tables, lens, 0.125)
    assert (out[3:] - expected).abs().max() <= 1e-5
    assert torch.equal(out[:3], torch.full((3, 4, 64), 7.0))


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "context_lens": a["context_lens"].int()}, "must be int64"),
    (lambda a: {**a, "context_lens": torch.tensor([9, 999])}, r"context_lens must be in \[1, max_blocks"),
    (lambda a: {**a, "context_lens": torch.tensor([0, 9])}, r"context_lens must be in \[1, max_blocks"),
    (lambda a: {**a, "query": a["query"].double()}, "must share a dtype"),
    (lambda a: {**a, "query": torch.randn(2, 3, 64)}, "multiple of num_kv_heads"),
    (lambda a: {**a, "query": torch.randn(2, 4, 32)}, "value_cache must be"),
    (lambda a: {**a, "key_cache": a["key_cache"].transpose(2, 3)}, "key_cache must be"),
    (lambda a: {**a, "key_cache": a["key_cache"].transpose(0, 1).contiguous().transpose(0, 1)[:, :, :, :8]},
     "key_cache must be"),
    (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "block_tables must be"),
])
def test_bad_arguments_are_clear_errors(change, message):
    key_cache, value_cache, _, block_tables = paged_setup([9, 40], 16, 2, 64)
    args = {"query": torch.randn(2, 4, 64), "key_cache": pack_key_cache(key_cache),
            "value_cache": pack_value_cache(value_cache),
            "block_tables": block_tables, "context_lens": torch.tensor([9, 40])}
    with pytest.raises(RuntimeError, match=message):
        paged_decode_attention(**change(args), scale=0.125)


@pytest.mark.parametrize("dtype, words", [(torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_key_layout_stores_and_gathers_what_the_plain_cache_holds(dtype, words, block_size):
    """The decode kernel's key layout, [blocks, Hkv, D / x, block_size, x], written through
    store_kv and read back through gather_keys, holds exactly the plain cache's values. The keys
    are a slice of a fused qkv row, as the models pass them (read in place, tokens apart)."""
    generator = torch.Generator().manual_seed(3)
    plain = torch.zeros(6, block_size, 3, 64, dtype=dtype)  # [blocks, block_size, Hkv, D]
    laid_out = key_cache_view(torch.zeros_like(plain))
    assert laid_out.shape == (6, 3, 64 // words, block_size, words)
    slots = torch.randperm(6 * block_size, generator=generator)[:2 * block_size + 5]
    qkv = torch.randn(len(slots), (9 + 3 + 3) * 64, generator=generator).to(dtype)  # [T, (Hq + 2 Hkv) D]
    key = qkv[:, 9 * 64:12 * 64].view(len(slots), 3, 64)
    plain.view(-1, 3, 64).index_copy_(0, slots, key)
    store_kv(key, key, laid_out, value_cache_view(torch.zeros_like(plain)), slots)
    assert torch.equal(laid_out, pack_key_cache(plain))
    table = torch.tensor([4, 0, 2, 5])
    for context_len in (1, block_size, 3 * block_size + 1):
        assert torch.equal(gather_keys(laid_out, table, context_len), reference.gather_kv(plain, table, context_len))


@pytest.mark.parametrize("dtype, words", [(torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_value_layout_stores_and_gathers_what_the_plain_cache_holds(dtype, words, block_size):
    """The decode kernel's value layout, [blocks, Hkv, block_size / y, D, y] (bf16 pairs positions),
    written through store_kv and read back through gather_values, holds exactly the plain cache's
    values; the values are a slice of a fused qkv row (tokens apart, read in place)."""
    generator = torch.Generator().manual_seed(6)
    plain = torch.zeros(6, block_size, 3, 64, dtype=dtype)  # [blocks, block_size, Hkv, D]
    laid_out = value_cache_view(torch.zeros_like(plain))
    assert laid_out.shape == (6, 3, block_size // words, 64, words)
    slots = torch.randperm(6 * block_size, generator=generator)[:2 * block_size + 5]
    qkv = torch.randn(len(slots), (9 + 3 + 3) * 64, generator=generator).to(dtype)  # [T, (Hq + 2 Hkv) D]
    value = qkv[:, 12 * 64:].view(len(slots), 3, 64)
    plain.view(-1, 3, 64).index_copy_(0, slots, value)
    store_kv(value, value, key_cache_view(torch.zeros_like(plain)), laid_out, slots)
    assert torch.equal(laid_out, pack_value_cache(plain))
    table = torch.tensor([4, 0, 2, 5])
    for context_len in (1, block_size, 3 * block_size + 1):
        assert torch.equal(gather_values(laid_out, table, context_len), reference.gather_kv(plain, table, context_len))
    with pytest.raises(RuntimeError, match="block 7 is outside the cache"):
        gather_values(laid_out, torch.tensor([0, 7]), block_size + 1)
    if words == 2:
        with pytest.raises(ValueError, match="block_size 1 must be a multiple of 2"):
            value_cache_view(torch.zeros(2, 1, 3, 64, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_keys_and_values_where_the_reference_store_does(dtype):
    """One call stores a step's keys and values in the kernel's layouts: both caches equal what
    reference.store_kv leaves, laid out, from slices of a fused qkv row (tokens apart, read in
    place); slots outside the cache and mismatched values are refused."""
    generator = torch.Generator().manual_seed(5)
    plain_keys, plain_values = torch.zeros(5, 16, 3, 64, dtype=dtype), torch.zeros(5, 16, 3, 64, dtype=dtype)
    key_cache, value_cache = key_cache_view(torch.zeros_like(plain_keys)), value_cache_view(torch.zeros_like(plain_values))
    slots = torch.randperm(5 * 16, generator=generator)[:21]
    qkv = torch.randn(21, (9 + 3 + 3) * 64, generator=generator).to(dtype)  # [T, (Hq + 2 Hkv) D]
    key, value = qkv[:, 9 * 64:12 * 64].view(21, 3, 64), qkv[:, 12 * 64:].view(21, 3, 64)
    reference.store_kv(key, value, plain_keys, plain_values, slots)
    store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, pack_key_cache(plain_keys)) and torch.equal(value_cache, pack_value_cache(plain_values))
    with pytest.raises(RuntimeError, match="slot 80 is outside the cache"):
        store_kv(key[:1], value[:1], key_cache, value_cache, torch.tensor([80]))
    with pytest.raises(RuntimeError, match="value must be as key"):
        store_kv(key[:2], value[:1], key_cache, value_cache, slots[:2])
    with pytest.raises(RuntimeError, match="value_cache must have key_cache's number of blocks"):
        store_kv(key[:1], value[:1], key_cache, value_cache[:2], slots[:1])


def test_key_layout_refuses_what_it_cannot_hold():
    values = value_cache_view(torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16))
    laid_out = key_cache_view(torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="slot 32 is outside the cache"):
        key = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
        store_kv(key, key, laid_out, values, torch.tensor([32]))
    with pytest.raises(RuntimeError, match="key must be"):
        key = torch.zeros(1, 2, 32, dtype=torch.bfloat16)
        store_kv(key, key, laid_out, values, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="block 7 is outside the cache"):
        gather_keys(laid_out, torch.tensor([0, 7]), 20)
    with pytest.raises(ValueError, match="head_dim 63 must be a multiple of 2"):
        key_cache_view(torch.zeros(2, 16, 2, 63, dtype=torch.bfloat16))
