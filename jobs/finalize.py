"""Assemble a finished batch's output.jsonl and errors.jsonl, exactly once, and make
sure every batch ends.

`request_finalize` is called by whoever records the batch's last result; an atomic
flag on the batch lets only the first caller enqueue the RQ job (JSON serializer,
never pickle). An RQ worker runs `finalize_batch`:

    rq worker -w jobs.rq_workers.FinalizeWorker --serializer rq.serializers.JSONSerializer kvfleet-finalize
    python -m workers.finalizer            # the same, plus the sweep (jobs/sweeper.py)

A permanent storage error (NoSuchBucket, AccessDenied, an unwritable folder) ends the
batch `failed`, with an error naming the target; an outage (storage or Redis) fails the
job, and the sweep enqueues it again with back-off. finalize_batch is idempotent: the
output files are written once.

NOTE: RQ's own Retry needs RQ's scheduler, which runs as a forked child of the
worker; a kill -9 of the finalizer leaves that child running, orphaned. The sweep
lives in the finalizer's own process and dies with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time

import redis
from redis.exceptions import LockError
from rq import Queue, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from jobs import batches, keys, queues
from jobs.connection import connect, queue_connection
from jobs.files import create_file
from jobs.results import is_error_line
from jobs.rq_workers import InProcessWorker
from jobs.storage import CHUNK, describe_error, is_permanent_error, open_storage, result_stores
from jobs.tenants import DEFAULT_TENANT

log = logging.getLogger("kvfleet.finalize")
FINALIZE_LOCK_SECONDS = 3600  # longer than any finalize: it is released when the job ends
ACTIVE_JOB_STATUSES = (JobStatus.QUEUED, JobStatus.STARTED, JobStatus.SCHEDULED, JobStatus.DEFERRED)


def finalize_queue(r: redis.Redis) -> Queue:
    """The RQ queue of finalize jobs; `r` is the data Redis (see connection.queue_connection)."""
    return Queue(keys.FINALIZE_QUEUE, connection=queue_connection(r), serializer=JSONSerializer)


def job_id(batch_id: str) -> str:
    return f"finalize-{batch_id}"


def request_finalize(r: redis.Redis, batch_id: str, force: bool = False) -> bool:
    """Enqueue finalize_batch for this batch if nobody has (or, with force, again);
    True if this call did.

    NOTE: the flag, the status change and the RQ job commit in one MULTI (under WATCH),
    so a worker killed half-way cannot leave a batch flagged but never finalized. With a
    Redis Cluster the queue is on another Redis: the job is enqueued right after the MULTI,
    and if that is lost the Sweeper enqueues it again after its grace period.
    """
    key = keys.batch(batch_id)
    queue = finalize_queue(r)
    is_same_redis = queue.connection is r
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)
                if batches.is_finalize_requested(pipe, batch_id) and not force:
                    return False
                is_expired = time.time() > int(pipe.hget(key, "expires_at") or 0)
                pipe.multi()
                batches.queue_finalize_requested(pipe, batch_id)
                # A batch past its window goes from in_progress to expired in finalize_batch;
                # from cancelling the transition is refused and finalize ends it cancelled.
                if not is_expired:
                    batches.queue_transition(pipe, batch_id, "finalizing")
                if is_same_redis:
                    _enqueue_finalize(queue, batch_id, pipe)
                pipe.execute()
                if not is_same_redis:
                    _enqueue_finalize(queue, batch_id)
                return True
            except redis.WatchError:
                continue  # the batch changed meanwhile (another result landed): look again


def run_queued_jobs(r: redis.Redis) -> int:
    """Run every queued finalize job in this process, as workers.finalizer would (tests,
    benchmarks, the demo); how many there were."""
    queue = finalize_queue(r)
    num_jobs = queue.count
    if num_jobs:
        InProcessWorker([queue], connection=queue.connection, serializer=JSONSerializer).work(burst=True,
                                                                                             logging_level="WARNING")
    return num_jobs


def _enqueue_finalize(queue: Queue, batch_id: str, pipe: redis.client.Pipeline | None = None) -> None:
    queue.enqueue_call("jobs.finalize.finalize_batch", args=[batch_id], job_id=job_id(batch_id),
                       result_ttl=3600, failure_ttl=7 * 86400, pipeline=pipe)


def _connection() -> redis.Redis:
    """The data Redis: the job's own connection, unless the queue has a Redis of its own
    (a cluster fleet), then KVFLEET_REDIS_URL (workers.finalizer sets it from --redis-url)."""
    job = get_current_job()
    if job is not None and not os.environ.get("KVFLEET_QUEUE_URL"):
        return job.connection
    return connect()


def finalize_batch(batch_id: str, r: redis.Redis | None = None) -> dict:
    """Write the output and error files into the batch's storage and end its status.
    Outages raise (the job fails; the Sweeper enqueues it again); a permanent storage
    error ends the batch failed."""
    r = r or _connection()
    lock = r.lock(keys.finalize_lock(batch_id), timeout=FINALIZE_LOCK_SECONDS, blocking=False)
    if not lock.acquire():  # another finalizer runs it now (a job enqueued twice, or swept meanwhile)
        log.info("batch %s: another finalizer is finalizing it", batch_id)
        return batches.batch_object(r, batch_id)
    try:
        return _finalize_locked(r, batch_id)
    finally:
        with contextlib.suppress(LockError):  # it outlived its timeout: the files are written once anyway
            lock.release()


def _finalize_locked(r: redis.Redis, batch_id: str) -> dict:
    fields = batches.load_fields(r, batch_id)
    if fields["status"] in batches.TERMINAL:
        return batches.batch_object(r, batch_id)
    try:
        _write_files(r, batch_id, fields)
    except Exception as error:  # noqa: BLE001 (classified: outages go back to RQ)
        if not is_permanent_error(error):
            raise
        message = f"storage {fields['sink']}: {describe_error(error)}"
        log.error("batch %s: %s; the batch ends failed", batch_id, message)
        batches.fail(r, batch_id, "storage_error", message)
        return batches.batch_object(r, batch_id)
    status = fields["status"]
    if status == "finalizing":
        batches.transition(r, batch_id, "completed")
    elif status == "cancelling":
        batches.transition(r, batch_id, "cancelled")
    elif status == "in_progress" and time.time() > fields["expires_at"]:
        batches.transition(r, batch_id, "expired")
    queues.retire(r, fields["model"], batch_id)  # every entry is acknowledged: its streams go
    return batches.batch_object(r, batch_id)


def _write_files(r: redis.Redis, batch_id: str, fields: dict) -> None:
    if fields.get("output_file_id") or fields.get("error_file_id"):
        return  # written by an earlier run
    storage = open_storage(fields["sink"], r)
    sources = [store.iter_results(batch_id) for store in result_stores(fields["sink"], r)]
    # Spool to disk: a batch of a million results must not sit in memory.
    with tempfile.TemporaryFile() as outputs, tempfile.TemporaryFile() as errors:
        for source in sources:
            for raw in source:
                (errors if is_error_line(json.loads(raw)) else outputs).write(raw.rstrip(b"\n") + b"\n")
        file_ids = {}
        for name, kind, spool in (("output_file_id", "output", outputs), ("error_file_id", "errors", errors)):
            if spool.tell():
                spool.seek(0)
                created = create_file(r, storage, iter(lambda s=spool: s.read(CHUNK), b""),
                                      f"{batch_id}_{kind}.jsonl", "batch_output",
                                      tenant=fields.get("tenant") or DEFAULT_TENANT, batch_id=batch_id,
                                      expires_after=int(fields.get("output_expires_after") or 0) or None)
                file_ids[name] = created["id"]
    if file_ids:
        batches.set_files(r, batch_id, file_ids)


def job_status(r: redis.Redis, batch_id: str) -> JobStatus | None:
    try:
        return Job.fetch(job_id(batch_id), connection=queue_connection(r), serializer=JSONSerializer).get_status()
    except NoSuchJobError:
        return None
