"""Online requests through the queue: the contract between producers.api and workers.

    API     validate -> XADD kvfleet:online:{model} (an OnlineEntry)
            -> XREAD BLOCK kvfleet:reply:{request_id} from 0-0: a reader that attaches late
               loses nothing
    worker  XREADGROUP on the online stream before any batch stream -> engine, priority lane
            -> one XADD per engine step to the reply stream (bounded, with a TTL)
            -> XACK after the last event. Nothing is written to batch storage.
    cancel  the API sets kvfleet:reply:{request_id}:cancel when the client goes away or its
            time is up; the worker checks it after every step and aborts the request.

Reply events, JSON in the entry field "event":

    {"type": "delta", "choices": [{"index", "text", "logprobs", "finish_reason", "token_ids"?}]}
    {"type": "done", "usage": {...}}                         the last event of a success
    {"type": "error", "status", "code", "message"}           the last event of a failure
    {"type": "restart"}     a non-streaming request runs again (its worker died): drop what came before

A worker that takes over an entry whose reply stream already holds events (its first
worker died mid-generation) does not run a streaming request again, whose client has
seen tokens: it ends the stream with an error. A non-streaming one runs again, after
a restart event.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from jobs import keys

REPLY_MAXLEN = 10_000  # events; one per engine step, so far more than a reader ever lags
REPLY_TTL_SECONDS = 120  # renewed by every event; the API deletes the stream when it is done
CANCEL_TTL_SECONDS = 3600
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_MAX_ONLINE_QUEUE = 256


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class OnlineEntry:
    request_id: str
    url: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # the batch-line body: no stream, stream_options or priority
    stream: bool
    priority: int
    deadline: float  # wall-clock seconds; past it the request is abandoned
    enqueued_at: float

    def to_fields(self) -> dict[str, str]:
        return {"request_id": self.request_id, "url": self.url, "body": json.dumps(self.body),
                "stream": str(int(self.stream)), "priority": str(self.priority), "deadline": repr(self.deadline),
                "enqueued_at": repr(self.enqueued_at)}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> OnlineEntry:
        """Raises KeyError or ValueError on a malformed entry."""
        text = {k.decode(): v.decode() for k, v in fields.items()}
        return cls(text["request_id"], text["url"], json.loads(text["body"]), text["stream"] == "1",
                   int(text["priority"]), float(text["deadline"]), float(text["enqueued_at"]))


def enqueue(r: redis.Redis, model: str, entry: OnlineEntry) -> str:
    return r.xadd(keys.online_stream(model), entry.to_fields()).decode()


def online_backlog(r: redis.Redis, model: str) -> int:
    """Online requests of the model that no worker has taken yet (the group's lag)."""
    try:
        groups = r.xinfo_groups(keys.online_stream(model))
    except redis.ResponseError:  # no stream yet
        return 0
    for group in groups:
        if group["name"].decode() == keys.CONSUMER_GROUP:
            lag = group.get("lag")
            return int(lag) if lag is not None else int(r.xlen(keys.online_stream(model)))
    return int(r.xlen(keys.online_stream(model)))


# -- events ------------------------------------------------------------------------
def delta_event(choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "delta", "choices": choices}


def done_event(usage: dict[str, Any]) -> dict[str, Any]:
    return {"type": "done", "usage": usage}


def error_event(status: int, code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "status": status, "code": code, "message": message}


RESTART_EVENT = {"type": "restart"}


def publish(pipe, request_id: str, event: dict[str, Any]) -> None:
    """Queue one event on a pipeline (the worker writes all of a step's events at once)."""
    key = keys.reply(request_id)
    pipe.xadd(key, {"event": json.dumps(event, separators=(",", ":"))}, maxlen=REPLY_MAXLEN, approximate=True)
    pipe.expire(key, REPLY_TTL_SECONDS)


def cancel(r: redis.Redis, request_id: str) -> None:
    r.set(keys.reply_cancel(request_id), 1, ex=CANCEL_TTL_SECONDS)


def decode_events(reply) -> tuple[str | None, list[dict[str, Any]]]:
    """An XREAD reply on one reply stream -> (last entry id, events)."""
    last_id, events = None, []
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            events.append(json.loads(fields[b"event"]))
    return last_id, events


def deadline_from_now(timeout: float) -> float:
    return time.time() + timeout
