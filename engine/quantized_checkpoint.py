"""Quantized Hugging Face checkpoints (config.json's `quantization_config`, vLLM's method names),
dequantized once at load into the engine's dtype, as GGUF files are: the formats are read, the
compute stays fp32/bf16/fp16.

    fp8                  weight float8_e4m3fn [N, K] with weight_scale per tensor ([] or [1]) or per
                         output channel ([N, 1]); with weight_block_size [bn, bk] (Qwen3-FP8,
                         DeepSeek), weight_scale_inv [ceil(N / bn), ceil(K / bk)]: w = q * scale
    compressed-tensors   "int-quantized" / "naive-quantized" (int8) and "float-quantized" (fp8 e4m3)
                         weights, weight_scale per tensor, channel [N, 1] or group [N, K / G], and an
                         optional weight_zero_point of the scale's shape: w = (q - zero_point) * scale;
                         "pack-quantized" (W4A16 and the like): weight_packed int32, unpacked by the
                         compressed-tensors library's own unpack_from_int32 (its zero points packed
                         along the output channels), then the same
    awq                  (AutoAWQ's GEMM layout, 4 bits) qweight int32 [K, N / 8] and qzeros int32
                         [K / G, N / 8], eight nibbles a word in the order 0 2 4 6 1 3 5 7 of their
                         columns; scales [K / G, N]: w[k, n] = (q - z[k / G, n]) * s[k / G, n]
    gptq                 (4 or 8 bits) qweight int32 [K * bits / 32, N] packed along K, low bits
                         first; qzeros int32 [K / G, N * bits / 32] packed along N, stored minus one
                         (the gptq format; not in gptq_v2); scales [K / G, N]; g_idx [K] each input
                         row's group (desc_act): w[k, n] = (q - z[g_idx[k], n]) * s[g_idx[k], n]

Activation and KV-cache scales (input_scale, k_scale, v_scale) are dropped: activations and the KV
cache stay in the engine's dtype. gpt-oss's MXFP4 experts are engine/mxfp4.py's. Anything else is
refused in one line before a weight is read (check_quantization).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

DEQUANTIZED_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")  # dequantize_quantized's
LOADED_METHODS = (*DEQUANTIZED_METHODS, "mxfp4")  # mxfp4: engine/mxfp4.py
PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
COMPRESSED_PACKED_PARTS = ("weight_packed", "weight_shape")
AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8 * word + this
COMPRESSED_TENSORS_FORMATS = ("int-quantized", "naive-quantized", "float-quantized", "pack-quantized")
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
                         "supported yet; kvfleet loads fp32, bf16 and fp16 checkpoints, awq, gptq, fp8 and "
                         "compressed-tensors ones and GGUF files (dequantized at load), and gpt-oss's MXFP4 experts")
    if method == "awq" and (quantization.get("bits", 4) != 4 or str(quantization.get("version", "gemm")).lower()
                            != "gemm" or quantization.get("zero_point") is False):
        raise ValueError("model: awq is supported in its GEMM layout, 4 bits with zero points; this checkpoint has "
                         f"version {quantization.get('version')!r}, bits {quantization.get('bits')}, zero_point "
                         f"{quantization.get('zero_point')}")
    if method == "gptq" and quantization.get("bits", 4) not in (4, 8):
        raise ValueError(f"model: gptq with {quantization.get('bits')} bits is not supported yet; 4 and 8 are")
    if method == "compressed-tensors" and quantization.get("format") not in COMPRESSED_TENSORS_FORMATS:
        raise ValueError(f"model: compressed-tensors format {quantization.get('format')!r} is not supported yet; "
                         f"kvfleet loads {', '.join(COMPRESSED_TENSORS_FORMATS)}")
    if method == "compressed-tensors" and quantization.get("format") == "pack-quantized":
        packed_bits(quantization)  # one width for every group of weights


def packed_bits(quantization: dict) -> int:
    """The one integer width of a pack-quantized checkpoint's weights (config_groups)."""
    widths = {(group.get("weights") or {}).get("num_bits") for group in quantization.get("config_groups", {}).values()}
    kinds = {(group.get("weights") or {}).get("type", "int") for group in quantization.get("config_groups", {}).values()}
    if len(widths) != 1 or not 1 <= (next(iter(widths)) or 0) <= 8 or kinds != {"int"}:
        raise ValueError(f"model: compressed-tensors pack-quantized weights of one integer width (1 to 8 bits) are "
                         f"supported; config_groups give widths {sorted(map(str, widths))} of types {sorted(kinds)}")
    return next(iter(widths))


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


