"""Qwen2: the Llama architecture with biases on q/k/v (not on o), usually tied
embeddings, and optional sliding windows on the layers `layer_types` marks."""

from __future__ import annotations

from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    def qkv_bias(self, config) -> bool:
        return True

    def o_bias(self, config) -> bool:
        return False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer
