"""Each tenant's open batches and queued lines, counted where they change, so that the quotas
checked at every create (`max_open_batches`, `max_queued_lines`: jobs/tenants.py) read two
numbers instead of every open batch.

    kvfleet:tenant:{t}:open    set   the tenant's batches not yet ended (SCARD: open batches)
    kvfleet:tenant:{t}:queued  hash  lines: its open batches' lines without a counted result

    a batch is created      its id joins `open`
    its lines are enqueued  lines += its valid lines, once (the batch's `queued_open` flag)
    a result is counted     lines -= 1, while the batch is open: the record script tells
                            (jobs/recording.py), from its partition's counts hash, whose tenant
                            it is and whether the partition is closed
    the batch ends          it leaves `open` (its terminal transition); each partition is
                            closed (jobs/backlog.py, at retire), then lines -= what it still
                            held, once (the flag goes)

Closing the partitions before taking the rest away means a result counted meanwhile is
taken away exactly once. A crash between two of these steps leaves a count off by what that
step held: the finalizer's sweep recounts both now and then (`reconcile`).
"""

from __future__ import annotations

from typing import Any

import redis

from jobs import keys
from jobs.tenants import DEFAULT_TENANT

QUEUED_FLAG = "queued_open"  # on the batch hash: its lines are in its tenant's count


def created(pipe: redis.Redis | redis.client.Pipeline, tenant: str, batch_id: str) -> None:
    pipe.sadd(keys.tenant_open(tenant), batch_id)


def enqueued(r: redis.Redis, tenant: str, batch_id: str, num_lines: int) -> None:
    """The batch's valid lines are all enqueued: they count, once."""
    if num_lines and r.hsetnx(keys.batch(batch_id), QUEUED_FLAG, 1):
        r.hincrby(keys.tenant_queued(tenant), "lines", num_lines)


def counted(r: redis.Redis, tenant: str, num_lines: int = 1) -> None:
    """Lines of open batches of `tenant` have their results."""
    r.hincrby(keys.tenant_queued(tenant), "lines", -num_lines)


def ended(r: redis.Redis, fields: dict[str, Any]) -> None:
    """The batch ended and its partitions are closed (`fields` read after that): what it still
    held leaves its tenant's lines. (It left `open` with its terminal transition.)"""
    tenant, batch_id = fields.get("tenant") or DEFAULT_TENANT, fields["id"]
    if r.hdel(keys.batch(batch_id), QUEUED_FLAG):
        remaining = max(0, fields["total"] - fields["completed"] - fields["failed"])
        if remaining:
            r.hincrby(keys.tenant_queued(tenant), "lines", -remaining)


def open_batches(r: redis.Redis, tenant: str) -> int:
    return r.scard(keys.tenant_open(tenant))


def queued_lines(r: redis.Redis, tenant: str) -> int:
    return max(0, int(r.hget(keys.tenant_queued(tenant), "lines") or 0))


def reconcile(r: redis.Redis, open_fields: list[dict[str, Any]]) -> int:
    """Recount every tenant's lines from the open batches' own counts (`open_fields`: every
    open batch's load_fields); returns how many tenants were off."""
    lines: dict[str, int] = {}
    for fields in open_fields:
        tenant = fields.get("tenant") or DEFAULT_TENANT
        lines.setdefault(tenant, 0)
        if fields.get(QUEUED_FLAG):
            lines[tenant] += max(0, fields["total"] - fields["completed"] - fields["failed"])
    num_off = 0
    for key in r.scan_iter(match=keys.tenant_queued("*"), count=1000):
        tenant = keys.tenant_of_queued(key.decode())
        lines.setdefault(tenant, 0)
    for tenant, count in lines.items():
        if queued_lines(r, tenant) != count:
            r.hset(keys.tenant_queued(tenant), "lines", count)
            num_off += 1
    return num_off
