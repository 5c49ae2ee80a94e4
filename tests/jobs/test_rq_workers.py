"""The finalize workers' command channel (jobs/rq_workers.py): stopping one never waits out
RQ's 60 s pub/sub read."""

from __future__ import annotations

import time

from rq.serializers import JSONSerializer

from jobs import batches, finalize
from jobs.rq_workers import COMMAND_READ_SECONDS, FinalizeWorker, InProcessWorker
from tests.jobs.test_finalize import record_all
from tests.jobs.test_results import make_batch


def test_a_stopping_finalize_worker_waits_at_most_one_read(r):
    worker = FinalizeWorker([finalize.finalize_queue(r)], connection=r, serializer=JSONSerializer)
    worker.subscribe()
    worker.pubsub.unsubscribe()
    time.sleep(0.5)  # the thread reads the unsubscribe reply before it is told to stop: the slow case
    started = time.monotonic()
    worker.unsubscribe()  # what RQ's teardown calls
    assert time.monotonic() - started < 5 * COMMAND_READ_SECONDS  # RQ's own reads would wait ~60 s
    assert not worker.pubsub_thread.is_alive()


def test_an_in_process_burst_runs_its_jobs_without_a_command_thread(r):
    batch_id = make_batch(r, "redis", total=2)
    record_all(r, batch_id, "redis", 2)  # the last result enqueues the finalize job
    worker = InProcessWorker([finalize.finalize_queue(r)], connection=r, serializer=JSONSerializer)
    worker.work(burst=True, logging_level="WARNING")
    assert worker.pubsub_thread is None and batches.batch_object(r, batch_id)["status"] == "completed"
