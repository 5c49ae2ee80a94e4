"""Which adapter a request runs with: vLLM's `LoRARequest`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and the PEFT folder it loads from.

    Positional order as vLLM's: (name, int id, path). `lora_name` is the identity: the
    engine keeps one copy per name, and the prefix cache keys on it; `lora_int_id` is
    accepted for vLLM's signature and not used."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name: must not be empty")
        if not self.lora_path:
            raise ValueError(f"lora_path: adapter {self.lora_name!r} names no folder")
