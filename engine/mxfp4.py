"""MXFP4 weights (OCP Microscaling Formats v1.0), as gpt-oss publishes its experts,
dequantized once at load into the engine's dtype.

A block of 32 consecutive values along a row shares one scale:
    value = fp4(code) * 2 ** (scale - 127)
- code: FP4 E2M1, 4 bits: sign, 2 exponent bits (bias 1), 1 mantissa bit, giving
  +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; two codes a byte, the low nibble first.
- scale: E8M0, one unsigned byte, a power of two; 255 is NaN.

Checkpoint layout: `<name>_blocks` [..., rows, in / 32, 16] uint8 and `<name>_scales`
[..., rows, in / 32] uint8, rows being the output features. The dequantized tensor is
handed on under `<name>` in the layout the same checkpoint uses unquantized
(gpt-oss: input-major, [..., in, rows]).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

BLOCK_SIZE = 32
# FP4 E2M1 by code: magnitudes for codes 0-7, the same negated for 8-15.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS, E8M0_NAN = 127, 255


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
                         f"blocks must be [..., G, {BLOCK_SIZE // 2}] and scales [..., G]")
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("MXFP4 scales hold 255, E8M0's NaN")
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    values = table[codes.long()]
    # Exact in fp32: every code times a power of two from 2^-127 to 2^127 (subnormals near the bottom).
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS)
    return values.flatten(-2).to(dtype)


def dequantize_checkpoint(weights: Iterator[tuple[str, object]], dtype: torch.dtype
                          ) -> Iterator[tuple[str, object]]:
    """Checkpoint (name, tensor) pairs with every `X_blocks` / `X_scales` pair replaced by
    the dequantized `X`, transposed to [..., in, out] as an unquantized X is stored; other
    tensors pass through untouched. A pair's halves may arrive in any order."""
    pending: dict[str, dict[str, object]] = {}
    for name, tensor in weights:
        base, _, kind = name.rpartition("_")
        if kind not in ("blocks", "scales") or not base:
            yield name, tensor
            continue
        halves = pending.setdefault(base, {})
        halves[kind] = tensor
        if len(halves) == 2:
            del pending[base]
            values = dequantize(halves["blocks"][:], halves["scales"][:], dtype)  # [..., out, in]
            yield base, values.transpose(-1, -2)
    if pending:
        raise ValueError(f"MXFP4 tensors without their other half: {sorted(pending)}")
