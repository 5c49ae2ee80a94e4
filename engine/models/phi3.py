"""Phi-3 and Phi-4-mini: the Llama layer with q/k/v and gate/up already fused in the
checkpoint, a sliding window on every layer when the config sets one, partial rotary
(Phi-4-mini turns 3/4 of each head) and `longrope` scaling (engine/models/layers.py).

The fused checkpoint tensors are split back into their projections at load
(`fused_checkpoint_modules`), so that under tensor parallelism each rank takes its
heads of q, k and v and its half of gate and up, as for separate tensors."""

from __future__ import annotations

from engine.models.mistral import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):
    packed_modules: dict = {}

    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        # checkpoint tensor -> the sizes of the projections stacked in it, in order
        self.fused_checkpoint_modules = {"qkv_proj": [q_size, kv_size, kv_size],
                                         "gate_up_proj": [config.intermediate_size] * 2}
