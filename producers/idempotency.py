"""`Idempotency-Key` on POST /v1/files and POST /v1/batches: a client that retries a create
after a timeout gets the object its first try made, not a second one.

The key is remembered for IDEMPOTENCY_TTL_SECONDS per route, claimed atomically (SET NX)
before the create runs; a retry that arrives while the first try still runs waits for it
(up to WAIT_SECONDS, then 409). A create that fails forgets the key, so the retry runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from jobs import keys
from producers.errors import APIError

IDEMPOTENCY_TTL_SECONDS = 24 * 3600
WAIT_SECONDS = 30.0
PENDING = b"pending"


def create_once(r: redis.Redis, route: str, idempotency_key: str | None, create: Callable[[], dict[str, Any]],
                load: Callable[[str], dict[str, Any]], tenant: str) -> dict[str, Any]:
    """`create()` once per key and tenant; a repeat returns `load(id)` of what the first one made."""
    if idempotency_key is None:
        return create()
    key = keys.idempotency(route, idempotency_key, tenant)
    if r.set(key, PENDING, nx=True, ex=IDEMPOTENCY_TTL_SECONDS):
        try:
            created = create()
        except BaseException:
            r.delete(key)  # nothing was made: a retry may try again
            raise
        r.set(key, created["id"], ex=IDEMPOTENCY_TTL_SECONDS)
        return created
    deadline = time.monotonic() + WAIT_SECONDS
    while (value := r.get(key)) == PENDING and time.monotonic() < deadline:
        time.sleep(0.1)
    if value is None:  # the first try failed meanwhile: this one runs
        return create_once(r, route, idempotency_key, create, load, tenant)
    if value == PENDING:
        raise APIError(409, "A request with this Idempotency-Key is still being processed; retry later.",
                       "idempotency_key_in_use", "Idempotency-Key")
    return load(value.decode())
