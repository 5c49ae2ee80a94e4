"""Load Hugging Face safetensors checkpoints (single file or sharded index) into
kvfleet's model definitions, by the original weight names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

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


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy each checkpoint tensor into its parameter (or its slice of a fused one).
    Raises ValueError on an unknown name, a shape mismatch or a missing weight."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    tied = {name for name, p in model.named_parameters(remove_duplicate=False) if name not in params}
    num_filled = {name: 0 for name in params}
    for name, tensor in weights:
        if name.endswith(SKIPPED_SUFFIXES):
            continue
        target, shard = name, None
        for source, (fused, index) in packed.items():
            if f".{source}." in name:
                target, shard = name.replace(f".{source}.", f".{fused}."), index
                break
        if target not in params and f"model.{target}" in params:
            target = f"model.{target}"  # e.g. OPT checkpoints saved without the "model." prefix
        if target in tied:
            continue  # a tied copy, e.g. lm_head.weight of a tied-embedding checkpoint
        if target not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in {type(model).__name__}")
        param = params[target]
        destination = param.data
        if shard is not None:
            sizes = param.shard_sizes
            destination = destination.narrow(0, sum(sizes[:shard]), sizes[shard])
        if destination.shape != tensor.shape:
            raise ValueError(f"checkpoint weight {name!r}: shape {tuple(tensor.shape)}, "
                             f"model expects {tuple(destination.shape)}")
        destination.copy_(tensor)
        num_filled[target] += 1
    for name, count in num_filled.items():
        expected = len(params[name].shard_sizes) if hasattr(params[name], "shard_sizes") else 1
        if count != expected:
            raise ValueError(f"checkpoint is missing weights for {name!r} ({count} of {expected} parts found)")
