"""The paged bf16 prefill attention on AMX tiles (kvfleet_kernels/cpu_prefill_attention.py:
paged_prefill_attention, csrc/paged_prefill_amx.cpp) against the fp32 reference on the same bf16
values: K/V read through a scattered block table whose unused slots hold NaN, every GQA ratio's
tiling, head sizes 64 to 256, blocks of 16 to 64, windows, prompts after a cached prefix, running
maxima raised mid-row (the lazy rescale), strided views, the CPU backend's use of it, and clear
errors."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, CpuAttentionBackend, PrefillSpan
from kvfleet_kernels import cpu_paged_attention, reference
from kvfleet_kernels.cpu_prefill_attention import paged_available, paged_prefill_attention, supports_paged

pytestmark = pytest.mark.skipif(not paged_available(), reason="needs AMX tiles (amx_bf16)")


def paged_case(query, key, value, block_size, seed=0):
    """The context's K/V in caches of the kernel's layouts, its blocks scattered among spare ones
    whose every slot, and every slot past the context, holds NaN (a freed sequence's leftovers)."""
    context_len, num_kv_heads, head_dim = key.shape
    num_blocks = (context_len + block_size - 1) // block_size
    total = 2 * num_blocks + 3
    block_table = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:num_blocks]
    plain_keys = torch.full((total, block_size, num_kv_heads, head_dim), float("nan"), dtype=key.dtype)
    plain_values = plain_keys.clone()
    positions = torch.arange(context_len)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    plain_keys.view(-1, num_kv_heads, head_dim)[slots] = key
    plain_values.view(-1, num_kv_heads, head_dim)[slots] = value
    return (cpu_paged_attention.pack_key_cache(plain_keys), cpu_paged_attention.pack_value_cache(plain_values),
            block_table)


def bf16_case(num_queries, context_len, num_heads, num_kv_heads, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(num_queries, num_heads, head_dim), (context_len, num_kv_heads, head_dim),
              (context_len, num_kv_heads, head_dim)]
    return [torch.randn(shape, generator=generator).bfloat16() for shape in shapes]


