"""The worker's online lane: requests pulled before any batch work, run by the engine at
their own priority (every online priority outranks batch work), answered through their
reply streams (jobs/online.py) after every engine step.

One round trip per step (`settle`) writes the step's events, acknowledges the finished
entries and checks which requests were cancelled (the client went away, or its time ran
out). Events wait in memory through a Redis outage and go out when it answers again.

Resume. The same round trip checkpoints running requests (workers/checkpoints.py): at their
first tokens, then every `checkpoint_tokens`, always queued before the events they cover, so
a request's first token never reaches a client before its sampling seed is saved. A worker
that takes an entry over (a crash, a migrating drain) continues it from the checkpoint; its
first event repeats each choice from the start, and the API sends the client only what is
past the text it has (producers/online_replies.py). A streaming request that sent tokens but
has no checkpoint cannot be continued: it ends with the worker_lost error.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import redis

from engine import LLMEngine, ProcessedRequest, RequestOutput, RequestOutputKind
from jobs import keys, online
from jobs.online import (
    ATTEMPTS_GRACE_SECONDS,
    WORKER_LOST,
    ChoiceDelta,
    Delta,
    Done,
    Error,
    OnlineEntry,
    ReplyEvent,
)
from jobs.results import Usage
from jobs.schemas import LineError, Request
from workers import stream_ops
from workers.chat_parsers import reasoning_tokens
from workers.lanes import Lane, LaneConfig, Work, engine_request_id, suppress_outages
from workers.translate import (
    EngineRequest,
    error_code,
    error_message,
    openai_logprobs,
    prefix_cache_salt,
    to_engine_request,
)


@dataclass
class OnlineWork(Work):
    entry: OnlineEntry | None = None
    attempt: int = 1  # tags its reply events (jobs/online.py)
    num_events: int = 0  # numbers them within the attempt
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    text_offsets: dict[int, int] = field(default_factory=dict)  # choice -> characters of its logprob tokens
    has_output: bool = False  # the first token was produced
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # choice -> its tokens, to count reasoning


class OnlineLane(Lane):
    name = "online"

    def __init__(self, r: redis.Redis, engine: LLMEngine, streams: list[str], config: LaneConfig) -> None:
        super().__init__(r, engine, streams, config)
        self.events: list[tuple[str, ReplyEvent]] = []  # (request id, event) to write, in order
        self.acks: list[tuple[str, str]] = []  # (stream, entry id) to ack after the events
        self.first_tokens: list[str] = []  # request ids whose first token goes out with these events

    # -- the lane protocol ------------------------------------------------------
    def pull(self, reclaim: bool) -> int:
        """Up to what admission allows, reclaimed entries first (with `reclaim`)."""
        works = list(self.in_flight.values())
        ready = self.take_parked()  # entries whose adapter's download ended
        count = self.config.admission.online_count(len(works), sum(not w.has_output for w in works)) \
            - len(self.parked) - len(ready)  # they will run here too
        if count <= 0 and not ready:
            return 0
        entries = ready + self.pull_entries(count, reclaim)
        for entry in entries:
            work = self.accept_or_dead_letter(*entry)
            if work is not None:
                self.config.admission.observe_online(
                    self.engine.num_blocks_needed(len(work.processed.prompt_token_ids)))
                self.start(work)
        return len(entries)

    def on_output(self, output: RequestOutput) -> None:
        """Queue the events of one step's output."""
        work = self.in_flight[output.request_id]
        if output.error is not None:  # its grammar did not compile, or a step failed because of it
            self.forget(work)
            self.fail_work(work, Error(400, output.error_code or "request_failed", output.error))
            return
        had_output = work.has_output
        choices = [self._choice_delta(work, delta) for delta in output.outputs]
        if work.has_output and not had_output:
            self.first_tokens.append(work.entry.request_id)
        if choices:
            output_format = None if work.request.output.is_plain else work.request.output.to_json()
            self.emit(work.entry.request_id, Delta(choices, output=output_format), work)
        if not output.finished:
            return
        self.forget(work)
        self.count(work, work.completion_tokens)
        self.config.metrics.observe_finished(output, work.enqueued_at, "online", work.finish_reasons)
        usage = Usage(len(output.prompt_token_ids), work.completion_tokens, output.num_cached_tokens,
                      self._reasoning_tokens(work))
        self.emit(work.entry.request_id, Done(usage.as_openai()), work)
        self.acks.append((work.stream, work.entry_id))

    def settle(self) -> None:
        """Write the queued events, then the acks, and check the cancel keys of the running
        requests, in one round trip; abort the cancelled ones. On a Redis error the events
        stay queued."""
        running = {work.entry.request_id: work for work in self.in_flight.values()}
        if not self.events and not self.acks and not running:
            return
        pipe = self.r.pipeline(transaction=False)
        saved = self.queue_checkpoints(pipe) if self.config.checkpoint_tokens else []  # before their tokens
        for request_id in self.first_tokens:  # before the tokens: a successor must never rerun them unseen
            online.queue_tokens_sent(pipe, request_id)
        for request_id, event in self.events:
            online.publish(pipe, request_id, event)
        for stream, entry_id in self.acks:
            pipe.xack(stream, keys.CONSUMER_GROUP, entry_id)
        self.queue_forget_finished(pipe)
        for request_id in running:
            pipe.exists(keys.reply_cancel(request_id))
        results = pipe.execute()
        self.mark_checkpointed(saved)
        self.events, self.acks, self.first_tokens = [], [], []
        flags = results[len(results) - len(running):] if running else []
        for work, is_cancelled in zip(running.values(), flags):
            if is_cancelled:
                self.forget(work)
                stream_ops.ack(self.r, work.stream, work.entry_id)

    def check(self) -> None:
        """Abort requests past their KVFLEET_REQUEST_TIMEOUT (the API gave up on them)."""
        now = time.time()
        for work in list(self.in_flight.values()):
            if now > work.entry.deadline:
                self.forget(work)
                self.fail_work(work, Error(504, "request_timeout", "The request timed out (KVFLEET_REQUEST_TIMEOUT)."))

    def checkpoint(self, force: bool = False) -> None:
        """`settle` checkpoints with the events; the hand-back's forced checkpoint is this."""
        if force:
            super().checkpoint(force=True)

    def is_checkpoint_urgent(self, work: OnlineWork) -> bool:
        return work.checkpointed_tokens == 0  # its first tokens: save the seed before they go out

    def hand_back(self) -> None:
        """Everything goes back to the stream, checkpointed, for another worker to continue.
        Without checkpoints, a streaming request that already sent tokens cannot run again
        from the start: it ends with the worker_lost error."""
        for work in list(self.in_flight.values()):
            if work.has_output and work.entry.stream and not self.config.checkpoint_tokens:
                self.drop(work)
                self.fail_work(work, Error(500, *WORKER_LOST))
        with suppress_outages():
            self.settle()
        super().hand_back()

    def lose(self, stream: str, entry_id: str) -> bool:
        work = self.in_flight.get(engine_request_id(stream, entry_id))
        if work is not None:  # its new owner answers now
            self.events = [(rid, event) for rid, event in self.events if rid != work.entry.request_id]
        self.acks = [ack for ack in self.acks if ack != (stream, entry_id)]  # its entry is the new owner's
        return super().lose(stream, entry_id)

    # -- entries and events -----------------------------------------------------
    def accept(self, stream: str, entry_id: str, fields: dict, deliveries: int) -> OnlineWork | None:
        """Turn an entry into validated work, or settle it here (an error event, a dead letter)."""
        try:
            entry = OnlineEntry.from_fields(fields)
        except (KeyError, ValueError, UnicodeDecodeError):
            stream_ops.dead_letter(self.r, stream, entry_id, fields, "malformed online entry")
            return None
        attempt = online.start_attempt(self.r, entry)
        if attempt.is_cancelled:  # its client went away: nothing to answer
            self.acks.append((stream, entry_id))
            return None
        if self.dead_letter_after_max_deliveries(stream, entry_id, fields, deliveries):
            self.emit(entry.request_id, Error(500, "max_deliveries_exceeded", f"The request failed "
                                              f"{deliveries - 1} times on workers.", attempt.number))
            return None
        if time.time() > entry.deadline:
            self.fail(stream, entry_id, entry.request_id, Error(504, "request_timeout", "The request timed out "
                      "(KVFLEET_REQUEST_TIMEOUT) before a worker started it.", attempt.number))
            return None
        try:
            request, processed = self.prepare(engine_request_id(stream, entry_id), entry, stream)
        except (*stream_ops.OUTAGE_ERRORS, redis.ResponseError):
            raise  # Redis itself: the loop backs off
        except Exception as error:  # noqa: BLE001 (whatever breaks on one request is that request's error)
            message = error.message if isinstance(error, LineError) else error_message(error)
            self.fail(stream, entry_id, entry.request_id, Error(400, error_code(error), message, attempt.number))
            return None
        work = OnlineWork(stream, entry_id, fields, request, processed, entry.enqueued_at, entry=entry,
                          attempt=attempt.number, checkpoint_key=keys.checkpoint(entry.request_id, "online"),
                          checkpoint_expires_at=entry.deadline + ATTEMPTS_GRACE_SECONDS)
        if attempt.number > 1:  # taken over: continue from the checkpoint, if there is one
            self.load_checkpoints([work])
        if entry.stream and attempt.has_sent_tokens and not work.resume:
            # Run again from the start, it would repeat or contradict what the client has.
            self.fail(stream, entry_id, entry.request_id, Error(500, *WORKER_LOST, attempt.number))
            return None
        return work

    def prepare(self, request_id: str, entry: OnlineEntry, stream: str) -> tuple[EngineRequest, ProcessedRequest]:
        """The engine's request for an entry, validated (ValueError if it can never run here);
        its tokens come out step by step (DELTA)."""
        request = to_engine_request(Request(custom_id=entry.request_id, url=entry.url, body=entry.body),
                                    self.engine.tokenizer, self.engine.default_sampling_params, self.config.parsers)
        params = dataclasses.replace(request.params, output_kind=RequestOutputKind.DELTA)
        return request, self.engine.process_request(request_id, request.prompt_token_ids, params,
                                                    priority=entry.priority,
                                                    lora_request=self.config.lora_request(stream, entry.tenant),
                                                    cache_salt=prefix_cache_salt(entry.tenant, request.body,
                                                                                 self.config.shared_prefix_cache))

    def emit(self, request_id: str, event: ReplyEvent, work: OnlineWork | None = None) -> None:
        """Queue an event, numbered within its attempt: a running `work`'s attempt and next
        number, else (the only event of an attempt that never started) number 1 of the
        attempt the event names."""
        if work is None:
            event = dataclasses.replace(event, seq=1)
        else:
            work.num_events += 1
            event = dataclasses.replace(event, attempt=work.attempt, seq=work.num_events)
        self.events.append((request_id, event))

    def fail(self, stream: str, entry_id: str, request_id: str, error: Error) -> None:
        """End an entry that never started with `error` (which names its attempt)."""
        self.emit(request_id, error)
        self.acks.append((stream, entry_id))

    def fail_work(self, work: OnlineWork, error: Error) -> None:
        """End a started request with `error`."""
        self.emit(work.entry.request_id, error, work)
        self.acks.append((work.stream, work.entry_id))

    def _reasoning_tokens(self, work: OnlineWork) -> int | None:
        if not work.request.output.reasoning:
            return None
        return sum(reasoning_tokens(work.request.output, ids, self.engine.tokenizer) for ids in work.token_ids.values())

    def _choice_delta(self, work: OnlineWork, delta) -> ChoiceDelta:
        work.has_output = work.has_output or bool(delta.token_ids)
        if work.request.output.reasoning:
            work.token_ids.setdefault(delta.index, []).extend(delta.token_ids)
        work.completion_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            work.finish_reasons.append(delta.finish_reason)
        tokenizer = self.engine.tokenizer
        offset = work.text_offsets.get(delta.index, 0)
        logprobs = openai_logprobs(delta.logprobs, delta.token_ids, work.request.params.logprobs or 0,
                                   tokenizer, work.request.url, offset)
        if logprobs is not None and "tokens" in logprobs:  # completions: offsets continue from here
            work.text_offsets[delta.index] = offset + sum(map(len, logprobs["tokens"]))
        return ChoiceDelta(delta.index, delta.text, delta.finish_reason, logprobs,
                           delta.token_ids if tokenizer is None else None)
