"""The incremental engine the worker loop drives: add_request / abort / step().

    step():  schedule -> execute the model -> postprocess (append tokens, stop checks) -> collect finished
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.checkpoint import (
    default_sampling_params,
    eos_token_ids,
    load_generation_config,
    load_hf_config,
    load_tokenizer,
)
from engine.config import EngineConfig
from engine.isolation import isolate_failures
from engine.lora.request import LoRARequest
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput
from engine.parallel import ParallelGroupError
from engine.postprocess import DeltaTracker, StopChecker, make_request_output, request_metrics
from engine.quantized_checkpoint import quantization_of
from engine.resume import SampleProgress, check_progress, progress_of, resumed_sequence
from engine.sampler import SamplerOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)


class ContextLengthExceeded(ValueError):
    """The request is longer than the model or the KV pool can ever hold."""


@dataclass
class _Request:
    prompt: str | None
    seqs: list[Sequence]
    deltas: DeltaTracker | None = field(default=None)  # output_kind DELTA: what was handed out

    @property
    def is_finished(self) -> bool:
        return len(self.seqs) == self.seqs[0].params.n and all(s.is_finished for s in self.seqs)


@dataclass(frozen=True)
class ProcessedRequest:
    """A request tokenized and validated, ready to queue: what `process_request` returns."""

    request_id: str
    prompt: str | None  # a text prompt, echoed in the output
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None
    priority: int
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None  # its prefix-cache namespace (vLLM's cache_salt)


@dataclass(frozen=True)
class EngineStats:
    """The engine's numbers at one moment, for admission, metrics and the heartbeat.

    `unstarted` requests were added but never scheduled; `waiting` counts those and
    the preempted ones that wait to be recomputed, but not those whose grammar still
    compiles (they wait for the compiler, not for room: admission goes on)."""

    num_running: int
    num_waiting: int
    num_unstarted: int
    num_unstarted_blocks_needed: int
    num_free_blocks: int
    num_total_blocks: int
    num_live_tokens: int  # tokens whose K/V sit in the cache ...
    num_used_slots: int  # ... against the slots of the blocks in use
    num_preemptions: int
    num_recomputed_tokens: int  # prefilled again after a preemption or a resume (since start)
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int
    num_lora_loads: int = 0  # adapters copied into a device slot (since start)
    resident_loras: tuple[str, ...] = ()  # the adapters in device slots now
    busy_loras: tuple[str, ...] = ()  # the adapters of requests waiting or running

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0 to 1."""
        return 1 - self.num_free_blocks / self.num_total_blocks if self.num_total_blocks else 0.0


