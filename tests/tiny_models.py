"""Tiny random-weight configurations of every supported architecture: the tests' and
`scripts/gpu_check.py`'s checkpoints (written by engine.demo_model.write_checkpoint)."""

from __future__ import annotations

from transformers import (
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

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
    # q/k norms, an explicit head_dim twice hidden / heads, untied embeddings.
    "qwen3": lambda: Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.1, architectures=["Qwen3ForCausalLM"]),
    # Two local layers (window 48, shorter than the longest prompts, RoPE base 10k) and a global
    # one (base 1M, linear scaling); q/k norms, query_pre_attn_scalar, logit soft-capping.
    "gemma3": lambda: Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, max_position_embeddings=512,
        sliding_window=48, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=30.0, initializer_range=0.1, architectures=["Gemma3ForCausalLM"]),
    # Fused qkv / gate_up in the checkpoint, half the head turned by RoPE (as Phi-4-mini turns
    # 3/4), and longrope: prompts and outputs past 64 tokens switch to the long factors.
    "phi3": lambda: Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.0, 2.5, 6.0, 12.0],
                         "original_max_position_embeddings": 64},
        initializer_range=0.1, architectures=["Phi3ForCausalLM"]),
    # Top 2 of 8 experts on every layer, renormalised (Mixtral-8x7B's routing).
    "mixtral": lambda: MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
        initializer_range=0.1, architectures=["MixtralForCausalLM"]),
    # Top 4 of 8 experts, renormalised (norm_topk_prob); layer 1 dense by mlp_only_layers; q/k norms.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, max_position_embeddings=512,
        initializer_range=0.1, architectures=["Qwen3MoeForCausalLM"]),
    # gpt-oss-20b's layout shrunk: sliding (window 48, shorter than the longest prompts) and full
    # layers alternating, attention sinks, biases everywhere, YaRN (x32 over 16 positions), top 2 of 8 experts; a SwiGLU
    # limit of 1 so that the clamps bite at these small activations (gpt-oss uses 7).
    "gpt_oss": lambda: GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=48,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0, "truncate": False},
        swiglu_limit=1.0, initializer_range=0.1, architectures=["GptOssForCausalLM"]),
    # facebook/opt-125m's shape, shrunk: pre-LayerNorm, ReLU, learned positions, tied head.
    "opt": lambda: OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, word_embed_proj_dim=64, do_layer_norm_before=True, init_std=0.1,
        architectures=["OPTForCausalLM"]),
}
