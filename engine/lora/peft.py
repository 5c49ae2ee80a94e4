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
import time
from dataclasses import dataclass, field
from pathlib import Path

import regex
import torch
from safetensors import safe_open

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
LITERAL_KEY = re.compile(r"[\w.\-]+")  # a module name or its end: compared as text
PATTERN_SECONDS = 1.0  # for all of one adapter's rank_pattern / alpha_pattern matching
MAX_PATTERN_KEYS = 1024


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


def key_matches(key: str, module: str, deadline: float, name: str) -> bool:
    r"""PEFT's rule for a rank_pattern / alpha_pattern key: the module's name ends with it. A key
    of plain name characters is compared as text (what PEFT writes); any other is PEFT's regular
    expression, matched under the adapter's time budget, so a key built to backtrack (say
    `(\w|\w\w|\w\w\w)+[A-Z]`) fails its adapter instead of hanging the worker."""
    if LITERAL_KEY.fullmatch(key):
        return module == key or module.endswith("." + key)
    try:
        return regex.match(rf"(.*\.)?({key})$", module, timeout=max(0.0, deadline - time.monotonic())) is not None
    except TimeoutError:
        raise LoRALoadError(f"adapter {name!r}: pattern key {key[:64]!r} takes too long to match module names "
                            f"(more than {PATTERN_SECONDS} s for the adapter)") from None
    except regex.error as error:
        raise LoRALoadError(f"adapter {name!r}: pattern key {key[:64]!r} is not a regular expression: {error}") from None


def _pattern_value(patterns: dict, module: str, default, deadline: float, name: str):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the module."""
    for key, value in (patterns or {}).items():
        if key_matches(key, module, deadline, name):
            return value
    return default


def scaling_of(config: dict, module: str, rank: int, deadline: float = math.inf, name: str = "") -> float:
    alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", config["r"]), deadline, name)
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def engine_target(module: str, packed: dict, fused: dict) -> tuple[str, int | None]:
    """(engine module, part) for a PEFT module path: q_proj -> (qkv_proj, 0); a module the
    checkpoint fuses already (Phi-3's qkv_proj) -> (qkv_proj, None): every part."""
    leaf = module.rsplit(".", 1)[-1]
    if leaf in packed:
        target, part = packed[leaf]
        return f"{module[: -len(leaf)]}{target}", part
    return module, (None if leaf in fused else 0)


def _pairs(weight_names: list[str], name: str) -> dict[str, dict[str, str]]:
    """PEFT module path -> {"A": its weight's name ([r, in]), "B": ... ([out, r])}."""
    pairs: dict[str, dict[str, str]] = {}
    for key in weight_names:
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight", key)
        if match is None:
            raise LoRALoadError(f"adapter {name!r}: weight {key!r} is not a LoRA A or B matrix (embedding "
                                "adapters, DoRA magnitudes and trained biases are not supported)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = key
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            have, missing = ("A", "B") if "A" in pair else ("B", "A")
            raise LoRALoadError(f"adapter {name!r}: {module} has lora_{have} but no lora_{missing}")
    return pairs


@dataclass(frozen=True)
class _Planned:
    """One module's weights, checked against the model from their declared shapes."""

    module: str
    a_key: str
    b_key: str
    target: str
    parts: list[int]
    rank: int


def _plan(handle, name: str, targets: dict[str, TargetModule], packed: dict, fused: dict,
          max_rank: int) -> list[_Planned]:
    """Every module's A and B checked by the shapes the file declares: nothing is read yet, so a
    rank or a shape the model cannot take costs no memory."""
    planned = []
    for module, pair in _pairs(list(handle.keys()), name).items():
        a_shape, b_shape = (tuple(handle.get_slice(pair[side]).get_shape()) for side in ("A", "B"))
        rank = a_shape[0] if a_shape else 0
        if rank > max_rank:
            raise LoRALoadError(f"adapter {name!r}: {module} has rank {rank}, above max_lora_rank {max_rank}")
        target_name, part = engine_target(module, packed, fused)
        target = targets.get(target_name)
        if target is None:
            raise LoRALoadError(f"adapter {name!r}: {module} is not a module LoRA applies to in this model "
                                "(the attention and MLP projections of its decoder layers)")
        parts = list(range(len(target.part_sizes))) if part is None else [part]
        out_features = sum(target.part_sizes[p] for p in parts)
        if a_shape != (rank, target.in_features) or b_shape != (out_features, rank):
            raise LoRALoadError(f"adapter {name!r}: {module} has A {a_shape} and B {b_shape}; the model expects "
                                f"A ({rank}, {target.in_features}) and B ({out_features}, {rank})")
        planned.append(_Planned(module, pair["A"], pair["B"], target_name, parts, rank))
    return planned


def _open_weights(folder: Path, name: str):
    try:
        return safe_open(str(folder / WEIGHTS_FILE), framework="pt")
    except FileNotFoundError:
        raise LoRALoadError(f"adapter {name!r}: {folder} has no {WEIGHTS_FILE} (only safetensors are read)") from None
    except Exception as error:  # safetensors raises its own error types for a corrupt file
        raise LoRALoadError(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read: {error}") from None


def load_peft_adapter(name: str, path: str | Path, targets: dict[str, TargetModule], packed: dict, fused: dict,
                      max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at `path`, checked against the model's wrapped modules (`targets`, by
    engine module name) and `max_rank` before its weights are read; LoRALoadError, naming what
    is wrong, otherwise."""
    folder = Path(path)
    config = read_adapter_config(folder, name)
    if len(config.get("alpha_pattern") or {}) + len(config.get("rank_pattern") or {}) > MAX_PATTERN_KEYS:
        raise LoRALoadError(f"adapter {name!r}: more than {MAX_PATTERN_KEYS} rank_pattern and alpha_pattern keys")
    deadline = time.monotonic() + PATTERN_SECONDS
    adapter = LoRAAdapter(name, str(folder), 0)
    with _open_weights(folder, name) as handle:
        for plan in _plan(handle, name, targets, packed, fused, max_rank):
            a, b = handle.get_tensor(plan.a_key), handle.get_tensor(plan.b_key)
            b = b.float() * scaling_of(config, plan.module, plan.rank, deadline, name)
            for p, b_part in zip(plan.parts, b.split([targets[plan.target].part_sizes[p] for p in plan.parts])):
                adapter.modules.setdefault(plan.target, {})[p] = (a.to(dtype).contiguous(),
                                                                  b_part.to(dtype).contiguous())
            adapter.rank = max(adapter.rank, plan.rank)
    if not adapter.modules:
        raise LoRALoadError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return adapter
