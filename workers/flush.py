"""Results leave the worker here: each is written to its batch's storage, then counted
and acked in one script (jobs.results.record_result). One queue per storage target (a
batch's sink URL), so a failing target holds back only its own batches:

  * an outage (connection refused, a timeout, a 5xx, throttling) backs that target off,
    capped exponential, and retries; nothing is acked before it is durable;
  * a permanent error (NoSuchBucket, AccessDenied, a folder we may not write) is tried
    MAX_PERMANENT_TRIES times; then the request fails with code `storage_error`, its
    error line kept in Redis (finalize adds it to the error file), and the target is
    treated as broken for BROKEN_SECONDS: its next results fail at once.

A Redis error is raised to the worker loop: Redis holds every target's bookkeeping.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from jobs import keys
from jobs.recording import record_result
from jobs.results import Usage, error_line
from jobs.storage import (
    STORAGE_ERRORS,
    RedisStorage,
    Storage,
    describe_error,
    is_permanent_error,
    open_storage,
)
from workers.stream_ops import OUTAGE_ERRORS

log = logging.getLogger("kvfleet.worker")
MAX_PERMANENT_TRIES = 3
BROKEN_SECONDS = 30.0


@dataclass
class PendingResult:
    stream: str
    entry_id: str | None  # None: nothing to ack (a dead-lettered entry's error line)
    batch_id: str
    line: dict
    usage: Usage | None = None


@dataclass
class Target:
    queue: deque[PendingResult] = field(default_factory=deque)
    backoff: float = 0.0
    retry_at: float = 0.0
    num_permanent_errors: int = 0
    broken_until: float = 0.0
    broken_reason: str = ""


class ResultFlusher:
    def __init__(self, r, consumer: str, max_backoff_seconds: float = 5.0) -> None:
        self.r, self.consumer = r, consumer  # results are counted only while this consumer owns their entry
        self.max_backoff_seconds = max_backoff_seconds
        self.targets: dict[str, Target] = {}  # sink URL -> its queue, in order
        self.storages: dict[str, Storage] = {}

    def add(self, sink: str, result: PendingResult) -> None:
        self.targets.setdefault(sink, Target()).queue.append(result)

    def __len__(self) -> int:
        return sum(len(target.queue) for target in self.targets.values())

    def entries(self) -> list[tuple[str, str]]:
        """(stream, entry_id) of every result waiting to be acked: their leases are kept."""
        return [(res.stream, res.entry_id) for t in self.targets.values() for res in t.queue if res.entry_id]

    def discard(self, stream: str, entry_id: str) -> bool:
        """Forget the result of an entry another worker took over: it is never written. False
        when no result of it waits here."""
        found = False
        for target in self.targets.values():
            kept = deque(res for res in target.queue if (res.stream, res.entry_id) != (stream, entry_id))
            found = found or len(kept) < len(target.queue)
            target.queue = kept
        return found

    def is_waiting(self) -> bool:
        """Every queued result waits for its target's back-off."""
        now = time.monotonic()
        return bool(self.targets) and all(t.retry_at > now for t in self.targets.values() if t.queue)

    def flush(self) -> None:
        """Record what each target takes now; raises redis errors."""
        for sink, target in list(self.targets.items()):
            while target.queue and time.monotonic() >= target.retry_at:
                if not self._record_first(sink, target):
                    break
            if not target.queue and time.monotonic() >= target.broken_until:
                del self.targets[sink]

    def _record_first(self, sink: str, target: Target) -> bool:
        """Record the target's first result, or settle it with a storage_error; False to stop
        (the target backs off)."""
        result = target.queue[0]
        now = time.monotonic()
        if now < target.broken_until:
            self._fail(sink, result, target.broken_reason)
            target.queue.popleft()
            return True
        ack = (result.stream, keys.CONSUMER_GROUP, result.entry_id) if result.entry_id else None
        try:
            storage = self.storages.get(sink) or self.storages.setdefault(sink, open_storage(sink, self.r))
            recorded = record_result(self.r, storage, result.batch_id, result.line, result.usage, ack=ack,
                                     owner=self.consumer)
            if not recorded.is_owner:
                log.warning("%s: %s is no longer this worker's (another worker took it over, or the sweep "
                            "settled it at its batch's deadline); its result here is not counted",
                            self.consumer, result.entry_id)
        except OUTAGE_ERRORS:
            raise  # Redis holds every target's bookkeeping: the loop backs off
        except STORAGE_ERRORS as error:
            if not is_permanent_error(error):
                target.backoff = min(self.max_backoff_seconds, max(0.1, target.backoff * 2))
                target.retry_at = now + target.backoff
                log.warning("storage %s: %s; retrying in %.1fs", sink, describe_error(error), target.backoff)
                return False
            target.num_permanent_errors += 1
            if target.num_permanent_errors < MAX_PERMANENT_TRIES:
                target.retry_at = now + 0.2 * target.num_permanent_errors
                return False
            target.broken_reason = f"the result could not be written to {sink}: {describe_error(error)}"
            target.broken_until = now + BROKEN_SECONDS
            target.num_permanent_errors = 0
            log.error("storage %s: %s; failing its requests with storage_error for %.0fs", sink,
                      describe_error(error), BROKEN_SECONDS)
            self._fail(sink, result, target.broken_reason)
        except Exception:  # noqa: BLE001 (one result's data must not take the worker down)
            log.exception("%s: recording %s of batch %s failed; leaving it unacked (it returns after the lease "
                          "and is dead-lettered after max_deliveries)", self.consumer, result.entry_id, result.batch_id)
        target.queue.popleft()
        target.backoff = target.num_permanent_errors = 0
        return True

    def _fail(self, sink: str, result: PendingResult, message: str) -> None:
        """Count the request failed with a storage_error line kept in Redis, and ack it."""
        ack = (result.stream, keys.CONSUMER_GROUP, result.entry_id) if result.entry_id else None
        line = error_line(result.line["custom_id"], "storage_error", message)
        record_result(self.r, RedisStorage(self.r), result.batch_id, line, ack=ack, owner=self.consumer)
