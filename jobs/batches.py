"""The batch object (OpenAI's shape) in a Redis hash, and its state machine.

    validating -> in_progress -> finalizing -> completed
         |             |  \\-> cancelling -> cancelled
         |             \\-> expired
         \\-> failed (from validating, in_progress or finalizing)

A transition is one Lua script: it checks the current status against the legal
sources and writes the new status and its timestamp atomically, so two workers
racing to finalize a batch cannot both win.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

import redis

from jobs import keys, outlook, retention, tenant_backlog
from jobs.storage import result_stores
from jobs.tenants import DEFAULT_TENANT, Caller

BATCH_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
TERMINAL = ("completed", "failed", "expired", "cancelled")
UNSUCCESSFUL = ("failed", "expired", "cancelled")  # terminal, and not every request ran
STOPPED = ("cancelling", "cancelled", "failed")  # a worker must not start its requests
# The error line of a request its batch stopped before it ran: (code, message).
CANCELLED_REQUEST = ("batch_cancelled", "The batch was cancelled before this request finished.")
EXPIRED_REQUEST = ("batch_expired", "This request could not be executed before the completion window expired.")
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "in_progress": ("validating",),
    "finalizing": ("in_progress",),
    "completed": ("finalizing",),
    "failed": ("validating", "in_progress", "finalizing", "cancelling"),
    "cancelling": ("validating", "in_progress"),
    "cancelled": ("cancelling",),
    "expired": ("in_progress",),
}
TIMESTAMP_FIELDS = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                    "failed": "failed_at", "cancelling": "cancelling_at", "cancelled": "cancelled_at",
                    "expired": "expired_at"}
WINDOWS = {"24h": 24 * 3600}
INT_FIELDS = ("created_at", "expires_at", *TIMESTAMP_FIELDS.values(), "total")
JSON_FIELDS = ("metadata", "errors")

FINALIZE_REQUESTED = "finalize_requested"  # set once, by whoever enqueues the batch's finalize job
COUNT_FIELDS = ("completed", "failed", "prompt_tokens", "completion_tokens", "cached_tokens",
                "reasoning_tokens")  # per partition

# KEYS: the batch hash. ARGV: new status, its timestamp field, this call's id, then the legal
# source statuses. The call's id is kept with the status: the same call sent again (redis-py
# retries after a lost reply) finds its own transition done and wins again; a racer loses.
_TRANSITION_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {-1, ''} end
if status == ARGV[1] and redis.call('HGET', KEYS[1], 'transition_id') == ARGV[3] then
  return {1, redis.call('HGET', KEYS[1], 'transition_from')}
end
for i = 4, #ARGV do
  if ARGV[i] == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], redis.call('TIME')[1], 'transition_id', ARGV[3],
               'transition_from', status)
    return {1, status}
  end
end
return {0, status}
"""
# KEYS: the batch hash. ARGV: field, value, field, value, ... Creates it only if it does not exist.
_CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


class IllegalTransition(Exception):
    pass


class BatchNotFound(KeyError):
    pass


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def validate_batch_id(batch_id: str) -> str:
    """A batch id names Redis keys, storage folders and its finalize job (RQ accepts only
    letters, digits, '_' and '-'): nothing else may reach them."""
    if not BATCH_ID_PATTERN.fullmatch(batch_id):
        raise ValueError(f"batch_id: must be 1 to 128 letters, digits, '_' or '-', got {batch_id!r}")
    return batch_id


def parse_window(window: str) -> int:
    """Seconds of a completion window like "24h", "90m" or "3600s"."""
    if window in WINDOWS:
        return WINDOWS[window]
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        seconds = int(window[:-1]) * units[window[-1]]
    except (ValueError, KeyError, IndexError):
        raise ValueError(f"completion_window: expected like '24h', '90m' or '3600s', got {window!r}") from None
    if seconds <= 0:
        raise ValueError(f"completion_window: must be positive, got {window!r}")
    return seconds


