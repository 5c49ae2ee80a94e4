"""Random GGUF files of real models' shapes for the CPU benchmarks (benchmarks/quantized.py,
benchmarks/kv_cache_fp8.py): written as F16 with gguf's writer, SmolLM2's tokenizer metadata copied
over (its 49,152-token vocabulary), then quantized to Q4_K_M by llama.cpp's own llama-quantize.
Random weights are fine for speed: every request runs to its length (ignore_eos). Cached under the
benchmark's folder (.bench-llama/).

    1b:  Llama-3.2-1B's shapes (16 layers of 2048, MLP 8192, 32 heads of 64, 8 KV heads, tied
         embeddings)
    moe: Qwen3-30B-A3B's layer (2048 wide, 32 heads of 128 over 4 KV heads with q/k norms, 128
         experts of 768 a layer, top 8, renormalised), 4 layers instead of 48, untied head
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

SHAPES = {
    "1b": {"arch": "llama", "layers": 16, "hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8,
           "head_dim": 64, "vocab": 49152},
    "moe": {"arch": "qwen3moe", "layers": 4, "hidden": 2048, "intermediate": 6144, "heads": 32, "kv_heads": 4,
            "head_dim": 128, "vocab": 49152, "experts": 128, "experts_used": 8, "expert_intermediate": 768},
}
FILE_NAMES = {"1b": "llama-1b-random", "moe": "qwen3-moe-4l-random"}


def write_random_model(name: str, cache: Path, bin_dir: Path, quant: str = "Q4_K_M") -> dict[str, str]:
    """{"f16": the random F16 GGUF of SHAPES[name], "quantized": its `quant` (Q4_K_M, Q8_0, ...) by
    llama-quantize}."""
    f16, quantized = cache / f"{FILE_NAMES[name]}.F16.gguf", cache / f"{FILE_NAMES[name]}.{quant}.gguf"
    if not f16.exists():
        write_f16(f16, SHAPES[name])
    if not quantized.exists():
        subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(quantized), quant], check=True,
                       capture_output=True)
    return {"f16": str(f16), "quantized": str(quantized)}


def write_f16(path: Path, shape: dict) -> None:
    from gguf import GGUFWriter  # noqa: PLC0415

    rng, partial = np.random.default_rng(0), path.with_suffix(".partial")
    writer = GGUFWriter(str(partial), shape["arch"])
    write_metadata(writer, shape)

    def matrix(*dims: int) -> np.ndarray:  # [..., rows, cols]
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    hidden, q, kv = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", matrix(shape["vocab"], hidden))
    writer.add_tensor("output_norm.weight", ones(hidden))
    if "experts" in shape:
        writer.add_tensor("output.weight", matrix(shape["vocab"], hidden))
    for layer in range(shape["layers"]):
        prefix = f"blk.{layer}."
        for tensor, rows, cols in (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                   ("attn_output", hidden, q)):
            writer.add_tensor(f"{prefix}{tensor}.weight", matrix(rows, cols))
        writer.add_tensor(f"{prefix}attn_norm.weight", ones(hidden))
        writer.add_tensor(f"{prefix}ffn_norm.weight", ones(hidden))
        if "experts" in shape:
            experts, width = shape["experts"], shape["expert_intermediate"]
            writer.add_tensor(f"{prefix}attn_q_norm.weight", ones(shape["head_dim"]))
            writer.add_tensor(f"{prefix}attn_k_norm.weight", ones(shape["head_dim"]))
            writer.add_tensor(f"{prefix}ffn_gate_inp.weight", matrix(experts, hidden).astype(np.float32))
            for tensor, rows, cols in (("ffn_gate_exps", width, hidden), ("ffn_up_exps", width, hidden),
                                       ("ffn_down_exps", hidden, width)):
                writer.add_tensor(f"{prefix}{tensor}.weight", matrix(experts, rows, cols))
        else:
            for tensor, rows, cols in (("ffn_gate", shape["intermediate"], hidden),
                                       ("ffn_up", shape["intermediate"], hidden),
                                       ("ffn_down", hidden, shape["intermediate"])):
                writer.add_tensor(f"{prefix}{tensor}.weight", matrix(rows, cols))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)  # whole or not at all: a killed write is not taken for the model


def write_metadata(writer, shape: dict) -> None:
    from gguf import GGUFReader, GGUFValueType  # noqa: PLC0415

    from engine.checkpoint import demo_model_path  # noqa: PLC0415

    writer.add_block_count(shape["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_rope_dimension_count(shape["head_dim"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape["vocab"])
    if "experts" in shape:
        writer.add_expert_count(shape["experts"])
        writer.add_expert_used_count(shape["experts_used"])
        writer.add_expert_feed_forward_length(shape["expert_intermediate"])
    writer.add_file_type(1)  # mostly F16
    for key, field in GGUFReader(demo_model_path()).fields.items():  # SmolLM2's tokenizer, as it is
        if key.startswith("tokenizer."):
            value = field.contents()
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, field.types[0], sub)
