"""Model definitions, one file per architecture, looked up by the checkpoint's
`architectures` entry."""

from __future__ import annotations

from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mistral import MistralForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.opt import OPTForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def get_model_class(config):
    architectures = list(getattr(config, "architectures", None) or [])
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"architectures {architectures or None} not supported; supported: {sorted(MODEL_REGISTRY)}")
