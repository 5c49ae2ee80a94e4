"""Mistral: the Llama architecture with sliding-window attention on every layer."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_windows(config) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers
