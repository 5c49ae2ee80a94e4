"""The incremental engine the worker loop drives: add_request / abort / step().

    step():  schedule -> run the model -> append tokens and check stops -> collect finished
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class ContextLengthExceeded(ValueError):
    """The request is longer than the model or the KV pool can ever hold."""


@dataclass
class _Request:
    prompt: str | None
    seqs: list[Sequence]


def load_eos_token_ids(model: str, hf_config, tokenizer) -> set[int]:
    """EOS ids as transformers' generate sees them: generation_config first."""
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        eos = None
    for fallback in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        eos = fallback if eos is None else eos
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if not (Path(config.model) / "config.json").is_file():
            raise ValueError(f"model: {config.model!r} is not a folder holding a Hugging Face checkpoint "
                             "(config.json and *.safetensors); kvfleet never downloads weights")
        self.hf_config = AutoConfig.from_pretrained(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self.eos_token_ids = load_eos_token_ids(config.model, self.hf_config, self.tokenizer)
        self.model_runner = ModelRunner(config, self.hf_config, self.eos_token_ids)
        self.max_model_len = self.model_runner.max_model_len
        self.scheduler = Scheduler(config, self.model_runner.num_kv_blocks)
        self.requests: dict[str, _Request] = {}

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
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the field and the limit, for a request that can never run."""
        num_prompt = len(prompt_token_ids)
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

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request; raises ValueError (and queues nothing) if it can never run.
        A text prompt is echoed in the output."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        prompt_token_ids = self.tokenize(prompt)
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, arrival_time)
        self.requests[request_id] = _Request(prompt if isinstance(prompt, str) else None, [seq])
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        for seq in self.scheduler.abort(request_id):
            self.model_runner.release(seq)
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the requests that finished in it."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.monotonic()
        for seq in batch.seqs:
            seq.first_scheduled_time = seq.first_scheduled_time or now
        sampled_seqs, sampled = self.model_runner.execute(batch)
        self.scheduler.update(batch)
        for children in batch.forks.values():
            self.requests[children[0].request_id].seqs.extend(children)
        finished: list[RequestOutput] = []
        now = time.monotonic()
        for seq, token_id, logprobs in zip(sampled_seqs, sampled.token_ids, sampled.logprobs):
            seq.token_ids.append(token_id)
            seq.first_token_time = seq.first_token_time or now
            if seq.last_token_time is not None:
                seq.inter_token_latencies.append(now - seq.last_token_time)
            seq.last_token_time = now
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            reason = self._check_stop(seq)
            if reason is None:
                continue
            self.scheduler.finish(seq, reason)
            self.model_runner.release(seq)
            request = self.requests[seq.request_id]
            if len(request.seqs) == seq.params.n and all(s.is_finished for s in request.seqs):
                del self.requests[seq.request_id]
                finished.append(self._make_output(request, now))
        return finished

    def _check_stop(self, seq: Sequence) -> str | None:
        params, token_id = seq.params, seq.token_ids[-1]
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and token_id in params.stop_token_ids:
            seq.stop_reason = token_id
            return "stop"
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if params.stop and may_stop and self._find_stop_string(seq):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _find_stop_string(self, seq: Sequence) -> bool:
        """Re-decode the output and look for a stop string in its new tail; on a hit,
        cut the text just before it."""
        previous_len = len(seq.text)
        seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, previous_len - longest + 1)
        hits = [(index, stop) for stop in seq.params.stop if (index := seq.text.find(stop, search_from)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.text, seq.stop_reason = seq.text[:index], stop
        return True

    def _make_output(self, request: _Request, now: float) -> RequestOutput:
        completions = []
        for seq in sorted(request.seqs, key=lambda s: s.sample_index):
            if seq.params.detokenize and not isinstance(seq.stop_reason, str):
                seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            completions.append(CompletionOutput(seq.sample_index, seq.text, seq.output_token_ids, seq.finish_reason,
                                                seq.stop_reason, seq.logprobs if seq.params.logprobs is not None
                                                else None))
        first = min(request.seqs, key=lambda s: s.sample_index)
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time, now,
                                 first.inter_token_latencies)
        return RequestOutput(first.request_id, request.prompt, first.prompt_token_ids, completions,
                             first.num_cached_tokens, True, metrics)

    def stats(self) -> dict:
        manager = self.scheduler.block_manager
        # Waiting sequences that never ran (as opposed to preempted ones, which wait to be recomputed).
        unstarted = [s for s in self.scheduler.waiting if s.first_scheduled_time is None]
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_unstarted": len(unstarted),
            "num_unstarted_blocks_needed": sum(self.num_blocks_needed(s.num_tokens) for s in unstarted),
            "num_free_blocks": manager.num_free_blocks,
            "num_total_blocks": manager.num_total_blocks,
            # Tokens whose K/V sit in the cache, against the slots of the blocks in use.
            "num_live_tokens": sum(s.num_computed_tokens for s in self.scheduler.running),
            "num_used_slots": (manager.num_total_blocks - manager.num_free_blocks) * manager.block_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": manager.num_prefix_queries,
            "prefix_cache_hits": manager.num_prefix_hits,
        }
