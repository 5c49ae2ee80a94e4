"""Every batch ends, even one no worker ever touches: the sweep expires it past its window
(partial results, an error file of what did not run), brings a cancel to cancelled, and
fails a batch whose enqueue never finished."""

from __future__ import annotations

import json
import time

import pytest

from jobs import batches, heartbeats, keys
from jobs.recording import record_result
from jobs.results import Choice, Usage, completion_body, success_line
from jobs.storage import open_storage
from jobs.sweeper import Sweeper
from producers import ingest
from tests.services import run_finalize_jobs
from tests.workers.helpers import MODEL, completion, read_lines, submit_lines


def later(seconds: float):
    """A wall clock `seconds` ahead of now."""
    return lambda: time.time() + seconds


def finish_one_by_hand(r, batch_id: str, custom_id: str) -> None:
    """What a worker does for one request: read its entry, record its result, ack it."""
    stream = keys.batch_stream(MODEL, batch_id)
    for _, entries in r.xreadgroup(keys.CONSUMER_GROUP, "w1", {stream: ">"}, count=100):
        for entry_id, fields in entries:
            if fields[b"custom_id"].decode() == custom_id:
                body = completion_body(MODEL, [Choice("done", "stop")], Usage(2, 1))
                record_result(r, open_storage("redis", r), batch_id, success_line(custom_id, body), Usage(2, 1),
                              ack=(stream, keys.CONSUMER_GROUP, entry_id.decode()))


def test_a_batch_nobody_serves_expires_with_its_partial_results_and_an_error_file(r):
    batch_id = submit_lines(r, [completion(f"c{i}", f"p{i}") for i in range(5)], completion_window="2s")
    finish_one_by_hand(r, batch_id, "c2")
    sweeper = Sweeper(r, grace_seconds=30)
    assert sweeper.end_stopped_batches() == []  # inside its window: nothing to do
    time.sleep(2.1)
    assert sweeper.end_stopped_batches() == [batch_id]
    assert run_finalize_jobs(r) == 1
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "expired" and batch["request_counts"] == {"total": 5, "completed": 1, "failed": 4}
    assert [line["custom_id"] for line in read_lines(r, batch["output_file_id"])] == ["c2"]
    errors = read_lines(r, batch["error_file_id"])
    assert sorted(e["custom_id"] for e in errors) == ["c0", "c1", "c3", "c4"]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert not r.sismember(keys.OPEN_BATCHES, batch_id)


def test_a_cancel_reaches_cancelled_without_any_worker(r):
    batch_id = submit_lines(r, [completion(f"c{i}", f"p{i}") for i in range(3)])
    batches.transition(r, batch_id, "cancelling")
    Sweeper(r, grace_seconds=30).sweep()
    run_finalize_jobs(r)
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "cancelled" and batch["request_counts"]["failed"] == 3
    assert {e["error"]["code"] for e in read_lines(r, batch["error_file_id"])} == {"batch_cancelled"}


def test_workers_serving_the_model_get_the_grace_period_first(r):
    heartbeats.record_heartbeat(r, "w1", {"models": [MODEL], "root": MODEL, "max_model_len": 64}, 30)
    batch_id = submit_lines(r, [completion("c0", "p")])
    batches.transition(r, batch_id, "cancelling")
    now = [1e10]
    sweeper = Sweeper(r, grace_seconds=30, wall_clock=lambda: now[0])
    assert sweeper.end_stopped_batches() == []
    now[0] += 31
    assert sweeper.end_stopped_batches() == [batch_id]


def test_a_deadline_is_enforced_at_once_even_while_workers_serve_the_model(r):
    """A saturated fleet never pulls the lines: the sweep ends the batch at its deadline, not
    a grace period later, keeps what finished, and retires its queue."""
    heartbeats.record_heartbeat(r, "w1", {"models": [MODEL], "root": MODEL, "max_model_len": 64}, 30)
    batch_id = submit_lines(r, [completion(f"c{i}", f"p{i}") for i in range(4)], completion_window="2m")
    finish_one_by_hand(r, batch_id, "c1")
    sweeper = Sweeper(r, grace_seconds=30)
    assert sweeper.end_stopped_batches() == []
    # The window runs out now (moved, rather than waited for).
    r.hset(keys.batch(batch_id), "expires_at", int(time.time()) - 1)
    assert sweeper.end_stopped_batches() == [batch_id]
    assert run_finalize_jobs(r) == 1
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "expired" and batch["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    assert [line["custom_id"] for line in read_lines(r, batch["output_file_id"])] == ["c1"]
    assert {e["error"]["code"] for e in read_lines(r, batch["error_file_id"])} == {"batch_expired"}
    assert not r.exists(keys.batch_stream(MODEL, batch_id)) and r.zcard(keys.queues(MODEL)) == 0


def test_a_batch_whose_enqueue_never_finished_fails_after_the_grace_period(r, monkeypatch):
    monkeypatch.setattr(ingest, "CHUNK_LINES", 2)
    monkeypatch.setattr(keys, "PARTITION_LINES", 2)
    lines = [json.dumps(completion(f"c{i}", f"p{i}")).encode() for i in range(6)]

    def crash(_count):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ingest.submit(r, lambda: lines, model=MODEL, batch_id="batch_halfway", on_progress=crash)
    done = submit_lines(r, [completion("c0", "p")])
    sweeper = Sweeper(r, grace_seconds=30, enqueue_grace_seconds=600)
    assert sweeper.end_stopped_batches() == []
    sweeper.wall_clock = later(601)
    assert sweeper.end_stopped_batches() == ["batch_halfway"]  # not the batch that enqueued completely
    batch = batches.batch_object(r, "batch_halfway")
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "enqueue_incomplete"
    assert batches.batch_object(r, done)["status"] == "in_progress"


def test_an_expired_batch_of_thousands_of_lines_is_settled_a_page_a_round_trip(redis_server, r):
    """The sweep settled a stopped batch's lines one record_result at a time (three round trips
    each: 2,970 took ~5 s, so a 100,000-line batch ended minutes past its deadline). Now a
    page of 1,000 a few round trips, whatever the host's speed."""
    import redis  # noqa: PLC0415

    from jobs.connection import connect  # noqa: PLC0415
    from jobs.sweeper import end_batch  # noqa: PLC0415

    round_trips = []

    class Counting(redis.Connection):
        def send_packed_command(self, command, check_health=True):
            round_trips.append(1)
            return super().send_packed_command(command, check_health)

    lines = [json.dumps({"custom_id": f"c{i}", "prompt": "p", "max_tokens": 2}).encode() for i in range(2500)]
    batch_id = ingest.submit(r, lambda: lines, model=MODEL, completion_window="2s").batch_id
    counted = connect(redis_server.url, connection_class=Counting)
    fields = batches.load_fields(counted, batch_id)
    round_trips.clear()
    assert end_batch(counted, fields, *batches.EXPIRED_REQUEST) == 2500
    assert len(round_trips) < 100, len(round_trips)  # ~7,500 one at a time
    assert batches.num_counted(r, batch_id) == 2500
    assert r.hlen(keys.batch_results(batch_id)) == 2500
