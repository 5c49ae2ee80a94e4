"""LoRA adapters on one base model: requests (`request.py`), PEFT folders (`peft.py`), the
LoRA-aware linears (`layers.py`) and where adapters live (`manager.py`)."""

from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
