"""A batch always ends: finalize is retried on outages, swept when its job is lost,
and a permanent storage error ends the batch failed with a reason."""

from __future__ import annotations

import json

import boto3
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from jobs import batches, keys
from jobs.finalize import job_id
from jobs.recording import record_result
from jobs.results import Choice, Usage, completion_body, error_line, success_line
from jobs.storage import RedisStorage, open_storage
from jobs.sweeper import Sweeper, counted_but_open
from tests.jobs.test_results import make_batch
from tests.services import S3Server, run_finalize_jobs
from tests.workers.helpers import read_lines


def record_all(r, batch_id: str, sink: str, n: int) -> None:
    storage = open_storage(sink, r)
    for i in range(n):
        body = completion_body("m", [Choice(f"text {i}", "stop")], Usage(3, 2))
        record_result(r, storage, batch_id, success_line(f"c{i}", body), Usage(3, 2))


def finalize_job(r, batch_id: str) -> Job:
    return Job.fetch(job_id(batch_id), connection=r, serializer=JSONSerializer)


def test_an_outage_at_finalize_is_retried_with_back_off_and_a_lost_job_is_swept(r, s3_server, s3_bucket):
    sink = f"s3://{s3_bucket}/out"
    batch_id = make_batch(r, sink, 4)
    record_all(r, batch_id, sink, 4)  # the last one enqueues finalize
    now = [0.0]  # the sweeper's clock, moved by hand
    sweeper = Sweeper(r, grace_seconds=3600, clock=lambda: now[0])
    assert sweeper.sweep() == []  # its job is queued: nothing to do
    s3_server.stop()
    try:
        assert run_finalize_jobs(r) == 1  # S3 is unreachable: the job fails
        assert finalize_job(r, batch_id).get_status() == JobStatus.FAILED
        assert batches.batch_object(r, batch_id)["status"] == "finalizing"
        assert sweeper.sweep() == []  # first seen failed: retried after 1 s, not at once
        now[0] += 1.0
        assert sweeper.sweep() == [batch_id]
        assert run_finalize_jobs(r) == 1  # still down: fails again
        now[0] += 1.5
        assert sweeper.sweep() == []  # the back-off doubled: 2 s now
        now[0] += 0.5
        assert sweeper.sweep() == [batch_id]
    finally:
        restarted = S3Server(port=s3_server.port).start()
        s3_server.server = restarted.server
    finalize_job(r, batch_id).delete()  # and now the job is lost (e.g. with a Redis that lost it)
    lost = Sweeper(r, grace_seconds=30, clock=lambda: now[0])
    assert lost.sweep() == []  # within the grace period: left alone
    assert counted_but_open(r) == [batch_id]
    now[0] += 30
    assert lost.sweep() == [batch_id]
    assert lost.sweep() == []  # its job is queued now: not twice
    assert run_finalize_jobs(r) == 1
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 4
    assert sorted(line["custom_id"] for line in read_lines(r, batch["output_file_id"])) == [f"c{i}" for i in range(4)]
    assert counted_but_open(r) == [] and not r.sismember(keys.OPEN_BATCHES, batch_id)
    assert lost.sweep() == []


def test_sweep_finalizes_a_counted_batch_that_never_asked(r):
    batch_id = make_batch(r, "redis", 2)
    storage = open_storage("redis", r)
    for i in range(2):  # counted as a worker would, but as if it died before request_finalize
        storage.put_result(batch_id, f"c{i}", json.dumps(error_line(f"c{i}", "x", "y")).encode())
    r.hset(keys.partition_counts(batch_id, 0), "failed", 2)
    assert batches.batch_object(r, batch_id)["status"] == "in_progress"
    assert Sweeper(r, grace_seconds=0).sweep() == [batch_id]
    run_finalize_jobs(r)
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "completed" and len(read_lines(r, batch["error_file_id"])) == 2


def test_a_permanent_storage_error_at_finalize_ends_the_batch_failed(r, s3_server, s3_bucket):
    sink = f"s3://{s3_bucket}/out"
    batch_id = make_batch(r, sink, 2)
    record_all(r, batch_id, sink, 2)
    s3 = boto3.client("s3", endpoint_url=s3_server.url)
    for item in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]:
        s3.delete_object(Bucket=s3_bucket, Key=item["Key"])
    s3.delete_bucket(Bucket=s3_bucket)
    run_finalize_jobs(r)
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    error = batch["errors"]["data"][0]
    assert error["code"] == "storage_error" and sink in error["message"] and "NoSuchBucket" in error["message"]
    assert finalize_job(r, batch_id).get_status() == JobStatus.FINISHED  # ended, not left to retry


def test_error_lines_kept_in_redis_for_a_broken_sink_reach_the_error_file(r, tmp_path):
    sink = f"file://{tmp_path}/out"
    batch_id = make_batch(r, sink, 3)
    record_all(r, batch_id, sink, 2)
    record_result(r, RedisStorage(r), batch_id, error_line("c2", "storage_error", "the sink was down"))
    run_finalize_jobs(r)
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert [line["error"]["code"] for line in read_lines(r, batch["error_file_id"])] == ["storage_error"]
    assert len(read_lines(r, batch["output_file_id"])) == 2


def test_two_finalizers_never_run_one_batch_s_finalize_at_once(r, monkeypatch):
    import threading
    import time

    from jobs import finalize

    batch_id = make_batch(r, "redis", 2)
    record_all(r, batch_id, "redis", 2)
    writes, original = [], finalize._write_files

    def slow_write(*args):
        writes.append(threading.current_thread().name)
        time.sleep(0.5)
        original(*args)

    monkeypatch.setattr(finalize, "_write_files", slow_write)
    results = []
    finalizers = [threading.Thread(target=lambda: results.append(finalize.finalize_batch(batch_id, r)), name=name)
                  for name in ("first", "second")]
    for thread in finalizers:
        thread.start()
    for thread in finalizers:
        thread.join(timeout=30)
    assert len(writes) == 1  # the other found the lock and left
    assert batches.batch_object(r, batch_id)["status"] == "completed"
    assert not r.exists(keys.finalize_lock(batch_id))
