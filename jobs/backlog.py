"""The batch backlog, summarised where it changes, so that no reader scans the open batches.

A worker picks whose work to pull by tenant share, then deadline (workers/fair_share.py). With
one stream per batch, reading every stream's backlog on every turn costs a worker in
proportion to the open batches: 20,000 one-line batches made one look 20,000 round trips.
Instead each partition keeps a summary, in its own slot (tag {pN}, like its streams), that
every script which changes a stream's backlog updates in the same step:

    kvfleet:ready-models:{pN}            zset  model -> earliest deadline of its ready work
    kvfleet:ready-tenants:{pN}:{model}   zset  tenant -> earliest deadline of its ready streams
    kvfleet:ready:{pN}:{model}:{tenant}  zset  stream -> its batch's deadline: streams with
                                               entries never delivered
    kvfleet:delivered:{pN}               set   streams with entries delivered, not acked
    kvfleet:backlog:{pN}:{model}         hash  lag (never delivered), pending (delivered)
    kvfleet:stream-info:{pN}             hash  stream -> "model<TAB>tenant<TAB>deadline"

    enqueue (producers/ingest.py)  XADD n: lag += n; the stream, tenant and model ready
    read (READ_LUA)                XREADGROUP from a tenant's ready streams, earliest deadline
                                   first: lag -= n, pending += n; a stream that gave fewer than
                                   asked is drained and leaves the ready set (then its tenant,
                                   then its model)
    ack (ACKED_LUA, in the record, ack and move scripts): pending -= 1; a stream left with no
                                   pending entry leaves `delivered`
    hand-back (the move script)    lag += 1, the stream ready again
    retire (RETIRE_LUA)            what the stream still held leaves the counts; it goes

A worker's turn then reads the models with ready work, their tenants, and the streams of the
tenants fair share picks: its Redis work grows with tenants and models, not with batches.
Reclaims and forwarded entries look only at `delivered` (bounded by the work in flight).
The counts are what KEDA scales on (GET /queue/MODEL). The finalizer's sweep recounts them
from the streams now and then (`reconcile`), in case something changed a stream behind the
scripts' back.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from jobs import keys
from jobs.scripts import LuaScript, run_all

ARRIVALS_MAXLEN = 100  # a signal stream: idle workers only need its newest id

# Shared by every script that acks an entry of a batch stream. KEYS: the stream, its partition's
# delivered set and stream-info hash. Returns 1 if the entry was pending (and counts it acked).
ACKED_LUA = """
local function info_of(info_key, stream)
  local raw = redis.call('HGET', info_key, stream)
  if not raw then return nil end
  local model, tenant, deadline = string.match(raw, '^(.*)\\t(.*)\\t(.*)$')
  return {model = model, tenant = tenant, deadline = deadline}
end
local function backlog_key(stream, model)
  return 'kvfleet:backlog:{' .. string.match(stream, '{(p%d+)}') .. '}:' .. model
end
local function acked(stream, group, entry_id, delivered_key, info_key)
  if redis.call('XACK', stream, group, entry_id) == 0 then return 0 end
  local info = info_of(info_key, stream)
  if info then redis.call('HINCRBY', backlog_key(stream, info.model), 'pending', -1) end
  return 1  -- a stream left with nothing pending leaves `delivered` at the next reclaim (PRUNE_LUA)
end
local function tenant_lines_key(key)
  return 'kvfleet:tenant-lines:{' .. string.match(key, '{(p%d+)}') .. '}'
end
local function make_ready(stream, info, count)
  local tag = '{' .. string.match(stream, '{(p%d+)}') .. '}'
  local tenants = 'kvfleet:ready-tenants:' .. tag .. ':' .. info.model
  redis.call('HINCRBY', backlog_key(stream, info.model), 'lag', count)
  redis.call('ZADD', 'kvfleet:ready:' .. tag .. ':' .. info.model .. ':' .. info.tenant, info.deadline, stream)
  redis.call('ZADD', tenants, 'LT', info.deadline, info.tenant)
  redis.call('ZADD', 'kvfleet:ready-models:' .. tag, 'LT', info.deadline, info.model)
end
"""

# KEYS: a tenant's ready set, its model's ready-tenants set, the partition's ready-models set,
# delivered set and the model's backlog hash. ARGV: group, consumer, count, tenant, model.
# Returns {{stream, entries}, ...} as XREADGROUP does, earliest deadline first.
READ_LUA = """
local want = tonumber(ARGV[3])
local found, read = {}, 0
while want > read do
  local head = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #head == 0 then break end
  local ok, reply = pcall(redis.call, 'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', want - read,
                          'STREAMS', head[1], '>')
  local entries = (ok and reply) and reply[1][2] or {}
  if #entries > 0 then
    table.insert(found, {head[1], entries})
    redis.call('SADD', KEYS[4], head[1])
    read = read + #entries
  end
  if read < want then redis.call('ZREM', KEYS[1], head[1]) end  -- drained, or retired meanwhile
