"""Reading an fp8 KV cache in the Triton kernels (kvfleet_kernels/paged_attention.py,
prefill_attention.py): the cache is passed as its bytes (uint8) and each element widened through
fp16's bits, exactly, on every GPU generation (sm_80 has no fp8 conversion of its own) and in the
interpreter. engine/kv_quant.py says what the cache holds: x / scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# FP8 constexpr of the kernels: what the cache's bytes are.
NOT_FP8, FP8_E4M3, FP8_E5M2 = 0, 1, 2


def fp8_kind(cache: torch.Tensor) -> int:
    return {torch.float8_e4m3fn: FP8_E4M3, torch.float8_e5m2: FP8_E5M2}.get(cache.dtype, NOT_FP8)


@triton.jit
def load_kv(ptr, offsets, mask, scale, FP8: tl.constexpr, dtype: tl.constexpr):
    """Cache elements at ptr + offsets (masked ones 0) in `dtype`: as stored, or an fp8 cache's
    bytes times `scale`. e5m2 is the top byte of an fp16; e4m3's fields moved into fp16's places
    read 2^-8 of its value (fp16's exponent bias is 8 more; subnormals land on subnormals)."""
    if FP8 == 0:
        x = tl.load(ptr + offsets, mask=mask, other=0.0).to(dtype)
    else:
        raw = tl.load(ptr + offsets, mask=mask, other=0).to(tl.uint16)
        if FP8 == 1:
            bits = ((raw & 0x80) << 8) | ((raw & 0x7F) << 7)
            x = (bits.to(tl.float16, bitcast=True).to(tl.float32) * (256.0 * scale)).to(dtype)
        else:
            x = ((raw << 8).to(tl.float16, bitcast=True).to(tl.float32) * scale).to(dtype)
    return x
