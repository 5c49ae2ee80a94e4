"""The engine of an embedding model: add_request / abort / step(), as LLMEngine's, for
requests that are one or more inputs each and finish in the step that runs them.

    step():  pick pending inputs up to max_num_batched_tokens (and max_num_seqs), shortest
             first within a priority -> one packed forward pass -> pool, truncate, normalize
             -> the requests whose inputs are all done

Prefill-only: no sampling, no KV cache (engine/embedding_runner.py).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from engine.checkpoint import load_tokenizer, resolve_checkpoint
from engine.config import EngineConfig
from engine.embedding_runner import EmbeddingModelRunner
from engine.isolation import isolate_failures
from engine.llm_engine import ContextLengthExceeded, EngineStats
from engine.outputs import EmbeddingOutput, EmbeddingRequestOutput
from engine.pooling import PoolingParams, finish_embedding, load_pooler_config

logger = logging.getLogger(__name__)
AGED_STEPS = 2  # an input passed over this many steps goes before shorter newcomers of its priority


@dataclass(frozen=True)
class ProcessedEmbeddingRequest:
    """Inputs tokenized and validated, ready to queue: what `process_request` returns."""

    request_id: str
    prompt_token_ids: list[list[int]]  # one list per input
    params: PoolingParams
    arrival_time: float | None
    priority: int

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.prompt_token_ids))


@dataclass
class _PendingInput:
    request_id: str
    index: int
    token_ids: list[int]
    priority: int
    order: int  # arrival order, for ties
    steps_waited: int = 0


@dataclass
class _Request:
    processed: ProcessedEmbeddingRequest
    embeddings: list[list[float] | None] = field(default_factory=list)


class EmbeddingEngine:
    task = "embed"

    def __init__(self, config: EngineConfig, hf_config) -> None:
        self.config, self.hf_config = config, hf_config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model, config.tokenizer)
        self.default_sampling_params: dict = {}
        self.model_runner = EmbeddingModelRunner(config, hf_config)
        checkpoint = resolve_checkpoint(config.model)
        self.pooler_config = load_pooler_config(None if checkpoint.gguf_file else checkpoint.folder, hf_config,
                                                config.pooling, config.normalize, self.model_runner.default_pooling)
        self.max_model_len, limit_source = self._input_limit()
        self.hidden_size = hf_config.hidden_size
        self.num_params = self.num_active_params = self.model_runner.num_params
        self.requests: dict[str, _Request] = {}
        self.pending: list[_PendingInput] = []
        self._order = itertools.count()
        pooler = self.pooler_config
        runner = self.model_runner
        logger.info("embedding model: %s pooling%s from %s, inputs up to %d tokens (%s), %d dimensions%s; "
                    "%s on %s%s, %s attention", pooler.pooling_type, ", normalized" if pooler.normalize else "",
                    pooler.source, self.max_model_len, limit_source, self.hidden_size,
                    ", Matryoshka" if pooler.is_matryoshka else "", str(runner.dtype).removeprefix("torch."),
                    runner.device, " (LayerNorms and residual in fp32)" if runner.is_mixed_precision else "",
                    runner.backend.name)

    def weights_summary(self) -> str:
        """How the weights are held (the worker's heartbeat): their dtype."""
        return str(self.model_runner.dtype).removeprefix("torch.")

    def _input_limit(self) -> tuple[int, str]:
        """The longest input, and why: sentence-transformers' max_seq_length, else the model's
        positions; never past max_model_len when set, nor past the smallest sliding window."""
        runner, pooler = self.model_runner, self.pooler_config
        limit, source = runner.max_input_tokens, "max_position_embeddings"
        if pooler.max_seq_length is not None:
            limit, source = min(limit, pooler.max_seq_length), "sentence_bert_config.json max_seq_length"
        if self.config.max_model_len is not None:
            if self.config.max_model_len > runner.max_input_tokens:
                raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's "
                                 f"{runner.max_input_tokens} positions")
            limit, source = self.config.max_model_len, "max_model_len"
        if runner.smallest_window is not None and runner.smallest_window < limit:
            limit, source = runner.smallest_window, "the smallest sliding window"
        return limit, source

    # -- capacity, for the worker ----------------------------------------------
    num_total_blocks = num_free_blocks = 0  # no KV cache: admission counts tokens

    @property
    def num_pending_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.pending)

    # -- requests ---------------------------------------------------------------
    def tokenize(self, text: str, max_length: int | None = None) -> list[int]:
        """With the special tokens the model adds; `max_length` truncates as the tokenizer
        does (sentence-transformers' way: the first tokens, the closing special tokens kept)."""
        if self.tokenizer is None:
            raise ValueError("input: text needs a tokenizer; this engine was started with skip_tokenizer_init, "
                             "so pass token ids")
        if max_length is None:
            return self.tokenizer(text)["input_ids"]
        return self.tokenizer(text, truncation=True, max_length=max_length)["input_ids"]

    def _input_ids(self, position: str, item: str | list[int], truncate_to: int | None) -> list[int]:
        """One input's token ids: text tokenized, token ids as given (vLLM: no special tokens added)."""
        ids = self.tokenize(item) if isinstance(item, str) else list(item)
        if not ids:
            raise ValueError(f"{position}: must not be empty")
        if not isinstance(item, str) and not all(isinstance(t, int) and 0 <= t < self.hf_config.vocab_size
                                                 for t in ids):
            raise ValueError(f"{position}: token ids must be integers in [0, {self.hf_config.vocab_size})")
        if len(ids) <= (truncate_to or self.max_model_len):
            return ids
        if truncate_to is None:
            raise ContextLengthExceeded(
                f"{position}: {len(ids)} tokens exceed this model's limit of {self.max_model_len} tokens; "
                "shorten it, or set truncate_prompt_tokens to keep the first tokens")
        return self.tokenize(item, truncate_to) if isinstance(item, str) else ids[:truncate_to]

    def _check_params(self, params: PoolingParams) -> int | None:
        """Raise ValueError for what this model cannot do; the truncation length, if any."""
        if params.dimensions is not None:
            supported = self.pooler_config.matryoshka_dimensions
            if supported is None:
                raise ValueError(f"dimensions: this model does not support Matryoshka embeddings (its config.json "
                                 f"sets neither is_matryoshka nor matryoshka_dimensions); it returns "
                                 f"{self.hidden_size} dimensions")
            if not 1 <= params.dimensions <= self.hidden_size or supported and params.dimensions not in supported:
                allowed = f"one of {list(supported)}" if supported else f"1 to {self.hidden_size}"
                raise ValueError(f"dimensions: {params.dimensions} is not supported by this model; use {allowed}")
        truncate = params.truncate_prompt_tokens
        if truncate is None:
            return None
        if truncate == -1:
            return self.max_model_len
        if not 1 <= truncate <= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {truncate} must be -1 or 1 to the model's limit of "
                             f"{self.max_model_len} tokens")
        return truncate

    def process_request(self, request_id: str, inputs: list[str | list[int]], params: PoolingParams | None = None,
                        arrival_time: float | None = None, priority: int = 0) -> ProcessedEmbeddingRequest:
        """Tokenize and validate without queueing: ValueError naming the input and the limit."""
        params = params or PoolingParams()
        truncate_to = self._check_params(params)
        if not inputs:
            raise ValueError("input: must not be empty")
        many = len(inputs) > 1
        token_ids = [self._input_ids(f"input[{i}]" if many else "input", item, truncate_to)
                     for i, item in enumerate(inputs)]
        return ProcessedEmbeddingRequest(request_id, token_ids, params, arrival_time, priority)

    def add_request(self, request_id: str, inputs: list[str | list[int]], params: PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        self.add_processed_request(self.process_request(request_id, inputs, params, arrival_time, priority))

    def add_processed_request(self, request: ProcessedEmbeddingRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self.requests[request.request_id] = _Request(request, [None] * len(request.prompt_token_ids))
        self.pending += [_PendingInput(request.request_id, i, ids, request.priority, next(self._order))
                         for i, ids in enumerate(request.prompt_token_ids)]

    def abort(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.pending = [p for p in self.pending if p.request_id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def shutdown(self) -> None:
        """Nothing to stop: embedding models run in this process alone."""

    # -- the loop ---------------------------------------------------------------
    def schedule(self) -> list[_PendingInput]:
        """Inputs for one step: by priority, inputs passed over AGED_STEPS times first, then
        shortest first (so the padded attention of the CPU path pads little), up to the
        token budget and max_num_seqs; always at least one."""
        order = sorted(self.pending, key=lambda p: (p.priority, p.steps_waited < AGED_STEPS, len(p.token_ids),
                                                    p.order))
        chosen, num_tokens = [], 0
        for pending in order:
            if chosen and (num_tokens + len(pending.token_ids) > self.config.max_num_batched_tokens
                           or len(chosen) >= self.config.max_num_seqs):
                break
            chosen.append(pending)
            num_tokens += len(pending.token_ids)
        return chosen

    def step(self) -> list[EmbeddingRequestOutput]:
        """Run one packed forward pass; return the requests it finished."""
        chosen = self.schedule()
        if not chosen:
            return []
        chosen_ids = {id(p) for p in chosen}
        self.pending = [p for p in self.pending if id(p) not in chosen_ids]
        for waiting in self.pending:
            waiting.steps_waited += 1
        failed = []
        try:
            self._embed(chosen)
        except Exception as error:  # noqa: BLE001 (one request's input must not fail its neighbours)
            at_fault = isolate_failures(list(dict.fromkeys(p.request_id for p in chosen)),
                                        lambda ids: self._embed([p for p in chosen if p.request_id in ids]), error)
            failed = [self._failed_output(request_id, cause) for request_id, cause in at_fault.items()]
        finished = [request_id for request_id in dict.fromkeys(p.request_id for p in chosen)
                    if request_id in self.requests and all(e is not None for e in self.requests[request_id].embeddings)]
        return failed + [self._output(self.requests.pop(request_id)) for request_id in finished]

    def _embed(self, chosen: list[_PendingInput]) -> None:
        """Embed these inputs in one packed pass; each keeps its vector only if all of them ran."""
        pooled = self.model_runner.embed([p.token_ids for p in chosen], self.pooler_config.pooling_type)
        embeddings = [finish_embedding(row, self.requests[p.request_id].processed.params.dimensions,
                                       self.pooler_config.normalize).tolist() for p, row in zip(chosen, pooled)]
        for pending, embedding in zip(chosen, embeddings):
            self.requests[pending.request_id].embeddings[pending.index] = embedding

    def _failed_output(self, request_id: str, cause: Exception) -> EmbeddingRequestOutput:
        """A request a failed step was traced to: it ends alone, with an error."""
        processed = self.requests[request_id].processed
        self.abort(request_id)
        return EmbeddingRequestOutput(request_id, processed.prompt_token_ids, [], error=(
            f"the request failed in the engine and was stopped alone: {type(cause).__name__}: {cause}"),
            error_code="engine_error")

    @staticmethod
    def _output(request: _Request) -> EmbeddingRequestOutput:
        processed = request.processed
        return EmbeddingRequestOutput(processed.request_id, processed.prompt_token_ids,
                                      [EmbeddingOutput(embedding) for embedding in request.embeddings])

    def stats(self) -> EngineStats:
        """Pending inputs count as waiting; there are no blocks."""
        return EngineStats(num_running=0, num_waiting=len(self.pending), num_unstarted=len(self.pending),
                           num_unstarted_blocks_needed=0, num_free_blocks=0, num_total_blocks=0,
                           num_live_tokens=0, num_used_slots=0, num_preemptions=0, num_recomputed_tokens=0,
                           num_prefix_queried_tokens=0, num_prefix_hit_tokens=0)
