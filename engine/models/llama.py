"""Llama family (Llama 2/3, and the base of Mistral and Qwen2), loading Hugging Face
checkpoints by their original weight names.

q/k/v and gate/up are fused into one matmul each; `packed_modules` tells the
loader which slice of the fused weight a checkpoint tensor fills. Under tensor
parallelism each rank holds its heads (KV heads split, or replicated when there are
fewer than ranks) and its slice of the MLP (engine/models/parallel_layers.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from engine import parallel
from engine.attention import ForwardContext
from engine.models.layers import RMSNorm, RotaryEmbedding
from engine.models.parallel_layers import (
    ColumnParallelLinear,
    lm_head,
    merged_column_linear,
    row_parallel_linear,
    vocab_embedding,
)


class LlamaAttention(nn.Module):
    qkv_bias_attr, o_bias_attr = "attention_bias", "attention_bias"

    def __init__(self, config, layer_idx: int, sliding_window: int | None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        total_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.num_heads = parallel.divide(total_heads, parallel.tp_size(), "num_attention_heads")  # this rank's
        kv_start, kv_end = parallel.kv_head_range(config.num_key_value_heads)
        self.num_kv_heads = kv_end - kv_start
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.sinks: nn.Parameter | None = None  # [Hq] attention sinks (gpt-oss)
        self.kv_scale = None  # engine.kv_quant.KVScales of an fp8 KV cache, set by the model runner
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        full_q = total_heads * self.head_dim
        kv_rows = (kv_start * self.head_dim, kv_end * self.head_dim)
        full_kv = config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [parallel.shard_range(full_q), kv_rows, kv_rows],
                                             bias=self.qkv_bias(config), full_sizes=[full_q, full_kv, full_kv])
        self.o_proj = row_parallel_linear(full_q, config.hidden_size, bias=self.o_bias(config))

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def o_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head normalisation of q [T, Hq, D] and k [T, Hkv, D] before RoPE: none in Llama."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm(q, k)
        q, k = rotary(positions, q, k, ctx.meta.seq_lens)
        key_cache, value_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.backend.forward(q, k, v, key_cache, value_cache, ctx.layer_meta(self.layer_idx), self.scale,
                                  self.sliding_window, self.sinks, self.kv_scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up in one matmul. `activation`:
    the config's `hidden_act` unless given (Gemma names it `hidden_activation`)."""

    def __init__(self, config, activation: str | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = parallel.divide(config.intermediate_size, parallel.tp_size(), "intermediate_size")
        self.gate_up_proj = merged_column_linear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = row_parallel_linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.activation = activation or config.hidden_act
        self.act = ACT2FN[self.activation]
        # gate_up [T, 2 * I] -> act(gate) * up [T, I] in one pass, where a native kernel has it
        # (engine/models/layers.py: use_cpu_layers); None: the torch ops below.
        self.act_and_mul = None
        # x [T, hidden] -> act(gate) * up [T, I], the gate_up product included, where a packed CPU
        # linear fuses the two (engine/models/layers.py: fuse_gate_up_silu); None: the steps above.
        self.fused_gate_up_act = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up_act is not None:
            return self.down_proj(self.fused_gate_up_act(x))
        if self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, layer_idx: int, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, sliding_window)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer `layer_idx`: dense here, experts in MoE models."""
        return LlamaMLP(config)

    def forward(self, positions, hidden, residual, rotary, ctx):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rotary, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, layer_cls: type[LlamaDecoderLayer], sliding_windows: list[int | None],
                 max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_cls(config, i, sliding_windows[i]) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.rotary_emb, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    layer_cls = LlamaDecoderLayer
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.layer_cls, self.sliding_windows(config), max_positions)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def sliding_windows(config) -> list[int | None]:
        """Per layer: the attention window, or None for full attention."""
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        return [config.sliding_window if kind == "sliding_attention" else None for kind in layer_types]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] (on rank 0; None on the other ranks)"""
        return self.lm_head(hidden)
