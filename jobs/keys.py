"""Every Redis key kvfleet uses, in one place, laid out for Redis Cluster.

NOTE: the part of a key in braces is its hash tag: Redis Cluster places keys with the
same tag in the same slot, and only keys of one slot may meet in a Lua script or a
MULTI. Every script and MULTI in kvfleet touches keys of one tag.

| key                                   | type         | holds                                                    |
|---------------------------------------|--------------|----------------------------------------------------------|
| kvfleet:stream:{pN}:{model}:{batch}   | stream       | the batch's requests of partition N: jobs/entries.py's   |
|                                       |              | BatchEntry (one queue per batch: jobs/queues.py)         |
| kvfleet:queues:{model}                | sorted set   | the model's batch streams by their batch's deadline      |
| kvfleet:tenant-weights                | hash         | tenant -> its fair-share weight (the API publishes it)   |
| kvfleet:done:{pN}:{batch}             | set          | custom ids of the batch's partition-N requests with a    |
|                                       |              | durable result (each counted once)                       |
| kvfleet:counts:{pN}:{batch}           | hash         | that partition's total, completed, failed and usage      |
| kvfleet:dead:{tag}                    | stream       | dead-lettered entries of the streams with that tag       |
| kvfleet:ready-models:{pN}             | sorted set   | the batch backlog's summary (jobs/backlog.py): models,   |
| kvfleet:ready-tenants:{pN}:{model}    | sorted set   | their tenants and their streams with entries never       |
| kvfleet:ready:{pN}:{model}:{tenant}   | sorted set   | delivered, by deadline; streams with entries pending;    |
| kvfleet:delivered:{pN}                | set          | each model's lag and pending counts; each stream's       |
| kvfleet:backlog:{pN}:{model}          | hash         | model, tenant and deadline                               |
| kvfleet:stream-info:{pN}              | hash         |                                                          |
| kvfleet:arrivals:{model}              | stream       | a signal per enqueue or hand-back, for idle workers      |
| kvfleet:online:{model}                | stream       | online requests (read first), fields in jobs/online.py   |
| kvfleet:reply:{request_id}            | stream + TTL | an online request's events, worker -> API                |
| kvfleet:reply:{request_id}:cancel     | string + TTL | set by the API when the client went away or timed out    |
| kvfleet:reply:{request_id}:attempts   | hash + TTL   | attempts started, whether tokens went out (until the     |
|                                       |              | request's deadline: jobs/online.py)                      |
| kvfleet:ckpt:{batch}:custom_id        | string + TTL | a running batch line's generated tokens (checkpoints.py) |
| kvfleet:ckpt:{request_id}:online      | string + TTL | the same for an online request (beside its reply stream) |
| kvfleet:batch:{batch}                 | hash         | the batch object's fields, total, timestamps, sink       |
| kvfleet:batch:{batch}:results         | hash         | custom id -> result line (the redis sink)                |
| kvfleet:batches                       | sorted set   | batch ids by creation time (listing)                     |
| kvfleet:batches:open                  | set          | batch ids not yet terminal (the finalizer's sweep)       |
| kvfleet:batches:ended                 | sorted set   | ended batch ids by when they are deleted (retention)     |
| kvfleet:file:{file}                   | hash         | a file object: bytes, filename, purpose, location        |
| kvfleet:files                         | sorted set   | file ids by creation time (listing)                      |
| kvfleet:file:{file}:content           | string       | the content of a file stored in Redis                    |
| kvfleet:idempotency:{digest}          | string + TTL | the object id an Idempotency-Key created (24 h)          |
| kvfleet:worker:{workers}:{name}       | hash + TTL   | heartbeat: served models, KV blocks, running/waiting/... |
| kvfleet:worker:{workers}:{name}:groups| string + TTL | the prefix groups it ran last (workers/affinity.py)      |
| kvfleet:workers:{workers}             | sorted set   | worker names by last heartbeat (jobs/heartbeats.py)      |
| kvfleet:models                        | sorted set   | served model names by the last time a worker served them |
| rq:queue:kvfleet-finalize             | RQ queue     | finalize_batch jobs (JSON serializer), one per batch     |

Partitions. On one Redis there is one partition (N = 0). On a Redis Cluster each batch's
stream is split into NUM_CLUSTER_PARTITIONS streams, so one batch's load spreads over
every master instead of pinning one slot. A batch's lines go to partitions in runs of
PARTITION_LINES lines, starting at a partition chosen by the batch id: a small batch
stays in one partition (a few keys), a large one spreads over all. Its counting keys
(done, counts) are per partition, tagged like the stream, so recording a result and
acking its entry stay one script; the batch hash (status, total) has a tag of its own,
and its counts are the sum of its partitions'. The trade-off: a batch's counts take P
reads; P = 16 covers clusters of up to 16 masters.

RQ cannot run on a Redis Cluster (its transactions span slots: rq/rq#1942), so with a
cluster the finalize queue lives on a plain Redis named by KVFLEET_QUEUE_URL
(jobs/connection.py).

A stream entry's fields are jobs/entries.py's `BatchEntry` (batch streams) and
jobs/online.py's `OnlineEntry` (online streams).
"""

