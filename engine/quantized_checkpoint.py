"""Quantized Hugging Face checkpoints (config.json's `quantization_config`, vLLM's method names),
dequantized once at load into the engine's dtype, as GGUF files are: the formats are read, the
compute stays fp32/bf16/fp16.

    fp8                  weight float8_e4m3fn [N, K] with weight_scale per tensor ([] or [1]) or per
                         output channel ([N, 1]); with weight_block_size [bn, bk] (Qwen3-FP8,
                         DeepSeek), weight_scale_inv [ceil(N / bn), ceil(K / bk)]: w = q * scale
    compressed-tensors   "int-quantized" / "naive-quantized" (int8) and "float-quantized" (fp8 e4m3)
                         weights, weight_scale per tensor, channel [N, 1] or group [N, K / G], and an
                         optional weight_zero_point of the scale's shape: w = (q - zero_point) * scale

Activation and KV-cache scales (input_scale, k_scale, v_scale) are dropped: activations and the KV
cache stay in the engine's dtype. gpt-oss's MXFP4 experts are engine/mxfp4.py's. Anything else is
refused in one line before a weight is read (check_quantization).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

LOADED_METHODS = ("fp8", "compressed-tensors", "mxfp4")
COMPRESSED_TENSORS_FORMATS = ("int-quantized", "naive-quantized", "float-quantized")
SCALE_PARTS = ("weight_scale", "weight_scale_inv", "weight_zero_point")
DROPPED_PARTS = ("input_scale", "k_scale", "v_scale", "output_scale")
QUANTIZED_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, torch.float8_e4m3fn: torch.float8_e4m3fn,
                    torch.int8: torch.int8}


def quantization_of(hf_config) -> dict | None:
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return None
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


def check_quantization(hf_config) -> None:
    """A quantized checkpoint kvfleet cannot load is one line naming its method (and format),
    before any weight is read: its packed tensors would otherwise meet the model as unknown names."""
    quantization = quantization_of(hf_config)
    if quantization is None:
        return
    method = quantization.get("quant_method")
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method not in LOADED_METHODS:
        raise ValueError(f"model: {method or 'unnamed'} quantization (config.json's quantization_config) is not "
                         "supported yet; kvfleet loads fp32, bf16 and fp16 checkpoints, fp8 and compressed-tensors "
                         "int8/fp8 ones and GGUF files (dequantized at load), and gpt-oss's MXFP4 experts")
    if method == "compressed-tensors" and quantization.get("format") not in COMPRESSED_TENSORS_FORMATS:
        raise ValueError(f"model: compressed-tensors format {quantization.get('format')!r} is not supported yet; "
                         f"kvfleet loads {', '.join(COMPRESSED_TENSORS_FORMATS)} (int8 and fp8 weights)")


def quantized_dtype(tensor) -> torch.dtype | None:
    """The quantized dtype of a checkpoint tensor (a safetensors slice or a tensor), else None."""
    dtype = tensor.get_dtype() if hasattr(tensor, "get_dtype") else tensor.dtype
    return QUANTIZED_DTYPES.get(dtype)


def expand_scale(scale: torch.Tensor, shape: torch.Size, block: list[int] | None) -> torch.Tensor:
    """A scale (or zero point) as a [N, K] tensor: per tensor, per channel [N, 1], per group
    [N, K / G], or per block [ceil(N / bn), ceil(K / bk)] of `block`."""
    rows, cols = shape
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, cols)
    scale = scale.reshape(scale.shape[0], -1) if scale.dim() != 2 else scale
    if block is not None:
        return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    if scale.shape[0] != rows or cols % scale.shape[1]:
        raise ValueError(f"a scale of shape {tuple(scale.shape)} does not fit a weight of shape {(rows, cols)}")
    return scale.repeat_interleave(cols // scale.shape[1], 1)


def dequantize_weight(parts: dict, block: list[int] | None, dtype: torch.dtype) -> torch.Tensor:
    """One module's weight [N, K] from its quantized weight, scale and optional zero point."""
    weight = parts["weight"][:]
    scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
    values = weight.float()
    if "weight_zero_point" in parts:
        values = values - expand_scale(parts["weight_zero_point"][:], weight.shape, None)
    uses_blocks = block is not None and "weight_scale_inv" in parts
    return (values * expand_scale(scale[:], weight.shape, block if uses_blocks else None)).to(dtype)


def dequantize_quantized(weights: Iterator[tuple[str, object]], quantization: dict, dtype: torch.dtype
                         ) -> Iterator[tuple[str, object]]:
    """Checkpoint (name, tensor) pairs with each quantized `X.weight` and its scales replaced by the
    dequantized `X.weight`; other tensors pass through. A module's parts may arrive in any order
    (any shard): they are held, unread, until the checkpoint has been walked."""
    block = quantization.get("weight_block_size")
    held: dict[str, dict[str, object]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in DROPPED_PARTS:
            continue
        if part in SCALE_PARTS or part == "weight" and quantized_dtype(tensor) is not None:
            held.setdefault(prefix, {})[part] = tensor
            continue
        yield name, tensor
    for prefix, parts in held.items():
        if "weight" not in parts or not {"weight_scale", "weight_scale_inv"} & set(parts):
            raise ValueError(f"checkpoint module {prefix!r}: a quantized weight needs its weight and its scale; "
                             f"found {sorted(parts)}")
        yield f"{prefix}.weight", dequantize_weight(parts, block, dtype)