def unpacked(parts: dict, bits: int) -> dict:
    """A pack-quantized module's parts with its weight (and zero points) unpacked to int8."""
    from compressed_tensors.compressors.pack_quantized.helpers import (  # noqa: PLC0415 (only these checkpoints)
        unpack_from_int32,
    )

    shape = torch.Size(parts["weight_shape"][:].tolist())
    parts = {**parts, "weight": unpack_from_int32(parts["weight_packed"][:], bits, shape)}
    if "weight_zero_point" in parts:
        scale_shape = parts["weight_scale"][:].shape
        parts["weight_zero_point"] = unpack_from_int32(parts["weight_zero_point"][:], bits, scale_shape, packed_dim=0)
    return parts


def dequantize_weight(parts: dict, block: list[int] | None, dtype: torch.dtype) -> torch.Tensor:
    """One module's weight [N, K] from its quantized weight, scale and optional zero point."""
    weight = parts["weight"][:]
    scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
    values = weight.float()
    if "weight_zero_point" in parts:
        values = values - expand_scale(parts["weight_zero_point"][:], weight.shape, None)
    uses_blocks = block is not None and "weight_scale_inv" in parts
    return (values * expand_scale(scale[:], weight.shape, block if uses_blocks else None)).to(dtype)


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits values each, low bits first, unpacked along `dim`."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    if dim == 0:  # [words, N, per_word] -> [words * per_word, N]
        return values.permute(0, 2, 1).reshape(packed.shape[0] * per_word, packed.shape[1])
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def awq_codes(parts: dict, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ GEMM: (codes [K, N], zero points [K / G, N], scales [K / G, N]), nibbles put back in order."""
    order = torch.tensor(AWQ_COLUMN_OF_NIBBLE).argsort()  # column j of a word sits in nibble order[j]
    q = unpack(parts["qweight"][:], 4, 1)
    z = unpack(parts["qzeros"][:], 4, 1)
    q, z = (t.reshape(t.shape[0], -1, 8)[..., order].reshape(t.shape[0], -1) for t in (q, z))
    return q, z, parts["scales"][:]


def gptq_codes(parts: dict, bits: int, has_offset_zeros: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ: (codes [K, N] packed along K, zero points [K / G, N] packed along N, plus one in the gptq
    format, scales [K / G, N])."""
    return unpack(parts["qweight"][:], bits, 0), unpack(parts["qzeros"][:], bits, 1) + (1 if has_offset_zeros else 0), \
        parts["scales"][:]


def packed_codes(parts: dict, quantization: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An AWQ or GPTQ module's (codes [K, N], zero points and scales [K / G, N], each input row's group [K])."""
    rows = parts["qweight"].get_shape()[0] if hasattr(parts["qweight"], "get_shape") else parts["qweight"].shape[0]
    method, bits = quantization["quant_method"], quantization.get("bits", 4)
    group_size = quantization.get("group_size", 128)
    if group_size in (None, -1):  # one group: per output channel
        group_size = rows if method == "awq" else rows * 32 // bits
    if method == "awq":
        q, z, scales = awq_codes(parts, group_size)
    else:
        q, z, scales = gptq_codes(parts, bits, quantization.get("checkpoint_format") != "gptq_v2")
    groups = parts["g_idx"][:].long() if "g_idx" in parts else torch.arange(q.shape[0]) // group_size
    return q, z, scales, groups


def dequantize_packed(parts: dict, quantization: dict, dtype: torch.dtype) -> torch.Tensor:
    """An AWQ or GPTQ module's weight [N, K]: w[k, n] = (q - z[group(k), n]) * s[group(k), n]."""
    q, z, scales, groups = packed_codes(parts, quantization)
    return ((q - z[groups]).float() * scales.float()[groups]).t().to(dtype)


def packed_quantized_weight(parts: dict, quantization: dict):
    """An AWQ or GPTQ module as the quantized kernels' QuantizedWeight (codes [N, K], a = s, b = s z
    in fp16). With desc_act (g_idx out of order) the input features are sorted by group, each group
    then G contiguous features, and the weight says in which order x must come (input_order)."""
    from kvfleet_kernels.cpu_quantized_linear import QuantizedWeight  # noqa: PLC0415

    q, z, scales, groups = packed_codes(parts, quantization)
    order = None
    if not torch.equal(groups, torch.arange(len(groups)) // (len(groups) // scales.shape[0])):
        order = torch.argsort(groups, stable=True)  # desc_act: features sorted into whole groups, x follows
        q = q[order]
    scale = scales.t().contiguous().half()
    offset = (z.t().float() * scale.float()).half()
    return QuantizedWeight(q.t().contiguous().to(torch.uint8), scale, offset, quantization.get("bits", 4), order)


def int_quantized_weight(parts: dict, bits: int):
    """A compressed-tensors integer module (int8, or pack-quantized unpacked to signed values) as the
    kernels' QuantizedWeight: codes q + 2^(bits - 1), a = s, b = s (2^(bits - 1) + zero point)."""
    from kvfleet_kernels.cpu_quantized_linear import QuantizedWeight  # noqa: PLC0415

    q = parts["weight"][:]
    scale = parts["weight_scale"][:].float()
    scale = scale.reshape(1, 1).expand(q.shape[0], 1) if scale.numel() == 1 else scale.reshape(q.shape[0], -1)
    zero = parts["weight_zero_point"][:].float().reshape(scale.shape) if "weight_zero_point" in parts else 0
    half = 1 << (bits - 1)
    return QuantizedWeight((q.int() + half).to(torch.uint8), scale.half(), (scale * (half + zero)).half(), bits)


def kept_bits(quantization: dict | None) -> int | None:
    """The code width the quantized kernels keep a checkpoint's modules in, or None where they
    cannot: AWQ, GPTQ (desc_act groups sorted, as vLLM sorts them) and compressed-tensors integer
    weights (int8, pack-quantized 4 or 8 bits), in groups of 16 or a multiple of 32 features."""
    if quantization is None:
        return None
    method, bits = quantization.get("quant_method"), quantization.get("bits", 4)
    sizes = {quantization.get("group_size", 128)}
    if method == "compressed-tensors":
        formats = {"int-quantized": 8, "naive-quantized": 8}
        bits = packed_bits(quantization) if quantization.get("format") == "pack-quantized" else \
            formats.get(quantization.get("format"))
        sizes = {(group.get("weights") or {}).get("group_size") for group in quantization.get("config_groups", {}).values()}
    elif method not in ("awq", "gptq"):
        return None
    fits = all(size in (None, -1, 16) or size % 32 == 0 for size in sizes)
    return bits if bits in (4, 8) and fits else None


def dequantize_quantized(weights: Iterator[tuple[str, object]], quantization: dict, dtype: torch.dtype,
                         receivers: dict | None = None) -> Iterator[tuple[str, object]]:
    """Checkpoint (name, tensor) pairs with each quantized `X.weight` and its scales replaced by the
    dequantized `X.weight`; other tensors pass through. A module's parts may arrive in any order
    (any shard): they are held, unread, until the checkpoint has been walked. A packed module `X`
    in `receivers` ({X: (quantized module, part)}) goes to it as codes and scales instead."""
    receivers = receivers or {}
    block = quantization.get("weight_block_size")
    held: dict[str, dict[str, object]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in DROPPED_PARTS:
            continue
        is_packed = part in PACKED_PARTS and quantization["quant_method"] in ("awq", "gptq") \
            or part in COMPRESSED_PACKED_PARTS
        if is_packed or part in SCALE_PARTS or part == "weight" and quantized_dtype(tensor) is not None:
            held.setdefault(prefix, {})[part] = tensor
            continue
        yield name, tensor
    for prefix, parts in held.items():
        if "qweight" in parts:
            if not {"qzeros", "scales"} <= set(parts):
                raise ValueError(f"checkpoint module {prefix!r}: a packed weight needs qweight, qzeros and scales; "
                                 f"found {sorted(parts)}")
            if prefix in receivers:
                module, part = receivers[prefix]
                module.load_part(part, packed_quantized_weight(parts, quantization))
                continue
            yield f"{prefix}.weight", dequantize_packed(parts, quantization, dtype)
            continue
        bits = 8
        if "weight_packed" in parts and {"weight_shape", "weight_scale"} <= set(parts):
            bits = packed_bits(quantization)
            parts = unpacked(parts, bits)
        if prefix in receivers and "weight" in parts and "weight_scale" in parts:
            module, part = receivers[prefix]
            module.load_part(part, int_quantized_weight(parts, bits))
            continue
        if "weight" not in parts or not {"weight_scale", "weight_scale_inv"} & set(parts):
            raise ValueError(f"checkpoint module {prefix!r}: a quantized weight needs its weight and its scale; "
                             f"found {sorted(parts)}")
        yield f"{prefix}.weight", dequantize_weight(parts, block, dtype)
