"""`Idempotency-Key` on POST /v1/files and POST /v1/batches: a client that retries a create
after a timeout gets the object its first try made, not a second one.

The key is remembered for IDEMPOTENCY_TTL_SECONDS per route and tenant. Before the create runs
it is claimed atomically (SET NX) as pending, for PENDING_TTL_SECONDS at a time: the create's
owner renews the claim from a thread while it runs, however long an upload takes, so a claim
whose API process died frees itself within seconds. A retry that arrives while the first try
still runs waits for it (up to WAIT_SECONDS, then 409), and takes over once the claim is gone.
A create that fails forgets the key, so the retry runs.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from jobs import keys
from producers.errors import APIError

IDEMPOTENCY_TTL_SECONDS = 24 * 3600
PENDING_TTL_SECONDS = 10
WAIT_SECONDS = 30.0
PENDING = b"pending:"

# KEYS: the idempotency key. ARGV: the claim, the new TTL (0: delete). Only the claim's owner acts.
_IF_CLAIMED_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) == 0 then return redis.call('DEL', KEYS[1]) end
return redis.call('EXPIRE', KEYS[1], ARGV[2])
"""


class HeldClaim:
    """Renews a pending claim every third of its TTL while the create runs."""

    def __init__(self, r: redis.Redis, key: str, claim: bytes) -> None:
        self.r, self.key, self.claim = r, key, claim
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._renew, daemon=True, name="idempotency-claim")

    def __enter__(self) -> HeldClaim:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def _renew(self) -> None:
        while not self.done.wait(PENDING_TTL_SECONDS / 3):
            with contextlib.suppress(redis.RedisError):  # the next turn tries again; a lapsed claim lets a retry run
                self.r.eval(_IF_CLAIMED_LUA, 1, self.key, self.claim, PENDING_TTL_SECONDS)

    def release(self) -> None:
        self.r.eval(_IF_CLAIMED_LUA, 1, self.key, self.claim, 0)


def create_once(r: redis.Redis, route: str, idempotency_key: str | None, create: Callable[[], dict[str, Any]],
                load: Callable[[str], dict[str, Any]], tenant: str) -> dict[str, Any]:
    """`create()` once per key and tenant; a repeat returns `load(id)` of what the first one made."""
    if idempotency_key is None:
        return create()
    key = keys.idempotency(route, idempotency_key, tenant)
    claim = PENDING + uuid.uuid4().hex.encode()
    if r.set(key, claim, nx=True, ex=PENDING_TTL_SECONDS):
        with HeldClaim(r, key, claim) as held:
            try:
                created = create()
            except BaseException:
                held.release()  # nothing was made: a retry may try again
                raise
        r.set(key, created["id"], ex=IDEMPOTENCY_TTL_SECONDS)
        return created
    deadline = time.monotonic() + WAIT_SECONDS
    while (value := r.get(key)) is not None and value.startswith(PENDING) and time.monotonic() < deadline:
        time.sleep(0.1)
    if value is None:  # the first try failed, or its process died and its claim lapsed: this one runs
        return create_once(r, route, idempotency_key, create, load, tenant)
    if value.startswith(PENDING):
        raise APIError(409, "A request with this Idempotency-Key is still being processed; retry later.",
                       "idempotency_key_in_use", "Idempotency-Key")
    return load(value.decode())
