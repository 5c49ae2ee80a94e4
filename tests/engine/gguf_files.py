"""Write GGUF files for the tests, from a Hugging Face checkpoint, the way llama.cpp's
converter lays them out (its tensor names, llama's q/k row permutation, Gemma's 1 + w
norms), with each matrix in a quantization type of the test's choosing.

gguf-py quantizes the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the float ones
itself; it has no K-quant encoder, so K-quant matrices are written as random blocks whose
fp16 scales are set small: a valid tensor of that type, not an approximation of the
checkpoint's weights. Either way the oracle is gguf's own dequantizer on what was written.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

Q = GGMLQuantizationType
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Byte offsets of the fp16 scale fields inside one 256-value block of each K-quant.
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
ARCH_OF_MODEL_TYPE = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


def random_k_quant(rows: int, cols: int, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of random blocks of `qtype` with scales of about 1e-3 (values within ~0.1)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(2e-4, 1.5e-3, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def encode(weights: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    if qtype in K_QUANTS:
        return random_k_quant(*weights.shape, qtype, rng)
    try:
        return quantize(weights, qtype)
    except NotImplementedError:  # a type kvfleet refuses (IQ*): any bytes of the right size
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, size=(weights.shape[0], weights.shape[1] // block_size * type_size),
                            dtype=np.uint8)


def to_gguf_layout(arch: str, gguf_name: str, weights: np.ndarray, config) -> np.ndarray:
    """What llama.cpp's converter does to a tensor (the inverse of engine/gguf_loader.py)."""
    if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
        half = weights.shape[0] // heads // 2
        return weights.reshape(heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    if arch.startswith("gemma") and gguf_name.endswith("norm.weight"):
        return weights + 1
    return weights


def write_metadata(writer: GGUFWriter, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters or {}
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    rope = config.rope_parameters or {}
    writer.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 10000.0))  # Gemma 3: the global base
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # Qwen3-MoE; Mixtral, whose feed-forward length is its experts'
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (`...experts.<e>.gate_proj.weight`) stacked as llama.cpp's converter
    stacks them, [E, N, K] under `...experts.gate_proj.weight` (GGUF's ffn_gate_exps); the
    rest as they are."""
    stacked, experts = {}, {}
    for name, tensor in tensors.items():
        match = re.match(r"^(.*\.experts)\.(\d+)\.(\w+\.weight)$", name)
        if match is None:
            stacked[name] = tensor
        else:
            experts.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = tensor
    for name, by_expert in experts.items():
        stacked[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return stacked


def write_gguf(hf_dir: str | Path, out: str | Path, qtype_of=lambda name, shape: Q.F32, seed: int = 0) -> dict:
    """Write `hf_dir`'s checkpoint to the GGUF `out`; matrices in `qtype_of(gguf_name, shape)`,
    vectors in F32. Returns {gguf name: (type, the dequantized tensor as written)}."""
    config = AutoConfig.from_pretrained(hf_dir)
    arch = ARCH_OF_MODEL_TYPE.get(config.model_type, config.model_type)
    arch_enum = next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch)
    name_map = get_tensor_name_map(arch_enum, config.num_hidden_layers)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(out), arch)
    write_metadata(writer, config)
    written = {}
    for hf_name, tensor in stack_experts(load_file(str(Path(hf_dir) / "model.safetensors"))).items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        weights = to_gguf_layout(arch, gguf_name, tensor.float().numpy(), config)
        qtype = qtype_of(gguf_name, weights.shape) if weights.ndim >= 2 else Q.F32
        matrix = weights.reshape(-1, weights.shape[-1])  # stacked experts [E, N, K]: their rows one after another
        data = encode(matrix, qtype, rng).reshape(*weights.shape[:-1], -1)
        writer.add_tensor(gguf_name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        with np.errstate(invalid="ignore", over="ignore"):  # random IQ bytes may hold NaN scales
            written[gguf_name] = (qtype, dequantize(data, qtype).reshape(weights.shape))
    rope = config.rope_parameters or {}
    if rope.get("rope_type") == "longrope":  # llama.cpp keeps the factors as tensors
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if rope.get("rope_type") == "llama3":  # llama.cpp writes Llama 3's scaling as per-frequency divisors
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        default = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        writer.add_tensor("rope_freqs.weight", (default / scaled).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
