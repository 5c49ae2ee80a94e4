"""Online requests through the queue: the contract between producers.api and workers.

    API     validate -> XADD kvfleet:online:{model} (an OnlineEntry)
            -> XREAD BLOCK kvfleet:reply:{request_id} from 0-0: a reader that attaches late
               loses nothing
    worker  XREADGROUP on the online stream before any batch stream -> engine, priority lane
            -> one XADD per engine step to the reply stream (bounded, with a TTL)
            -> XACK after the last event. Nothing is written to batch storage.
    cancel  the API sets kvfleet:reply:{request_id}:cancel when the client goes away or its
            time is up; the worker checks it after every step and aborts the request.

Reply events are typed (`Delta`, `Done`, `Error`), encoded as JSON in the entry field
"event" by `encode_event` and read back by `decode_events`, here alone:

    {"type": "delta", "attempt", "seq", "choices": [{"index", "text", "logprobs", "finish_reason", "token_ids"?}]}
    {"type": "done", "attempt", "seq", "usage": {...}, "body"?}      the last event of a success; an
                                                                     embeddings answer comes whole in "body"
    {"type": "error", "attempt", "seq", "status", "code", "message"}  the last event of a failure

Sequence numbers. Events are numbered 1, 2, 3, ... within an attempt. A write that redis-py
sent again after a timeout can add an event twice: the reader drops the repeat. A reader that
lags so far behind that the bounded stream dropped events it had not read sees the gap, and
ends the answer with the `reply_lost` error rather than skip text silently.

Attempts. Every time a worker starts a request it takes the next attempt number from the
request's attempt record (kvfleet:reply:{request_id}:attempts, a hash kept until the
request's deadline, so it outlives the reply stream's TTL), and tags each event with it.
The record also says whether any attempt has sent a token. When a worker dies
mid-generation, whoever takes the entry over continues it from its checkpoint
(kvfleet:ckpt:{request_id}:online, workers/online_lane.py), however late it comes, and its
first event repeats each choice from the start:
  * a non-streaming answer keeps only the newest attempt's events: it is whole;
  * a stream sends the client only what is past the text it has, after checking that the
    repetition matches it (producers/online_replies.py);
  * a streaming request that sent tokens and has no checkpoint is not run again (the
    client would read a different text): its stream ends with the worker_lost error.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import redis

from jobs import keys

REPLY_MAXLEN = 10_000  # events; one per engine step, so far more than a reader ever lags
REPLY_TTL_SECONDS = 120  # renewed by every event; the API deletes the stream when it is done
CANCEL_TTL_SECONDS = 3600
WORKER_LOST = ("worker_lost", "The worker serving this request stopped after streaming began, and its "
                              "replacement could not continue it; the output is incomplete. Retry the request.")
ATTEMPTS_GRACE_SECONDS = 60  # the attempt record outlives the request's deadline by this much
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_MAX_ONLINE_QUEUE = 256


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class OnlineEntry:
    request_id: str
    url: str  # /v1/completions, /v1/chat/completions or /v1/embeddings
    body: dict[str, Any]  # the batch-line body: no stream, stream_options or priority
    stream: bool
    priority: int
    deadline: float  # wall-clock seconds; past it the request is abandoned
    enqueued_at: float
    prefix: str = ""  # its prompt's prefix hashes (jobs/prefixes.py), comma-separated
    tenant: str = "default"  # the caller's (jobs/tenants.py)

    def to_fields(self) -> dict[str, str]:
        return {"request_id": self.request_id, "url": self.url, "body": json.dumps(self.body),
                "stream": str(int(self.stream)), "priority": str(self.priority), "deadline": repr(self.deadline),
                "enqueued_at": repr(self.enqueued_at), "prefix": self.prefix, "tenant": self.tenant}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> OnlineEntry:
        """Raises KeyError or ValueError on a malformed entry."""
        text = {k.decode(): v.decode() for k, v in fields.items()}
        return cls(text["request_id"], text["url"], json.loads(text["body"]), text["stream"] == "1",
                   int(text["priority"]), float(text["deadline"]), float(text["enqueued_at"]),
                   text.get("prefix", ""), text.get("tenant", "default"))


# KEYS: the online stream, the request's enqueue marker (same slot). ARGV: the marker's TTL, then
# the entry's fields and values. XADD once per request id, however often the call is sent.
_ENQUEUE_ONCE_LUA = """
if not redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[1]) then return false end
return redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
"""


def enqueue(r: redis.Redis, model: str, entry: OnlineEntry) -> None:
    """XADD the entry to the model's online stream, once: a retried call (the client's, or
    redis-py's after a timeout) finds the request id's marker and adds nothing."""
    ttl = max(1, int(entry.deadline - entry.enqueued_at) + ATTEMPTS_GRACE_SECONDS)
    fields = [item for pair in entry.to_fields().items() for item in pair]
    r.eval(_ENQUEUE_ONCE_LUA, 2, keys.online_stream(model), keys.online_enqueued(model, entry.request_id), ttl,
           *fields)


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


# -- reply events ----------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice produced in one engine step."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None  # OpenAI's shape for the endpoint, this step's tokens only
    token_ids: list[int] | None = None  # only from workers without a tokenizer (vLLM's return_token_ids)


@dataclass(frozen=True)
class Delta:
    choices: list[ChoiceDelta]
    attempt: int = 1
    seq: int = 0  # 1, 2, 3, ... within the attempt (0: unnumbered); the reader drops repeats, sees gaps
    output: dict[str, Any] | None = None  # how a chat answer is read (jobs/chat_output.OutputFormat); None: as text
    is_last: ClassVar[bool] = False


@dataclass(frozen=True)
class Done:
    """The last event of a success."""

    usage: dict[str, Any]  # OpenAI's usage object
    attempt: int = 1
    seq: int = 0
    body: dict[str, Any] | None = None  # the whole response of an endpoint that is not streamed (embeddings)
    is_last: ClassVar[bool] = True


@dataclass(frozen=True)
class Error:
    """The last event of a failure."""

    status: int
    code: str
    message: str
    attempt: int = 1
    seq: int = 0
    is_last: ClassVar[bool] = True


ReplyEvent = Delta | Done | Error
_EVENT_TYPES: dict[str, type] = {"delta": Delta, "done": Done, "error": Error}
_TYPE_NAMES = {cls: name for name, cls in _EVENT_TYPES.items()}


def encode_event(event: ReplyEvent) -> str:
    """The event as the JSON its reply-stream entry holds."""
    payload = {"type": _TYPE_NAMES[type(event)], **dataclasses.asdict(event)}
    if isinstance(event, Delta):  # token_ids only where a worker sends them
        for choice in payload["choices"]:
            if choice["token_ids"] is None:
                del choice["token_ids"]
        if event.output is None:
            del payload["output"]
    if isinstance(event, Done) and event.body is None:
        del payload["body"]
    return json.dumps(payload, separators=(",", ":"))


def decode_event(text: str | bytes) -> ReplyEvent:
    payload = json.loads(text)
    cls = _EVENT_TYPES[payload.pop("type")]
    if cls is Delta:
        return Delta([ChoiceDelta(**choice) for choice in payload["choices"]], payload["attempt"], payload["seq"],
                     payload.get("output"))
    return cls(**payload)


def publish(pipe, request_id: str, event: ReplyEvent) -> None:
    """Queue one event on a pipeline (the worker writes all of a step's events at once)."""
    key = keys.reply(request_id)
    pipe.xadd(key, {"event": encode_event(event)}, maxlen=REPLY_MAXLEN, approximate=True)
    pipe.expire(key, REPLY_TTL_SECONDS)


@dataclass(frozen=True)
class Attempt:
    number: int  # 1 for the first worker to start the request
    is_cancelled: bool  # its client went away
    has_sent_tokens: bool  # an earlier attempt published a token


def start_attempt(r: redis.Redis, entry: OnlineEntry) -> Attempt:
    """A worker starts (or takes over) the request: the next attempt number, in one round trip."""
    key = keys.reply_attempts(entry.request_id)
    pipe = r.pipeline(transaction=False)
    pipe.exists(keys.reply_cancel(entry.request_id))
    pipe.hincrby(key, "started", 1)
    pipe.hget(key, "sent")
    pipe.expireat(key, int(entry.deadline) + ATTEMPTS_GRACE_SECONDS)
    is_cancelled, number, sent, _ = pipe.execute()
    return Attempt(int(number), bool(is_cancelled), bool(sent))


def queue_tokens_sent(pipe, request_id: str) -> None:
    """Mark, with the events that carry them, that the request's tokens have gone out."""
    pipe.hset(keys.reply_attempts(request_id), "sent", 1)


def cancel(r: redis.Redis, request_id: str) -> None:
    r.set(keys.reply_cancel(request_id), 1, ex=CANCEL_TTL_SECONDS)


def decode_events(reply) -> tuple[str | None, list[ReplyEvent]]:
    """An XREAD reply on one reply stream -> (last entry id, events)."""
    last_id, events = None, []
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            events.append(decode_event(fields[b"event"]))
    return last_id, events