from __future__ import annotations

import hashlib
import os
import re
import zlib

import redis
from redis.cluster import RedisCluster

PREFIX = "kvfleet"
CONSUMER_GROUP = "workers"
FINALIZE_QUEUE = "kvfleet-finalize"
BATCHES = f"{PREFIX}:batches"
FILES = f"{PREFIX}:files"
OPEN_BATCHES = f"{PREFIX}:batches:open"
EXPIRING_FILES = f"{PREFIX}:files:expiring"  # file id -> its expires_at (jobs/retention.py)
ENDED_BATCHES = f"{PREFIX}:batches:ended"  # ended batch id -> when it is deleted (jobs/retention.py)
WORKERS = f"{PREFIX}:workers:{{workers}}"
MODELS = f"{PREFIX}:models"
LORA_ADAPTERS = f"{PREFIX}:lora-adapters"  # hash: adapter named by path or URI -> the base model whose workers load it
NUM_CLUSTER_PARTITIONS = 16
PARTITION_LINES = 100  # consecutive lines of a batch that share a partition
_TAG = re.compile(r"\{([^}]*)\}")


def num_partitions(r: redis.Redis | RedisCluster) -> int:
    return NUM_CLUSTER_PARTITIONS if isinstance(r, RedisCluster) else 1


def partition_of(batch_id: str, line_index: int, num_partitions: int) -> int:
    """The partition of a batch's line_index-th valid line (0-based)."""
    return (zlib.crc32(batch_id.encode()) + line_index // PARTITION_LINES) % num_partitions


def batch_stream(model: str, batch_id: str, partition: int = 0) -> str:
    """A batch's queue of requests in one partition (jobs/queues.py). Batch ids hold no ':'."""
    return f"{PREFIX}:stream:{{p{partition}}}:{model}:{batch_id}"


def batch_streams(model: str, batch_id: str, num_partitions: int) -> list[str]:
    return [batch_stream(model, batch_id, partition) for partition in range(num_partitions)]


def is_batch_stream(key: str) -> bool:
    return key.startswith(f"{PREFIX}:stream:")


def batch_of_stream(stream_key: str) -> str:
    """The batch id a batch stream's key names."""
    return stream_key.rsplit(":", 1)[1]


def model_of_stream(stream_key: str) -> str:
    """The model a batch stream's key names (a model name may hold ':')."""
    return stream_key.split("}:", 1)[1].rsplit(":", 1)[0]


def queues(model: str) -> str:
    """The model's batch streams, scored by their batch's deadline (jobs/queues.py)."""
    return f"{PREFIX}:queues:{{{model}}}"


TENANT_WEIGHTS = f"{PREFIX}:tenant-weights"


def stream_partition(stream_key: str) -> int:
    """The partition a batch stream's key names."""
    return int(hash_tag(stream_key)[1:])


def hash_tag(key: str) -> str:
    match = _TAG.search(key)
    return match.group(1) if match else key


def partition_done(batch_id: str, partition: int) -> str:
    return f"{PREFIX}:done:{{p{partition}}}:{batch_id}"


def partition_counts(batch_id: str, partition: int) -> str:
    return f"{PREFIX}:counts:{{p{partition}}}:{batch_id}"


# The batch backlog's summary, per partition, in the partition's slot (jobs/backlog.py).
def ready_models(partition: int) -> str:
    return f"{PREFIX}:ready-models:{{p{partition}}}"


def ready_tenants(partition: int, model: str) -> str:
    return f"{PREFIX}:ready-tenants:{{p{partition}}}:{model}"


def ready(partition: int, model: str, tenant: str) -> str:
    return f"{PREFIX}:ready:{{p{partition}}}:{model}:{tenant}"


def delivered(partition: int) -> str:
    return f"{PREFIX}:delivered:{{p{partition}}}"


def backlog(partition: int, model: str) -> str:
    return f"{PREFIX}:backlog:{{p{partition}}}:{model}"


def stream_info(partition: int) -> str:
    return f"{PREFIX}:stream-info:{{p{partition}}}"


def arrivals(model: str) -> str:
    """A signal stream: an entry whenever the model's batch backlog grows (an enqueue, a hand-
    back), for idle workers to block on; the slot of the model's online stream."""
    return f"{PREFIX}:arrivals:{{{model}}}"


def checkpoint(owner: str, name: str) -> str:
    """A running generation's checkpoint (workers/checkpoints.py). A batch line's: owner =
    batch id, name = custom_id (unique in its batch); an online request's: its request id
    and "online", in the slot of its reply stream. The hash tag keeps a batch's checkpoints
    in one slot."""
    return f"{PREFIX}:ckpt:{{{owner}}}:{name}"


def dead_letters(stream_key: str) -> str:
    """The dead-letter stream of a stream: the same hash tag, so moving an entry is one MULTI."""
    return f"{PREFIX}:dead:{{{hash_tag(stream_key)}}}"


DEAD_LETTERS_PATTERN = f"{PREFIX}:dead:*"


def online_stream(model: str) -> str:
    return f"{PREFIX}:online:{{{model}}}"


def model_of_any_stream(stream_key: str) -> str:
    """The model a batch or online stream's key names."""
    if stream_key.startswith(f"{PREFIX}:online:{{"):
        return stream_key[len(PREFIX) + len(":online:{"):-1]
    return model_of_stream(stream_key)


def online_enqueued(model: str, request_id: str) -> str:
    """Marks an online request enqueued; tagged like its model's online stream (one script)."""
    return f"{PREFIX}:online:{{{model}}}:enqueued:{request_id}"


def reply(request_id: str) -> str:
    return f"{PREFIX}:reply:{{{request_id}}}"


def reply_attempts(request_id: str) -> str:
    return f"{PREFIX}:reply:{{{request_id}}}:attempts"


def reply_cancel(request_id: str) -> str:
    return f"{PREFIX}:reply:{{{request_id}}}:cancel"


def batch(batch_id: str) -> str:
    return f"{PREFIX}:batch:{{{batch_id}}}"


def finalize_lock(batch_id: str) -> str:
    """Held by the one finalizer that runs the batch's finalize."""
    return f"{PREFIX}:batch:{{{batch_id}}}:finalizing"


def batch_results(batch_id: str) -> str:
    return f"{PREFIX}:batch:{{{batch_id}}}:results"


def tenant_files(tenant: str) -> str:
    """A tenant's files by creation time (jobs/tenants.py); FILES holds every tenant's."""
    return f"{PREFIX}:tenant:{{{tenant}}}:files"


def tenant_batches(tenant: str) -> str:
    """A tenant's batches by creation time; BATCHES holds every tenant's."""
    return f"{PREFIX}:tenant:{{{tenant}}}:batches"


def tenant_inflight(tenant: str) -> str:
    """A tenant's online requests not yet answered: "request_id tokens" scored by deadline."""
    return f"{PREFIX}:tenant:{{{tenant}}}:inflight"


def tenant_open(tenant: str) -> str:
    """A tenant's batches not yet ended (jobs/tenant_backlog.py)."""
    return f"{PREFIX}:tenant:{{{tenant}}}:open"


def tenant_lines(partition: int) -> str:
    """Tenant -> its open batches' lines in the partition without a result (jobs/tenant_backlog.py)."""
    return f"{PREFIX}:tenant-lines:{{p{partition}}}"


def tokens_freed(tenant: str) -> str:
    """The pub/sub channel a release of the tenant's in-flight tokens is announced on."""
    return f"{PREFIX}:tokens-freed:{tenant}"


TOKENS_FREED_PATTERN = f"{PREFIX}:tokens-freed:*"


def tenant_of_tokens_freed(channel: str) -> str:
    return channel.removeprefix(f"{PREFIX}:tokens-freed:")


def file(file_id: str) -> str:
    return f"{PREFIX}:file:{{{file_id}}}"


def file_content(file_id: str) -> str:
    return f"{PREFIX}:file:{{{file_id}}}:content"


def idempotency(route: str, idempotency_key: str, tenant: str = "default") -> str:
    """The object id a client's Idempotency-Key created on `route` for its tenant (hashed: the
    key is the client's; per tenant: another tenant's equal key is another key). The default
    tenant's keys hash as before tenants existed, so a retry across the upgrade still matches."""
    scope = f"{route}\n{idempotency_key}" if tenant == "default" else f"{route}\n{tenant}\n{idempotency_key}"
    digest = hashlib.sha256(scope.encode()).hexdigest()
    return f"{PREFIX}:idempotency:{{{digest}}}"


def worker(name: str) -> str:
    return f"{PREFIX}:worker:{{workers}}:{name}"


def worker_groups(name: str) -> str:
    """The prefix groups a worker ran last (workers/affinity.py), space-separated hex, with a TTL."""
    return f"{PREFIX}:worker:{{workers}}:{name}:groups"


def group_claim(model: str, group: str) -> str:
    """The worker that first pulled a prefix group nobody held (workers/affinity.py), with a TTL."""
    return f"{PREFIX}:worker:{{workers}}:claim:{model}:{group}"


def default_redis_url() -> str:
    """KVFLEET_REDIS_URL, or a Redis on localhost."""
    return os.environ.get("KVFLEET_REDIS_URL", "redis://localhost:6379/0")
