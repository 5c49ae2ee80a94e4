"""kvfleet's inference engine: paged KV cache, continuous batching, vLLM-shaped API."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import ContextLengthExceeded, EngineStats, LLMEngine, ProcessedRequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.parallel import ParallelGroupError
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "ContextLengthExceeded", "EngineConfig", "EngineStats", "SamplingParams", "RequestOutputKind",
           "ProcessedRequest",
           "RequestOutput", "CompletionOutput", "ParallelGroupError",
           "StructuredOutputsParams"]