def check(query, key, value, block_size=16, sliding_window=None, seed=0):
    """Within bf16's rounding of the fp32 attention over the same values, and no further from it
    than torch's own bf16 path (SDPA's CPU flash kernel, which rounds the probabilities too)."""
    key_cache, value_cache, block_table = paged_case(query, key, value, block_size, seed)
    scale = query.shape[-1] ** -0.5
    exact = reference.prefill_attention(query.float(), key.float(), value.float(), scale, sliding_window)
    got = paged_prefill_attention(query, key_cache, value_cache, block_table, key.shape[0], scale, sliding_window)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape and not got.isnan().any()
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)
    torch_error = (reference.prefill_attention(query, key, value, scale, sliding_window).float() - exact).abs().max()
    assert (got.float() - exact).abs().max() <= 2 * torch_error + 1e-3
    return got


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (9, 3), (8, 2), (12, 2), (16, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_queries, context_len", [(1, 1), (16, 16), (37, 37), (100, 300), (1, 33), (33, 97)])
def test_matches_the_fp32_reference(num_heads, num_kv_heads, head_dim, num_queries, context_len):
    check(*bf16_case(num_queries, context_len, num_heads, num_kv_heads, head_dim))


@pytest.mark.parametrize("head_dim, block_size", [(64, 32), (64, 64), (128, 32), (192, 16), (256, 64)])
def test_head_sizes_and_block_sizes(head_dim, block_size):
    check(*bf16_case(70, 130, 8, 2, head_dim, seed=4), block_size=block_size, seed=1)


@pytest.mark.parametrize("sliding_window", [1, 24, 40, 500])
@pytest.mark.parametrize("num_queries, context_len", [(50, 200), (130, 130), (1, 90)])
def test_sliding_window(sliding_window, num_queries, context_len):
    """Windows that start inside a 32-key chunk (24, 40) and rows that see nothing of an item's
    first chunks (1)."""
    check(*bf16_case(num_queries, context_len, 12, 2, 64, seed=1), sliding_window=sliding_window)


def test_long_prompt_after_a_cached_prefix():
    # The document shape: a 256-token cached instruction, then ~1,000 new tokens.
    check(*bf16_case(1000, 1256, 9, 3, 64, seed=2))


@pytest.mark.parametrize("rising", [True, False], ids=["max-rises-along-the-row", "max-first"])
def test_running_max_raised_mid_row(rising):
    """Scores that climb by far more than 2^8 every 32 keys (so in every chunk the kernel walks) make
    every row raise its running max (and shrink what it summed so far) again and again; the
    opposite order sets it once. Both must be the softmax of the whole row."""
    num_queries, context_len, head_dim = 20, 200, 64
    query, key, value = bf16_case(num_queries, context_len, 4, 2, head_dim, seed=5)
    steps = torch.arange(context_len, dtype=torch.float32) / 32  # +1 a chunk
    ramp = steps if rising else steps.flip(0)
    query = (query.float().abs() + 1).bfloat16()
    key = (key.float().abs() * 0.1 + ramp[:, None, None] * 3).bfloat16()  # scores climb ~24 a chunk
    # The case is what it claims: each 32 keys' best score (log2 units) passes the one before by > 8.
    log2_scores = query[0, 0].float() @ key[:160, 0].float().T * head_dim ** -0.5 * 1.4427  # [160] keys
    chunk_best = log2_scores.view(5, 32).max(dim=1).values
    steps = chunk_best.diff() if rising else -chunk_best.diff()
    assert (steps > 8).all()
    check(query, key, value)


def test_strided_views_of_a_fused_projection():
    query, key, value = bf16_case(40, 40, 8, 2, 64, seed=3)
    key_cache, value_cache, block_table = paged_case(query, key, value, 16)
    fused = torch.cat([query.flatten(1), key.flatten(1)], dim=1)  # [T, (8 + 2) * 64]
    strided_query = fused[:, :8 * 64].view(40, 8, 64)
    out = torch.full((40, 12, 64), 7.0, dtype=torch.bfloat16)
    got = paged_prefill_attention(strided_query, key_cache, value_cache, block_table, 40, 0.125, out=out[:, 2:10])
    assert got.data_ptr() == out[:, 2:10].data_ptr()
    torch.testing.assert_close(got, paged_prefill_attention(query, key_cache, value_cache, block_table, 40, 0.125))
    assert (out[:, :2] == 7).all() and (out[:, 10:] == 7).all()  # nothing outside the view written


def test_the_cpu_backend_reads_the_cache_in_place(monkeypatch):
    """A prompt after a 48-token cached prefix: the CPU backend stores the new K/V, then attends
    over the paged context with no gather, and the output is the reference's."""
    num_kv_heads, head_dim, block_size, cached, new = 2, 64, 16, 48, 30
    query, key, value = bf16_case(new, cached + new, 8, num_kv_heads, head_dim, seed=6)
    backend = CpuAttentionBackend()
    assert backend.paged_prefill
    plain = torch.zeros(8, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
    key_cache, value_cache = backend.cache_views(plain, plain.clone())
    block_table = torch.tensor([5, 2, 7, 0, 3], dtype=torch.long)
    positions = torch.arange(cached + new)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    backend.store_kv(key[:cached], value[:cached], key_cache, value_cache, slots[:cached])
    for gather in ("gather_keys", "gather_values"):
        monkeypatch.setattr(backend, gather, lambda *a: pytest.fail("the paged kernel gathers nothing"))
    meta = AttentionMetadata(slot_mapping=slots[cached:], num_prefill_tokens=new,
                             decode_block_tables=torch.zeros(0, 5, dtype=torch.long),
                             decode_context_lens=torch.zeros(0, dtype=torch.long),
                             prefills=[PrefillSpan(0, new, cached + new, block_table)])
    got = backend.forward(query, key[cached:], value[cached:], key_cache, value_cache, meta, head_dim ** -0.5)
    exact = reference.prefill_attention(query.float(), key.float(), value.float(), head_dim ** -0.5)
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)


def test_what_it_does_not_take():
    query, key, value = bf16_case(8, 8, 4, 2, 64)
    key_cache, value_cache, _ = paged_case(query, key, value, 16)
    assert supports_paged(query, key_cache, None)
    assert not supports_paged(query, key_cache, torch.zeros(4))  # sinks: the reference path
    assert not supports_paged(query.float(), key_cache, None)
    narrow = torch.zeros(4, 2, 16, 16, 2, dtype=torch.bfloat16)  # head size 32: brgemm's
    assert not supports_paged(query[..., :32], narrow, None)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "query": a["query"].float()}, "bf16"),
    (lambda a: {**a, "context_len": 4}, "context must hold"),
    (lambda a: {**a, "block_table": a["block_table"][:1]}, "covering context_len"),
    (lambda a: {**a, "block_table": a["block_table"].int()}, "int64"),
    (lambda a: {**a, "key_cache": a["key_cache"][:, :1]}, "key_cache must be"),
    (lambda a: {**a, "scale": -1.0}, "scale must be positive"),
])
def test_bad_arguments_are_clear_errors(change, message):
    query, key, value = bf16_case(8, 20, 4, 2, 64)
    key_cache, value_cache, block_table = paged_case(query, key, value, 16)
    arguments = {"query": query, "key_cache": key_cache, "value_cache": value_cache, "block_table": block_table,
                 "context_len": 20, "scale": 0.125}
    with pytest.raises(RuntimeError, match=message):
        paged_prefill_attention(**change(arguments))
