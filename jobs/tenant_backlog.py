"""Each tenant's open batches and queued lines, counted where they change, so that the quotas
checked at every create (`max_open_batches`, `max_queued_lines`: jobs/tenants.py) read a few
numbers instead of every open batch.

    kvfleet:tenant:{t}:open     set   the tenant's batches not yet ended (SCARD: open batches)
    kvfleet:tenant-lines:{pN}   hash  tenant -> its open batches' lines in partition N without
                                      a counted result

The lines are counted in the partition's own slot, by the scripts that already run there, in
the same step, so no count costs a round trip of its own:
    enqueue (producers/ingest.py)   += the chunk's lines (an invalid line: += 1 in the batch's
                                       first partition, with its error line)
    record (jobs/recording.py)      -= 1 for a result counted while its partition is open
    retire (jobs/backlog.py)        -= what the partition still held, and the partition closes:
                                       a late result of an ended batch takes nothing away
A tenant's queued lines are the sum over the partitions (one on a single Redis). The
finalizer's sweep recounts them from the open batches now and then (`reconcile`).
"""

from __future__ import annotations

from typing import Any

import redis

from jobs import keys
from jobs.tenants import DEFAULT_TENANT

# KEYS: the partition's tenant-lines hash and a batch's counts hash there. ARGV: tenant, lines.
# Lines a batch holds in the partition without a row of their own (its invalid lines, whose
# error lines are recorded there): counted, and in the partition's total.
_ADD_LINES_LUA = """
redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], 'total', ARGV[2])
"""


def created(pipe: redis.Redis | redis.client.Pipeline, tenant: str, batch_id: str) -> None:
    pipe.sadd(keys.tenant_open(tenant), batch_id)


def add_lines(r: redis.Redis, tenant: str, batch_id: str, partition: int, num_lines: int) -> None:
    if num_lines:
        r.execute_command("EVAL", _ADD_LINES_LUA, 2, keys.tenant_lines(partition),
                          keys.partition_counts(batch_id, partition), tenant, num_lines)


def open_batches(r: redis.Redis, tenant: str) -> int:
    return r.scard(keys.tenant_open(tenant))


def queued_lines(r: redis.Redis, tenant: str) -> int:
    pipe = r.pipeline(transaction=False)
    for partition in range(keys.num_partitions(r)):
        pipe.hget(keys.tenant_lines(partition), tenant)
    return max(0, sum(int(value or 0) for value in pipe.execute()))


def reconcile(r: redis.Redis, open_fields: list[dict[str, Any]]) -> int:
    """Recount every tenant's lines per partition from the open batches' own counts
    (`open_fields`: every open batch's load_fields); returns how many counts were off. A batch
    created while this runs is missed until the next run."""
    partitions = range(keys.num_partitions(r))
    pipe = r.pipeline(transaction=False)
    for fields in open_fields:
        for partition in partitions:
            pipe.hmget(keys.partition_counts(fields["id"], partition), "total", "completed", "failed", "closed")
    rows = iter(pipe.execute() if open_fields else [])
    lines: dict[int, dict[str, int]] = {partition: {} for partition in partitions}
    for fields in open_fields:
        tenant = fields.get("tenant") or DEFAULT_TENANT
        for partition in partitions:
            total, completed, failed, closed = next(rows)
            held = 0 if closed else max(0, int(total or 0) - int(completed or 0) - int(failed or 0))
            lines[partition][tenant] = lines[partition].get(tenant, 0) + held
    num_off = 0
    for partition, counted in lines.items():
        stored = {name.decode(): int(value) for name, value in r.hgetall(keys.tenant_lines(partition)).items()}
        for tenant in set(stored) | set(counted):
            if stored.get(tenant, 0) != counted.get(tenant, 0):
                r.hset(keys.tenant_lines(partition), tenant, counted.get(tenant, 0))
                num_off += 1
    return num_off
