"""Online `POST /v1/embeddings`, through the queue like completions (producers/routes/online.py):
the same checks, the same online stream and priority lane, the same reply stream. The
worker answers with one event, the whole OpenAI body (embeddings are never streamed)."""

from __future__ import annotations

import time

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from jobs.online import Done, Error
from jobs.schemas import EMBEDDINGS, OnlineEmbeddingBody
from producers.dependencies import ServicesDep, SettingsDep
from producers.online_replies import EventOrder, event_error
from producers.routes import v1_router
from producers.routes.online import (
    Cancelled,
    client_closed,
    enqueue_when_allowed,
    finish,
    first_events,
    next_events,
)

router = v1_router("embeddings")


@router.post("/embeddings", summary="Create embeddings (online, through the queue)")
async def create_embeddings(body: OnlineEmbeddingBody, request: Request, services: ServicesDep, settings: SettingsDep):
    try:
        entry, is_cold = await enqueue_when_allowed(services, settings, EMBEDDINGS, body, request)
    except Cancelled:
        return client_closed()
    services.online_stats.arrived()
    is_complete = False
    try:
        last_id, events = await first_events(services, settings, entry, is_cold, request)
        order = EventOrder()
        while True:
            for event in events:
                if order.place(event) == EventOrder.OLD:
                    continue  # a repeat, or a worker that lost the request
                if isinstance(event, Error):
                    is_complete = True
                    raise event_error(event)
                if isinstance(event, Done):
                    is_complete = True
                    services.online_stats.first_token(time.time() - entry.enqueued_at)
                    return event.body
            last_id, events = await next_events(services, entry, last_id, request)
    except Cancelled:
        return client_closed()
    finally:
        await run_in_threadpool(finish, services.redis, entry, is_complete)

