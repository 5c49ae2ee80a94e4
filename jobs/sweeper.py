"""Every batch ends: the finalizer's sweep (workers/finalizer.py runs `Sweeper.sweep` every
few seconds) walks every open batch and ends those that cannot end by themselves.

  * Past its completion window: at once, each request without a result gets a
    `batch_expired` error line, and finalize ends the batch `expired` (OpenAI's semantics:
    the partial results, and an error file of what did not run), whether or not a worker
    ever pulled its lines. Workers abort the lines they still run at their next check.
  * Cancelling: the same with `batch_cancelled`, ended `cancelled`; workers settle what
    they run themselves, so the sweep acts at once only when no live worker serves the
    model, else after the grace period. Both record idempotently (each request counts once).
  * Enqueue never finished (its producer died halfway): after `enqueue_grace_seconds` the
    batch fails with `enqueue_incomplete`. (Re-running `producers.submit` with the same
    --batch-id before then resumes the enqueue instead.)
  * Every request counted but no finalize job working on it: finalize is enqueued again,
    with back-off after a failed job (1, 2, 4, ... s, up to the grace period), after the
    grace period for a job lost with Redis or a crash between counting and enqueueing.

Finding the requests without a result reads the batch's own streams (jobs/queues.py),
which hold every request not yet acknowledged. A batch that ended has its streams retired.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import redis
from rq.job import JobStatus

from jobs import backlog, batches, files, heartbeats, keys, queues, retention, tenant_backlog
from jobs.entries import BatchEntry, MalformedEntry
from jobs.finalize import ACTIVE_JOB_STATUSES, job_status, request_finalize
from jobs.recording import record_many
from jobs.results import error_line
from jobs.storage import open_storage

log = logging.getLogger("kvfleet.finalize")
WAITING_FOR_FINALIZE = ("in_progress", "finalizing", "cancelling")
DEFAULT_ENQUEUE_GRACE_SECONDS = 600.0
SCAN_COUNT = 1000
DEAD_LETTER_TRIM_SECONDS = 60.0
SETTLE_PAGE = 1000  # a stopped batch's unfinished lines settled in one pipelined round trip
RECONCILE_SECONDS = 300.0  # between recounts of the backlog's summary from the streams (jobs/backlog.py)


def open_batches(r: redis.Redis) -> list[dict[str, Any]]:
    """The fields of every batch not yet terminal; drops the index entries of the others."""
    batch_ids = sorted(b.decode() for b in r.smembers(keys.OPEN_BATCHES))
    found = []
    for batch_id, fields in zip(batch_ids, batches.load_many(r, batch_ids)):
        if fields is None or fields["status"] in batches.TERMINAL:
            r.srem(keys.OPEN_BATCHES, batch_id)  # the hash is gone, or its transition's SREM was lost
            if fields is not None:
                queues.retire(r, fields["model"], batch_id)
                retention.schedule_batch_deletion(r, batch_id, time.time())
        else:
            found.append(fields)
    return found


def counted_but_open(r: redis.Redis) -> list[str]:
    """Open batches whose every request has a result counted, in a status that waits
    for finalize."""
    return [fields["id"] for fields in open_batches(r) if fields["status"] in WAITING_FOR_FINALIZE
            and 0 < fields["total"] <= fields["completed"] + fields["failed"]]


def stop_reason(fields: dict[str, Any], now: float) -> tuple[str, str] | None:
    """(code, message) for the requests of a batch that must not run any more."""
    if fields["status"] == "cancelling":
        return batches.CANCELLED_REQUEST
    if fields["status"] == "in_progress" and now > fields["expires_at"]:
        return batches.EXPIRED_REQUEST
    return None


def unfinished_entries(r: redis.Redis, fields: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(stream, entry id, custom id) of the batch's entries whose request has no result counted."""
    done = batches.counted_ids(r, fields["id"])
    for stream in keys.batch_streams(fields["model"], fields["id"], keys.num_partitions(r)):
        start = "-"
        while entries := r.xrange(stream, min=start, count=SCAN_COUNT):
            for entry_id, entry_fields in entries:
                try:
                    entry = BatchEntry.from_fields(entry_fields)
                except MalformedEntry:
                    continue
                if entry.batch_id == fields["id"] and entry.custom_id not in done:
                    done.add(entry.custom_id)  # a handed-back copy of it may follow
                    yield stream, entry_id.decode(), entry.custom_id
            start = f"({entries[-1][0].decode()}"


def end_batch(r: redis.Redis, fields: dict[str, Any], code: str, message: str) -> int:
    """Settle every request of the batch that has no result with an error line, then make sure
    finalize runs (it ends the batch expired or cancelled); how many it settled."""
    storage = open_storage(fields["sink"], r)
    num_settled, page = 0, []
    for stream, entry_id, custom_id in unfinished_entries(r, fields):
        page.append((error_line(custom_id, code, message), (stream, keys.CONSUMER_GROUP, entry_id)))
        if len(page) == SETTLE_PAGE:  # a page at a time: a 100,000-line batch ends in seconds
            record_many(r, storage, fields["id"], page)
            num_settled, page = num_settled + len(page), []
    record_many(r, storage, fields["id"], page)
    request_finalize(r, fields["id"])  # no-op when the last result above enqueued it already
    return num_settled + len(page)


