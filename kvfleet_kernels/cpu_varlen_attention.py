"""varlen_attention for the CPU in native code (csrc/varlen_attention_cpu.cpp, in the library
kvfleet_kernels/cpu_paged_attention.py builds): embedding models' packed inputs, each attending to
itself alone, with no padding and no gathers. Same contract as kvfleet_kernels.reference.varlen_attention."""

from __future__ import annotations

import torch

from kvfleet_kernels.cpu_paged_attention import require_built


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, causal: bool) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] (views of a fused projection are fine: only D
    must be dense), cu_seqlens [num_seqs + 1] int32 -> [T, Hq, D] in query's dtype. Rows from
    cu_seqlens[-1] on belong to no input (a batch padded for the matmuls) and come back zero."""
    require_built()
    out = torch.empty(query.shape, dtype=query.dtype)
    total = int(cu_seqlens[-1])
    out[total:].zero_()
    # Shapes, dtypes and strides are checked in the C++ op (TORCH_CHECK), where they are read.
    torch.ops.kvfleet_cpu.varlen_attention(out, query, key, value, cu_seqlens, scale, causal)
    return out
