"""Online `POST /v1/completions`, `POST /v1/chat/completions` and `POST /v1/responses`, through the queue.

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

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import redis
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from jobs import adapters, heartbeats, keys, online, prefixes, tenants
from jobs.online import Error, OnlineEntry, ReplyEvent
from jobs.schemas import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    OnlineChatBody,
    OnlineCompletionBody,
    OnlineFields,
    OnlineResponsesBody,
    chat_body_of,
    first_error,
)
from jobs.tenants import OPEN, Tenant
from producers.dependencies import Services, ServicesDep, Settings, SettingsDep
from producers.errors import APIError, error_body
from producers.online_replies import Accumulator, ChunkWriter, event_error
from producers.responses_stream import ResponseEventWriter, finished_body
from producers.routes import v1_router
from producers.routes.models import model_not_found, resolve_adapter
from producers.token_waits import ClientGone

log = logging.getLogger("kvfleet.api")
router = v1_router("online")
READ_BLOCK_MS = 500  # between two looks at the client and the clock


class Cancelled(Exception):
    """The client went away while the request was queued or running."""


@router.post("/completions", summary="Create a completion (online; streams with stream=true)")
async def create_completion(body: OnlineCompletionBody, request: Request, services: ServicesDep,
                            settings: SettingsDep):
    return await answer(COMPLETIONS, body, request, services, settings)


@router.post("/chat/completions", summary="Create a chat completion (online; streams with stream=true)")
async def create_chat_completion(body: OnlineChatBody, request: Request, services: ServicesDep,
                                 settings: SettingsDep):
    return await answer(CHAT_COMPLETIONS, body, request, services, settings)


@router.post("/responses", summary="Create a model response (OpenAI's Responses API; streams with stream=true; "
                                   "not stored)")
async def create_response(body: OnlineResponsesBody, request: Request, services: ServicesDep,
                          settings: SettingsDep):
    try:
        chat_body_of(body)  # what does not fit a chat request (a tool_choice naming no tool) is a 400 here
    except ValidationError as error:
        field, message = first_error(error)
        raise APIError(400, f"{field}: {message}", "invalid_request", field) from None
    return await answer(RESPONSES, body, request, services, settings)


def enqueue(services: Services, settings: Settings, url: str, body: OnlineFields,
            tenant: Tenant = OPEN.tenant, is_admin: bool = True) -> tuple[OnlineEntry, bool]:
    """Checks that need Redis, then XADD; runs in the thread pool (redis-py is blocking).
    Returns the entry and whether it waits for a cold start (its model has no live worker
    now, but had one: scaled to zero, and the online stream's lag wakes one)."""
    r, model = services.redis, body.model
    if not adapters.check_access(r, model, tenant.name, is_admin):
        raise model_not_found(model)  # another tenant's adapter: as if there were none
    is_cold = model not in services.served_models.get()
    if is_cold:
        services.served_models.forget()  # maybe it just started: look again next time
        if not heartbeats.is_known_model(r, model, settings.known_model_seconds) and \
                resolve_adapter(r, model, tenant.name, is_admin) is None:  # nor an adapter loaded on demand
            raise model_not_found(model)
    if online.online_backlog(r, model) >= settings.max_online_queue:
        raise APIError(429, f"Too many online requests queued for model '{model}' (KVFLEET_MAX_ONLINE_QUEUE "
                            f"{settings.max_online_queue}); retry shortly.", "too_many_requests",
                       kind="rate_limit_error")
    now = time.time()
    batch_body = body.batch_body()
    entry = OnlineEntry(online.new_request_id(), url, batch_body, bool(body.stream), body.priority,
                        now + settings.request_timeout, now,
                        prefixes.encode(prefixes.prefix_hashes(prefixes.prompt_text(batch_body, url),
                                                               prefixes.salt_of(tenant.name, batch_body))),
                        tenant.name)
    tokens = tokens_of(entry)
    if tenant.max_inflight_tokens is not None and tokens > tenant.max_inflight_tokens:
        raise APIError(429, f"This request's {tokens} tokens (prompt + max_tokens, estimated) are more than tenant "
                            f"{tenant.name!r}'s max_inflight_tokens of {tenant.max_inflight_tokens}: it can never "
                            "run; lower max_tokens.", "quota_exceeded", "max_inflight_tokens", kind="rate_limit_error")
    if tenants.reserve_tokens(r, tenant, entry.request_id, tokens, entry.deadline) is None:
        raise Throttled(APIError(
            429, f"Tenant {tenant.name!r} had {tenants.inflight_tokens(r, tenant.name)} online tokens in flight "
                 f"until this request's timeout; its {tokens} more would pass max_inflight_tokens of "
                 f"{tenant.max_inflight_tokens}.", "quota_exceeded", "max_inflight_tokens", kind="rate_limit_error"))
    try:
        online.enqueue(r, model, entry)
    except BaseException:
        tenants.release_tokens(r, entry.tenant, entry.request_id, tokens)
        raise
    return entry, is_cold


class Throttled(Exception):
    """The tenant's online tokens in flight are at max_inflight_tokens: the request waits."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error  # the answer if it is still throttled at its timeout


async def enqueue_when_allowed(services: Services, settings: Settings, url: str, body: OnlineFields,
                               request: Request) -> tuple[OnlineEntry, bool]:
    """`enqueue`, waiting while the caller's tenant is at its max_inflight_tokens: its requests
    queue up here, in no worker's way, until tokens in flight are freed (producers/token_waits.py)
    or the request times out. Raises Cancelled if the client leaves meanwhile."""
    caller = request.state.caller
    tenant = caller.tenant
    give_up_at = time.monotonic() + settings.request_timeout
    while True:
        try:
            return await run_in_threadpool(enqueue, services, settings, url, body, tenant, caller.is_admin)
        except Throttled as throttled:
            if time.monotonic() >= give_up_at:
                raise throttled.error from None
            try:
                await services.token_waits.wait(tenant.name, give_up_at - time.monotonic(), request.is_disconnected)
            except ClientGone:
                raise Cancelled from None


def client_closed() -> JSONResponse:
    return JSONResponse(error_body("The client closed the request.", "invalid_request_error",
                                   "client_closed_request"), status_code=499)


def tokens_of(entry: OnlineEntry) -> int:
    """The tokens an online request holds against its tenant's max_inflight_tokens (estimated:
    jobs/tenants.py); an embeddings request generates none."""
    if entry.url == EMBEDDINGS:
        return tenants.estimated_tokens(json.dumps(entry.body.get("input", "")), {}, default_max_tokens=0)
    return tenants.estimated_tokens(prefixes.prompt_text(entry.body, entry.url), entry.body)


async def next_events(services: Services, entry: OnlineEntry, last_id: str, request: Request | None,
                      deadline: float | None = None, timeout: APIError | None = None) -> tuple[str, list[ReplyEvent]]:
    """Block until the reply stream has events: (last id, events). Raises Cancelled
    when the client has gone, `timeout` past `deadline` (by default the request's: 504)."""
    deadline = entry.deadline if deadline is None else deadline
    while True:
        remaining_ms = int((deadline - time.time()) * 1000)
        if remaining_ms <= 0:
            raise timeout or APIError(504, "The request timed out (KVFLEET_REQUEST_TIMEOUT).", "request_timeout",
                                      kind="timeout_error")
        if request is not None and await request.is_disconnected():  # also while tokens flow
            raise Cancelled
        reply = await services.async_redis.xread({keys.reply(entry.request_id): last_id}, count=256,
                                                 block=min(READ_BLOCK_MS, remaining_ms))
        new_id, events = online.decode_events(reply)
        if events:
            return new_id, events


def finish(r: redis.Redis, entry: OnlineEntry, is_complete: bool) -> None:
    """Tell the worker to stop unless the request ended; drop the reply stream."""
    try:
        if not is_complete:
            online.cancel(r, entry.request_id)
        r.delete(keys.reply(entry.request_id))
        tenants.release_tokens(r, entry.tenant, entry.request_id, tokens_of(entry))
    except redis.RedisError as error:  # the reply stream expires by itself; the worker's deadline stops it
        log.warning("request %s: cleanup failed: %s", entry.request_id, error)


class ReplyStream(StreamingResponse):
    """Server-sent events whose cleanup always runs, once: when the stream ends, when the
    client leaves mid-stream, and when it leaves before the first chunk (Starlette then never
    starts the generator, so a `finally` in it would not run). The cleanup is blocking Redis
    I/O: it goes to the thread pool, never onto the event loop."""

    def __init__(self, chunks: AsyncIterator[bytes], cleanup) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # a cancelled task cannot await: hand it over without waiting
            asyncio.get_running_loop().run_in_executor(None, self.cleanup)


async def first_events(services: Services, settings: Settings, entry: OnlineEntry, is_cold: bool,
                       request: Request) -> tuple[str, list[ReplyEvent]]:
    """The first events; for a model with no live worker, waited for up to the cold-start bound."""
    if not is_cold:
        return await next_events(services, entry, "0-0", request)
    bound = min(entry.deadline, time.time() + settings.cold_start_seconds)
    no_worker = APIError(503, f"No worker of model '{entry.body.get('model')}' started within "
                              f"{settings.cold_start_seconds:g} s (KVFLEET_COLD_START_SECONDS); retry shortly.",
                         "model_cold_start_timeout", kind="server_error")
    return await next_events(services, entry, "0-0", request, bound, no_worker)


async def answer(url: str, body: OnlineFields, request: Request, services: Services, settings: Settings):
    try:
        entry, is_cold = await enqueue_when_allowed(services, settings, url, body, request)
    except Cancelled:
        return client_closed()
    services.online_stats.arrived()
    is_complete = is_handed_over = False
    try:
        last_id, events = await first_events(services, settings, entry, is_cold, request)
        if isinstance(events[0], Error):
            is_complete = True
            raise event_error(events[0])
        services.online_stats.first_token(time.time() - entry.enqueued_at)
        if body.stream:
            is_handed_over = True  # the stream takes the request over, with its own cleanup
            chunks = ResponseEventWriter(entry, body.model, body) if url == RESPONSES \
                else ChunkWriter(entry, body.model, url, body.include_usage)
            return ReplyStream(stream_chunks(services, entry, chunks, last_id, events),
                               lambda: finish(services.redis, entry, chunks.is_complete))
        response = Accumulator(body)
        while not response.add(events):
            last_id, events = await next_events(services, entry, last_id, request)
        is_complete = True
        if url == RESPONSES:
            return finished_body(response, entry, body.model, body)
        return response.body(entry, body.model, url)
    except Cancelled:
        return client_closed()
    finally:
        if not is_handed_over:
            await run_in_threadpool(finish, services.redis, entry, is_complete)


async def stream_chunks(services: Services, entry: OnlineEntry, chunks: ChunkWriter, last_id: str,
                        events: list[ReplyEvent]) -> AsyncIterator[bytes]:
    while True:
        for event in events:
            for chunk in chunks.of(event):
                yield chunks.encode(chunk)
            if chunks.is_ended:
                for end in chunks.end():
                    yield end
                return
        try:
            last_id, events = await next_events(services, entry, last_id, None)  # Starlette watches the client
        except APIError as error:  # past the deadline: end the stream (its cleanup cancels the request)
            for chunk in chunks.error_chunks(event_error(Error(error.status, error.code, error.message))):
                yield chunks.encode(chunk)
            for end in chunks.end():
                yield end
            return
