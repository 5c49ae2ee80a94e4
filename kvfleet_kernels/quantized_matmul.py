"""Triton matmuls on quantized weights, dequantized in registers a tile at a time: the GPU peer of
kvfleet_kernels/cpu_quantized_linear.py.

  * quantized_matmul: x [M, K] @ W^T for W in the one form every integer format becomes
    (cpu_quantized_linear.QuantizedWeight: 4- or 8-bit codes, w = a * code - b with an fp16 a and
    b per group of input features): AWQ, GPTQ (desc_act: the input reordered once), compressed-
    tensors' packed and int8 weights, GGUF's kernel types. 4-bit codes are packed two a byte along
    the input (feature 2j in the low nibble, 2j + 1 in the high).
  * fp8_matmul: x @ W^T for fp8 weights (e4m3) with a scale per output channel or one per tensor,
    widened in registers through fp16's bits as the fp8 KV cache is (kvfleet_kernels/kv_fp8.py),
    so it runs on sm_80 as on the interpreter; the activations stay in x's dtype (W8A16).

Each program owns a BLOCK_M x BLOCK_N tile of the output and walks the input BLOCK_K features at a
time, BLOCK_K dividing the group, so a tile's scales are one per column. fp32 accumulation, the
output in x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_kernels.cpu_quantized_linear import QuantizedWeight


@dataclass
class TritonQuantizedWeight:
    codes: torch.Tensor  # uint8 [N, K / 2] (bits 4: two codes a byte) or [N, K] (bits 8)
    scale: torch.Tensor  # fp16 [N, K / group_size]: a
    offset: torch.Tensor  # fp16 [N, K / group_size]: b, w = a * code - b
    bits: int
    group_size: int
    in_features: int
    input_order: torch.Tensor | None  # as QuantizedWeight's: x[:, input_order] is multiplied

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def to(self, device: torch.device | str) -> TritonQuantizedWeight:
        order = None if self.input_order is None else self.input_order.to(device)
        return TritonQuantizedWeight(self.codes.to(device), self.scale.to(device), self.offset.to(device), self.bits,
                                     self.group_size, self.in_features, order)


def pack_weight(weight: QuantizedWeight) -> TritonQuantizedWeight:
    """The kernel's form of a QuantizedWeight: 4-bit codes two a byte, 6- and 8-bit ones a byte
    each, everything contiguous, where the weight is (TritonQuantizedWeight.to moves it)."""
    n, k = weight.shape
    if weight.bits not in (4, 6, 8) or k % 2 or weight.group_size % 16:
        raise ValueError(f"quantized_matmul takes 4-, 6- or 8-bit codes in groups of a multiple of 16 features, "
                         f"got {weight.bits} bits, groups of {weight.group_size}, {k} features")
    codes, bits = weight.codes, 8 if weight.bits == 6 else weight.bits
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [N, K / 2]
    return TritonQuantizedWeight(codes.contiguous(), weight.scale.contiguous(), weight.offset.contiguous(),
                                 bits, weight.group_size, k, weight.input_order)


def dequantize_rows(weight: TritonQuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight, fp32 [len(ids), K]: an embedding table's lookups (no input order)."""
    codes = weight.codes[ids]
    if weight.bits == 4:  # [ids, K / 2] -> [ids, K]: feature 2j in the low nibble
        codes = torch.stack((codes & 0x0F, codes >> 4), dim=2).flatten(1)
    scale = weight.scale[ids].float().repeat_interleave(weight.group_size, dim=1)
    offset = weight.offset[ids].float().repeat_interleave(weight.group_size, dim=1)
    return scale * codes.float() - offset


