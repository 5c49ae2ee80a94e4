"""BERT and XLM-RoBERTa encoders (`BertModel`, `XLMRobertaModel`: all-MiniLM, bge, e5,
multilingual-e5, bge-m3's dense part) for embeddings, by their Hugging Face weight names.

Post-LayerNorm blocks with bidirectional attention over each input of a packed batch
(engine/packed_attention.py); no KV cache. The module tree mirrors transformers' so the
checkpoint's names map one to one; q/k/v are fused into one matmul (`packed_modules`).

    embeddings: word + position (+ XLM-R's padding offset) + token type 0 -> LayerNorm
    each layer: x = LN(x + out(attention(x)));  x = LN(x + down(act(up(x))))

The hidden state travels as a pair: the fp32 residual stream and the matmuls' input. They are
one tensor unless the matmuls run in bf16/fp16 (`use_low_precision`); then every LayerNorm
writes both at once on the CPU (kvfleet_kernels/cpu_layers.py: add_layer_norm).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from engine.attention import ForwardContext
from engine.models.layers import LowPrecisionLinear
from engine.models.parallel_layers import ColumnParallelLinear

# (residual stream, matmul input): the same tensor, or fp32 and its bf16/fp16 copy.
Hidden = tuple[torch.Tensor, torch.Tensor]

# Checkpoint tensors an encoder used for embeddings never reads: the pretraining heads, the
# pooler (sentence-transformers pools itself), and a buffer some checkpoints save.
_UNUSED_PREFIXES = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids")


class AddLayerNorm(nn.LayerNorm):
    """LayerNorm(x + residual) -> Hidden. Once `low_dtype` is set (bf16/fp16 matmuls on the
    CPU) it also returns the copy in that dtype, from the same native pass."""

    low_dtype: torch.dtype | None = None

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> Hidden:
        if self.low_dtype is not None:
            from kvfleet_kernels.cpu_layers import add_layer_norm  # noqa: PLC0415 (builds the native library)

            return add_layer_norm(x, residual, self.weight, self.bias, self.eps, self.low_dtype)
        out = self(x + residual)
        return out, out


class BertEmbeddings(nn.Module):
    def __init__(self, config, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = AddLayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Hidden:
        """input_ids, positions [T] -> [T, hidden]; every token is of type 0 (single inputs)."""
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        return self.LayerNorm.add_norm(hidden, self.position_embeddings(positions + self.position_offset))


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv_proj = ColumnParallelLinear(hidden, [(0, hidden)] * 3, bias=True)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D]
        out = ctx.backend.forward(q, k, v, None, None, ctx.meta, self.scale)
        return out.reshape(num_tokens, -1)


class BertSelfOutput(nn.Module):
    """A projection, then LayerNorm over it plus the residual."""

    def __init__(self, in_features: int, config) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = AddLayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> Hidden:
        return self.LayerNorm.add_norm(self.dense(hidden), residual)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config.hidden_size, config)

    def forward(self, hidden: Hidden, ctx: ForwardContext) -> Hidden:
        residual, matmul_input = hidden
        return self.output(self.self(matmul_input, ctx), residual)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.is_exact_gelu = config.hidden_act == "gelu"  # transformers' "gelu" is the erf form

    def use_low_precision(self, dtype: torch.dtype) -> None:
        """The matmul in `dtype`, with the exact GELU fused into it (engine/models/layers.py)."""
        self.dense = LowPrecisionLinear(self.dense, dtype, "gelu" if self.is_exact_gelu else None)
        if self.is_exact_gelu:
            self.act = nn.Identity()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config.intermediate_size, config)

    def forward(self, hidden: Hidden, ctx: ForwardContext) -> Hidden:
        residual, matmul_input = self.attention(hidden, ctx)
        return self.output(self.intermediate(matmul_input), residual)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    is_causal = False  # every token sees its whole input
    default_pooling = "mean"  # what sentence-transformers does with a bare folder; its files say otherwise
    packed_modules = {"query": ("qkv_proj", 0), "key": ("qkv_proj", 1), "value": ("qkv_proj", 2)}
    checkpoint_prefixes = ("bert.",)  # BertForMaskedLM and friends nest the encoder

    def __init__(self, config, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported; "
                             "supported: absolute")
        self.embeddings = BertEmbeddings(config, self.position_offset(config))
        self.encoder = BertEncoder(config)

    @staticmethod
    def position_offset(config) -> int:
        """Position ids start at 0 in BERT."""
        return 0

    @classmethod
    def max_input_tokens(cls, config) -> int:
        """The position table's length, less the offset."""
        return config.max_position_embeddings - cls.position_offset(config)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """The parameter name a checkpoint tensor fills (prefix dropped), or None to skip it."""
        for prefix in cls.checkpoint_prefixes:
            name = name.removeprefix(prefix)
        return None if name.startswith(_UNUSED_PREFIXES) else name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden]"""
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, ctx)
        return hidden[0]

    def use_native_layer_norms(self, low_dtype: torch.dtype) -> None:
        """Every LayerNorm also writes its output in `low_dtype`, the matmuls' (CPU only)."""
        for module in self.modules():
            if isinstance(module, AddLayerNorm):
                module.low_dtype = low_dtype


class XLMRobertaModel(BertModel):
    """RoBERTa's layout: positions start after the padding index (padding_idx + 1), as
    transformers numbers the tokens of an unpadded input; one token type."""

    checkpoint_prefixes = ("roberta.",)

    @staticmethod
    def position_offset(config) -> int:
        return config.pad_token_id + 1
