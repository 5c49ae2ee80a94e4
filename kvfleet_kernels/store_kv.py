"""store_kv: write each new token's K and V rows into their paged-cache slots (an fp8 cache's
bytes as they are: the rows arrive quantized, engine/kv_quant.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.reference import as_bytes


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64; negative = padding, skipped
    key_token_stride,
    value_token_stride,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_BLOCK: tl.constexpr,  # ROW rounded up to a power of two
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    columns = tl.arange(0, ROW_BLOCK)
    mask = columns < tl.where(slot >= 0, ROW, 0)  # a padding token (slot < 0) writes nothing
    key = tl.load(key_ptr + token * key_token_stride + columns, mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + columns, mask=mask)
    tl.store(key_cache_ptr + slot * ROW + columns, key, mask=mask)
    tl.store(value_cache_ptr + slot * ROW + columns, value, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and key_cache.shape == value_cache.shape
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (key_cache.shape, key.shape)
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    for tensor in (key, value):  # each token's [num_kv_heads, head_dim] row must be contiguous
        assert tensor.stride(2) == 1 and tensor.stride(1) == head_dim, tensor.stride()
    assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype  # fp8: quantized before (engine/kv_quant.py)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    key, value, key_cache, value_cache = (as_bytes(t) for t in (key, value, key_cache, value_cache))
    _store_kv_kernel[(num_tokens,)](key, value, key_cache, value_cache, slot_mapping, key.stride(0),
                                    value.stride(0), ROW=row, ROW_BLOCK=triton.next_power_of_2(row))
