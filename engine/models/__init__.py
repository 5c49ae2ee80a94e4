"""Model definitions, one file per architecture, looked up by the checkpoint's
`architectures` entry."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.mistral import MistralForCausalLM
from engine.models.opt import OPTForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}


def get_model_class(config):
    architectures = list(getattr(config, "architectures", None) or [])
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"architectures {architectures or None} not supported; supported: {sorted(MODEL_REGISTRY)}")
