"""Writes that redis-py sends again after a timeout (jobs/connection.py retries them) are safe
to repeat: here the reply of each write is lost once, after Redis ran it, and the retry runs
it a second time, as on a real network that drops a reply."""

from __future__ import annotations

import redis

from jobs import keys
from jobs.connection import connect
from jobs.files import create_file, read_file
from jobs.storage import RedisStorage


class LosesEachWriteReplyOnce(redis.Connection):
    """A connection whose first reply to a write command is lost after the server ran it."""

    lost: set[tuple] = set()
    writes = {"SETRANGE", "APPEND", "SET", "HSET", "EVAL", "EVALSHA", "XADD", "ZADD", "SADD"}

    def send_command(self, *args, **kwargs):
        self.last = args
        return super().send_command(*args, **kwargs)

    def read_response(self, *args, **kwargs):
        response = super().read_response(*args, **kwargs)
        command = str(self.last[0]).upper() if self.last else ""
        if command in self.writes and self.last not in self.lost:
            self.lost.add(self.last)
            raise redis.TimeoutError("the reply was lost (after the write ran)")
        return response


def test_a_file_written_through_lost_replies_is_byte_for_byte_the_upload(redis_server, r):
    LosesEachWriteReplyOnce.lost = set()
    flaky = connect(redis_server.url, connection_class=LosesEachWriteReplyOnce)
    chunks = [bytes([65 + i]) * 1000 + b"\n" for i in range(5)]  # five chunks, each written twice
    created = create_file(flaky, RedisStorage(flaky), iter(chunks), "results.jsonl", "batch_output")
    assert len(LosesEachWriteReplyOnce.lost) >= 5  # every chunk's write was sent twice
    content = b"".join(read_file(r, created["id"]))
    assert content == b"".join(chunks)
    assert created["bytes"] == len(content) == r.strlen(keys.file_content(created["id"]))


def test_a_batch_submitted_recorded_and_finalized_through_lost_replies_counts_each_line_once(redis_server, r):
    import json  # noqa: PLC0415

    from jobs import batches  # noqa: PLC0415
    from jobs.recording import record_result  # noqa: PLC0415
    from jobs.results import Usage, success_line  # noqa: PLC0415
    from producers.ingest import submit  # noqa: PLC0415
    from tests.services import run_finalize_jobs  # noqa: PLC0415

    LosesEachWriteReplyOnce.lost = set()
    flaky = connect(redis_server.url, connection_class=LosesEachWriteReplyOnce)
    lines = [json.dumps({"custom_id": f"c{i}", "prompt": f"p{i}", "max_tokens": 2}).encode() for i in range(7)]
    submission = submit(flaky, lambda: lines, model="demo")
    assert submission.accepted and submission.num_enqueued == 7
    stream = keys.batch_stream("demo", submission.batch_id)
    assert r.xlen(stream) == 7
    storage = RedisStorage(flaky)
    for _, entries in r.xreadgroup(keys.CONSUMER_GROUP, "w1", {stream: ">"}, count=100):
        for entry_id, fields in entries:
            custom_id = json.loads(fields[b"line"])["custom_id"]
            line = success_line(custom_id, {"choices": [{"text": custom_id}]})
            recorded = record_result(flaky, storage, submission.batch_id, line,
                                     Usage(prompt_tokens=3, completion_tokens=2),
                                     ack=(stream, keys.CONSUMER_GROUP, entry_id.decode()), owner="w1")
            assert recorded.is_owner  # its own write sent again is not another worker's
    assert run_finalize_jobs(r) == 1  # enqueued once, by the last result counted
    batch = batches.batch_object(r, submission.batch_id)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 7, "completed": 7, "failed": 0}
    assert batch["usage"]["input_tokens"] == 21
    output = b"".join(read_file(r, batch["output_file_id"])).splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == [f"c{i}" for i in range(7)]
