"""Online `POST /v1/completions` and `POST /v1/chat/completions`, through the queue.

    validate -> the model has a live worker (else 404 model_not_found)
             -> its online backlog is under KVFLEET_MAX_ONLINE_QUEUE (else 429, Retry-After)
             -> XADD to kvfleet:online:{model} -> read the reply stream (XREAD BLOCK)
             -> one JSON response, or server-sent events as OpenAI and vLLM send them

Streaming waits for the first event before it answers, so a request the worker
refuses (too long, say) is a plain 4xx; after that, a failure is an error event
followed by `data: [DONE]`. A client that goes away, or a request past
KVFLEET_REQUEST_TIMEOUT, is cancelled: the worker aborts it after its next step.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import redis
import redis.asyncio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from jobs import heartbeats, keys, online
from jobs.online import OnlineEntry
from jobs.results import Choice, Usage, chat_completion_body, completion_body
from jobs.schemas import CHAT_COMPLETIONS, COMPLETIONS, OnlineChatBody, OnlineCompletionBody, OnlineFields
from producers.errors import APIError, error_body

READ_BLOCK_MS = 500  # between two looks at the client and the clock
SERVED_CACHE_SECONDS = 1.0


def request_timeout() -> float:
    return float(os.environ.get("KVFLEET_REQUEST_TIMEOUT", online.DEFAULT_REQUEST_TIMEOUT))


def max_online_queue() -> int:
    return int(os.environ.get("KVFLEET_MAX_ONLINE_QUEUE", online.DEFAULT_MAX_ONLINE_QUEUE))


class Cancelled(Exception):
    """The client went away while the request was queued or running."""


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class OnlineStats:
    """This API process's online requests over the last `window_seconds`: how many arrived, and
    their time to first token (enqueue to the first event from the worker). The console shows it."""

    def __init__(self, window_seconds: float = 60.0, clock=time.monotonic) -> None:
        self.window_seconds, self.clock = window_seconds, clock
        self.arrivals: deque[float] = deque()
        self.first_tokens: deque[tuple[float, float]] = deque()  # (when, seconds to the first token)

    def arrived(self) -> None:
        self.arrivals.append(self.clock())

    def first_token(self, seconds: float) -> None:
        self.first_tokens.append((self.clock(), seconds))

    def summary(self) -> dict[str, float | int | None]:
        start = self.clock() - self.window_seconds
        while self.arrivals and self.arrivals[0] < start:
            self.arrivals.popleft()
        while self.first_tokens and self.first_tokens[0][0] < start:
            self.first_tokens.popleft()
        ttfts = sorted(seconds for _, seconds in self.first_tokens)

        def quantile(q: float) -> float | None:
            return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None

        return {"requests_per_s": len(self.arrivals) / self.window_seconds, "requests": len(self.arrivals),
                "ttft_p50": quantile(0.5), "ttft_p99": quantile(0.99), "window_seconds": self.window_seconds}


def add_online_routes(router: APIRouter, r: redis.Redis, ar: redis.asyncio.Redis,
                      stats: OnlineStats | None = None) -> None:
    stats = stats or OnlineStats()
    served_cache: dict[str, Any] = {"at": 0.0, "models": {}}

    def served_models() -> dict[str, Any]:
        if time.monotonic() - served_cache["at"] > SERVED_CACHE_SECONDS:
            served_cache.update(at=time.monotonic(), models=heartbeats.served_models(r))
        return served_cache["models"]

    def enqueue(url: str, body: OnlineFields) -> tuple[str, OnlineEntry]:
        """Checks that need Redis, then XADD; runs in the thread pool (redis-py is blocking)."""
        served, model = served_models(), body.model
        if model not in served:
            served_cache["at"] = 0.0  # maybe it just started: look again next time
            raise APIError(404, f"The model '{model}' does not exist: no live worker serves it.", "model_not_found",
                           "model")
        limit = max_online_queue()
        if online.online_backlog(r, model) >= limit:
            raise APIError(429, f"Too many online requests queued for model '{model}' (KVFLEET_MAX_ONLINE_QUEUE "
                                f"{limit}); retry shortly.", "too_many_requests", kind="rate_limit_error")
        now = time.time()
        entry = OnlineEntry(online.new_request_id(), url, body.batch_body(), bool(body.stream), body.priority,
                            now + request_timeout(), now)
        online.enqueue(r, model, entry)
        return model, entry

    async def next_events(entry: OnlineEntry, last_id: str, request: Request | None):
        """Block until the reply stream has events: (last id, events). Raises Cancelled
        when the client has gone, APIError 504 past the deadline."""
        while True:
            remaining_ms = int((entry.deadline - time.time()) * 1000)
            if remaining_ms <= 0:
                raise APIError(504, "The request timed out (KVFLEET_REQUEST_TIMEOUT).", "request_timeout",
                               kind="timeout_error")
            reply = await ar.xread({keys.reply(entry.request_id): last_id}, count=256,
                                   block=min(READ_BLOCK_MS, remaining_ms))
            new_id, events = online.decode_events(reply)
            if events:
                return new_id, events
            if request is not None and await request.is_disconnected():
                raise Cancelled

    def finish(entry: OnlineEntry, is_complete: bool) -> None:
        """Tell the worker to stop unless the request ended; drop the reply stream."""
        if not is_complete:
            online.cancel(r, entry.request_id)
        r.delete(keys.reply(entry.request_id))

    async def answer(url: str, body: OnlineFields, request: Request):
        model, entry = await run_in_threadpool(enqueue, url, body)
        stats.arrived()
        is_complete = is_handed_over = False
        try:
            last_id, events = await next_events(entry, "0-0", request)
            if events[0]["type"] == "error":
                is_complete = True
                raise event_error(events[0])
            stats.first_token(time.time() - entry.enqueued_at)
            if body.stream:
                is_handed_over = True  # the stream takes the request over, with its own cleanup
                chunks = stream_chunks(entry, model, url, body, last_id, events)
                return StreamingResponse(chunks, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            response = Accumulator(body)
            while not response.add(events):
                last_id, events = await next_events(entry, last_id, request)
            is_complete = True
            return response.body(entry, model, url)
        except Cancelled:
            return JSONResponse(error_body("The client closed the request.", "invalid_request_error",
                                           "client_closed_request"), status_code=499)
        finally:
            if not is_handed_over:
                await run_in_threadpool(finish, entry, is_complete)

    async def stream_chunks(entry: OnlineEntry, model: str, url: str, body: OnlineFields, last_id: str,
                            events: list[dict]) -> AsyncIterator[bytes]:
        chunks = ChunkWriter(entry, model, url, body.include_usage)
        is_complete = False
        try:
            while True:
                for event in events:
                    for chunk in chunks.of(event):
                        yield sse(chunk)
                    if event["type"] in ("done", "error"):
                        is_complete = True
                        yield sse("[DONE]")
                        return
                try:
                    last_id, events = await next_events(entry, last_id, None)  # Starlette watches the client
                except APIError as error:  # past the deadline: end the stream, and cancel the request
                    for chunk in chunks.of(online.error_event(error.status, error.code, error.message)):
                        yield sse(chunk)
                    yield sse("[DONE]")
                    return
        finally:  # also when the client disconnects and Starlette cancels this generator
            finish(entry, is_complete)  # blocking, and brief: a cancelled task cannot await

    @router.post("/completions", summary="Create a completion (online; streams with stream=true)")
    async def create_completion(body: OnlineCompletionBody, request: Request):
        return await answer(COMPLETIONS, body, request)

    @router.post("/chat/completions", summary="Create a chat completion (online; streams with stream=true)")
    async def create_chat_completion(body: OnlineChatBody, request: Request):
        return await answer(CHAT_COMPLETIONS, body, request)


class Accumulator:
    """A non-streaming response, put together from the events."""

    def __init__(self, body: OnlineFields) -> None:
        self.num_choices = getattr(body, "n", None) or 1
        self.reset()

    def reset(self) -> None:
        self.texts = [""] * self.num_choices
        self.finish_reasons: list[str | None] = [None] * self.num_choices
        self.logprobs: list[dict | None] = [None] * self.num_choices
        self.token_ids: list[list[int] | None] = [None] * self.num_choices
        self.usage: dict[str, Any] = {}
        self.error: dict[str, Any] | None = None

    def add(self, events: list[dict]) -> bool:
        """True once the request has ended (done, or an error that raises)."""
        for event in events:
            if event["type"] == "restart":
                self.reset()
            elif event["type"] == "error":
                raise event_error(event)
            elif event["type"] == "done":
                self.usage = event["usage"]
                return True
            else:
                for choice in event["choices"]:
                    i = choice["index"]
                    self.texts[i] += choice["text"]
                    self.finish_reasons[i] = choice["finish_reason"] or self.finish_reasons[i]
                    self.logprobs[i] = merge_logprobs(self.logprobs[i], choice["logprobs"])
                    if "token_ids" in choice:
                        self.token_ids[i] = (self.token_ids[i] or []) + choice["token_ids"]
        return False

    def body(self, entry: OnlineEntry, model: str, url: str) -> dict[str, Any]:
        choices = [Choice(text, reason or "stop", logprobs, ids) for text, reason, logprobs, ids in
                   zip(self.texts, self.finish_reasons, self.logprobs, self.token_ids)]
        usage = Usage(self.usage.get("prompt_tokens", 0), self.usage.get("completion_tokens", 0),
                      self.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
        build = chat_completion_body if url == CHAT_COMPLETIONS else completion_body
        response = build(model, choices, usage)
        response["id"] = response_id(entry, url)
        return response


def event_error(event: dict[str, Any]) -> APIError:
    """A worker's error event as the API error it stands for."""
    return APIError(event["status"], event["message"], event["code"],
                    kind="server_error" if event["status"] >= 500 else "invalid_request_error")


