"""An fp8 KV cache in the Triton kernels (kvfleet_kernels/kv_fp8.py; TRITON_INTERPRET=1 on the CPU,
compiled by make gpu-check) and the torch reference: store_kv writes the quantized bytes, and
decode and prefill read them times their scales, as the reference over the dequantized cache."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kv_quant import KVScales, quantize_kv
from kvfleet_kernels import reference
from kvfleet_kernels.paged_attention import paged_decode_attention
from kvfleet_kernels.prefill_attention import prefill_attention
from kvfleet_kernels.store_kv import store_kv
from tests.kvfleet_kernels.test_reference import attention_sinks, paged_setup

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = (0.03, 0.07)


def dequantized_cache(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return cache.float() * scale


def test_quantize_kv_rounds_to_nearest_and_saturates():
    x = torch.tensor([1000.0, -1e6, 0.3, 0.0])
    e4m3 = quantize_kv(x.view(1, 1, 4), 1.0, torch.float8_e4m3fn).float().flatten()
    assert e4m3.tolist() == [448.0, -448.0, 0.3125, 0.0]  # 0.3 lies nearer 0.3125 than 0.28125
    e5m2 = quantize_kv(x.view(1, 1, 4), 2.0, torch.float8_e5m2).float().flatten()
    assert e5m2.tolist() == [512.0, -57344.0, 0.15625, 0.0]  # 1e6 / 2 would round to inf: the largest instead


def test_calculated_scales_come_from_the_first_keys_that_are_not_padding():
    scales = KVScales(calculate=True)
    scales.observe(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8))  # a capture's padding: nothing learned
    assert scales.calculate and (scales.k, scales.v) == (1.0, 1.0)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    scales.observe(key, value)
    assert (scales.k, scales.v) == (key.abs().max().item() / 200, value.abs().max().item() / 100)
    scales.observe(key * 10, value * 10)  # once only
    assert scales.k == key.abs().max().item() / 200


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_store_kv_writes_the_quantized_bytes(fp8):
    num_blocks, block_size, num_kv_heads, head_dim = 8, 16, 2, 32
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=fp8) for _ in range(4)]
    key = quantize_kv(torch.randn(40, num_kv_heads, head_dim), 0.01, fp8)
    value = quantize_kv(torch.randn(40, num_kv_heads, head_dim), 0.01, fp8)
    slots = torch.randperm(num_blocks * block_size)[:40]
    store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    for ours, theirs in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("partition_tokens", [None, 32])  # 32: split-K over partitions
@pytest.mark.parametrize("sinks", [False, True])
def test_triton_decode_reads_an_fp8_cache_times_its_scales(fp8, num_heads, num_kv_heads, partition_tokens, sinks):
    head_dim, context_lens = 32, [1, 17, 100, 64]
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, 16, num_kv_heads, head_dim)
    key_cache = quantize_kv(key_cache * 3, SCALES[0], fp8)
    value_cache = quantize_kv(value_cache * 3, SCALES[1], fp8)
    query, lens = torch.randn(len(context_lens), num_heads, head_dim), torch.tensor(context_lens)
    head_sinks = attention_sinks(num_heads) if sinks else None
    expected = reference.paged_decode_attention(query, dequantized_cache(key_cache, SCALES[0]),
                                                dequantized_cache(value_cache, SCALES[1]), block_tables, lens,
                                                1 / math.sqrt(head_dim), 40, sinks=head_sinks)
    got = paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 1 / math.sqrt(head_dim), 40,
                                 sinks=head_sinks, partition_tokens=partition_tokens,
                                 tile_tokens=16 if partition_tokens else None, kv_scales=SCALES)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("sliding_window", [None, 9])
def test_triton_prefill_reads_an_fp8_cache_times_its_scales(fp8, sliding_window):
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    context_lens, num_queries = [20, 7, 45], [3, 7, 16]  # chunks over cached prefixes, and a whole prompt
    key_cache, value_cache, tables, block_tables = paged_setup(context_lens, 16, num_kv_heads, head_dim)
    key_cache = quantize_kv(key_cache * 3, SCALES[0], fp8)
    value_cache = quantize_kv(value_cache * 3, SCALES[1], fp8)
    starts = torch.tensor([0, *torch.tensor(num_queries).cumsum(0).tolist()])
    query = torch.randn(int(starts[-1]), num_heads, head_dim)
    got = prefill_attention(query, key_cache, value_cache, block_tables, starts, torch.tensor(context_lens),
                            max(num_queries), 1 / math.sqrt(head_dim), sliding_window, kv_scales=SCALES)
    for index, (context_len, table) in enumerate(zip(context_lens, tables)):
        rows = slice(int(starts[index]), int(starts[index + 1]))
        keys = reference.dequantized(reference.gather_kv(key_cache, torch.tensor(table), context_len), SCALES[0],
                                     torch.float32)
        values = reference.dequantized(reference.gather_kv(value_cache, torch.tensor(table), context_len), SCALES[1],
                                       torch.float32)
        expected = reference.prefill_attention(query[rows], keys, values, 1 / math.sqrt(head_dim), sliding_window)
        torch.testing.assert_close(got[rows], expected, atol=1e-5, rtol=1e-5)
