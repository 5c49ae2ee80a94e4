"""Gemma 3 (text; Gemma3ForCausalLM, model_type gemma3_text).

What sets it apart from Llama:
- local layers (a sliding window) alternate with global ones by `layer_types`, and
  each kind has its own RoPE (local: base 10k; global: base 1M, maybe linear-scaled);
- RMSNorm over each head of q and k; the query scale is query_pre_attn_scalar^-1/2;
- four norms a layer: before and after attention, before and after the MLP, each
  Gemma's (1 + weight) RMSNorm, with plain residual adds around them;
- embeddings scaled by sqrt(hidden_size), a GeGLU MLP (gelu_pytorch_tanh);
- the final logits soft-capped (cap * tanh(logits / cap)) where the config sets it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.models.layers import GemmaRMSNorm, RotaryEmbedding
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from engine.models.parallel_layers import lm_head, vocab_embedding

SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma3Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, sliding_window: int | None) -> None:
        super().__init__(config, layer_idx, sliding_window)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D]: each head's vector normalised on its own."""
        return self.q_norm(q), self.k_norm(k)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, sliding_window: int | None) -> None:
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.self_attn = Gemma3Attention(config, layer_idx, sliding_window)
        self.mlp = LlamaMLP(config, activation=config.hidden_activation)  # GeGLU, no bias
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]"""
        attended = self.self_attn(positions, self.input_layernorm(hidden), rotary, ctx)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(nn.Module):
    def __init__(self, config, sliding_windows: list[int | None], max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden) rounded to the model's dtype first, as transformers multiplies
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, sliding_windows[i])
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = config.head_dim
        self.rotary_local = RotaryEmbedding(config, head_dim, max_positions, layer_type=SLIDING)
        self.rotary_global = RotaryEmbedding(config, head_dim, max_positions, layer_type=FULL)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.normalizer.to(self.norm.weight.dtype)  # [T, hidden]
        for layer in self.layers:
            hidden = layer(positions, hidden, self.rotary_local if layer.is_sliding else self.rotary_global, ctx)
        return self.norm(hidden)


class Gemma3ForCausalLM(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma 3: attn_logit_softcapping is not supported (Gemma 3 checkpoints leave it unset)")
        self.config = config
        self.model = Gemma3Model(config, LlamaForCausalLM.sliding_windows(config), max_positions)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] (on rank 0; None on the other ranks)"""
        logits = self.lm_head(hidden)
        if logits is not None and self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
