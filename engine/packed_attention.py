"""Attention for embedding models: whole inputs packed back to back, no KV cache, no
padding in the matmuls. The backends take the paged backends' arguments (engine/attention.py),
so the decoder models run unchanged as embedding models; the caches they pass are None.

    | input A ........ | input B ... | input C ........... |
    cu_seqlens[0]      [1]           [2]                   [3]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import resolve_backend_name
from engine.devices import repeat_interleave
from kvfleet_kernels import reference


@dataclass
class PackedAttentionMetadata:
    seq_lens_list: list[int]  # each input's length, in packed order
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32 on the device: each input's first row, then the total
    max_seqlen: int
    causal: bool  # decoder embedding models; encoders see their whole input
    seq_lens: torch.Tensor  # [R] each row's input length (read by longrope, as in AttentionMetadata); 1 on pad rows
    # How the CPU path pads (kvfleet_kernels/reference.py: padding_plan), built by the first layer that needs it.
    padding_plan: list[reference.PaddedGroup] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, seq_lens: list[int], causal: bool, device: torch.device,
              num_rows: int | None = None) -> PackedAttentionMetadata:
        """num_rows: the batch's rows R when it carries pad rows after the inputs (CPU only)."""
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        cu_seqlens = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu_seqlens[1:])
        row_lens = torch.ones(num_rows or int(cu_seqlens[-1]), dtype=torch.int32)
        row_lens[:int(cu_seqlens[-1])] = repeat_interleave(lens, lens)
        return cls(seq_lens, cu_seqlens.to(device), max(seq_lens), causal, row_lens.to(device))


class TorchPackedAttention:
    """One batched SDPA over the inputs padded for attention alone (kvfleet_kernels/reference.py:
    padded_varlen_attention); the CPU path where the native kernel cannot be built."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache, value_cache,
                meta: PackedAttentionMetadata, scale: float, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None, kv_scale=None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]. A sliding window never
        binds: the embedding engine limits inputs to the smallest window. No KV cache: kv_scale
        (an fp8 cache's, engine/kv_quant.py) is never set here."""
        if sinks is not None:
            raise ValueError("attention sinks are not supported in embedding models")
        if meta.padding_plan is None:
            meta.padding_plan = reference.padding_plan(meta.seq_lens_list, meta.causal, query.device)
        return reference.padded_varlen_attention(query, key, value, meta.seq_lens_list, scale, meta.causal,
                                                 meta.padding_plan)


class CpuPackedAttention(TorchPackedAttention):
    """The native varlen kernel (kvfleet_kernels/cpu_varlen_attention.py); the CPU path. It reads the
    inputs in place, so the batch may carry rows past the last input (padding for the matmuls,
    engine/embedding_runner.py): their output is zero."""

    name = "cpu"

    def forward(self, query, key, value, key_cache, value_cache, meta: PackedAttentionMetadata, scale: float,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None, kv_scale=None) -> torch.Tensor:
        from kvfleet_kernels.cpu_varlen_attention import varlen_attention  # noqa: PLC0415 (builds on first use)

        if sinks is not None:
            raise ValueError("attention sinks are not supported in embedding models")
        return varlen_attention(query, key, value, meta.cu_seqlens, scale, meta.causal)


class TritonPackedAttention(TorchPackedAttention):
    """The Triton varlen kernel (kvfleet_kernels/varlen_attention.py); the CUDA path."""

    name = "triton"

    def __init__(self) -> None:
        from kvfleet_kernels.varlen_attention import varlen_attention  # noqa: PLC0415 (imports triton)

        self._attention = varlen_attention

    def forward(self, query, key, value, key_cache, value_cache, meta: PackedAttentionMetadata, scale: float,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None, kv_scale=None) -> torch.Tensor:
        if sinks is not None:
            raise ValueError("attention sinks are not supported in embedding models")
        return self._attention(query, key, value, meta.cu_seqlens, meta.max_seqlen, scale, meta.causal)


def select_packed_backend(name: str, device: torch.device) -> TorchPackedAttention:
    """The paged backends' rule (engine/attention.py: resolve_backend_name)."""
    backends = {"cpu": CpuPackedAttention, "torch": TorchPackedAttention, "triton": TritonPackedAttention}
    return backends[resolve_backend_name(name, device)]()
