"""Qwen3 (dense): the Llama architecture with an RMSNorm over each head of q and k
before RoPE, an explicit `head_dim` (not hidden / heads), no q/k/v bias, and tied or
untied embeddings by the config."""

from __future__ import annotations

import torch

from engine.models.layers import RMSNorm
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, sliding_window: int | None) -> None:
        super().__init__(config, layer_idx, sliding_window)
        # One weight over head_dim, shared by every head (and so by every rank).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D]: each head's vector normalised on its own."""
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return q, k


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
