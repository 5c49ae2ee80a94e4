"""Random PEFT LoRA adapters for the tests, the benchmark and the GPU check, written by
`peft` itself (LoraConfig, get_peft_model, save_pretrained), and their reference: the
base model with the adapter merged (`merge_and_unload`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    targets: tuple[str, ...]
    alpha: float = 16.0
    rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()  # (module name pattern, rank) as PEFT's rank_pattern


# Eight adapters: ranks 4 to 64, each a different set of modules, one rsLoRA, one with a rank_pattern.
EIGHT = [
    AdapterSpec(4, ("q_proj", "v_proj")),
    AdapterSpec(8, tuple(ATTENTION)),
    AdapterSpec(16, tuple(MLP), alpha=8.0),
    AdapterSpec(32, tuple(ATTENTION + MLP), alpha=32.0),
    AdapterSpec(64, ("o_proj", "down_proj"), alpha=64.0, rslora=True),
    AdapterSpec(8, ("k_proj", "up_proj"), alpha=4.0),
    AdapterSpec(12, ("gate_proj", "v_proj", "o_proj"), alpha=24.0, rank_pattern=(("v_proj", 4),)),
    AdapterSpec(16, tuple(ATTENTION + MLP), alpha=16.0),
]


def write_adapter(base_dir: str | Path, out_dir: str | Path, spec: AdapterSpec, seed: int,
                  scale: float = 1.0, dtype: torch.dtype = torch.float32) -> Path:
    """A random adapter for the checkpoint at `base_dir` (B random too: PEFT's default init
    would make it a no-op). `scale` multiplies B, to size its effect on the output."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 (a test dependency)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                        use_rslora=spec.rslora, rank_pattern=dict(spec.rank_pattern), init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def merged_model(base_dir: str | Path, adapter_dir: str | Path | None, dtype: torch.dtype = torch.float32):
    """transformers' model with the adapter merged into its weights (the base alone for None)."""
    from peft import PeftModel  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return model.eval()
