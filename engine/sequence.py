"""A request's state as the scheduler sees it: tokens, blocks, progress, status."""

from __future__ import annotations

import enum
import itertools
import time

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams

_arrival_order = itertools.count()  # breaks ties between equal arrival times


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """One completion being generated.

    NOTE: `token_ids` is prompt + output. `num_computed_tokens` of them have their
    K/V in the cache; the scheduler moves it forward, preemption resets it to 0.

        token_ids:   [ p p p p p p p p p o o o ]
                       |<- computed ->|  |<- still to run through the model
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, sample_index: int = 0, priority: int = 0,
                 lora_request: LoRARequest | None = None, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.sample_index = sample_index
        self.params = params
        self.priority = priority  # lower runs first, as in vLLM
        self.arrival_order = next(_arrival_order)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # Tokens whose K/V was computed once and lost: thrown away by a preemption, or with the
        # worker that ran a resumed request. Prefilled again at its next admission (the
        # scheduler counts them in num_recomputed_tokens, beyond prefix-cache hits).
        self.num_lost_tokens = 0
        # n > 1: samples still to fork from this sequence once its prompt has run.
        self.num_pending_samples = params.n - 1 if sample_index == 0 else 0
        self.block_table: list[int] = []
        self.sliding_block_table: list[int] = []  # a hybrid model's sliding layers' pool (engine/block_manager.py)
        self.block_hashes: list[int] = []
        self.lora_request = lora_request  # the adapter it runs with (engine/lora/), None: the base model
        # Separates prefix-cache namespaces: blocks computed under another salt never match
        # (another tenant's or the request's own `cache_salt`, as vLLM's; another adapter's; a
        # longrope model's long-factor blocks against its short-factor ones).
        salts = [cache_salt] if cache_salt else []
        salts += [f"lora:{lora_request.lora_name}"] if lora_request is not None else []
        self.cache_salt: str | None = "|".join(salts) or None
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text = ""
        self.logprobs: list[dict[int, float]] = []
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.inter_token_latencies: list[float] = []
        self.grammar = None  # engine.structured_outputs.SequenceGrammar of a constrained request
        # The seed each sampled token's draw derives from (engine/sampler.py: token_seed): the
        # request's, or one the model runner draws at the first sample and keeps here.
        self.sampling_seed: int | None = params.seed

    @property
    def seq_id(self) -> str:
        return f"{self.request_id}#{self.sample_index}"

    @property
    def schedule_key(self) -> tuple[int, float, int]:
        """The scheduler's order: (priority, arrival); the largest key is preempted first."""
        return self.priority, self.arrival_time, self.arrival_order

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: dict[int, float] | None, now: float) -> None:
        """Add a sampled token, with its logprobs and the latency stamps the metrics read."""
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.first_token_time is None:
            self.first_token_time = now
        if self.last_token_time is not None:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now

    def fork(self, sample_index: int) -> Sequence:
        """A sibling sample: the same prompt and progress; blocks are shared by the caller."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, self.arrival_time, sample_index,
                         self.priority, self.lora_request)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.cache_salt = self.cache_salt
        child.first_scheduled_time = self.first_scheduled_time
        child.status = self.status
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        child.sampling_seed = self.sampling_seed  # its own draws still differ: token_seed mixes in the sample
        return child

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.name})")
