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

from jobs import batches, keys
from jobs.finalize import request_finalize
from jobs.results import Usage, is_error_line, usage_of
from jobs.storage import Storage

# KEYS: the partition's done set and counts hash [, the stream]. ARGV: custom id, "completed"
# or "failed", prompt, completion and cached tokens [, group, entry id [, owner]]. Returns
# {added, counted in the partition, the partition's total}, or {-1, 0, 0} when the entry is
# not pending for the owner any more (another worker took it over): nothing is counted. An
# entry acked already with its request counted is this same call sent again after a lost
# reply (or a racer's, equally counted): {0, counted, total}.
_RECORD_LUA = """
if ARGV[8] then
  local pending = redis.call('XPENDING', KEYS[3], ARGV[6], ARGV[7], ARGV[7], 1)
  if #pending == 0 or pending[1][2] ~= ARGV[8] then
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
end
if #KEYS == 3 then redis.call('XACK', KEYS[3], ARGV[6], ARGV[7]) end
local f = redis.call('HMGET', KEYS[2], 'completed', 'failed', 'total')
return {added, (tonumber(f[1]) or 0) + (tonumber(f[2]) or 0), tonumber(f[3]) or 0}
"""


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
    if not storage.put_result(batch_id, custom_id, json.dumps(line, separators=(",", ":")).encode()):
        stored = storage.get_result(batch_id, custom_id)  # another attempt's line came first: count it
        if stored is not None:
            line = json.loads(stored)
            usage = usage_of(line)
    usage = usage or Usage()
    if partition is None:
        partition = keys.stream_partition(ack[0]) if ack else keys.partition_of(batch_id, 0, keys.num_partitions(r))
    script_keys = [keys.partition_done(batch_id, partition), keys.partition_counts(batch_id, partition),
                   *([ack[0]] if ack else [])]
    args = [custom_id, "failed" if is_error_line(line) else "completed", usage.prompt_tokens,
            usage.completion_tokens, usage.cached_tokens, *(ack[1:] if ack else ()),
            *([owner] if ack and owner else [])]
    added, counted, partition_total = r.eval(_RECORD_LUA, len(script_keys), *script_keys, *args)
    if added == -1:
        return Recorded(is_new=False, is_batch_done=False, is_owner=False)
    is_batch_done = False
    # Not only when new: a script sent again after its reply was lost counted the line the first
    # time, and this call may be the batch's last (request_finalize enqueues once whoever asks).
    if counted >= partition_total:  # this partition is done: maybe the whole batch is
        fields = batches.load_fields(r, batch_id)
        is_batch_done = fields["completed"] + fields["failed"] >= fields["total"]
    if is_batch_done:
        request_finalize(r, batch_id)
    return Recorded(bool(added), is_batch_done)