class Sweeper:
    """Call `sweep` every few seconds (workers/finalizer.py does)."""

    def __init__(self, r: redis.Redis, grace_seconds: float, clock=time.monotonic,
                 enqueue_grace_seconds: float = DEFAULT_ENQUEUE_GRACE_SECONDS, wall_clock=time.time) -> None:
        self.r, self.grace_seconds, self.clock, self.wall_clock = r, grace_seconds, clock, wall_clock
        self.enqueue_grace_seconds = enqueue_grace_seconds
        self.waiting_since: dict[str, float] = {}  # batch id -> when it was first seen stuck (or re-enqueued)
        self.num_retries: dict[str, int] = {}
        self.stopped_since: dict[str, float] = {}  # batch id -> when it was first seen expired or cancelling
        self.next_dead_letter_trim = 0.0
        self.next_reconcile = 0.0

    def sweep(self) -> list[str]:
        """The ids finalize was enqueued for again (batches ended here are logged). Files past
        their expiry, ended batches past their retention and old dead letters are deleted too
        (jobs/retention.py)."""
        self.end_stopped_batches()
        self.delete_past_retention()
        if self.clock() >= self.next_reconcile:
            self.next_reconcile = self.clock() + RECONCILE_SECONDS
            if num_corrected := backlog.reconcile(self.r):
                log.warning("the backlog's summary was off in %d counts; recounted from the streams", num_corrected)
            if num_off := tenant_backlog.reconcile(self.r, open_batches(self.r)):
                log.warning("%d tenants' queued lines were off; recounted from their open batches", num_off)
        return self.finalize_counted_batches()

    def delete_past_retention(self) -> None:
        now = self.wall_clock()
        expired = files.delete_expired(self.r, now)
        if expired:
            log.info("deleted %d files at their expiry", len(expired))
        due = retention.batches_due(self.r, now)
        for batch_id in due:
            batches.delete_batch(self.r, batch_id)
        if due:
            log.info("deleted %d ended batches at the end of their retention", len(due))
        if self.clock() >= self.next_dead_letter_trim:  # it scans for the streams: not every sweep
            self.next_dead_letter_trim = self.clock() + DEAD_LETTER_TRIM_SECONDS
            if num_trimmed := retention.trim_dead_letters(self.r, now):
                log.info("trimmed %d dead letters past their retention", num_trimmed)

    def end_stopped_batches(self) -> list[str]:
        """End the batches past their window or cancelling, and fail those whose enqueue never
        finished; returns the ids acted on."""
        now, acted = self.wall_clock(), []
        served = set(heartbeats.served_models(self.r))
        for fields in open_batches(self.r):
            try:
                if self._end_if_stopped(fields, now, served):
                    acted.append(fields["id"])
            except (redis.ConnectionError, redis.TimeoutError):
                raise  # an outage: the next sweep tries again
            except Exception:  # noqa: BLE001 (one broken batch, a sink that is gone, must not stop the sweep)
                log.exception("batch %s: could not end it; trying again at the next sweep", fields["id"])
        return acted

    def _end_if_stopped(self, fields: dict[str, Any], now: float, served: set[str]) -> bool:
        batch_id = fields["id"]
        if fields.get("enqueued_at") == "" and now - fields["created_at"] > self.enqueue_grace_seconds:
            log.warning("batch %s: its enqueue never finished; failing it", batch_id)
            batches.fail(self.r, batch_id, "enqueue_incomplete", "The batch's requests were not all "
                         "enqueued: its producer stopped halfway. Submit it again.")
            return True
        reason = stop_reason(fields, now)
        if reason is None or fields.get("finalize_requested"):
            return False
        since = self.stopped_since.setdefault(batch_id, now)
        is_cancel = reason == batches.CANCELLED_REQUEST
        if is_cancel and fields["model"] in served and now - since < self.grace_seconds:
            return False  # its workers settle it themselves
        num_settled = end_batch(self.r, fields, *reason)
        log.info("batch %s: %s; settled %d requests without a result", batch_id, reason[0], num_settled)
        return True

    def finalize_counted_batches(self) -> list[str]:
        now, requeued = self.clock(), []
        stuck = {}
        for batch_id in counted_but_open(self.r):
            status = job_status(self.r, batch_id)
            if status not in ACTIVE_JOB_STATUSES:
                stuck[batch_id] = status
        for gone in set(self.waiting_since) - set(stuck):
            self.waiting_since.pop(gone)
            self.num_retries.pop(gone, None)
        for batch_id, status in stuck.items():
            retries = self.num_retries.get(batch_id, 0)
            wait = min(self.grace_seconds, 2.0**retries) if status == JobStatus.FAILED else self.grace_seconds
            if now - self.waiting_since.setdefault(batch_id, now) < wait:
                continue
            log.warning("batch %s: every request is counted but it is still open (finalize job: %s); "
                        "finalizing it again", batch_id, status or "none")
            request_finalize(self.r, batch_id, force=True)
            self.waiting_since[batch_id], self.num_retries[batch_id] = now, retries + 1
            requeued.append(batch_id)
        return requeued
