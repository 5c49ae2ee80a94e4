"""OPT (facebook/opt-*): learned positions offset by 2, LayerNorm, ReLU MLP, and
the lm_head tied to the token embedding."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from engine import parallel
from engine.attention import ForwardContext
from engine.models.parallel_layers import lm_head, merged_column_linear, row_parallel_linear, vocab_embedding

POSITION_OFFSET = 2  # OPT's learned position table reserves its first two rows


class OPTAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = self.num_kv_heads = parallel.divide(config.num_attention_heads, parallel.tp_size(),
                                                             "num_attention_heads")  # this rank's
        self.scale = self.head_dim**-0.5
        self.kv_scale = None  # engine.kv_quant.KVScales of an fp8 KV cache, set by the model runner
        self.qkv_proj = merged_column_linear(config.hidden_size, [config.hidden_size] * 3, bias=config.enable_bias)
        self.out_proj = row_parallel_linear(config.hidden_size, config.hidden_size, bias=config.enable_bias)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.backend.forward(q, k, v, key_cache, value_cache, ctx.layer_meta(self.layer_idx), self.scale,
                                  kv_scale=self.kv_scale)  # [T, H, D]
        return self.out_proj(out.reshape(num_tokens, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        affine = config.layer_norm_elementwise_affine
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        parallel.divide(config.ffn_dim, parallel.tp_size(), "ffn_dim")
        self.fc1 = merged_column_linear(config.hidden_size, [config.ffn_dim], bias=config.enable_bias)
        self.fc2 = row_parallel_linear(config.ffn_dim, config.hidden_size, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.act = ACT2FN[config.activation_function]

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        residual = hidden
        if self.do_layer_norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, ctx)
        if not self.do_layer_norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.do_layer_norm_before:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(self.act(self.fc1(hidden)))
        if not self.do_layer_norm_before:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.word_embed_proj_dim)
        # The learned positions split like a vocabulary: each rank holds some of the rows.
        self.embed_positions = vocab_embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        projected = config.word_embed_proj_dim != config.hidden_size
        self.project_in = nn.Linear(config.word_embed_proj_dim, config.hidden_size, bias=False) if projected else None
        self.project_out = nn.Linear(config.hidden_size, config.word_embed_proj_dim, bias=False) if projected else None
        has_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = (nn.LayerNorm(config.hidden_size, elementwise_affine=config.layer_norm_elementwise_affine)
                                 if has_final_norm else None)
        self.layers = nn.ModuleList(OPTDecoderLayer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, word_embed_proj_dim]
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(hidden, ctx)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.lm_head = lm_head(config.word_embed_proj_dim, config.vocab_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
