"""An fp8 KV cache in the native CPU decode kernel (csrc/decode_item.h, cpu_vec.h's bf16_words32
and load_fp8_pairs) and the CPU cache ops: against the torch reference over the same fp8 bytes,
every finite fp8 value read exactly, and subnormals kept (bf16's dot product would drop its own)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kv_quant import quantize_kv
from kvfleet_kernels import reference
from kvfleet_kernels.cpu_paged_attention import (
    gather_keys,
    gather_values,
    key_cache_view,
    pack_key_cache,
    pack_value_cache,
    paged_decode_attention,
    store_kv,
    value_cache_view,
)
from tests.kvfleet_kernels.native import native_cpu
from tests.kvfleet_kernels.test_reference import attention_sinks, paged_setup

pytestmark = native_cpu


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)  # the queries: the same on every run
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = (0.03, 0.07)  # k_scale, v_scale: values of about 3 sit near the middle of e4m3's range


def fp8_case(context_lens, num_heads, num_kv_heads, head_dim, fp8, block_size=16):
    key_cache, value_cache, _, block_tables = paged_setup(context_lens, block_size, num_kv_heads, head_dim)
    key_cache = quantize_kv(key_cache * 3, SCALES[0], fp8)
    value_cache = quantize_kv(value_cache * 3, SCALES[1], fp8)
    return key_cache, value_cache, block_tables, torch.tensor(context_lens)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 2), (12, 2)])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: the run-time head size path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("context_lens", [[1, 16, 33, 70, 300], [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 129, 7, 48]])
def test_decode_over_an_fp8_cache_matches_the_reference_over_the_same_bytes(fp8, num_heads, num_kv_heads, head_dim,
                                                                               dtype, context_lens):
    key_cache, value_cache, block_tables, lens = fp8_case(context_lens, num_heads, num_kv_heads, head_dim, fp8)
    query = torch.randn(len(context_lens), num_heads, head_dim).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    expected = reference.paged_decode_attention(query.float(), key_cache, value_cache, block_tables, lens, scale,
                                                kv_scales=SCALES)
    got = paged_decode_attention(query, pack_key_cache(key_cache), pack_value_cache(value_cache), block_tables, lens,
                                 scale, kv_scales=SCALES)
    assert got.dtype == dtype
    # bf16: the output rounded, and (as torch's bf16 attention) the probabilities before the V product
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliding_windows_and_sinks_read_an_fp8_cache_as_the_reference_does(fp8, dtype):
    key_cache, value_cache, block_tables, lens = fp8_case([5, 40, 200, 333], 8, 2, 64, fp8)
    query = torch.randn(4, 8, 64).to(dtype)
    sinks = attention_sinks(8)
    for window, layer_sinks in ((50, None), (None, sinks), (17, sinks)):
        expected = reference.paged_decode_attention(query.float(), key_cache, value_cache, block_tables, lens, 0.125,
                                                    window, sinks=layer_sinks, kv_scales=SCALES)
        got = paged_decode_attention(query, pack_key_cache(key_cache), pack_value_cache(value_cache), block_tables,
                                     lens, 0.125, window, sinks=layer_sinks, kv_scales=SCALES)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_finite_fp8_value_is_read_exactly(fp8, dtype):
    """A context of one position returns its value times v_scale: every finite byte, subnormals
    and the largest included, through the bf16 widening and the fp32 one."""
    every_byte = torch.arange(256, dtype=torch.uint8).view(fp8)
    finite = every_byte[torch.isfinite(every_byte.float())]
    head_dim = 128
    num_seqs = -(-finite.numel() // head_dim)
    values = torch.zeros(num_seqs * head_dim, dtype=torch.uint8)
    values[:finite.numel()] = finite.view(torch.uint8)
    key_cache = torch.zeros(num_seqs, 16, 1, head_dim, dtype=fp8)
    value_cache = torch.zeros_like(key_cache)
    value_cache.view(torch.uint8)[:, 0, 0] = values.view(num_seqs, head_dim)
    query = torch.randn(num_seqs, 1, head_dim).to(dtype)
    got = paged_decode_attention(query, pack_key_cache(key_cache), pack_value_cache(value_cache),
                                 torch.arange(num_seqs).view(-1, 1), torch.ones(num_seqs, dtype=torch.long), 0.1,
                                 kv_scales=(1.0, 0.5))
    expected = (values.view(fp8).float() * 0.5).view(num_seqs, 1, head_dim).to(dtype)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_subnormal_keys_keep_their_weight_in_the_bf16_path(fp8):
    """Keys stored as fp8 subnormals: bf16's dot product reads bf16 subnormals as zero, so the
    widening must give them as normal bf16 numbers; read as zero, a large query would see a
    uniform softmax, far from the reference."""
    smallest_normal = torch.finfo(fp8).smallest_normal
    key_cache, value_cache, block_tables, lens = fp8_case([256, 100, 3, 200], 4, 2, 64, fp8)
    keys = (torch.rand(key_cache.shape) - 0.5) * 1.6 * smallest_normal  # every magnitude rounds below the smallest normal
    key_cache = quantize_kv(keys, 1.0, fp8)
    assert (key_cache.float().abs() < smallest_normal).all() and (key_cache.float() != 0).float().mean() > 0.5
    query = (torch.randn(4, 4, 64) / smallest_normal).bfloat16()
    expected = reference.paged_decode_attention(query.float(), key_cache, value_cache, block_tables, lens, 1.0,
                                                kv_scales=(1.0, SCALES[1]))
    got = paged_decode_attention(query, pack_key_cache(key_cache), pack_value_cache(value_cache), block_tables, lens,
                                 1.0, kv_scales=(1.0, SCALES[1]))
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_store_and_gather_move_fp8_bytes_into_the_kernel_layouts(fp8):
    """store_kv writes quantized rows into the pair layouts (x = y = 2 for fp8) byte for byte, and
    gather_keys/gather_values read them back in token order."""
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 3, 64
    plain_keys = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=fp8)
    plain_values = torch.zeros_like(plain_keys)
    keys, values = key_cache_view(plain_keys.clone()), value_cache_view(plain_values.clone())
    assert keys.shape[-1] == 2 and values.shape[-1] == 2
    new_keys = quantize_kv(torch.randn(37, num_kv_heads, head_dim) * 5, 0.02, fp8)
    new_values = quantize_kv(torch.randn(37, num_kv_heads, head_dim) * 5, 0.02, fp8)
    slots = torch.randperm(num_blocks * block_size)[:37]
    store_kv(new_keys, new_values, keys, values, slots)
    reference.store_kv(new_keys, new_values, plain_keys, plain_values, slots)
    assert torch.equal(keys.view(torch.uint8), pack_key_cache(plain_keys).view(torch.uint8))
    assert torch.equal(values.view(torch.uint8), pack_value_cache(plain_values).view(torch.uint8))
    table = torch.tensor([4, 0, 5, 2])
    for gathered, plain in ((gather_keys(keys, table, 50), plain_keys), (gather_values(values, table, 50), plain_values)):
        assert gathered.dtype == fp8
        assert torch.equal(gathered.view(torch.uint8), reference.gather_kv(plain, table, 50).view(torch.uint8))


def test_scales_are_refused_for_a_cache_that_is_not_fp8():
    key_cache, value_cache, _, block_tables = paged_setup([5], 16, 2, 64)
    with pytest.raises(RuntimeError, match="fp8 caches only"):
        paged_decode_attention(torch.randn(1, 2, 64), pack_key_cache(key_cache), pack_value_cache(value_cache),
                               block_tables, torch.tensor([5]), 0.125, kv_scales=(2.0, 1.0))
