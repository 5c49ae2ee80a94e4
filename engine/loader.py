"""Load checkpoints into kvfleet's model definitions, by the original Hugging Face
weight names: safetensors (single file or sharded index) here, GGUF through
engine/gguf_loader.py.

Safetensors are read lazily (slices): a parameter with a `weight_loader`
(engine/models/parallel_layers.py) reads only the rows or columns its rank holds."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.checkpoint import resolve_checkpoint
from engine.kv_quant import take_kv_scales
from engine.models.parallel_layers import copy_checked
from engine.mxfp4 import dequantize_checkpoint
from engine.quantized_checkpoint import (
    DEQUANTIZED_METHODS,
    dequantize_quantized,
    kept_bits,
    quantization_of,
    quantized_dtype,
)
from engine.quantized_linear import checkpoint_receivers, swap_in_quantized_layers, weight_sources

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors checkpoint in {model_dir}")
    return files


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, object]]:
    """(name, slice): index a slice (`[a:b]`, `[:, a:b]`, `[:]`) to read that part only."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_slice(name)


def model_weights(model_name: str, model: nn.Module, hf_config, dtype: torch.dtype,
                  keep_quantized: str | None = None) -> Iterator[tuple[str, object]]:
    """The weights of the checkpoint `model_name` names (engine/checkpoint.py), by HF name;
    MXFP4, fp8, compressed-tensors, AWQ and GPTQ tensors dequantized into `dtype`. With
    `keep_quantized` ("cpu" or "triton": whose kernels compute on them), a GGUF file's kernel-typed
    linears and embeddings, and an integer checkpoint's packed linears, are first swapped for
    quantized modules, which take their tensors as they are (engine/quantized_linear.py)."""
    checkpoint = resolve_checkpoint(model_name)
    if checkpoint.gguf_file:
        from engine.gguf_loader import iterate_gguf_weights, use_quantized_gguf_layers  # noqa: PLC0415 (imports gguf)

        if keep_quantized:
            use_quantized_gguf_layers(model, checkpoint.gguf_path, hf_config, dtype, keep_quantized)
        return iterate_gguf_weights(checkpoint.gguf_path, model, hf_config)
    model.checkpoint_kv_scales = {}  # {layer: {"k": .., "v": ..}}, filled as the weights are read
    weights = dequantize_checkpoint(take_kv_scales(iterate_weights(checkpoint.folder), model.checkpoint_kv_scales),
                                    dtype)
    quantization = quantization_of(hf_config)
    if quantization is not None and quantization.get("quant_method") in DEQUANTIZED_METHODS:
        receivers = {}
        if keep_quantized and kept_bits(quantization) is not None:
            receivers = use_quantized_packed_layers(model, checkpoint.folder, quantization, dtype, keep_quantized)
        weights = dequantize_quantized(weights, quantization, dtype, receivers)
    return weights


def use_quantized_packed_layers(model: nn.Module, folder, quantization: dict, dtype: torch.dtype,
                                kernel: str = "cpu") -> dict:
    """Swap every linear whose checkpoint modules are all integer-quantized (AWQ/GPTQ qweight,
    compressed-tensors weight_packed or an int8 weight) for a quantized module; {checkpoint module:
    (quantized module, part)} for dequantize_quantized to deliver them to."""
    packed = {name.rpartition(".")[0] for name, tensor in iterate_weights(folder)
              if name.endswith((".qweight", ".weight_packed"))
              or name.endswith(".weight") and quantized_dtype(tensor) == torch.int8}
    source_of = {f"{prefix}.weight": prefix for prefix in packed}
    swap_in_quantized_layers(model, lambda name: weight_sources(model, name, source_of), dtype, kernel)
    keep_packed_experts_quantized(model, packed, kernel)
    model.quantized_kept = f"{quantization['quant_method']} {kept_bits(quantization)}-bit"
    return checkpoint_receivers(model)