class LLMEngine:
    task = "generate"  # what `GET /v1/models` reports; EmbeddingEngine says "embed"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.hf_config = load_hf_config(config.model)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model, config.tokenizer)
        generation_config = load_generation_config(config.model)
        self.eos_token_ids = eos_token_ids(generation_config, self.hf_config, self.tokenizer)
        self.default_sampling_params = default_sampling_params(config.generation_config, generation_config)
        self.model_runner = ModelRunner(config, self.hf_config, self.eos_token_ids)
        self.max_model_len = self.model_runner.max_model_len
        # The whole model's values, and those one token reads (an MoE's top_k / num_experts of its experts).
        self.num_params, self.num_active_params = self.model_runner.num_params, self.model_runner.num_active_params
        self.stop_checker = StopChecker(self.eos_token_ids, self.max_model_len, self.tokenizer)
        self.scheduler = Scheduler(config, self.model_runner.num_kv_blocks, self.model_runner.kv_pools,
                                   self.model_runner.long_rope_after)
        self.requests: dict[str, _Request] = {}
        logger.info("%s", self.describe())

    def weights_summary(self) -> str:
        """How the weights are held, in a few words (the start-up line, the worker's heartbeat):
        the dtype; a GGUF's quantized types kept as they are; a quantized checkpoint dequantized."""
        runner = self.model_runner
        dtype = str(runner.dtype).removeprefix("torch.")
        kept = getattr(runner.model, "quantized_kept", None)
        if kept:
            return f"{kept} kept quantized, {runner.quantized_weight_bytes / 2**20:,.0f} MiB"
        quantization = quantization_of(self.hf_config)
        if quantization:
            return f"{quantization.get('quant_method')} checkpoint, dequantized at load"
        return dtype

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's element type: the model's dtype, or fp8_e4m3 / fp8_e5m2."""
        name = str(self.model_runner.kv_cache_dtype).removeprefix("torch.")
        return {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}.get(name, name)

    def describe(self) -> str:
        """What the engine chose, in one line for the start-up log: where a user sees which
        dtype, attention path and generation defaults their run took."""
        runner, config = self.model_runner, self.config
        architecture = (getattr(self.hf_config, "architectures", None) or [self.hf_config.model_type])[0]
        source = {"auto": "the checkpoint's generation_config.json", "vllm": "--generation-config vllm"}.get(
            config.generation_config, config.generation_config)
        defaults = (f"{self.default_sampling_params} (from {source}; a request's own values win)"
                    if self.default_sampling_params else f"none (none from {source})")
        dtype = str(runner.dtype).removeprefix("torch.")
        summary = self.weights_summary()
        weights = "" if summary == dtype else f" ({summary})"
        return (f"engine: {architecture}, {self.num_params / 1e6:,.0f}M parameters{weights}, {dtype} on "
                f"{runner.device}, "
                f"{runner.backend.name} attention, {self.num_total_blocks} KV blocks of {config.block_size} tokens "
                f"({self.kv_cache_dtype}), "
                f"max_model_len {self.max_model_len}, tensor parallel {config.tensor_parallel_size}; "
                f"generation defaults: {defaults}")

    # -- capacity, for admission by the worker -------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.scheduler.block_manager.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free_blocks

    def num_blocks_needed(self, num_prompt_tokens: int, max_tokens: int = 1) -> int:
        """Blocks one sequence holds once its prompt and max_tokens outputs are all cached."""
        return self.scheduler.block_manager.num_blocks_for(num_prompt_tokens + max_tokens)

    # -- requests ---------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("prompt: a text prompt needs a tokenizer; this engine was started with "
                             "skip_tokenizer_init, so pass token ids")
        return self.tokenizer.encode(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the field and the limit, for a request that can never run."""
        num_prompt = len(prompt_token_ids)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop: stop strings need a tokenizer (skip_tokenizer_init is set); "
                             "use stop_token_ids")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: constraints need a tokenizer (skip_tokenizer_init is set)")
            self._structured().check(params.structured_outputs)
        if num_prompt == 0:
            raise ValueError("prompt: must not be empty")
        if not all(isinstance(t, int) and 0 <= t < self.hf_config.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {self.hf_config.vocab_size})")
        if num_prompt + params.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(f"prompt: {num_prompt} prompt tokens + max_tokens {params.max_tokens} exceed "
                             f"max_model_len {self.max_model_len}")
        needed = self.num_blocks_needed(num_prompt, params.max_tokens) * params.n
        if needed > self.num_total_blocks:
            raise ContextLengthExceeded(f"prompt: needs {needed} KV blocks ({num_prompt} prompt tokens + max_tokens "
                             f"{params.max_tokens}, n={params.n}) but num_kv_blocks is {self.num_total_blocks}")

    def process_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                        arrival_time: float | None = None, priority: int = 0,
                        lora_request: LoRARequest | None = None, cache_salt: str | None = None) -> ProcessedRequest:
        """Tokenize and validate a request without queueing it (vLLM's input processing):
        raises ValueError, naming the field and the limit, if it can never run here. An
        adapter is read (or found in the host cache) and checked here, once. `cache_salt`:
        cached prompt blocks are shared only among requests of the same salt (vLLM's)."""
        params = params or SamplingParams(**self.default_sampling_params)
        prompt_token_ids = self.tokenize(prompt)
        self.validate(prompt_token_ids, params)
        if lora_request is not None:
            self.load_lora(lora_request)
        return ProcessedRequest(request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, params,
                                arrival_time, priority, lora_request, cache_salt)

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter into the host cache; ValueError (LoRALoadError) if it
        cannot run on this engine."""
        lora = self.model_runner.lora
        if lora is None:
            raise ValueError(f"model: adapter {lora_request.lora_name!r} asked for, but this engine serves no "
                             "adapters (start it with enable_lora)")
        pinned = {seq.lora_name for request in self.requests.values() for seq in request.seqs if seq.lora_name}
        lora.load(lora_request, pinned)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None, cache_salt: str | None = None) -> None:
        """Queue a request; raises ValueError (and queues nothing) if it can never run.
        A text prompt is echoed in the output. A lower `priority` runs first (vLLM's
        priority scheduling); equal priorities run in arrival order. `lora_request`: the
        adapter it runs with (enable_lora)."""
        self.add_processed_request(self.process_request(request_id, prompt, params, arrival_time, priority,
                                                        lora_request, cache_salt))

    def add_processed_request(self, request: ProcessedRequest, resume: list[SampleProgress] | None = None) -> None:
        """Queue a request `process_request` validated (a worker validates before it admits).
        `resume`: its samples' progress from an earlier run (engine/resume.py), continued
        where they stopped; ValueError (and nothing queued) if it cannot be."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        params = request.params
        seq = Sequence(request.request_id, request.prompt_token_ids, params, request.arrival_time,
                       priority=request.priority, lora_request=request.lora_request, cache_salt=request.cache_salt)
        if params.structured_outputs is not None:
            # compiles in the background; a thinking model's waits for the end of its reasoning
            seq.grammar = self._structured().start(params.structured_outputs, params.reasoning)
        seqs = [seq]
        if resume:
            check_progress(resume, params.n, params.max_tokens, self.hf_config.vocab_size)
            seqs = [resumed_sequence(seq, sample, self.tokenizer) for sample in sorted(resume, key=lambda p: p.index)]
        deltas = DeltaTracker() if params.output_kind is RequestOutputKind.DELTA else None
        self.requests[request.request_id] = _Request(request.prompt, seqs, deltas)
        for sample in seqs:
            if not sample.is_finished:
                self.scheduler.add(sample)

    def num_output_tokens(self, request_id: str) -> int:
        """Tokens a running request's samples have generated so far (0 once it is gone)."""
        request = self.requests.get(request_id)
        return 0 if request is None else sum(seq.num_output_tokens for seq in request.seqs)

    def progress(self, request_id: str) -> list[SampleProgress] | None:
        """A running request's samples so far, to checkpoint (None: nothing to resume yet)."""
        request = self.requests.get(request_id)
        return None if request is None else progress_of(request.seqs)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _structured(self) -> StructuredOutputs:
        """The xgrammar compiler, built with the first constrained request."""
        if self.model_runner.structured is None:
            self.model_runner.structured = StructuredOutputs(self.tokenizer, self.hf_config.vocab_size,
                                                             self.eos_token_ids)
        return self.model_runner.structured

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel group (nothing to do on one device)."""
        self.model_runner.shutdown()

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the requests that finished in it and, for DELTA
        requests, what each sampled this step (finished=False until the last)."""
        batch = self.scheduler.schedule()
        failed = [self._failed_output(seq.request_id, seq.grammar.error(), "structured_outputs_error")
                  for seq in self.scheduler.take_failed()]
        if not batch:
            return failed
        batch, sampled_seqs, sampled, failed_in_step = self._execute(batch)
        for children in batch.forks.values():  # n > 1: samples forked this step join their request
            self.requests[children[0].request_id].seqs.extend(children)
        finished_seqs = self.scheduler.postprocess(batch, sampled_seqs, sampled, self.stop_checker.check)
        return failed + failed_in_step + self._collect_outputs(sampled_seqs, finished_seqs)

    def _execute(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, list[Sequence], SamplerOutput,
                                                        list[RequestOutput]]:
        """Run the batch. If it raises, find the requests at fault (engine/isolation.py): they end
        with an error output, the rest of the step is returned as if it ran alone. Raises
        StepFailed if no request explains the failure."""
        try:
            return batch, *self.model_runner.execute(batch), []
        except ParallelGroupError:
            raise
        except Exception as error:  # noqa: BLE001 (one request's values must not fail its neighbours)
            parts: list[tuple[list[str], list[Sequence], SamplerOutput]] = []  # each part that ran

            def run(request_ids: list[str]) -> None:
                parts.append((request_ids, *self.model_runner.execute(batch.only(set(request_ids)))))

            at_fault = isolate_failures(batch.request_ids(), run, error, fatal=(ParallelGroupError,))
        outputs = [self._failed_output(request_id, f"the request failed in the engine and was stopped alone: "
                                                   f"{type(cause).__name__}: {cause}", "engine_error")
                   for request_id, cause in at_fault.items()]
        # postprocess reads the step's progress and its samples apart: the parts' samples, in any order.
        sampled = SamplerOutput([t for *_, out in parts for t in out.token_ids],
                                [lp for *_, out in parts for lp in out.logprobs])
        ran = batch.only({request_id for request_ids, *_ in parts for request_id in request_ids})
        return ran, [seq for _, seqs, _ in parts for seq in seqs], sampled, outputs

    def _failed_output(self, request_id: str, error: str, code: str) -> RequestOutput:
        """The output of a request that failed: its grammar did not compile, or a step failed
        because of it. Whatever it generated is dropped with it."""
        request = self.requests.get(request_id)
        self.abort(request_id)
        seq = request.seqs[0]
        return RequestOutput(request_id, request.prompt, seq.prompt_token_ids,
                             [CompletionOutput(0, "", [], "error")], error=error, error_code=code)

    def _collect_outputs(self, sampled_seqs: list[Sequence], finished_seqs: list[Sequence]) -> list[RequestOutput]:
        """A request is done once all n of its samples are. Finished samples were sampled this
        step, so `sampled_seqs` names every request."""
        outputs, now = [], time.monotonic()
        for request_id in dict.fromkeys(seq.request_id for seq in sampled_seqs):  # once each, in order
            request = self.requests[request_id]
            is_finished = request.is_finished
            if is_finished:
                del self.requests[request_id]
            if request.deltas is not None:
                samples = sorted(request.seqs, key=lambda s: s.sample_index)
                deltas = [d for seq in samples if (d := request.deltas.delta(seq, self.tokenizer)) is not None]
                if deltas or is_finished:
                    first = samples[0]
                    outputs.append(RequestOutput(request_id, request.prompt, first.prompt_token_ids, deltas,
                                                 first.num_cached_tokens, is_finished,
                                                 request_metrics(samples, now) if is_finished else None))
            elif is_finished:
                outputs.append(make_request_output(request.prompt, request.seqs, self.tokenizer, now))
        return outputs

    def stats(self) -> EngineStats:
        manager = self.scheduler.block_manager
        unstarted = [s for s in self.scheduler.waiting if s.first_scheduled_time is None]
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=sum(s.grammar is None or s.grammar.is_ready() for s in self.scheduler.waiting),
            num_unstarted=len(unstarted),
            num_unstarted_blocks_needed=sum(self.num_blocks_needed(s.num_tokens) for s in unstarted),
            num_free_blocks=manager.num_free_blocks,
            num_total_blocks=manager.num_total_blocks,
            num_live_tokens=sum(s.num_computed_tokens for s in self.scheduler.running),
            num_used_slots=(manager.num_total_blocks - manager.num_free_blocks) * manager.block_size,
            num_preemptions=self.scheduler.num_preemptions,
            num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
            num_prefix_queried_tokens=manager.num_prefix_queries,
            num_prefix_hit_tokens=manager.num_prefix_hits,
            num_lora_loads=lora.num_slot_loads if (lora := self.model_runner.lora) else 0,
            resident_loras=tuple(name for name in lora.slots if name) if lora else (),
            busy_loras=tuple(sorted({s.lora_name for s in (*self.scheduler.waiting, *self.scheduler.running)
                                     if s.lora_name is not None})) if lora else (),
        )
