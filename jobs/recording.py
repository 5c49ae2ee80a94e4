"""Recording a result exactly once:

    record_result:  write the line durably (the first write wins: jobs/storage.py)
                ->  one Lua script on the request's partition: if the recorder still owns
                    the entry, SADD done set, count it only if new, add usage, XACK it
                ->  if that completed the partition, sum the batch's partitions; if that
                    completed the batch: enqueue finalize, once.

NOTE: the line counted is the line stored. When two attempts of one request race (a worker
stalled past its lease while another took the entry over), the first write is the stored
line; whoever comes second finds it there and counts that line's usage, not its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from jobs import backlog, batches, keys
from jobs.finalize import request_finalize
from jobs.results import Usage, is_error_line, usage_of
from jobs.scripts import LuaScript, run_all
from jobs.storage import Storage

# KEYS: the partition's done set and counts hash [, the stream, the partition's delivered set and
# stream-info hash (the backlog's summary: jobs/backlog.py)]. ARGV: custom id, "completed"
# or "failed", prompt, completion, cached and reasoning tokens [, group, entry id [, owner]]. Returns
# {added, counted in the partition, the partition's total}, or {-1, 0, 0} when the entry is
# not pending for the owner any more (another worker took it over): nothing is counted. An
# entry acked already with its request counted is this same call sent again after a lost
# reply (or a racer's, equally counted): {0, counted, total}.
_RECORD_LUA = LuaScript(backlog.ACKED_LUA + """
if ARGV[9] then
  local pending = redis.call('XPENDING', KEYS[3], ARGV[7], ARGV[8], ARGV[8], 1)
  if #pending == 0 or pending[1][2] ~= ARGV[9] then
    if #pending > 0 or redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then return {-1, 0, 0} end
    local f = redis.call('HMGET', KEYS[2], 'completed', 'failed', 'total')
    return {0, (tonumber(f[1]) or 0) + (tonumber(f[2]) or 0), tonumber(f[3]) or 0}
  end
end
local added = redis.call('SADD', KEYS[1], ARGV[1])
if added == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  redis.call('HINCRBY', KEYS[2], 'prompt_tokens', ARGV[3])
  redis.call('HINCRBY', KEYS[2], 'completion_tokens', ARGV[4])
  redis.call('HINCRBY', KEYS[2], 'cached_tokens', ARGV[5])
  if ARGV[6] ~= '0' then redis.call('HINCRBY', KEYS[2], 'reasoning_tokens', ARGV[6]) end
end
if #KEYS == 5 then acked(KEYS[3], ARGV[7], ARGV[8], KEYS[4], KEYS[5]) end
local f = redis.call('HMGET', KEYS[2], 'completed', 'failed', 'total', 'tenant', 'closed')
if added == 1 and f[4] and not f[5] then  -- a queued line of its tenant's open batch is done
  redis.call('HINCRBY', tenant_lines_key(KEYS[2]), f[4], -1)
end
return {added, (tonumber(f[1]) or 0) + (tonumber(f[2]) or 0), tonumber(f[3]) or 0}
""")


@dataclass
class Recorded:
    is_new: bool  # False: this request had a result already (a redelivery); nothing was counted
    is_batch_done: bool  # every request of the batch has a result counted (checked only when new)
    is_owner: bool = True  # False: the entry belongs to another worker now; nothing was counted or acked


def record_result(r: redis.Redis, storage: Storage, batch_id: str, line: dict[str, Any],
                  usage: Usage | None = None, ack: tuple[str, str, str] | None = None,
                  partition: int | None = None, owner: str | None = None) -> Recorded:
    """Store a result durably, then count it once and XACK its entry in one script.
    `ack` is (stream, group, entry_id); with `owner` (the worker's consumer name) nothing is
    counted or acked unless the entry is still pending for it. The request is counted in its
    stream's partition (`partition`, else the ack's stream's, else the batch's first); a
    request must always be counted in the same one. Finalize is enqueued when this completes
    the batch."""
    custom_id = line["custom_id"]
    if not storage.put_result(batch_id, custom_id, encode(line)):
        line, usage = _stored_line(storage, batch_id, line, usage)
    reply = _RECORD_LUA(r, *_script_call(r, batch_id, line, usage, ack, partition, owner))
    return _counted(r, batch_id, [reply])[0]


def record_many(r: redis.Redis, storage: Storage, batch_id: str,
                items: list[tuple[dict[str, Any], tuple[str, str, str] | None]]) -> int:
    """`record_result` for many lines of one batch, each (line, ack): their writes together
    (storage.put_results: one round trip in Redis) and their count scripts in one pipelined
    round trip. The sweep settles a batch's unfinished lines this way. Returns how many were new."""
    stored = storage.put_results(batch_id, [(line["custom_id"], encode(line)) for line, _ in items])
    calls = []
    for (line, ack), is_first in zip(items, stored):
        usage = usage_of(line)
        if not is_first:
            line, usage = _stored_line(storage, batch_id, line, usage)
        calls.append((_RECORD_LUA, *_script_call(r, batch_id, line, usage, ack, None, None)))
    return sum(recorded.is_new for recorded in _counted(r, batch_id, run_all(r, calls)))


def encode(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode()


def _stored_line(storage: Storage, batch_id: str, line: dict[str, Any], usage: Usage | None):
    """Another attempt's line came first: count that one, with its usage."""
    stored = storage.get_result(batch_id, line["custom_id"])
    return (json.loads(stored), usage_of(json.loads(stored))) if stored is not None else (line, usage)


def _script_call(r: redis.Redis, batch_id: str, line: dict[str, Any], usage: Usage | None,
                 ack: tuple[str, str, str] | None, partition: int | None, owner: str | None) -> tuple[list, list]:
    """_RECORD_LUA's keys and arguments for one result."""
    usage = usage or Usage()
    if partition is None:
        partition = keys.stream_partition(ack[0]) if ack else keys.partition_of(batch_id, 0, keys.num_partitions(r))
    script_keys = [keys.partition_done(batch_id, partition), keys.partition_counts(batch_id, partition),
                   *([ack[0], keys.delivered(partition), keys.stream_info(partition)] if ack else [])]
    args = [line["custom_id"], "failed" if is_error_line(line) else "completed", usage.prompt_tokens,
            usage.completion_tokens, usage.cached_tokens, usage.reasoning_tokens or 0, *(ack[1:] if ack else ()),
            *([owner] if ack and owner else [])]
    return script_keys, args


def _counted(r: redis.Redis, batch_id: str, replies: list) -> list[Recorded]:
    """The record scripts' replies: finalize enqueued if they completed the batch."""
    is_partition_done = False
    for added, counted, partition_total in replies:
        # Not only when new: a script sent again after its reply was lost counted the line the
        # first time, and this call may be the batch's last (request_finalize enqueues once).
        is_partition_done |= added != -1 and counted >= partition_total
    is_batch_done = False
    if is_partition_done:  # a partition is done: maybe the whole batch is
        fields = batches.load_fields(r, batch_id)
        is_batch_done = fields["completed"] + fields["failed"] >= fields["total"]
        if is_batch_done:
            request_finalize(r, batch_id)
    return [Recorded(added == 1, is_batch_done and added != -1, added != -1) for added, *_ in replies]