def keep_packed_experts_quantized(model: nn.Module, packed: set[str], kernel: str) -> None:
    """Keep quantized the experts of every MoE layer whose every expert's projections are among the
    checkpoint's `packed` modules (FusedMoE.keep_quantized); each then loads into its own part."""
    from engine.models.moe import FusedMoE  # noqa: PLC0415

    roles = {"gate": 0, "up": 1, "down": 2}
    for prefix, experts in [(n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE)]:
        parts = {f"{prefix}.{expert}.{name}": (expert, roles[role]) for expert in range(experts.num_experts)
                 for name, role in getattr(model, "expert_projections", {}).items()}
        if parts and set(parts) <= packed and not experts.w13_weight.shape[-1] % 32 \
                and not experts.w2_weight.shape[-1] % 32:
            experts.keep_quantized(kernel).checkpoint_parts = parts


def split_fused(model: nn.Module, name: str, tensor) -> list[tuple[str, object, int | None]]:
    """A checkpoint tensor that already fuses projections (Phi-3's qkv_proj, gate_up_proj)
    as (name, part, index) for each projection, the way separate tensors would arrive."""
    for fused, sizes in getattr(model, "fused_checkpoint_modules", {}).items():
        if f".{fused}." in name:
            return [(name, part, index) for index, part in enumerate(tensor[:].split(sizes, dim=0))]
    return [(name, tensor, None)]


def parameter_of(name: str, packed: dict, params: dict) -> tuple[str, int | None]:
    """(parameter name, part) a checkpoint weight fills: its own parameter, or its part of
    a merged one (q_proj -> part 0 of qkv_proj)."""
    target, part = name, None
    for source, (fused, index) in packed.items():
        if f".{source}." in name:
            target, part = name.replace(f".{source}.", f".{fused}."), index
            break
    if target not in params and f"model.{target}" in params:
        target = f"model.{target}"  # e.g. OPT checkpoints saved without the "model." prefix
    return target, part


def checkpoint_targets(model: nn.Module, name: str, tensor, params: dict) -> list[tuple[str, object, object]]:
    """(parameter name, tensor, part) for each parameter the checkpoint tensor `name`
    fills: the model's own mapping first (`remap_checkpoint_weight`: experts), then
    fused checkpoint tensors split, then merged parameters (q_proj -> qkv_proj, part 0)."""
    remap = getattr(model, "remap_checkpoint_weight", None)
    mapped = remap(name, tensor) if remap is not None else None
    if mapped is not None:
        return mapped
    packed = getattr(model, "packed_modules", {})
    targets = []
    for split_name, part_tensor, fused_part in split_fused(model, name, tensor):
        target, part = parameter_of(split_name, packed, params)
        targets.append((target, part_tensor, part if fused_part is None else fused_part))
    return targets


@dataclass
class ParameterCounts:
    """Values in the checkpoint the model read (every rank counts the whole model)."""

    total: int = 0
    experts: int = 0  # of which in MoE experts


def num_values(tensor) -> int:
    shape = tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape
    return math.prod(shape)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, object]]) -> ParameterCounts:
    """Copy each checkpoint tensor (or lazy slice) into its parameter, or its part of a
    merged one. Raises ValueError on an unknown name, a shape mismatch or a missing weight."""
    params = dict(model.named_parameters())
    tied = {name for name, p in model.named_parameters(remove_duplicate=False) if name not in params}
    num_filled = {name: 0 for name in params}
    counts = ParameterCounts()
    for checkpoint_name, checkpoint_tensor in weights:
        if checkpoint_name.endswith(SKIPPED_SUFFIXES):
            continue
        for target, tensor, part in checkpoint_targets(model, checkpoint_name, checkpoint_tensor, params):
            name = checkpoint_name
            if target in tied:
                continue  # a tied copy, e.g. lm_head.weight of a tied-embedding checkpoint
            if target not in params:
                raise ValueError(f"checkpoint weight {name!r} has no place in {type(model).__name__}")
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is not None:
                    loader(param.data, tensor, part)
                else:
                    copy_checked(param.data, tensor[:])
            except ValueError as error:
                raise ValueError(f"checkpoint weight {name!r}: {error}") from None
            num_filled[target] += 1
            counts.total += num_values(tensor)
            counts.experts += num_values(tensor) if ".experts." in target else 0
    for name, count in num_filled.items():
        expected = getattr(params[name], "num_parts", 1)
        if count != expected:
            raise ValueError(f"checkpoint is missing weights for {name!r} ({count} of {expected} parts found)")
    return counts
