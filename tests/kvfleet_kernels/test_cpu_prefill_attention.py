"""The native bf16 prefill attention kernels (kvfleet_kernels/cpu_prefill_attention.py: brgemm on
AMX, bf16_dot on avx512_bf16) against the torch reference in fp32 on the same bf16 values: GQA
ratios of every tiling, head sizes, fresh prompts and prompts after a cached prefix, one-token
chunks, sliding windows, strided views; each kernel where this CPU runs it, and the backend's
choice of kernel."""

from __future__ import annotations

import pytest
import torch

from engine.attention import CpuAttentionBackend, PrefillSpan
from kvfleet_kernels import cpu_prefill_attention, reference
from kvfleet_kernels.cpu_prefill_attention import (
    KERNELS,
    available,
    available_kernels,
    prefill_attention,
    supports,
)

pytestmark = pytest.mark.skipif(not available(), reason="needs a CPU with avx512_bf16 or AMX")
GQA = [(4, 4), (4, 2), (9, 3), (8, 2), (12, 2)]  # ratios 1, 2, 3, 4, 6
each_kernel = pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.skipif(name not in available_kernels(), reason=f"this CPU has no {name}"))
    for name in KERNELS])


def bf16_case(num_queries, context_len, num_heads, num_kv_heads, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(num_queries, num_heads, head_dim, generator=generator).bfloat16()
    key = torch.randn(context_len, num_kv_heads, head_dim, generator=generator).bfloat16()
    value = torch.randn(context_len, num_kv_heads, head_dim, generator=generator).bfloat16()
    return query, key, value


def check(name, query, key, value, sliding_window=None):
    """Within bf16's rounding of the fp32 attention over the same values, and no further from it
    than torch's own bf16 path (SDPA's CPU flash kernel, which rounds the probabilities too)."""
    scale = query.shape[-1] ** -0.5
    exact = reference.prefill_attention(query.float(), key.float(), value.float(), scale, sliding_window)
    got = prefill_attention(query, key, value, scale, sliding_window, name=name)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)
    torch_error = (reference.prefill_attention(query, key, value, scale, sliding_window).float() - exact).abs().max()
    assert (got.float() - exact).abs().max() <= 2 * torch_error + 1e-3


@each_kernel
@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_queries, context_len", [(1, 1), (37, 37), (64, 64), (100, 300), (1, 33), (33, 97)])
def test_matches_the_fp32_reference(name, num_heads, num_kv_heads, head_dim, num_queries, context_len):
    check(name, *bf16_case(num_queries, context_len, num_heads, num_kv_heads, head_dim))


@pytest.mark.skipif("brgemm" not in available_kernels(), reason="this CPU has no AMX")
@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_brgemm_takes_every_multiple_of_32(head_dim):
    check("brgemm", *bf16_case(70, 130, 8, 2, head_dim, seed=4))


@each_kernel
@pytest.mark.parametrize("sliding_window", [1, 24, 64, 500])
@pytest.mark.parametrize("num_queries, context_len", [(50, 200), (130, 130), (1, 90)])
def test_sliding_window(name, sliding_window, num_queries, context_len):
    """Windows that start rows of one block past the block's first keys (1, 24): those rows see
    nothing in the item's first key blocks."""
    check(name, *bf16_case(num_queries, context_len, 12, 2, 64, seed=1), sliding_window=sliding_window)


@each_kernel
def test_long_prompt_after_a_cached_prefix(name):
    # The document shape: a 256-token cached instruction, then ~1,000 new tokens.
    check(name, *bf16_case(1000, 1256, 9, 3, 64, seed=2))


@each_kernel
def test_strided_views_of_a_fused_projection(name):
    query, key, value = bf16_case(40, 40, 8, 2, 64, seed=3)
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)  # [T, (8 + 2 + 2) * 64]
    q, k, v = fused.split([8 * 64, 2 * 64, 2 * 64], dim=1)
    got = prefill_attention(q.view(40, 8, 64), k.view(40, 2, 64), v.view(40, 2, 64), 0.125, name=name)
    torch.testing.assert_close(got, prefill_attention(query, key, value, 0.125, name=name))


@each_kernel
def test_bad_arguments_are_clear_errors(name):
    query, key, value = bf16_case(8, 8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        prefill_attention(query.float(), key.float(), value.float(), 0.125, name=name)
    with pytest.raises(RuntimeError, match="context must hold"):
        prefill_attention(query, key[:4], value[:4], 0.125, name=name)
    with pytest.raises(RuntimeError, match="multiple of 32" if name == "brgemm" else "64 or 128"):
        prefill_attention(query[..., :48], key[..., :48], value[..., :48], 0.125, name=name)
    missing = [other for other in KERNELS if other not in available_kernels()]
    for other in missing:
        with pytest.raises(RuntimeError, match="unavailable here"):
            prefill_attention(query, key, value, 0.125, name=other)


def test_the_cpu_backend_takes_the_cpus_kernel_where_it_applies():
    query, key, value = bf16_case(20, 20, 4, 2, 64)
    span = PrefillSpan(query_start=0, num_queries=20, context_len=20, block_table=torch.zeros(2, dtype=torch.long))
    backend = CpuAttentionBackend(native_prefill=True)
    torch.testing.assert_close(backend.prefill(query, key, value, span, 0.125, None, None),
                               prefill_attention(query, key, value, 0.125))
    assert supports(query, None)
    sinks = torch.zeros(4)
    assert not supports(query, sinks) and not supports(query.float(), None) and not supports(query[..., :48], None)
    # Sinks and fp32 stay on the reference path.
    torch.testing.assert_close(backend.prefill(query.float(), key.float(), value.float(), span, 0.125, None, sinks),
                               reference.prefill_attention(query.float(), key.float(), value.float(), 0.125,
                                                           None, None, sinks))


@pytest.fixture
def fresh_kernel_choice():
    """The CPU's kernel is chosen once and cached: cleared before, and after the test's patches
    are undone (this fixture is set up before monkeypatch, so it is torn down after it)."""
    def clear():
        for cached in (available_kernels, cpu_prefill_attention.kernel):
            cached.cache_clear()
    clear()
    yield
    clear()


@pytest.mark.parametrize("has_amx", [False, True])
def test_the_cpu_backend_runs_brgemm_on_amx_and_bf16_dot_without(has_amx, fresh_kernel_choice, monkeypatch):
    """The kernel follows the CPU: brgemm where AMX tiles are, bf16_dot where only avx512_bf16 is."""
    if has_amx and "brgemm" not in available_kernels():
        pytest.skip("this CPU has no AMX")
    if not has_amx and not torch.ops.kvfleet_cpu.bf16_prefill_available():
        pytest.skip("this CPU has no avx512_bf16")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_amx)
    available_kernels.cache_clear()
    backend = CpuAttentionBackend()
    chosen = cpu_prefill_attention.kernel()
    assert backend.native_prefill and chosen == ("brgemm" if has_amx else "bf16_dot")
    calls = []
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention",
                        lambda *a, **k: calls.append(k.get("name")) or prefill_attention(*a, **k))
    query, key, value = bf16_case(30, 40, 4, 2, 64)
    span = PrefillSpan(query_start=0, num_queries=30, context_len=40, block_table=torch.zeros(3, dtype=torch.long))
    out = backend.prefill(query, key, value, span, 0.125, None, None)
    assert len(calls) == 1
    torch.testing.assert_close(out, prefill_attention(query, key, value, 0.125, name=chosen))
