"""What a checkpoint is run for: `generate` (LLMEngine) or `embed` (EmbeddingEngine).

auto (vLLM's rule, by what the folder says): encoder architectures and folders that
sentence-transformers would load with a Pooling module are embedding models; every other
checkpoint generates. `--task embed` runs a decoder (Qwen3, Llama, ...) as an embedding
model with last-token pooling, as Qwen3-Embedding is used.
"""

from __future__ import annotations

from engine.checkpoint import load_hf_config, resolve_checkpoint
from engine.config import EngineConfig
from engine.pooling import sentence_transformers_pooling

ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel")


def resolve_task(config: EngineConfig, hf_config=None) -> str:
    if config.task != "auto":
        return config.task
    hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
    if any(name in ENCODER_ARCHITECTURES for name in getattr(hf_config, "architectures", None) or []):
        return "embed"
    checkpoint = resolve_checkpoint(config.model)
    if checkpoint.gguf_file is None:
        pooling, _, _ = sentence_transformers_pooling(checkpoint.folder)
        if pooling is not None:
            return "embed"
    return "generate"


def create_engine(config: EngineConfig):
    """The engine `config`'s task runs: an LLMEngine or an EmbeddingEngine."""
    hf_config = load_hf_config(config.model)
    if resolve_task(config, hf_config) == "embed":
        from engine.embedding_engine import EmbeddingEngine  # noqa: PLC0415

        return EmbeddingEngine(config, hf_config)
    from engine.llm_engine import LLMEngine  # noqa: PLC0415

    return LLMEngine(config)
