"""Redis stream operations of the worker loop, one small function each.

NOTE: an entry stays in the consumer group's pending list (PEL) from delivery
until its result is durable and it is XACKed. A live worker resets the idle time
of its in-flight entries from a thread (workers/leases.py), so only entries of dead or
stuck workers ever go idle past the lease and get reclaimed.
"""

from __future__ import annotations

import time

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    SlotNotCoveredError,
    TryAgainError,
)

from jobs import backlog, keys, queues
from jobs.entries import REQUEUES_FIELD
from jobs.scripts import LuaScript

GROUP = keys.CONSUMER_GROUP
# Redis does not answer. A cluster mid-failover answers CLUSTERDOWN or TRYAGAIN, or has no node
# for a slot yet: the worker backs off and retries, as for an outage.
OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError, MasterDownError,
                 ClusterError, SlotNotCoveredError)
REQUEUES = REQUEUES_FIELD.encode()


ensure_group = queues.ensure_group


def is_gone(error: redis.ResponseError) -> bool:
    """The stream or its group no longer exists: its batch ended and its stream was retired."""
    return "NOGROUP" in str(error) or "no such key" in str(error)


def read_planned(r: redis.Redis, consumer: str, plan: list[tuple[str, int]]) -> list[tuple[str, str, dict]]:
    """Never-delivered entries, up to a count from each stream of `plan` ([(stream, count)]), in
    one pipelined round trip: [(stream, entry_id, fields)]. A stream retired meanwhile (its
    group is gone) gives none."""
    pipe = r.pipeline(transaction=False)
    for stream, count in plan:
        pipe.xreadgroup(GROUP, consumer, {stream: ">"}, count=count)
    found = []
    for reply in pipe.execute(raise_on_error=False):
        if isinstance(reply, redis.ResponseError) and is_gone(reply):
            continue  # the batch ended and its stream was retired
        if isinstance(reply, Exception):
            raise reply
        found += _entries(reply)
    return found


def read_new(r: redis.Redis, streams: list[str], consumer: str, count: int, block_ms: int | None):
    """Never-delivered entries of the streams, the first stream's first:
    [(stream, entry_id, fields)]. On one Redis, one XREADGROUP: COUNT applies to each stream,
    so up to count x len(streams) come back; every one is delivered, and admission hands back
    what does not fit. On a cluster (one read per stream: they live in different slots) the
    streams are read in order until `count` are found; with none, it blocks on the first
    stream only (the caller rotates the order)."""
    if count <= 0:
        return []
    if not isinstance(r, RedisCluster):
        return _entries(r.xreadgroup(GROUP, consumer, dict.fromkeys(streams, ">"), count=count, block=block_ms))
    found = []
    for stream in streams:
        found += _entries(r.xreadgroup(GROUP, consumer, {stream: ">"}, count=count - len(found)))
        if len(found) >= count:
            return found
    if not found and block_ms is not None and streams:
        found = _entries(r.xreadgroup(GROUP, consumer, {streams[0]: ">"}, count=count, block=block_ms))
    return found


def wait_for_new(r: redis.Redis, streams: list[str], block_ms: int, signals: dict[str, str] | None = None) -> None:
    """Block until one of the streams holds an entry its group has not delivered yet, or a
    signal stream (a model's arrivals: jobs/backlog.py) grows past the id given, or block_ms
    passes; consumes nothing (the lanes pull what they take). XREAD from each group's
    last-delivered id returns at once when such an entry is there already, so one that arrived
    after the last pull is never slept through. On a cluster one XREAD cannot span slots: it
    waits on the first stream, and the signals of its slot, only (the worker lists online
    streams first)."""
    signals = dict(signals or {})
    if isinstance(r, RedisCluster) and streams:
        streams = streams[:1]
        signals = {key: mark for key, mark in signals.items() if keys.hash_tag(key) == keys.hash_tag(streams[0])}
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        pipe.xinfo_groups(stream)
    waits = {}
    for stream, groups in zip(streams, pipe.execute(raise_on_error=False) if streams else []):
        if not isinstance(groups, Exception):  # a stream gone meanwhile is not waited on
            waits[stream] = (our_group(groups) or {}).get("last-delivered-id", b"0-0")
    waits.update(signals)
    if waits:
        r.xread(waits, count=1, block=block_ms)
    else:
        time.sleep(block_ms / 1000)


def _entries(reply) -> list:
    return [(stream.decode() if isinstance(stream, bytes) else stream, eid.decode(), fields)
            for stream, items in reply or [] for eid, fields in items]


def pull(r: redis.Redis, consumer: str, count: int, lease_ms: int, reclaim_streams: list[str],
         read_streams: list[str], block_ms: int | None):
    """Up to `count` entries: stale ones taken over from `reclaim_streams` first, then never-delivered
    ones of `read_streams` (blocking up to block_ms): [(stream, entry_id, fields, deliveries)]."""
    entries = []
    for stream in reclaim_streams:
        entries += [(stream, *entry) for entry in reclaim_stale(r, stream, consumer, lease_ms, count - len(entries))]
    if len(entries) < count:
        fresh = read_new(r, read_streams, consumer, count - len(entries), block_ms)
        entries += [(stream, entry_id, fields, 1) for stream, entry_id, fields in fresh]
    return entries


