"""Assemble a finished batch's output.jsonl and errors.jsonl, exactly once.

`request_finalize` is called by whoever records the batch's last result; an
atomic flag on the batch lets only the first caller enqueue the RQ job
(JSON serializer, never pickle). An RQ worker runs `finalize_batch`:

    rq worker --serializer rq.serializers.JSONSerializer kvfleet-finalize
    python -m workers.finalizer            # the same, with kvfleet's defaults
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import redis
from rq import Queue, get_current_job
from rq.serializers import JSONSerializer

from jobs import batches, keys
from jobs.files import create_file
from jobs.results import is_error_line
from jobs.storage import CHUNK, open_storage


def finalize_queue(r: redis.Redis) -> Queue:
    return Queue(keys.FINALIZE_QUEUE, connection=r, serializer=JSONSerializer)


def request_finalize(r: redis.Redis, batch_id: str) -> bool:
    """Enqueue finalize_batch for this batch if nobody has; True if this call did.

    NOTE: the flag, the status change and the RQ job commit in one MULTI (under WATCH),
    so a worker killed half-way cannot leave a batch flagged but never finalized.
    """
    key = keys.batch(batch_id)
    queue = finalize_queue(r)
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                if pipe.hexists(key, "finalize_requested"):
                    return False
                is_expired = time.time() > int(pipe.hget(key, "expires_at") or 0)
                pipe.multi()
                pipe.hset(key, "finalize_requested", 1)
                # A batch past its window goes from in_progress to expired in finalize_batch;
                # from cancelling the transition is refused and finalize ends it cancelled.
                if not is_expired:
                    batches.queue_transition(pipe, batch_id, "finalizing")
                queue.enqueue_call("jobs.finalize.finalize_batch", args=[batch_id], job_id=f"finalize-{batch_id}",
                                   result_ttl=3600, pipeline=pipe)
                pipe.execute()
                return True
            except redis.WatchError:
                continue  # the batch changed meanwhile (another result landed): look again


def _connection() -> redis.Redis:
    job = get_current_job()
    if job is not None:
        return job.connection
    return redis.Redis.from_url(os.environ.get("KVFLEET_REDIS_URL", "redis://localhost:6379/0"))


def finalize_batch(batch_id: str, r: redis.Redis | None = None) -> dict:
    """Write the output and error files into the batch's storage and end its status."""
    r = r or _connection()
    fields = batches.load_fields(r, batch_id)
    storage = open_storage(fields["sink"], r)
    if not fields.get("output_file_id") and not fields.get("error_file_id"):
        # Spool to disk: a batch of a million results must not sit in memory.
        with tempfile.TemporaryFile() as outputs, tempfile.TemporaryFile() as errors:
            for raw in storage.iter_results(batch_id):
                (errors if is_error_line(json.loads(raw)) else outputs).write(raw.rstrip(b"\n") + b"\n")
            file_ids = {}
            for name, kind, spool in (("output_file_id", "output", outputs), ("error_file_id", "errors", errors)):
                if spool.tell():
                    spool.seek(0)
                    created = create_file(r, storage, iter(lambda s=spool: s.read(CHUNK), b""),
                                          f"{batch_id}_{kind}.jsonl", "batch_output")
                    file_ids[name] = created["id"]
        if file_ids:
            r.hset(keys.batch(batch_id), mapping=file_ids)
    status = fields["status"]
    if status == "finalizing":
        batches.transition(r, batch_id, "completed")
    elif status == "cancelling":
        batches.transition(r, batch_id, "cancelled")
    elif status == "in_progress" and time.time() > fields["expires_at"]:
        batches.transition(r, batch_id, "expired")
    return batches.batch_object(r, batch_id)
