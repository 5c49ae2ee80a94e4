"""Every Redis key kvfleet uses, in one place.

| key                              | type        | holds                                                        |
|----------------------------------|-------------|--------------------------------------------------------------|
| kvfleet:stream:{model}           | stream      | one entry per request, fields STREAM_ENTRY_FIELDS below      |
| kvfleet:online:{model}           | stream      | online requests (read first), fields in jobs/online.py       |
| kvfleet:reply:{request_id}       | stream + TTL| an online request's events, worker -> API (jobs/online.py)   |
| kvfleet:reply:{request_id}:cancel| string + TTL| set by the API when the client went away or timed out        |
| kvfleet:batch:{id}               | hash        | the batch object's fields, counts, timestamps, sink          |
| kvfleet:batch:{id}:done          | set         | custom ids with a durable result (counted once)              |
| kvfleet:batch:{id}:results       | hash        | custom id -> result line (the redis sink)                    |
| kvfleet:batches                  | sorted set  | batch ids by creation time (listing)                         |
| kvfleet:batches:open             | set         | batch ids not yet terminal (the finalizer's sweep)           |
| kvfleet:file:{id}                | hash        | a file object: bytes, filename, purpose, location            |
| kvfleet:file:{id}:content        | string      | the content of a file stored in Redis                        |
| kvfleet:dead                     | stream      | dead-lettered entries with their last error                  |
| kvfleet:worker:{name}            | hash + TTL  | heartbeat: served models, KV blocks, running/waiting/...     |
| kvfleet:workers                  | sorted set  | worker names by last heartbeat (jobs/heartbeats.py)          |
| rq:queue:kvfleet-finalize        | RQ queue    | finalize_batch jobs (JSON serializer), one per batch         |

A stream entry's fields, as producers/ingest.py writes them and workers read them:

    batch_id      the batch it belongs to
    custom_id     the request's id within the batch
    line_number   its line in the input file (1-based), for error messages
    line          the original JSONL line; workers re-validate it with jobs.schemas.parse_line
    enqueued_at   wall-clock seconds at XADD, for the queue-time metric
    requeues      (only on a copy handed back by a worker) how often it was handed back
"""

from __future__ import annotations

import os

PREFIX = "kvfleet"
CONSUMER_GROUP = "workers"
FINALIZE_QUEUE = "kvfleet-finalize"
BATCHES = f"{PREFIX}:batches"
OPEN_BATCHES = f"{PREFIX}:batches:open"
DEAD_LETTERS = f"{PREFIX}:dead"
WORKERS = f"{PREFIX}:workers"
STREAM_ENTRY_FIELDS = ("batch_id", "custom_id", "line_number", "line", "enqueued_at")
HANDED_BACK_FIELD = "requeues"


def stream(model: str) -> str:
    return f"{PREFIX}:stream:{model}"


def online_stream(model: str) -> str:
    return f"{PREFIX}:online:{model}"


def reply(request_id: str) -> str:
    return f"{PREFIX}:reply:{request_id}"


def reply_cancel(request_id: str) -> str:
    return f"{PREFIX}:reply:{request_id}:cancel"


def batch(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}"


def batch_done(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}:done"


def batch_results(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}:results"


def file(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}"


def file_content(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}:content"


def worker(name: str) -> str:
    return f"{PREFIX}:worker:{name}"


def default_redis_url() -> str:
    """KVFLEET_REDIS_URL, or a Redis on localhost."""
    return os.environ.get("KVFLEET_REDIS_URL", "redis://localhost:6379/0")
