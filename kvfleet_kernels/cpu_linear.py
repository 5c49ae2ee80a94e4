"""bf16 linear layers over a weight packed once into VNNI pairs, in the library
kvfleet_kernels/cpu_paged_attention.py builds: the CPU linear of bf16 models on CPUs with native
bf16 (engine/models/layers.py: PackedBf16Linear). Two kernels, one per kind of CPU:

- "brgemm" (csrc/brgemm_linear_cpu.cpp): oneDNN's brgemm microkernel, on CPUs with AMX. It beat
  oneDNN's matmul primitive at every row count measured (1.8x at 16 rows, 1.2x at 64 and 8,192).
- "vnni" (csrc/vnni_linear_cpu.cpp): avx512_bf16's pair dot product, on CPUs with it and no AMX,
  where torch's brgemm packs no bf16. Against the primitive on a 2-core EPYC: 1.5-2x at 1-16 rows
  (weights streamed at ~30 GB/s, the read probe), 1.2x at 64, even at thousands (~400 GFLOP/s).

Elsewhere neither is measured, or neither runs, and bf16 linears stay on oneDNN's primitive."""

from __future__ import annotations

import functools

import torch

from kvfleet_kernels.cpu_paged_attention import load_error, require_built

KERNELS = ("brgemm", "vnni")


@functools.cache
def available(kernel: str) -> bool:
    """The library builds and `kernel` runs bf16 on this CPU."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown bf16 linear kernel {kernel!r}; expected one of {KERNELS}")
    if load_error() is not None:
        return False
    if kernel == "brgemm":
        return torch.ops.kvfleet_cpu.brgemm_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() and torch.ops.kvfleet_cpu.vnni_linear_supported()


def preferred_kernel() -> str | None:
    """The kernel bf16 linears take here: brgemm on CPUs with AMX tiles, vnni on CPUs with
    avx512_bf16 and no AMX; None where neither applies (oneDNN's primitive stays)."""
    if torch.cpu._is_amx_tile_supported():
        return "brgemm" if available("brgemm") else None
    return "vnni" if available("vnni") else None


def pack_weight(weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """weight [N, K] (K even) -> its bf16 copy in `kernel`'s VNNI panels of 64 output columns,
    [ceil(N / 64), K * 64], readable only by `linear` with the same kernel."""
    require_built()
    weight = weight.detach().to(torch.bfloat16).contiguous()
    if kernel == "brgemm":
        return torch.ops.kvfleet_cpu.pack_brgemm_weight(weight)
    return torch.ops.kvfleet_cpu.pack_vnni_weight(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           kernel: str) -> torch.Tensor:
    """x [rows, K] (any float dtype; bf16 with dense rows is read in place) @ weight^T + bias
    -> [rows, out_features] bf16, sums in fp32 rounded once; bias [out_features] fp32 or None."""
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        x = x.to(torch.bfloat16).contiguous()
    out = x.new_empty((x.shape[0], out_features))
    if kernel == "brgemm":
        torch.ops.kvfleet_cpu.brgemm_linear(out, x, packed, bias)
    else:
        torch.ops.kvfleet_cpu.vnni_linear(out, x, packed, bias)
    return out


def can_fuse_silu_and_mul(kernel: str, out_features: int) -> bool:
    """Whether `gate_up_silu` takes a gate_up weight of `out_features` on `kernel` (either): I =
    out_features / 2 a multiple of the 64-column panels, so gate and up panels pair up."""
    return kernel in KERNELS and out_features % 128 == 0


def gate_up_silu(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 kernel: str) -> torch.Tensor:
    """A gated MLP's gate_up projection and silu_and_mul in one pass: x [rows, K] @ weight^T + bias
    = [gate, up] [rows, out_features] -> SiLU(gate) * up [rows, out_features / 2] bf16, bit for
    bit `silu_and_mul(linear(...))` (kvfleet_kernels/cpu_layers.py)."""
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        x = x.to(torch.bfloat16).contiguous()
    out = x.new_empty((x.shape[0], out_features // 2))
    if kernel == "brgemm":
        torch.ops.kvfleet_cpu.brgemm_gate_up_silu(out, x, packed, bias)
    else:
        torch.ops.kvfleet_cpu.vnni_gate_up_silu(out, x, packed, bias)
    return out