end
if read > 0 then
  redis.call('HINCRBY', KEYS[5], 'lag', 0 - read)
  redis.call('HINCRBY', KEYS[5], 'pending', read)
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #head == 0 then redis.call('ZREM', KEYS[2], ARGV[4]) else redis.call('ZADD', KEYS[2], head[2], ARGV[4]) end
head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #head == 0 then redis.call('ZREM', KEYS[3], ARGV[5]) else redis.call('ZADD', KEYS[3], head[2], ARGV[5]) end
return found
"""

# KEYS: the stream, the partition's delivered set and stream-info hash, the batch's counts hash
# in the partition. ARGV: group. What the stream still held leaves the counts, its summary
# entries go, then the stream; the partition closes, its lines leave its tenant's queued lines
# (jobs/tenant_backlog.py).
RETIRE_LUA = ACKED_LUA + """
local info = info_of(KEYS[3], KEYS[1])
if info then
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
  local lag, pending = 0, 0
  if ok then
    for _, group in ipairs(groups) do
      local fields = {}
      for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
      if fields['name'] == ARGV[1] then
        pending = fields['pending'] or 0
        lag = fields['lag']
        if not lag then lag = #redis.call('XRANGE', KEYS[1], '(' .. fields['last-delivered-id'], '+') end
      end
    end
  end
  local tag = '{' .. string.match(KEYS[1], '{(p%d+)}') .. '}'
  local ready = 'kvfleet:ready:' .. tag .. ':' .. info.model .. ':' .. info.tenant
  local tenants = 'kvfleet:ready-tenants:' .. tag .. ':' .. info.model
  -- never -0: Redis reads "-0" as no integer
  if lag > 0 then redis.call('HINCRBY', backlog_key(KEYS[1], info.model), 'lag', 0 - lag) end
  if pending > 0 then redis.call('HINCRBY', backlog_key(KEYS[1], info.model), 'pending', 0 - pending) end
  redis.call('ZREM', ready, KEYS[1])
  if redis.call('ZCARD', ready) == 0 then redis.call('ZREM', tenants, info.tenant) end
  if redis.call('ZCARD', tenants) == 0 then redis.call('ZREM', 'kvfleet:ready-models:' .. tag, info.model) end
  redis.call('HDEL', KEYS[3], KEYS[1])
end
redis.call('SREM', KEYS[2], KEYS[1])
redis.call('DEL', KEYS[1])
local c = redis.call('HMGET', KEYS[4], 'total', 'completed', 'failed', 'tenant', 'closed')
if c[4] and not c[5] then
  local held = (tonumber(c[1]) or 0) - (tonumber(c[2]) or 0) - (tonumber(c[3]) or 0)
  if held > 0 then redis.call('HINCRBY', tenant_lines_key(KEYS[4]), c[4], 0 - held) end
  redis.call('HSET', KEYS[4], 'closed', 1)
end
return 1
"""

# KEYS: a stream, its partition's delivered set. ARGV: group. A stream with nothing pending
# any more leaves `delivered` (atomically with the look: a read that delivers anew adds it back).
PRUNE_LUA = """
if redis.call('XPENDING', KEYS[1], ARGV[1])[1] == 0 then return redis.call('SREM', KEYS[2], KEYS[1]) end
return 0
"""


READ, RETIRE, PRUNE = LuaScript(READ_LUA), LuaScript(RETIRE_LUA), LuaScript(PRUNE_LUA)


def stream_info(model: str, tenant: str, deadline: float) -> str:
    """What the summary keeps of a batch stream (tenant names hold no tab: jobs/tenants.py)."""
    return f"{model}\t{tenant}\t{int(deadline)}"


def retire_stream(r: redis.Redis, stream: str) -> None:
    partition = keys.stream_partition(stream)
    RETIRE(r, [stream, keys.delivered(partition), keys.stream_info(partition),
                keys.partition_counts(keys.batch_of_stream(stream), partition)], [keys.CONSUMER_GROUP])


def signal_arrival(r: redis.Redis, model: str) -> None:
    """Wake the model's idle workers: its batch backlog grew."""
    r.xadd(keys.arrivals(model), {"n": 1}, maxlen=ARRIVALS_MAXLEN, approximate=True)


def totals(r: redis.Redis, models: list[str]) -> tuple[int, int]:
    """(pending, lag) of the models' batch backlog over every partition: one round trip of
    models x partitions reads."""
    pipe = r.pipeline(transaction=False)
    for model in models:
        for partition in range(keys.num_partitions(r)):
            pipe.hmget(keys.backlog(partition, model), "pending", "lag")
    rows = pipe.execute() if models else []
    return sum(max(0, int(p or 0)) for p, _ in rows), sum(max(0, int(lag or 0)) for _, lag in rows)


@dataclass(frozen=True)
class Head:
    """One tenant's ready work in a partition: `stream` its ready set, `deadline` its earliest
    (what fair share plans over, as it plans over batch queues: workers/fair_share.py)."""

    stream: str
    model: str
    deadline: float
    tenant: str
    partition: int


