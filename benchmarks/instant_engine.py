"""An engine without a model that answers every request at once: a worker on it does all its
queue, lease and storage work, and none of the model's, so what is measured is the control
plane (benchmarks/control_plane.py, tests/workers/test_control_plane.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine import CompletionOutput, EngineStats, ProcessedRequest, RequestOutput, SamplingParams


@dataclass(frozen=True)
class InstantConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    model: str = "instant"
    tensor_parallel_size: int = 1
    max_loras: int = 0
    block_size: int = 16


class InstantEngine:
    """LLMEngine's face to a worker; every request finishes in the step after it was added,
    with `max_tokens` tokens of id 0. Prompts are token ids (no tokenizer)."""

    task = "generate"
    tokenizer = None
    max_model_len = 1 << 20
    num_params = num_active_params = 0

    def __init__(self, config: InstantConfig | None = None) -> None:
        self.config = config or InstantConfig()
        self.default_sampling_params: dict = {}
        self.requests: dict[str, ProcessedRequest] = {}
        self.num_steps = 0

    def weights_summary(self) -> str:
        return "none (instant engine)"

    def num_blocks_needed(self, num_prompt_tokens: int, max_tokens: int = 1) -> int:
        return -(-(num_prompt_tokens + max_tokens) // self.config.block_size)

    def stats(self) -> EngineStats:
        total = self.config.max_num_seqs * 64
        used = sum(self.num_blocks_needed(len(r.prompt_token_ids), r.params.max_tokens) for r in self.requests.values())
        return EngineStats(num_running=len(self.requests), num_waiting=0, num_unstarted=0,
                           num_unstarted_blocks_needed=0, num_free_blocks=max(0, total - used), num_total_blocks=total,
                           num_live_tokens=0, num_used_slots=0, num_preemptions=0, num_recomputed_tokens=0,
                           num_prefix_queried_tokens=0, num_prefix_hit_tokens=0)

    def process_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                        arrival_time: float | None = None, priority: int = 0, lora_request=None,
                        cache_salt: str | None = None) -> ProcessedRequest:
        if isinstance(prompt, str):
            raise ValueError("prompt: the instant engine takes token ids")
        return ProcessedRequest(request_id, None, list(prompt), params or SamplingParams(), arrival_time, priority,
                                lora_request, cache_salt)

    def add_processed_request(self, request: ProcessedRequest, resume=None) -> None:
        if len(self.requests) >= self.config.max_num_seqs:
            raise ValueError("the instant engine is full")
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        done, self.requests = self.requests, {}
        return [RequestOutput(request_id, None, request.prompt_token_ids,
                              [CompletionOutput(0, "", [0] * request.params.max_tokens, "length")])
                for request_id, request in done.items()]

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def num_output_tokens(self, request_id: str) -> int:
        return 0

    def progress(self, request_id: str):
        return None

    def shutdown(self) -> None:
        pass
