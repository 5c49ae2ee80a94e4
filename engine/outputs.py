"""What the engine hands back, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: sampled token first, then the top ones


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = None  # why the request failed (finish_reason "error")
    error_code: str | None = None  # structured_outputs_error (its grammar never compiled) or engine_error

    # The first completion's fields, for the common n == 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # pooled, truncated to the request's dimensions, normalized if the model is


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's vectors, one per input in order (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    prompt_token_ids: list[list[int]]  # per input
    outputs: list[EmbeddingOutput]
    finished: bool = True
    error: str | None = None
    error_code: str | None = None  # engine_error: a failed step was traced to it

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompt_token_ids))
