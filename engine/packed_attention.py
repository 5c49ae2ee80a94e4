"""Attention for embedding models: whole inputs packed back to back, no KV cache, no
padding in the matmuls. The backends take the paged backends' arguments (engine/attention.py),
so the decoder models run unchanged as embedding models; the caches they pass are None.

    | input A ........ | input B ... | input C ........... |
    cu_seqlens[0]      [1]           [2]                   [3]
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kernels import reference


@dataclass
class PackedAttentionMetadata:
    seq_lens_list: list[int]  # each input's length, in packed order
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32 on the device: each input's first row, then the total
    max_seqlen: int
    causal: bool  # decoder embedding models; encoders see their whole input
    seq_lens: torch.Tensor  # [T] each token's input length (read by longrope, as in AttentionMetadata)
    # How the CPU path pads (kernels/reference.py: padding_plan), built by the first layer that needs it.
    padding_plan: list[reference.PaddedGroup] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, seq_lens: list[int], causal: bool, device: torch.device) -> PackedAttentionMetadata:
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        cu_seqlens = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu_seqlens[1:])
        return cls(seq_lens, cu_seqlens.to(device), max(seq_lens), causal,
                   torch.repeat_interleave(lens, lens).to(device))


class TorchPackedAttention:
    """One batched SDPA over the inputs padded for attention alone (kernels/reference.py:
    padded_varlen_attention); the CPU path."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache, value_cache,
                meta: PackedAttentionMetadata, scale: float, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]. A sliding window never
        binds: the embedding engine limits inputs to the smallest window."""
        if sinks is not None:
            raise ValueError("attention sinks are not supported in embedding models")
        if meta.padding_plan is None:
            meta.padding_plan = reference.padding_plan(meta.seq_lens_list, meta.causal, query.device)
        return reference.padded_varlen_attention(query, key, value, meta.seq_lens_list, scale, meta.causal,
                                                 meta.padding_plan)


class TritonPackedAttention(TorchPackedAttention):
    """The Triton varlen kernel (kernels/varlen_attention.py); the CUDA path."""

    name = "triton"

    def __init__(self) -> None:
        from kernels.varlen_attention import varlen_attention  # noqa: PLC0415 (imports triton)

        self._attention = varlen_attention

    def forward(self, query, key, value, key_cache, value_cache, meta: PackedAttentionMetadata, scale: float,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is not None:
            raise ValueError("attention sinks are not supported in embedding models")
        return self._attention(query, key, value, meta.cu_seqlens, meta.max_seqlen, scale, meta.causal)


def select_packed_backend(name: str, device: torch.device) -> TorchPackedAttention:
    """auto: triton on CUDA, torch on the CPU (`cpu` names the same torch path: its native
    kernel is for paged decode, which embeddings never run)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name in ("torch", "cpu"):
        return TorchPackedAttention()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' needs a CUDA device; on the CPU it runs only under "
                         "TRITON_INTERPRET=1 (set before kernels are imported), which is for tests")
    return TritonPackedAttention()
