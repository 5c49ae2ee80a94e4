"""bf16 linear layers on oneDNN's brgemm microkernel (csrc/brgemm_linear_cpu.cpp, in the library
kvfleet_kernels/cpu_paged_attention.py builds), over a weight packed once: the CPU linear of bf16
models on CPUs with AMX (engine/models/layers.py: BrgemmLinear). On those it beat oneDNN's matmul
primitive at every row count measured (1.8x at 16 rows, 1.2x at 64 and 8,192; the C++ file has
the figures); elsewhere it is unmeasured, so the primitive stays."""

from __future__ import annotations

import functools

import torch

from kvfleet_kernels.cpu_paged_attention import load_error, require_built


@functools.cache
def available() -> bool:
    """The library builds and torch's brgemm packs bf16 on this CPU."""
    return load_error() is None and torch.ops.kvfleet_cpu.brgemm_bf16_supported()


def preferred() -> bool:
    """Whether bf16 linears take this path here: available, and the CPU has AMX tiles."""
    return torch.cpu._is_amx_tile_supported() and available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K even) -> its bf16 copy in the microkernel's blocked VNNI layout,
    [ceil(N / 64), K * 64], readable only by `linear`."""
    require_built()
    return torch.ops.kvfleet_cpu.pack_brgemm_weight(weight.detach().to(torch.bfloat16).contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] (any float dtype; bf16 with dense rows is read in place) @ weight^T + bias
    -> [rows, out_features] bf16, sums in fp32; bias [out_features] fp32 or None."""
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        x = x.to(torch.bfloat16).contiguous()
    out = x.new_empty((x.shape[0], out_features))
    torch.ops.kvfleet_cpu.brgemm_linear(out, x, packed, bias)
    return out