def reclaim_stale(r: redis.Redis, stream: str, consumer: str, lease_ms: int, count: int):
    """Take over up to `count` entries idle longer than the lease: [(entry_id, fields, deliveries)]."""
    if count <= 0:
        return []
    reply = r.xautoclaim(stream, GROUP, consumer, min_idle_time=lease_ms, start_id="0-0", count=count)
    claimed = [(eid.decode(), fields) for eid, fields in reply[1] if fields]
    if not claimed:
        return []
    pending = r.xpending_range(stream, GROUP, min=claimed[0][0], max=claimed[-1][0], count=len(claimed) * 4,
                               consumername=consumer)
    deliveries = {p["message_id"].decode(): p["times_delivered"] for p in pending}
    return [(eid, fields, deliveries.get(eid, 1)) for eid, fields in claimed]


def requeue(r: redis.Redis, stream: str, entry_id: str, fields: dict) -> None:
    """Hand an entry back to the fleet at once for lack of room here: ack it and append a
    copy that counts one more hand-back (its `requeues` field), atomically."""
    _append_copy(r, stream, entry_id, fields, int(fields.get(REQUEUES, 0)) + 1)


def release(r: redis.Redis, stream: str, entry_id: str, fields: dict) -> None:
    """Hand an entry back on shutdown: the same, without counting it (no request is at fault)."""
    _append_copy(r, stream, entry_id, fields, int(fields.get(REQUEUES, 0)))


# KEYS: the stream the entry is acked in, the stream its copy goes to (the same slot), the
# partition's delivered set and stream-info hash (jobs/backlog.py: a batch stream's backlog
# summary; an online stream has none). ARGV: the group, the entry id, then the copy's fields
# and values. The copy is added only by the XACK that removes the entry, so a call sent twice
# (a retry) adds one copy; a copy back into its own batch stream is ready work again.
_MOVE_ONCE_LUA = backlog.ACKED_LUA + """
if acked(KEYS[1], ARGV[1], ARGV[2], KEYS[3], KEYS[4]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
local info = info_of(KEYS[4], KEYS[2])
if KEYS[2] == KEYS[1] and info then make_ready(KEYS[1], info, 1) end
return 1
"""
# KEYS and ARGV as _MOVE_ONCE_LUA's, without a copy.
_ACK_LUA = backlog.ACKED_LUA + """
return acked(KEYS[1], ARGV[1], ARGV[2], KEYS[2], KEYS[3])
"""


_MOVE_ONCE, _ACK = LuaScript(_MOVE_ONCE_LUA), LuaScript(_ACK_LUA)


def _summary_keys(stream: str) -> list[str]:
    """The backlog summary's keys a script on `stream` updates (online streams have their own tag:
    keys no stream-info names, so the scripts find nothing to count there)."""
    if keys.is_batch_stream(stream):
        partition = keys.stream_partition(stream)
        return [keys.delivered(partition), keys.stream_info(partition)]
    tag = "{" + keys.hash_tag(stream) + "}"
    return [f"{keys.PREFIX}:delivered:{tag}", f"{keys.PREFIX}:stream-info:{tag}"]


def _move(r: redis.Redis, stream: str, entry_id: str, target: str, fields: dict) -> None:
    flat = [item for pair in fields.items() for item in pair]
    # execute_command: redis-py's cluster client routes EVAL by its keys
    _MOVE_ONCE(r, [stream, target, *_summary_keys(stream)], [GROUP, entry_id, *flat])
    if target == stream and keys.is_batch_stream(stream):
        backlog.signal_arrival(r, keys.model_of_stream(stream))


def _append_copy(r: redis.Redis, stream: str, entry_id: str, fields: dict, requeues: int) -> None:
    copy = dict(fields)
    if requeues:
        copy[REQUEUES] = requeues
    _move(r, stream, entry_id, stream, copy)


def dead_letter(r: redis.Redis, stream: str, entry_id: str, fields: dict, error: str) -> None:
    """Move an entry to the dead-letter stream with its last error, and ack it."""
    record = {k.decode() if isinstance(k, bytes) else k: v for k, v in fields.items()}
    record.update({"stream": stream, "entry_id": entry_id, "error": error})
    _move(r, stream, entry_id, keys.dead_letters(stream), record)


def ack(r: redis.Redis, stream: str, entry_id: str) -> None:
    _ACK(r, [stream, *_summary_keys(stream)], [GROUP, entry_id])


def trim_acknowledged(r: redis.Redis, stream: str) -> None:
    """Drop entries below both the oldest pending one and the group's last delivered
    one: everything older is acknowledged. Never MAXLEN on live work."""
    groups = {g["name"].decode(): g for g in r.xinfo_groups(stream)}
    group = groups.get(GROUP)
    if group is None:
        return
    floor = group["last-delivered-id"].decode()
    summary = r.xpending(stream, GROUP)
    if summary["pending"]:
        floor = min(floor, summary["min"].decode(), key=lambda eid: tuple(map(int, eid.split("-"))))
    if floor != "0-0":
        r.xtrim(stream, minid=floor, approximate=False)


def stream_backlog(r: redis.Redis, stream: str) -> tuple[int, int]:
    """(pending, lag) of the consumer group."""
    return group_backlog(r.xinfo_groups(stream))


def our_group(groups: list[dict]) -> dict | None:
    """kvfleet's consumer group in an XINFO GROUPS reply."""
    return next((group for group in groups if group["name"].decode() == GROUP), None)


def group_backlog(groups: list[dict]) -> tuple[int, int]:
    """(pending, lag) of kvfleet's group in an XINFO GROUPS reply."""
    group = our_group(groups)
    return (int(group["pending"]), int(group.get("lag") or 0)) if group else (0, 0)