@triton.jit
def _quantized_matmul_kernel(
    x_ptr,  # [M, K]
    codes_ptr,  # [N, K / 2] uint8 (BITS 4) or [N, K] uint8 (BITS 8)
    scale_ptr,  # [N, K / GROUP] fp16
    offset_ptr,  # [N, K / GROUP] fp16
    out_ptr,  # [M, N]
    M, N, K, x_row_stride, out_row_stride,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    groups_per_row = K // GROUP
    for k0 in range(0, K, BLOCK_K):
        features = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + features[None, :], mask=row_mask[:, None], other=0.0)
        if BITS == 4:
            pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(codes_ptr + cols[:, None] * (K // 2) + pairs[None, :], mask=col_mask[:, None], other=0)
            codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]: feature 2j, then 2j + 1
        else:
            codes = tl.load(codes_ptr + cols[:, None] * K + features[None, :], mask=col_mask[:, None], other=0)
        group = cols * groups_per_row + k0 // GROUP  # [BLOCK_N]: one group a column in this tile
        a = tl.load(scale_ptr + group, mask=col_mask, other=0.0).to(tl.float32)
        b = tl.load(offset_ptr + group, mask=col_mask, other=0.0).to(tl.float32)
        weight = (codes.to(tl.float32) * a[:, None] - b[:, None]).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(weight), input_precision=DOT_PRECISION)
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _launch_shape(m: int, block_k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): rows by the step's size (tl.dot takes 16 at least)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64, block_k


def quantized_matmul(x: torch.Tensor, weight: TritonQuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype (fp32 accumulation)."""
    assert x.dim() == 2 and x.shape[1] == weight.in_features, (x.shape, weight.in_features)
    if weight.input_order is not None:
        x = x.index_select(1, weight.input_order)
    x = x.contiguous()
    m, k, n = x.shape[0], weight.in_features, weight.out_features
    out = x.new_empty((m, n)) if out is None else out
    if m == 0:
        return out
    block_m, block_n, block_k = _launch_shape(m, min(weight.group_size, 128))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quantized_matmul_kernel[grid](x, weight.codes, weight.scale, weight.offset, out, m, n, k, x.stride(0),
                                   out.stride(0), BITS=weight.bits, GROUP=weight.group_size, BLOCK_M=block_m,
                                   BLOCK_N=block_n, BLOCK_K=block_k,
                                   DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return out


@triton.jit
def _fp8_matmul_kernel(
    x_ptr,  # [M, K]
    weight_ptr,  # [N, K] the fp8 (e4m3) weight's bytes
    scale_ptr,  # [N] fp32 (PER_CHANNEL) or [1]
    out_ptr,  # [M, N]
    M, N, K, x_row_stride, out_row_stride,
    PER_CHANNEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        features = k0 + tl.arange(0, BLOCK_K)
        feature_mask = features < K
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + features[None, :],
                    mask=row_mask[:, None] & feature_mask[None, :], other=0.0)
        raw = tl.load(weight_ptr + cols[:, None] * K + features[None, :],
                      mask=col_mask[:, None] & feature_mask[None, :], other=0).to(tl.uint16)
        bits = ((raw & 0x80) << 8) | ((raw & 0x7F) << 7)  # e4m3 in fp16's places: 2^-8 of its value
        weight = (bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(weight), input_precision=DOT_PRECISION)
    if PER_CHANNEL:
        acc *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    else:
        acc *= tl.load(scale_ptr)
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight * weight_scale)^T -> [M, N] in x's dtype: weight [N, K] float8_e4m3fn,
    weight_scale [N] (per channel) or one value (per tensor), fp32 accumulation."""
    assert weight.dtype == torch.float8_e4m3fn and x.dim() == 2 and x.shape[1] == weight.shape[1]
    x, weight = x.contiguous(), weight.contiguous()
    scale = weight_scale.float().reshape(-1).contiguous()
    assert scale.numel() in (1, weight.shape[0]), scale.shape
    m, (n, k) = x.shape[0], weight.shape
    out = x.new_empty((m, n)) if out is None else out
    if m == 0:
        return out
    block_m, block_n, block_k = _launch_shape(m, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_matmul_kernel[grid](x, weight.view(torch.uint8), scale, out, m, n, k, x.stride(0), out.stride(0),
                             PER_CHANNEL=scale.numel() > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return out
