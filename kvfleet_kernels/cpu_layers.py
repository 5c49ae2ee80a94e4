"""CPU layers in native code (csrc/cpu_layers.cpp, in the library kvfleet_kernels/cpu_paged_attention.py
builds): RMSNorm fused with the residual add before it, SiLU-and-mul and rotary embedding in
place, for bf16 and fp16 models and fp32 ones whose weights are kept quantized; LayerNorm fused
with the residual add for encoders whose matmuls run in bf16 around an fp32 residual stream;
greedy sampling's argmax in any float dtype; and the LoRA delta of a mixed-adapter step
(csrc/lora_cpu.cpp), in every dtype."""

from __future__ import annotations

import torch

from kvfleet_kernels.cpu_paged_attention import require_built


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [rows, 2 * width] bf16/fp16/fp32 (gate, then up) -> silu(gate) * up [rows, width], rounded
    as transformers' act(gate) * up is (vLLM's silu_and_mul)."""
    require_built()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = x.new_empty((x.shape[0], x.shape[1] // 2))
    torch.ops.kvfleet_cpu.silu_and_mul(out, x)
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] fp32/bf16/fp16 -> [rows] int64: torch.argmax(dim=-1), the first
    index of each row's largest value (a NaN the largest), read in the logits' own dtype."""
    require_built()
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    torch.ops.kvfleet_cpu.argmax_rows(out, logits)
    return out


def rotary_in_place(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary on query [T, Hq, D] and key [T, Hkv, D] (bf16/fp16/fp32, dense heads) in
    place, cos/sin rows [max_positions, D] fp32 picked by positions [T] and rounded to the
    dtype, as kvfleet_kernels.reference.rotary after transformers' cast. Returns (query, key)."""
    require_built()
    torch.ops.kvfleet_cpu.rotary_in_place(query, key, positions.contiguous(), cos, sin)
    return query, key


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Same contract as kvfleet_kernels.reference.rms_norm, in one pass per row: x, residual [..., hidden]
    bf16, fp16 or fp32, weight [hidden]. Returns normed, or (normed, x + residual) with `residual`."""
    require_built()
    shape = x.shape  # [..., hidden]: Qwen3's q/k norms pass [T, heads, head_dim]
    rows = x.reshape(-1, shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype)
    residual_out = None if residual is None else torch.empty(rows.shape, dtype=x.dtype)
    residual_rows = None if residual is None else residual.reshape(rows.shape).contiguous()
    torch.ops.kvfleet_cpu.add_rms_norm(out, residual_out, rows, residual_rows, weight, eps)
    return out.view(shape) if residual is None else (out.view(shape), residual_out.view(shape))


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float, low_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm(x + residual) in fp32, and its copy in `low_dtype` (bf16 or fp16), in one pass:
    x [rows, hidden] fp32/bf16/fp16, residual fp32 like it or None, weight and bias fp32 [hidden].
    Returns (normed fp32, normed in low_dtype)."""
    require_built()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    out_low = torch.empty(x.shape, dtype=low_dtype)
    torch.ops.kvfleet_cpu.add_layer_norm(out, out_low, x, None if residual is None else residual.contiguous(),
                                         weight, bias, eps)
    return out, out_low


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor,
             token_slots: torch.Tensor, part_offsets: list[int]) -> torch.Tensor:
    """out [T, width] += each token's LoRA delta, in place (punica's BGMV), and returns out:
    x [T, in]; lora_a [L, P * R, in] and lora_b_t [L, R, width] contiguous, in out's dtype;
    token_slots [T] int64 (-1: the base model); part p's shrink rows [p * R, (p + 1) * R)
    feed its columns [part_offsets[p], part_offsets[p + 1]). Accumulates in fp32 and rounds
    each output once."""
    require_built()
    x = x if x.stride(-1) == 1 else x.contiguous()
    torch.ops.kvfleet_cpu.add_lora(out, x, lora_a, lora_b_t, token_slots, part_offsets)
    return out
