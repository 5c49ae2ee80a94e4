"""Read a PEFT LoRA adapter folder (`adapter_config.json`, `adapter_model.safetensors`)
into host tensors keyed by the engine's own modules.

PEFT names a weight by the base model's module, `base_model.model.<module>.lora_A.weight`
([r, in]) and `.lora_B.weight` ([out, r]). The engine merges q/k/v and gate/up into one
matmul each, so a q_proj adapter fills part 0 of qkv_proj (the model's `packed_modules`,
as the weight loader maps them); a checkpoint that fuses them already (Phi-3) gives one B
for all parts, split here by the model's `fused_checkpoint_modules`. The scaling
(lora_alpha / r, or / sqrt(r) with rsLoRA; per module under rank_pattern and
alpha_pattern) is folded into B once, at load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


class LoRALoadError(ValueError):
    """The adapter cannot run on this engine: missing, malformed, or unsupported."""


@dataclass
class LoRAAdapter:
    """One adapter on the host: per engine module, per part, (A [r, in], B [out, r] scaled)."""

    name: str
    path: str
    rank: int  # the largest of its modules'
    modules: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for parts in self.modules.values() for a, b in parts.values())


@dataclass(frozen=True)
class TargetModule:
    """What a wrapped engine module offers an adapter: its parts' full shapes."""

    in_features: int
    part_sizes: tuple[int, ...]  # full output features of each part (q, k, v), before any sharding


def read_adapter_config(folder: Path, name: str) -> dict:
    if not folder.is_dir():
        raise LoRALoadError(f"adapter {name!r}: {folder} is not a folder")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRALoadError(f"adapter {name!r}: {folder} has no {CONFIG_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LoRALoadError(f"adapter {name!r}: {CONFIG_FILE} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise LoRALoadError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    kind = str(config.get("peft_type", "LORA")).upper()
    unsupported = [(kind != "LORA", f"peft_type {kind} (only LORA)"),
                   (bool(config.get("use_dora")), "use_dora (DoRA)"),
                   (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only 'none')"),
                   (bool(config.get("modules_to_save")), "modules_to_save (fully trained modules)"),
                   (bool(config.get("fan_in_fan_out")), "fan_in_fan_out")]
    for is_set, what in unsupported:
        if is_set:
            raise LoRALoadError(f"adapter {name!r}: {what} is not supported")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRALoadError(f"adapter {name!r}: {CONFIG_FILE} r must be a positive integer")
    return config


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module's name end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def scaling_of(config: dict, module: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", config["r"]))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def engine_target(module: str, packed: dict, fused: dict) -> tuple[str, int | None]:
    """(engine module, part) for a PEFT module path: q_proj -> (qkv_proj, 0); a module the
    checkpoint fuses already (Phi-3's qkv_proj) -> (qkv_proj, None): every part."""
    leaf = module.rsplit(".", 1)[-1]
    if leaf in packed:
        target, part = packed[leaf]
        return f"{module[: -len(leaf)]}{target}", part
    return module, (None if leaf in fused else 0)


def _pairs(tensors: dict[str, torch.Tensor], name: str) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT module path -> {"A": [r, in], "B": [out, r]}."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight", key)
        if match is None:
            raise LoRALoadError(f"adapter {name!r}: weight {key!r} is not a LoRA A or B matrix (embedding "
                                "adapters, DoRA magnitudes and trained biases are not supported)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            have, missing = ("A", "B") if "A" in pair else ("B", "A")
            raise LoRALoadError(f"adapter {name!r}: {module} has lora_{have} but no lora_{missing}")
    return pairs


def load_peft_adapter(name: str, path: str | Path, targets: dict[str, TargetModule], packed: dict, fused: dict,
                      max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at `path`, checked against the model's wrapped modules (`targets`, by
    engine module name) and `max_rank`; LoRALoadError, naming what is wrong, otherwise."""
    folder = Path(path)
    config = read_adapter_config(folder, name)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except FileNotFoundError:
        raise LoRALoadError(f"adapter {name!r}: {folder} has no {WEIGHTS_FILE} (only safetensors are read)") from None
    except Exception as error:  # safetensors raises its own error types for a corrupt file
        raise LoRALoadError(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read: {error}") from None
    adapter = LoRAAdapter(name, str(folder), 0)
    for module, pair in _pairs(tensors, name).items():
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRALoadError(f"adapter {name!r}: {module} has rank {rank}, above max_lora_rank {max_rank}")
        target_name, part = engine_target(module, packed, fused)
        target = targets.get(target_name)
        if target is None:
            raise LoRALoadError(f"adapter {name!r}: {module} is not a module LoRA applies to in this model "
                                "(the attention and MLP projections of its decoder layers)")
        parts = range(len(target.part_sizes)) if part is None else [part]
        out_features = sum(target.part_sizes[p] for p in parts)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, target.in_features) or \
                tuple(b.shape) != (out_features, rank):
            raise LoRALoadError(f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                                f"the model expects A ({rank}, {target.in_features}) and B ({out_features}, {rank})")
        b = b.float() * scaling_of(config, module, rank)
        for p, b_part in zip(parts, b.split([target.part_sizes[p] for p in parts])):
            adapter.modules.setdefault(target_name, {})[p] = (a.to(dtype).contiguous(), b_part.to(dtype).contiguous())
        adapter.rank = max(adapter.rank, rank)
    if not adapter.modules:
        raise LoRALoadError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return adapter
