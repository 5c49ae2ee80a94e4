"""Results in all three storages: recorded once however often they are written,
and finalized into output/error files exactly once, by an RQ worker with the JSON
serializer."""

from __future__ import annotations

import json

import pytest

from jobs import batches, keys
from jobs.files import read_file
from jobs.finalize import finalize_queue, request_finalize
from jobs.recording import record_result
from jobs.results import Choice, Usage, completion_body, error_line, success_line
from jobs.storage import open_storage
from tests.services import run_finalize_jobs


@pytest.fixture(params=["redis", "s3", "file"])
def sink(request, tmp_path):
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/results"
    if request.param == "file":
        return f"file://{tmp_path}/results"
    return "redis"


def make_batch(r, sink, total) -> str:
    batch_id = batches.new_batch_id()
    batches.create_batch(r, batch_id, endpoint="/v1/completions", model="m", input_file_id=None,
                         completion_window="24h", sink=sink)
    r.hset(keys.batch(batch_id), "total", total)
    batches.transition(r, batch_id, "in_progress")
    return batch_id


def test_recording_twice_counts_once_and_finalize_runs_once(r, sink):
    batch_id = make_batch(r, sink, total=3)
    storage = open_storage(sink, r)
    usage = Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=1)
    body = completion_body("m", [Choice("hi", "stop")], usage)
    first = record_result(r, storage, batch_id, success_line("a", body), usage)
    again = record_result(r, storage, batch_id, success_line("a", body), usage)  # a redelivery
    assert first.is_new and not again.is_new
    counts = batches.batch_object(r, batch_id)["request_counts"]
    assert (counts["completed"], counts["failed"]) == (1, 0)
    record_result(r, storage, batch_id, error_line("b", "invalid_request", "line 2: prompt: too long"))
    assert finalize_queue(r).count == 0
    last = record_result(r, storage, batch_id, success_line("c", body), usage)
    assert last.is_batch_done
    record_result(r, storage, batch_id, success_line("c", body), usage)  # redelivered after completion
    assert not request_finalize(r, batch_id)
    assert run_finalize_jobs(r) == 1
    assert run_finalize_jobs(r) == 0
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert batch["usage"]["input_tokens"] == 10 and batch["usage"]["output_tokens"] == 4
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == 2
    outputs = [json.loads(x) for x in b"".join(read_file(r, batch["output_file_id"])).splitlines()]
    errors = [json.loads(x) for x in b"".join(read_file(r, batch["error_file_id"])).splitlines()]
    assert sorted(o["custom_id"] for o in outputs) == ["a", "c"]
    assert [e["custom_id"] for e in errors] == ["b"]
    assert errors[0]["error"] == {"code": "invalid_request", "message": "line 2: prompt: too long"}
    assert outputs[0]["response"]["body"]["object"] == "text_completion"


def test_record_acks_the_stream_entry_in_the_same_script(r):
    batch_id = make_batch(r, "redis", total=1)
    stream = keys.batch_stream("m", batch_id)
    r.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    r.xadd(stream, {"batch_id": batch_id, "custom_id": "a"})
    entry_id = r.xreadgroup(keys.CONSUMER_GROUP, "w1", {stream: ">"}, count=1)[0][1][0][0]
    assert r.xpending(stream, keys.CONSUMER_GROUP)["pending"] == 1
    record_result(r, open_storage("redis", r), batch_id, success_line("a", {}),
                  ack=(stream, keys.CONSUMER_GROUP, entry_id))
    assert r.xpending(stream, keys.CONSUMER_GROUP)["pending"] == 0


def test_cancelled_batch_keeps_partial_results(r):
    batch_id = make_batch(r, "redis", total=2)
    storage = open_storage("redis", r)
    record_result(r, storage, batch_id, success_line("a", {}))
    batches.transition(r, batch_id, "cancelling")
    record_result(r, storage, batch_id, error_line("b", "batch_cancelled", "cancelled before it ran"))
    assert run_finalize_jobs(r) == 1
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "cancelled" and batch["output_file_id"] and batch["error_file_id"]


def test_a_finalize_request_that_dies_half_way_leaves_nothing_behind(r, monkeypatch):
    import jobs.finalize as finalize

    batch_id = make_batch(r, "redis", total=1)
    original = finalize.Queue.enqueue_call

    def killed(*args, **kwargs):
        raise ConnectionError("the worker died while enqueueing")

    monkeypatch.setattr(finalize.Queue, "enqueue_call", killed)
    with pytest.raises(ConnectionError):
        request_finalize(r, batch_id)
    assert not r.hexists(keys.batch(batch_id), "finalize_requested")  # no flag without its job
    assert batches.batch_object(r, batch_id)["status"] == "in_progress"
    monkeypatch.setattr(finalize.Queue, "enqueue_call", original)
    assert request_finalize(r, batch_id)
    assert run_finalize_jobs(r) == 1
    assert batches.batch_object(r, batch_id)["status"] == "completed"
