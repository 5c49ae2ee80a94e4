"""Where online requests wait while their tenant is at its max_inflight_tokens.

A request held back by the quota waits in its API process, touching no Redis, until one of:
  * tokens of its tenant are freed: `jobs.tenants.release_tokens` publishes on the tenant's
    channel, and the one subscriber of this process wakes every waiter of that tenant at
    once; each tries its reservation again, once;
  * RECHECK_SECONDS pass: pub/sub drops messages across a reconnect, and tokens of an API
    process that died free themselves at their deadline, which no one announces;
  * its client goes away (looked at every DISCONNECT_CHECK_SECONDS, locally): it stops.
So a tenant's waiting requests cost Redis one reservation per release and one per
RECHECK_SECONDS each, and a departed client costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis

from jobs import keys

log = logging.getLogger("kvfleet.api")
RECHECK_SECONDS = 2.0
DISCONNECT_CHECK_SECONDS = 0.25
RESUBSCRIBE_SECONDS = 1.0


class ClientGone(Exception):
    """The client left while its request waited for its tenant's tokens."""


class TokenWaits:
    def __init__(self, async_redis) -> None:
        self.async_redis = async_redis
        self.events: dict[str, asyncio.Event] = {}  # tenant -> set when its tokens are freed
        self.listener: asyncio.Task | None = None

    async def wait(self, tenant: str, timeout: float, is_gone: Callable[[], Awaitable[bool]]) -> None:
        """Return when `tenant`'s tokens are freed or `timeout` (at most RECHECK_SECONDS) passes;
        raise ClientGone once `is_gone()` says the client left."""
        self._listen()
        event = self.events.setdefault(tenant, asyncio.Event())
        loop = asyncio.get_running_loop()
        end = loop.time() + min(timeout, RECHECK_SECONDS)
        while (left := end - loop.time()) > 0:
            try:
                await asyncio.wait_for(event.wait(), min(left, DISCONNECT_CHECK_SECONDS))
                return
            except TimeoutError:
                if await is_gone():
                    raise ClientGone from None

    def wake(self, tenant: str) -> None:
        """Every request of `tenant` waiting now tries again; later ones wait for the next release."""
        event = self.events.pop(tenant, None)
        if event is not None:
            event.set()

    def _listen(self) -> None:
        if self.listener is None or self.listener.done():
            self.listener = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Subscribe to every tenant's release channel; resubscribe after an outage."""
        while True:
            pubsub = self.async_redis.pubsub()
            try:
                await pubsub.psubscribe(keys.TOKENS_FREED_PATTERN)
                async for message in pubsub.listen():
                    if message["type"] == "pmessage":
                        channel = message["channel"]
                        self.wake(keys.tenant_of_tokens_freed(channel.decode() if isinstance(channel, bytes)
                                                             else channel))
            except (redis.RedisError, OSError) as error:
                log.warning("token waits: subscription lost (%s); waiters recheck every %ss", error, RECHECK_SECONDS)
                await asyncio.sleep(RESUBSCRIBE_SECONDS)
            finally:
                await pubsub.aclose()
