"""The native bf16 prefill attention (kvfleet_kernels/csrc/prefill_attention_cpu.cpp) against the torch
reference in fp32 on the same bf16 values: GQA ratios of every tiling, both head sizes, fresh
prompts and prompts after a cached prefix, one-token chunks, sliding windows, strided views;
the backend's choice between it and the reference."""

from __future__ import annotations

import pytest
import torch

from engine.attention import CpuAttentionBackend, PrefillSpan
from kvfleet_kernels import reference
from kvfleet_kernels.cpu_prefill_attention import available, preferred, prefill_attention, supports

pytestmark = pytest.mark.skipif(not available(), reason="needs a CPU with avx512_bf16")
GQA = [(4, 4), (4, 2), (9, 3), (8, 2), (12, 2)]  # ratios 1, 2, 3, 4, 6


def bf16_case(num_queries, context_len, num_heads, num_kv_heads, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(num_queries, num_heads, head_dim, generator=generator).bfloat16()
    key = torch.randn(context_len, num_kv_heads, head_dim, generator=generator).bfloat16()
    value = torch.randn(context_len, num_kv_heads, head_dim, generator=generator).bfloat16()
    return query, key, value


def check(query, key, value, sliding_window=None):
    """Within bf16's rounding of the fp32 attention over the same values, and no further from it
    than torch's own bf16 path (SDPA's CPU flash kernel, which rounds the probabilities too)."""
    scale = query.shape[-1] ** -0.5
    exact = reference.prefill_attention(query.float(), key.float(), value.float(), scale, sliding_window)
    got = prefill_attention(query, key, value, scale, sliding_window)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)
    torch_error = (reference.prefill_attention(query, key, value, scale, sliding_window).float() - exact).abs().max()
    assert (got.float() - exact).abs().max() <= 2 * torch_error + 1e-3


@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_queries, context_len", [(1, 1), (37, 37), (64, 64), (100, 300), (1, 33), (33, 97)])
def test_matches_the_fp32_reference(num_heads, num_kv_heads, head_dim, num_queries, context_len):
    check(*bf16_case(num_queries, context_len, num_heads, num_kv_heads, head_dim))


@pytest.mark.parametrize("sliding_window", [1, 24, 64, 500])
@pytest.mark.parametrize("num_queries, context_len", [(50, 200), (130, 130), (1, 90)])
def test_sliding_window(sliding_window, num_queries, context_len):
    check(*bf16_case(num_queries, context_len, 12, 2, 64, seed=1), sliding_window=sliding_window)


def test_long_prompt_after_a_cached_prefix():
    # The document shape: a 256-token cached instruction, then ~1,000 new tokens.
    check(*bf16_case(1000, 1256, 9, 3, 64, seed=2))


def test_strided_views_of_a_fused_projection():
    query, key, value = bf16_case(40, 40, 8, 2, 64, seed=3)
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)  # [T, (8 + 2 + 2) * 64]
    q, k, v = fused.split([8 * 64, 2 * 64, 2 * 64], dim=1)
    got = prefill_attention(q.view(40, 8, 64), k.view(40, 2, 64), v.view(40, 2, 64), 0.125)
    torch.testing.assert_close(got, prefill_attention(query, key, value, 0.125))


def test_bad_arguments_are_clear_errors():
    query, key, value = bf16_case(8, 8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        prefill_attention(query.float(), key.float(), value.float(), 0.125)
    with pytest.raises(RuntimeError, match="context must hold"):
        prefill_attention(query, key[:4], value[:4], 0.125)
    with pytest.raises(RuntimeError, match="64 or 128"):
        prefill_attention(query[..., :32], key[..., :32], value[..., :32], 0.125)


def test_the_cpu_backend_takes_it_where_it_applies():
    query, key, value = bf16_case(20, 20, 4, 2, 64)
    span = PrefillSpan(query_start=0, num_queries=20, context_len=20, block_table=torch.zeros(2, dtype=torch.long))
    backend = CpuAttentionBackend(native_prefill=True)
    torch.testing.assert_close(backend.prefill(query, key, value, span, 0.125, None, None),
                               prefill_attention(query, key, value, 0.125))
    assert supports(query, None)
    sinks = torch.zeros(4)
    assert not supports(query, sinks) and not supports(query.float(), None) and not supports(query[..., :32], None)
    # Sinks and fp32 stay on the reference path.
    torch.testing.assert_close(backend.prefill(query.float(), key.float(), value.float(), span, 0.125, None, sinks),
                               reference.prefill_attention(query.float(), key.float(), value.float(), 0.125,
                                                           None, None, sinks))


@pytest.mark.parametrize("has_amx", [False, True])
def test_the_cpu_backend_leaves_prefill_to_torch_flash_on_amx(has_amx, monkeypatch):
    """With AMX tiles, torch's flash kernel runs bf16 on them and is the faster prefill."""
    preferred.cache_clear()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_amx)
    try:
        backend = CpuAttentionBackend()
    finally:
        preferred.cache_clear()
    assert backend.native_prefill is not has_amx
    calls = []
    monkeypatch.setattr(backend._prefill_native, "prefill_attention", lambda *a: calls.append(a) or prefill_attention(*a))
    query, key, value = bf16_case(30, 40, 4, 2, 64)
    span = PrefillSpan(query_start=0, num_queries=30, context_len=40, block_table=torch.zeros(3, dtype=torch.long))
    out = backend.prefill(query, key, value, span, 0.125, None, None)
    assert len(calls) == (0 if has_amx else 1)
    expected = prefill_attention(query, key, value, 0.125) if not has_amx else \
        reference.prefill_attention(query, key, value, 0.125)
    torch.testing.assert_close(out, expected)