def create_batch(r: redis.Redis, batch_id: str, *, endpoint: str, model: str, input_file_id: str | None,
                 completion_window: str, sink: str, metadata: dict[str, str] | None = None,
                 tenant: str = DEFAULT_TENANT, output_expires_after: int | None = None) -> bool:
    """Create the batch in status validating, owned by `tenant`, its output and error files to
    expire `output_expires_after` seconds after they are written; False if it already exists
    (idempotent)."""
    validate_batch_id(batch_id)
    created = time.time()
    now = int(created)
    fields = {"id": batch_id, "status": "validating", "endpoint": endpoint, "model": model,
              "input_file_id": input_file_id or "", "completion_window": completion_window, "sink": sink,
              "created_at": now, "expires_at": now + parse_window(completion_window),
              "metadata": json.dumps(metadata or {}), "total": 0, "enqueued_at": "", "tenant": tenant,
              "output_expires_after": output_expires_after or ""}
    # The indexes first (they live in other slots than the batch): an id listed before its
    # hash exists is skipped by readers, a hash never listed would be lost to the sweep.
    pipe = r.pipeline(transaction=False)
    pipe.zadd(keys.BATCHES, {batch_id: created}, nx=True)  # sub-second, so listing order is creation order
    pipe.zadd(keys.tenant_batches(tenant), {batch_id: created}, nx=True)
    pipe.sadd(keys.OPEN_BATCHES, batch_id)  # until terminal: what the finalizer's sweep looks at
    tenant_backlog.created(pipe, tenant, batch_id)
    pipe.execute()
    flat = [item for pair in fields.items() for item in pair]
    return bool(r.eval(_CREATE_LUA, 1, keys.batch(batch_id), *flat))


def _transition_args(batch_id: str, to_status: str) -> list:
    return [1, keys.batch(batch_id), to_status, TIMESTAMP_FIELDS[to_status], uuid.uuid4().hex,
            *TRANSITIONS[to_status]]


def queue_transition(pipe: redis.client.Pipeline, batch_id: str, to_status: str) -> None:
    """The same transition, queued in a MULTI; an illegal one leaves the status as it is."""
    pipe.execute_command("EVAL", _TRANSITION_LUA, *_transition_args(batch_id, to_status))  # no eval() in a cluster pipeline


def transition(r: redis.Redis, batch_id: str, to_status: str) -> str:
    """Move the batch to `to_status` if legal; return the status it left.
    Raises IllegalTransition (or BatchNotFound) and changes nothing otherwise."""
    code, previous = r.eval(_TRANSITION_LUA, *_transition_args(batch_id, to_status))
    previous = previous.decode() if isinstance(previous, bytes) else previous
    if code == -1:
        raise BatchNotFound(batch_id)
    if code == 0:
        raise IllegalTransition(f"batch {batch_id}: cannot go from {previous} to {to_status}")
    if to_status in TERMINAL:  # other slots: if these are lost, the sweep drops the id and schedules it
        r.srem(keys.OPEN_BATCHES, batch_id)
        r.srem(keys.tenant_open((r.hget(keys.batch(batch_id), "tenant") or DEFAULT_TENANT.encode()).decode()), batch_id)
        retention.schedule_batch_deletion(r, batch_id, time.time())
    return previous


def fail(r: redis.Redis, batch_id: str, code: str, message: str) -> None:
    """End the batch failed, with `errors` saying why (OpenAI's batch errors list)."""
    fail_with_errors(r, batch_id, [{"code": code, "message": message, "line": None, "param": None}])


def fail_with_errors(r: redis.Redis, batch_id: str, errors: list[dict[str, Any]], total: int | None = None) -> None:
    """End the batch failed with OpenAI's `errors` list (a file's invalid lines, say), and
    its request total when it is known."""
    fields: dict[str, Any] = {"errors": json.dumps(errors)}
    if total is not None:
        fields["total"] = total
    r.hset(keys.batch(batch_id), mapping=fields)
    transition(r, batch_id, "failed")


def set_total(r: redis.Redis, batch_id: str, total: int) -> None:
    """The number of requests in the batch, once its file is validated."""
    r.hset(keys.batch(batch_id), "total", total)


def set_estimated_tokens(r: redis.Redis, batch_id: str, estimated_tokens: int) -> None:
    """The fair-share tokens of the batch's valid lines (jobs/tenants.py), which its ETA reads
    before it has results (jobs/outlook.py)."""
    r.hset(keys.batch(batch_id), "estimated_tokens", estimated_tokens)


