"""Tiny random-weight configurations of every supported architecture: the tests' and
`scripts/gpu_check.py`'s checkpoints (written by engine.demo_model.write_checkpoint)."""

from __future__ import annotations

from transformers import LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

VOCAB = 512
TINY_CONFIGS = {
    # GQA (4 query heads over 2 KV heads) and Llama 3 RoPE scaling.
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        architectures=["LlamaForCausalLM"]),
    # MQA, and a sliding window shorter than the longest prompts.
    "mistral": lambda: MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, sliding_window=48, initializer_range=0.1,
        architectures=["MistralForCausalLM"]),
    # q/k/v biases, tied embeddings.
    "qwen2": lambda: Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.1,
        architectures=["Qwen2ForCausalLM"]),
    # facebook/opt-125m's shape, shrunk: pre-LayerNorm, ReLU, learned positions, tied head.
    "opt": lambda: OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, word_embed_proj_dim=64, do_layer_norm_before=True, init_std=0.1,
        architectures=["OPTForCausalLM"]),
}
