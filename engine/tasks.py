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


def resolve_task(config: EngineConfig) -> str:
    """generate or embed; a GGUF always generates (its config is costly to read twice)."""
    if config.task != "auto":
        return config.task
    checkpoint = resolve_checkpoint(config.model)
    if checkpoint.gguf_file is not None:
        return "generate"
    hf_config = load_hf_config(config.model)
    if any(name in ENCODER_ARCHITECTURES for name in getattr(hf_config, "architectures", None) or []):
        return "embed"
    pooling, _, _ = sentence_transformers_pooling(checkpoint.folder)
    return "embed" if pooling is not None else "generate"


def create_engine(config: EngineConfig):
    """The engine `config`'s task runs: an LLMEngine or an EmbeddingEngine."""
    if resolve_task(config) == "embed":
        from engine.embedding_engine import EmbeddingEngine  # noqa: PLC0415

        return EmbeddingEngine(config, load_hf_config(config.model))
    from engine.llm_engine import LLMEngine  # noqa: PLC0415

    return LLMEngine(config)