def mark_enqueued(r: redis.Redis, batch_id: str) -> None:
    """Every request of the batch is in its streams (or recorded as invalid): until then the
    sweep may fail a batch whose producer died halfway (jobs/sweeper.py)."""
    r.hset(keys.batch(batch_id), "enqueued_at", int(time.time()))


def set_files(r: redis.Redis, batch_id: str, file_ids: dict[str, str]) -> None:
    """The output_file_id and error_file_id finalize wrote."""
    r.hset(keys.batch(batch_id), mapping=file_ids)


def is_finalize_requested(pipe: redis.client.Pipeline, batch_id: str) -> bool:
    return bool(pipe.hexists(keys.batch(batch_id), FINALIZE_REQUESTED))


def queue_finalize_requested(pipe: redis.client.Pipeline, batch_id: str) -> None:
    """Flag the batch, in the caller's MULTI: its finalize job is enqueued (by whoever set the flag)."""
    pipe.hset(keys.batch(batch_id), FINALIZE_REQUESTED, 1)


def load_fields(r: redis.Redis, batch_id: str) -> dict[str, Any]:
    """The batch hash's fields, with the counts and usage summed over its partitions."""
    [fields] = load_many(r, [batch_id])
    if fields is None:
        raise BatchNotFound(batch_id)
    return fields


def load_many(r: redis.Redis, batch_ids: list[str]) -> list[dict[str, Any] | None]:
    """load_fields of each batch (None where it does not exist). On one Redis, one pipeline; on
    a cluster, the hashes first, then the counts of the partitions each batch uses (its
    `partitions` field: a one-line batch reads one, not all sixteen)."""
    num_partitions = keys.num_partitions(r)
    pipe = r.pipeline(transaction=False)
    if num_partitions == 1:
        for batch_id in batch_ids:
            pipe.hgetall(keys.batch(batch_id))
            pipe.hmget(keys.partition_counts(batch_id, 0), *COUNT_FIELDS)
        replies = pipe.execute()
        return [_fields(replies[i], replies[i + 1:i + 2]) for i in range(0, len(replies), 2)]
    for batch_id in batch_ids:
        pipe.hgetall(keys.batch(batch_id))
    hashes = pipe.execute() if batch_ids else []
    used = [_partitions(raw, num_partitions) for raw in hashes]
    for batch_id, partitions in zip(batch_ids, used):
        for partition in partitions:
            pipe.hmget(keys.partition_counts(batch_id, partition), *COUNT_FIELDS)
    counts, start, found = pipe.execute() if any(used) else [], 0, []
    for raw, partitions in zip(hashes, used):
        found.append(_fields(raw, counts[start:start + len(partitions)]))
        start += len(partitions)
    return found


def load_hash(r: redis.Redis, batch_id: str) -> dict[str, Any]:
    """The batch hash's own fields, without its counts (one command): what a worker needs of a
    batch (status, deadline, tenant, sink, model). BatchNotFound if it does not exist."""
    fields = _fields(r.hgetall(keys.batch(batch_id)), [])
    if fields is None:
        raise BatchNotFound(batch_id)
    return fields


def _partitions(raw: dict, num_partitions: int) -> list[int]:
    """The partitions a batch's lines went to (all of them for a batch from before they were kept)."""
    if not raw:
        return []
    listed = raw.get(b"partitions")
    return [int(p) for p in listed.decode().split(",") if p] if listed else list(range(num_partitions))


def _fields(raw: dict, partitions: list) -> dict[str, Any] | None:
    if not raw:
        return None
    fields: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
    for index, name in enumerate(COUNT_FIELDS):
        fields[name] = sum(int(values[index] or 0) for values in partitions)
    for name in INT_FIELDS:
        if name in fields:
            fields[name] = int(fields[name])
    for name in JSON_FIELDS:
        if name in fields:
            fields[name] = json.loads(fields[name])
    return fields


def batch_object(r: redis.Redis, batch_id: str) -> dict[str, Any]:
    """The batch as OpenAI's API returns it, with kvfleet's eta_at and at_risk."""
    return openai_object(r, load_fields(r, batch_id))


def openai_object(r: redis.Redis, fields: dict[str, Any], view: outlook.FleetView | None = None) -> dict[str, Any]:
    """load_fields' fields as OpenAI's batch object, with kvfleet's eta_at and at_risk; pass one
    `view` for the batches of one page, so the fleet's numbers are read once."""
    return as_openai(outlook.annotate(fields, view or outlook.FleetView(r, load_many)))


