"""Batch queues: one Redis stream per batch (per partition on a cluster), so that a worker
chooses whose work comes next (workers/fair_share.py: by tenant share, then deadline)
instead of taking one stream's arrival order.

    kvfleet:stream:{pN}:{model}:{batch}   the batch's requests (jobs/entries.py), group `workers`
    kvfleet:queues:{model}                 sorted set: the model's batch streams, scored by
                                           their batch's deadline (its expires_at)

The producer registers a batch's streams, each with its consumer group already made, before
it enqueues a line, so a worker never reads a stream without a group; what the backlog's
summary keeps of each stream (its model, tenant and deadline: jobs/backlog.py) is written
then too. Finalize retires them once the batch is terminal (the sweep retires any it
missed): the registry entry, the summary's, and the stream itself. Workers never read the
registry: they read the summary. Its readers are the sweep, the API's console and `active`
(each stream's backlog from the stream itself, for reconciling the summary and for tests).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis

from jobs import backlog, keys
from jobs.tenants import DEFAULT_TENANT


@dataclass(frozen=True)
class Queue:
    stream: str
    model: str
    deadline: float  # wall-clock seconds: its batch's expires_at
    lag: int | None = None  # entries never delivered; None: Redis cannot tell (a read finds out)
    pending: int = 0  # delivered and not yet acknowledged

    @property
    def batch_id(self) -> str:
        return keys.batch_of_stream(self.stream)


def ensure_group(r: redis.Redis, stream: str) -> None:
    """The consumer group of `stream`, reading from its start; the stream is made if need be."""
    try:
        r.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as error:
        if "BUSYGROUP" not in str(error):
            raise


def register(r: redis.Redis, model: str, batch_id: str, partitions: Iterable[int], deadline: float,
             tenant: str = DEFAULT_TENANT) -> list[str]:
    """Make the batch's streams in these partitions and list them for the model's workers."""
    streams = [keys.batch_stream(model, batch_id, partition) for partition in sorted(set(partitions))]
    for stream in streams:  # one call each: on a cluster they live in other slots
        ensure_group(r, stream)
        partition = keys.stream_partition(stream)
        r.hset(keys.stream_info(partition), stream, backlog.stream_info(model, tenant, deadline))
        r.hset(keys.partition_counts(batch_id, partition), "tenant", tenant)  # whose counted results they are
    if streams:
        r.zadd(keys.queues(model), dict.fromkeys(streams, deadline))
        # What its counts are summed over (jobs/batches.py: load_many reads only these).
        r.hset(keys.batch(batch_id), "partitions", ",".join(str(keys.stream_partition(s)) for s in streams))
    return streams


def retire(r: redis.Redis, model: str, batch_id: str) -> None:
    """Forget an ended batch's streams: out of the registry, what they still held out of the
    backlog's summary and of its tenant's queued lines (its partitions close:
    jobs/tenant_backlog.py), then deleted."""
    streams = keys.batch_streams(model, batch_id, keys.num_partitions(r))
    r.zrem(keys.queues(model), *streams)
    for stream in streams:
        backlog.retire_stream(r, stream)


def registered(r: redis.Redis, models: list[str]) -> list[Queue]:
    """The served models' batch streams, earliest deadline first, without their backlog."""
    pipe = r.pipeline(transaction=False)
    for model in models:
        pipe.zrange(keys.queues(model), 0, -1, withscores=True)
    found = [Queue(stream.decode(), model, deadline)
             for model, rows in zip(models, pipe.execute()) for stream, deadline in rows]
    return sorted(found, key=lambda queue: (queue.deadline, queue.stream))


def active(r: redis.Redis, models: list[str]) -> list[Queue]:
    """`registered`, each with its group's lag and pending count; a stream retired meanwhile
    is left out."""
    queues = registered(r, models)
    if not queues:
        return []
    pipe = r.pipeline(transaction=False)
    for queue in queues:
        pipe.xinfo_groups(queue.stream)
    found = []
    for queue, groups in zip(queues, pipe.execute(raise_on_error=False)):
        if isinstance(groups, Exception):
            continue  # no such key: retired after the registry was read
        group = next((g for g in groups if g["name"].decode() == keys.CONSUMER_GROUP), None)
        if group is not None:
            lag = group.get("lag")
            found.append(Queue(queue.stream, queue.model, queue.deadline, None if lag is None else int(lag),
                               int(group["pending"])))
    return found


def sum_backlog(queues: list[Queue]) -> tuple[int, int]:
    """(pending, lag) summed over the queues; an unknown lag counts as none."""
    return sum(q.pending for q in queues), sum(q.lag or 0 for q in queues)
