"""The worker's leases, kept from a thread of their own.

A pulled entry stays in its consumer group's pending list (PEL) under this worker's name
until it is acked. Entries idle longer than the lease are taken over by other workers
(XAUTOCLAIM), so a live worker must keep resetting the idle time of everything it holds,
whatever its loop is doing: an engine step or a storage put can take longer than the
lease. `LeaseKeeper` renews them every `interval_seconds` from a daemon thread that never
waits on the loop: the loop only hands it the list of what it holds (`hold`).

NOTE: renewal checks ownership. An entry that another worker has taken over (this one
stalled past the lease after all) is not taken back: XCLAIM with min-idle 0 would steal
it and both would run it. It is reported lost instead (`take_lost`), and the worker
aborts it at once and never writes its result.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

import redis

from jobs import keys
from jobs.scripts import LuaScript, run_all
from workers import stream_ops

log = logging.getLogger("kvfleet.worker")

# KEYS: the stream. ARGV: group, owner, new owner, then entry ids. Gives the ids `owner`
# still holds to `new owner` (XCLAIM JUSTID, which counts no delivery, and resets their idle
# time); returns the others. Renewing a lease is the owner giving an entry to itself;
# forwarding one to another worker (workers/affinity.py) is the same move.
TRANSFER_OWNED_LUA = """
local lost = {}
for i = 4, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #pending == 1 and pending[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""


TRANSFER_OWNED = LuaScript(TRANSFER_OWNED_LUA)


def renew(r: redis.Redis, consumer: str, held: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Renew the leases of the (stream, entry id) pairs this consumer owns, in one round trip;
    returns the pairs it no longer owns (taken over, or acked by another worker)."""
    by_stream: dict[str, list[str]] = defaultdict(list)
    for stream, entry_id in held:
        by_stream[stream].append(entry_id)
    if not by_stream:
        return set()
    calls = [(TRANSFER_OWNED, [stream], [keys.CONSUMER_GROUP, consumer, consumer, *entry_ids])
             for stream, entry_ids in by_stream.items()]
    lost = set()
    for (stream, entry_ids), reply in zip(by_stream.items(), run_all(r, calls, raise_on_error=False)):
        if isinstance(reply, redis.ResponseError) and stream_ops.is_gone(reply):  # its batch ended
            reply = entry_ids
        elif isinstance(reply, Exception):
            raise reply
        lost |= {(stream, entry_id.decode() if isinstance(entry_id, bytes) else entry_id) for entry_id in reply}
    return lost


class LeaseKeeper:
    def __init__(self, r: redis.Redis, consumer: str, interval_seconds: float) -> None:
        self.r, self.consumer, self.interval_seconds = r, consumer, interval_seconds
        self._lock = threading.Lock()
        self._held: list[tuple[str, str]] = []
        self._lost: set[tuple[str, str]] = set()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kvfleet-leases-{consumer}")
        self._is_started = False

    def start_once(self) -> None:
        if not self._is_started and not self._stopped.is_set():
            self._is_started = True
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def hold(self, entries: list[tuple[str, str]]) -> None:
        """What the worker holds now: renewed until the next call."""
        with self._lock:
            self._held = entries

    def take_lost(self) -> set[tuple[str, str]]:
        """The entries found owned by someone else since the last call."""
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    def renew_now(self) -> None:
        with self._lock:
            held = self._held
        lost = renew(self.r, self.consumer, held)
        if lost:  # or acked by this worker since `held` was handed over: the worker tells them apart
            with self._lock:
                self._lost |= lost

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_seconds):
            try:
                self.renew_now()
            except redis.RedisError as error:  # an outage: the loop backs off; try again next interval
                log.warning("%s: renewing leases failed: %s", self.consumer, error)
            except Exception:  # noqa: BLE001 (the thread must outlive any one surprise, or leases lapse)
                log.exception("%s: renewing leases failed", self.consumer)