def as_openai(f: dict[str, Any]) -> dict[str, Any]:
    """load_fields' fields as OpenAI's batch object."""
    batch_id = f["id"]
    usage = None
    if f.get("prompt_tokens") or f.get("completion_tokens"):
        prompt, completion = f.get("prompt_tokens", 0), f.get("completion_tokens", 0)
        usage = {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                 "input_tokens_details": {"cached_tokens": f.get("cached_tokens", 0)},
                 "output_tokens_details": {"reasoning_tokens": f.get("reasoning_tokens", 0)}}
    return {
        "id": batch_id, "object": "batch", "endpoint": f["endpoint"], "model": f["model"],
        "input_file_id": f["input_file_id"] or None, "completion_window": f["completion_window"],
        "status": f["status"], "output_file_id": f.get("output_file_id") or None,
        "error_file_id": f.get("error_file_id") or None,
        "errors": {"object": "list", "data": f["errors"]} if f.get("errors") else None,
        "created_at": f["created_at"], "expires_at": f["expires_at"],
        **{name: f.get(name) for name in TIMESTAMP_FIELDS.values()},
        "request_counts": {"total": f["total"], "completed": f["completed"], "failed": f["failed"]},
        "usage": usage, "metadata": f["metadata"] or None,
        # kvfleet's extensions (jobs/outlook.py), where the fields were annotated
        "eta_at": f.get("eta_at"), "at_risk": bool(f.get("at_risk")),
    }


def list_batch_ids(r: redis.Redis, after: str | None = None, limit: int = 20, tenant: str | None = None) -> list[str]:
    """Newest first; `after` is the id where the previous page ended. Only `tenant`'s batches,
    unless None (every tenant's)."""
    index = keys.BATCHES if tenant is None else keys.tenant_batches(tenant)
    start = 0
    if after:
        rank = r.zrevrank(index, after)
        if rank is None:
            raise BatchNotFound(after)
        start = rank + 1
    return [b.decode() for b in r.zrevrange(index, start, start + limit - 1)]


def delete_batch(r: redis.Redis, batch_id: str) -> None:
    """Delete an ended batch at its retention's end: its per-request results (from every store
    that holds them), its counting keys, its object and its index entries. Its files keep
    their own retention; its streams were retired when it ended."""
    raw = r.hmget(keys.batch(batch_id), "sink", "tenant")
    sink, tenant = (value.decode() if value else None for value in raw)
    if sink is not None:
        for store in result_stores(sink, r):
            store.delete_results(batch_id)
    pipe = r.pipeline(transaction=False)
    for partition in range(keys.num_partitions(r)):
        pipe.delete(keys.partition_done(batch_id, partition), keys.partition_counts(batch_id, partition))
    pipe.delete(keys.batch(batch_id), keys.batch_results(batch_id), keys.finalize_lock(batch_id))
    pipe.zrem(keys.BATCHES, batch_id)
    pipe.zrem(keys.tenant_batches(tenant or DEFAULT_TENANT), batch_id)
    pipe.srem(keys.OPEN_BATCHES, batch_id)
    pipe.zrem(keys.ENDED_BATCHES, batch_id)
    pipe.execute()


def owned_fields(r: redis.Redis, batch_id: str, caller: Caller) -> dict[str, Any]:
    """load_fields, if the caller may see the batch; BatchNotFound as if absent otherwise."""
    fields = load_fields(r, batch_id)
    if not caller.owns(fields.get("tenant")):
        raise BatchNotFound(batch_id)
    return fields


def num_counted(r: redis.Redis, batch_id: str) -> int:
    """How many of the batch's requests have a result counted (completed or failed)."""
    fields = load_fields(r, batch_id)
    return fields["completed"] + fields["failed"]


def counted_ids(r: redis.Redis, batch_id: str) -> set[str]:
    """The custom ids with a result counted, over every partition."""
    pipe = r.pipeline(transaction=False)
    for partition in range(keys.num_partitions(r)):
        pipe.smembers(keys.partition_done(batch_id, partition))
    return {member.decode() for members in pipe.execute() for member in members}
