"""The worker's online lane: requests pulled before any batch work, run by the engine at
their own priority (every online priority outranks batch work), answered through their
reply streams (jobs/online.py) after every engine step.

One round trip per step writes the step's events, acknowledges the finished entries
and checks which requests were cancelled (the client went away, or its time ran out).
Events wait in memory through a Redis outage and go out when it answers again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from engine import LLMEngine, RequestOutput, RequestOutputKind
from jobs import keys, online
from jobs.online import OnlineEntry
from jobs.results import Usage
from jobs.schemas import MAX_PRIORITY, LineError, Request
from workers import stream_ops
from workers.translate import EngineRequest, RequestRejected, error_code, openai_logprobs, to_engine_request

BATCH_PRIORITY = MAX_PRIORITY + 1  # the engine priority of batch work: below every online priority
WORKER_LOST = ("worker_lost", "The worker serving this request stopped after streaming began; "
                              "the output is incomplete. Retry the request.")


@dataclass
class OnlineWork:
    entry: OnlineEntry
    request: EngineRequest
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    text_offsets: dict[int, int] = field(default_factory=dict)  # choice -> characters of its logprob tokens
    has_output: bool = False  # the first token was produced


class OnlineLane:
    def __init__(self, r: redis.Redis, engine: LLMEngine, streams: list[str], consumer: str) -> None:
        self.r, self.engine, self.streams, self.consumer = r, engine, streams, consumer
        self.events: list[tuple[str, dict]] = []  # (request id, event) to write, in order
        self.acks: list[tuple[str, str]] = []  # (stream, entry id) to ack after the events

    # -- pulling -----------------------------------------------------------------
    def pull(self, count: int, lease_ms: int, max_deliveries: int,
             is_running: Callable[[str, str], bool], reclaim: bool = True) -> list[tuple[str, str, OnlineWork]]:
        """Up to `count` online entries, reclaimed ones first (with `reclaim`): [(stream, entry_id, work)].
        `is_running(stream, entry_id)`: a reclaimed entry this worker runs already."""
        if count <= 0:
            return []
        entries = stream_ops.pull(self.r, self.consumer, count, lease_ms, self.streams if reclaim else [],
                                  self.streams, None)
        accepted = []
        for stream, entry_id, fields, deliveries in entries:
            if is_running(stream, entry_id):
                continue
            work = self.accept(stream, entry_id, fields, deliveries, max_deliveries)
            if work is not None:
                accepted.append((stream, entry_id, work))
        return accepted

    def accept(self, stream: str, entry_id: str, fields: dict, deliveries: int,
               max_deliveries: int) -> OnlineWork | None:
        """Turn an entry into work, or settle it here (an error event, a dead letter)."""
        try:
            entry = OnlineEntry.from_fields(fields)
        except (KeyError, ValueError, UnicodeDecodeError):
            stream_ops.dead_letter(self.r, stream, entry_id, fields, "malformed online entry")
            return None
        if deliveries > max_deliveries:
            stream_ops.dead_letter(self.r, stream, entry_id, fields,
                                   f"delivered {deliveries} times (max_deliveries {max_deliveries})")
            self.events.append((entry.request_id, online.error_event(
                500, "max_deliveries_exceeded", f"The request failed {deliveries - 1} times on workers.")))
            return None
        pipe = self.r.pipeline(transaction=False)
        pipe.exists(keys.reply_cancel(entry.request_id))
        pipe.xlen(keys.reply(entry.request_id))
        is_cancelled, num_events = pipe.execute()
        if is_cancelled:
            self.acks.append((stream, entry_id))
            return None
        if time.time() > entry.deadline:
            return self._refuse(stream, entry_id, entry, 504, "request_timeout",
                                "The request timed out (KVFLEET_REQUEST_TIMEOUT) before a worker started it.")
        if num_events and entry.stream:  # its client has seen tokens: running it again would repeat them
            return self._refuse(stream, entry_id, entry, 500, *WORKER_LOST)
        if num_events:
            self.events.append((entry.request_id, online.RESTART_EVENT))
        try:
            request = to_engine_request(Request(custom_id=entry.request_id, url=entry.url, body=entry.body),
                                        self.engine.tokenizer)
            self.engine.validate(request.prompt_token_ids, request.params)
        except (LineError, RequestRejected, ValueError) as error:
            message = error.message if isinstance(error, LineError) else str(error)
            return self._refuse(stream, entry_id, entry, 400, error_code(error), message)
        request.params = dataclasses.replace(request.params, output_kind=RequestOutputKind.DELTA)
        return OnlineWork(entry, request)

    def _refuse(self, stream: str, entry_id: str, entry: OnlineEntry, status: int, code: str, message: str) -> None:
        self.fail(stream, entry_id, entry.request_id, status, code, message)
        return None

    # -- answering -----------------------------------------------------------------
    def fail(self, stream: str, entry_id: str, request_id: str, status: int, code: str, message: str) -> None:
        self.events.append((request_id, online.error_event(status, code, message)))
        self.acks.append((stream, entry_id))

    def on_output(self, stream: str, entry_id: str, work: OnlineWork, output: RequestOutput) -> bool:
        """Queue the events of one step's output; True when the request is done."""
        tokenizer, url = self.engine.tokenizer, work.request.url
        choices = []
        for delta in output.outputs:
            work.has_output = work.has_output or bool(delta.token_ids)
            work.completion_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                work.finish_reasons.append(delta.finish_reason)
            offset = work.text_offsets.get(delta.index, 0)
            logprobs = openai_logprobs(delta.logprobs, delta.token_ids, work.request.params.logprobs or 0,
                                       tokenizer, url, offset)
            if logprobs is not None and "tokens" in logprobs:  # completions: offsets continue from here
                work.text_offsets[delta.index] = offset + sum(map(len, logprobs["tokens"]))
            choice = {"index": delta.index, "text": delta.text, "finish_reason": delta.finish_reason,
                      "logprobs": logprobs}
            if tokenizer is None:
                choice["token_ids"] = delta.token_ids
            choices.append(choice)
        if choices:
            self.events.append((work.entry.request_id, online.delta_event(choices)))
        if not output.finished:
            return False
        usage = Usage(len(output.prompt_token_ids), work.completion_tokens, output.num_cached_tokens)
        self.events.append((work.entry.request_id, online.done_event(usage.as_openai())))
        self.acks.append((stream, entry_id))
        return True

    def flush(self, watched: list[str]) -> set[str]:
        """Write the queued events, then the acks, and check the cancel keys of `watched`
        request ids, in one round trip; returns the cancelled ids. On a Redis error the
        events stay queued."""
        if not self.events and not self.acks and not watched:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for request_id, event in self.events:
            online.publish(pipe, request_id, event)
        for stream, entry_id in self.acks:
            pipe.xack(stream, keys.CONSUMER_GROUP, entry_id)
        for request_id in watched:
            pipe.exists(keys.reply_cancel(request_id))
        results = pipe.execute()
        self.events, self.acks = [], []
        flags = results[len(results) - len(watched):] if watched else []
        return {request_id for request_id, flag in zip(watched, flags) if flag}