def heads(r: redis.Redis, models: list[str]) -> list[Head]:
    """One head per (partition, model of `models`, tenant) with ready work, earliest deadline
    first: the models with ready work per partition, then their tenants (two round trips)."""
    served, partitions = set(models), range(keys.num_partitions(r))
    pipe = r.pipeline(transaction=False)
    for partition in partitions:
        pipe.zrange(keys.ready_models(partition), 0, -1)
    pairs = [(partition, model.decode()) for partition, found in zip(partitions, pipe.execute())
             for model in found if model.decode() in served]
    for partition, model in pairs:
        pipe.zrange(keys.ready_tenants(partition, model), 0, -1, withscores=True)
    found = [Head(keys.ready(partition, model, tenant.decode()), model, deadline, tenant.decode(), partition)
             for (partition, model), rows in zip(pairs, pipe.execute() if pairs else []) for tenant, deadline in rows]
    return sorted(found, key=lambda queue: (queue.deadline, queue.stream))


def read(r: redis.Redis, consumer: str, plan: list[tuple[Head, int]]) -> list[tuple[str, str, dict]]:
    """Up to `count` never-delivered entries of each planned head, its tenant's earliest
    deadlines first, in one pipelined round trip: [(stream, entry id, fields)]."""
    calls = [(READ, [head.stream, keys.ready_tenants(head.partition, head.model), keys.ready_models(head.partition),
                     keys.delivered(head.partition), keys.backlog(head.partition, head.model)],
              [keys.CONSUMER_GROUP, consumer, count, head.tenant, head.model]) for head, count in plan]
    return [(_text(stream), _text(entry_id), _fields(flat)) for reply in run_all(r, calls)
            for stream, entries in reply or [] for entry_id, flat in entries]


def prune_delivered(r: redis.Redis, streams: list[str]) -> None:
    """Drop the streams with nothing pending any more from `delivered` (a worker does, after a
    reclaim: acks leave the set alone, so that each ack costs no XPENDING)."""
    run_all(r, [(PRUNE, [stream, keys.delivered(keys.stream_partition(stream))], [keys.CONSUMER_GROUP])
                for stream in streams], raise_on_error=False)  # a stream retired meanwhile: the retire dropped it


def delivered_streams(r: redis.Redis) -> list[str]:
    """Every batch stream with entries delivered and not acked, over the partitions."""
    pipe = r.pipeline(transaction=False)
    for partition in range(keys.num_partitions(r)):
        pipe.smembers(keys.delivered(partition))
    return sorted(_text(stream) for members in pipe.execute() for stream in members)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _fields(flat: list) -> dict:
    """A script's flat [field, value, ...] as XREADGROUP's reply gives them to redis-py."""
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def reconcile(r: redis.Redis) -> int:
    """Recount every model's backlog from its streams (XINFO GROUPS each, in one pipeline), and
    put every stream with never-delivered entries back in its ready set: what the scripts keep
    exact unless something changed a stream behind their back (a stream deleted by hand). The
    finalizer's sweep runs it now and then; an increment that lands between its read and its
    write is lost until the next run. Returns how many counts it corrected."""
    models = [key.decode().removeprefix(f"{keys.PREFIX}:queues:{{").removesuffix("}")
              for key in r.scan_iter(match=f"{keys.PREFIX}:queues:*", count=1000)]
    num_corrected = 0
    for model in models:
        streams = [stream.decode() for stream in r.zrange(keys.queues(model), 0, -1)]
        counts = {partition: [0, 0] for partition in range(keys.num_partitions(r))}  # [lag, pending]
        pipe = r.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        for stream, groups in zip(streams, pipe.execute(raise_on_error=False) if streams else []):
            group = None if isinstance(groups, Exception) else next(
                (g for g in groups if g["name"].decode() == keys.CONSUMER_GROUP), None)
            if group is None:
                continue
            lag, pending = int(group.get("lag") or 0), int(group["pending"])
            counts[keys.stream_partition(stream)][0] += lag
            counts[keys.stream_partition(stream)][1] += pending
            if lag:
                _make_ready(r, stream)
        for partition, (lag, pending) in counts.items():
            stored = r.hmget(keys.backlog(partition, model), "lag", "pending")
            if [int(value or 0) for value in stored] != [lag, pending]:
                r.hset(keys.backlog(partition, model), mapping={"lag": lag, "pending": pending})
                num_corrected += 1
    return num_corrected


def _make_ready(r: redis.Redis, stream: str) -> None:
    """`stream` has never-delivered entries: in its tenant's ready set (no count changes)."""
    partition = keys.stream_partition(stream)
    raw = r.hget(keys.stream_info(partition), stream)
    if raw is None:
        return
    model, tenant, deadline = raw.decode().split("\t")
    r.zadd(keys.ready(partition, model, tenant), {stream: float(deadline)})
    r.zadd(keys.ready_tenants(partition, model), {tenant: float(deadline)}, lt=True)
    r.zadd(keys.ready_models(partition), {model: float(deadline)}, lt=True)