def merge_logprobs(so_far: dict | None, new: dict | None) -> dict | None:
    """Logprobs of consecutive deltas, in OpenAI's shape: lists are concatenated."""
    if new is None:
        return so_far
    if so_far is None:
        return {key: list(value) for key, value in new.items()}
    return {key: so_far[key] + value for key, value in new.items()}


def response_id(entry: OnlineEntry, url: str) -> str:
    return f"{'chatcmpl' if url == CHAT_COMPLETIONS else 'cmpl'}-{entry.request_id}"


class ChunkWriter:
    """Reply events -> OpenAI stream chunks (`chat.completion.chunk` or `text_completion`)."""

    def __init__(self, entry: OnlineEntry, model: str, url: str, include_usage: bool) -> None:
        self.is_chat = url == CHAT_COMPLETIONS
        self.include_usage = include_usage
        self.head = {"id": response_id(entry, url), "object": "chat.completion.chunk" if self.is_chat
                     else "text_completion", "created": int(entry.enqueued_at), "model": model}
        self.has_role: set[int] = set()

    def _chunk(self, choices: list[dict], **extra) -> dict[str, Any]:
        chunk = {**self.head, "choices": choices, **extra}
        if self.include_usage and "usage" not in chunk:
            chunk["usage"] = None  # as OpenAI: every chunk has the field, only the last one fills it
        return chunk

    def of(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if event["type"] == "error":
            error = event_error(event)
            return [error_body(error.message, error.kind, error.code)]
        if event["type"] == "done":
            return [self._chunk([], usage=event["usage"])] if self.include_usage else []
        if event["type"] != "delta":
            return []
        chunks = []
        for choice in event["choices"]:
            extra = {"token_ids": choice["token_ids"]} if "token_ids" in choice else {}
            if not self.is_chat:
                chunks.append(self._chunk([{"index": choice["index"], "text": choice["text"],
                                            "logprobs": choice["logprobs"], "finish_reason": choice["finish_reason"],
                                            **extra}]))
                continue
            if choice["index"] not in self.has_role:  # vLLM and OpenAI open each choice with the role
                self.has_role.add(choice["index"])
                chunks.append(self._chunk([{"index": choice["index"], "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]))
            chunks.append(self._chunk([{"index": choice["index"], "delta": {"content": choice["text"]},
                                        "logprobs": choice["logprobs"], "finish_reason": choice["finish_reason"],
                                        **extra}]))
        return chunks
