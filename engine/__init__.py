"""kvfleet's inference engine: paged KV cache, continuous batching, vLLM-shaped API."""

from engine.config import EngineConfig
from engine.embedding_engine import EmbeddingEngine, ProcessedEmbeddingRequest
from engine.isolation import StepFailed
from engine.llm import LLM
from engine.llm_engine import ContextLengthExceeded, EngineStats, LLMEngine, ProcessedRequest
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from engine.parallel import ParallelGroupError
from engine.pooling import PoolingParams
from engine.resume import SampleProgress
from engine.sampling_params import (
           ReasoningMarkers,
           RequestOutputKind,
           SamplingParams,
           StructuredOutputsParams,
)
from engine.tasks import create_engine, resolve_task

__all__ = ["LLM", "LLMEngine", "ContextLengthExceeded", "EngineConfig", "EngineStats", "SamplingParams",
           "ReasoningMarkers", "RequestOutputKind",
           "ProcessedRequest", "SampleProgress",
           "RequestOutput", "CompletionOutput", "ParallelGroupError", "StepFailed",
           "StructuredOutputsParams", "EmbeddingEngine", "ProcessedEmbeddingRequest", "EmbeddingOutput",
           "EmbeddingRequestOutput", "PoolingParams", "create_engine", "resolve_task", "LoRARequest"]
