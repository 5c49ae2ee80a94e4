"""Leases that cannot be lost silently: renewed from a thread, never taken back from a worker
that took the entry over, and a result never counted by a worker that lost its entry."""

from __future__ import annotations

import json
import time

import pytest

from engine import EngineConfig, LLMEngine
from jobs import batches, keys
from jobs.recording import record_result
from jobs.results import Choice, Usage, completion_body, success_line
from jobs.storage import open_storage
from tests.workers.helpers import MODEL, completion, make_worker, submit_lines
from workers.leases import renew

GROUP = keys.CONSUMER_GROUP


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64, max_num_seqs=8))


def owners(r, stream: str) -> dict[str, str]:
    return {p["message_id"].decode(): p["consumer"].decode() for p in r.xpending_range(stream, GROUP, "-", "+", 100)}


def test_renewal_resets_the_idle_time_of_owned_entries_and_reports_stolen_ones(r):
    stream = keys.batch_stream(MODEL, submit_lines(r, [completion(f"c{i}", f"p {i}") for i in range(3)]))
    ids = [entry_id.decode() for _, entries in r.xreadgroup(GROUP, "w1", {stream: ">"}) for entry_id, _ in entries]
    time.sleep(0.3)
    r.xclaim(stream, GROUP, "thief", min_idle_time=0, message_ids=[ids[1]])  # taken over
    r.xack(stream, GROUP, ids[2])  # finished by someone else
    lost = renew(r, "w1", [(stream, entry_id) for entry_id in ids])
    assert lost == {(stream, ids[1]), (stream, ids[2])}
    assert owners(r, stream) == {ids[0]: "w1", ids[1]: "thief"}  # the thief keeps it: never taken back
    idle = {p["message_id"].decode(): p["time_since_delivered"] for p in r.xpending_range(stream, GROUP, "-", "+", 10)}
    assert idle[ids[0]] < 250  # renewed
    assert r.xpending_range(stream, GROUP, ids[0], ids[0], 1)[0]["times_delivered"] == 1  # JUSTID counts none


def test_a_running_request_taken_over_is_aborted_and_its_result_never_written(engine, r):
    batch_id = submit_lines(r, [completion("slow", "a long one", max_tokens=60)])
    stream = keys.batch_stream(MODEL, batch_id)
    worker = make_worker(engine, r, lease_seconds=30)  # the thief's entry never looks stale to it
    worker.run_once()
    assert worker.num_in_flight == 1 and engine.has_unfinished()
    [entry_id] = owners(r, stream)
    r.xclaim(stream, GROUP, "thief", min_idle_time=0, message_ids=[entry_id])
    worker.leases.renew_now()
    worker.run_once()  # aborts it first thing
    assert worker.num_in_flight == 0 and not engine.has_unfinished()
    for _ in range(20):
        worker.run_once()
    assert batches.num_counted(r, batch_id) == 0 and not r.exists(keys.batch_results(batch_id))
    assert owners(r, stream) == {entry_id: "thief"}
    worker.leases.stop()


def test_the_line_counted_is_the_line_stored_when_two_attempts_race(r, tmp_path):
    batch_id = submit_lines(r, [completion("c0", "p")])
    stream = keys.batch_stream(MODEL, batch_id)
    [(_, [(entry_id, _)])] = r.xreadgroup(GROUP, "slow", {stream: ">"})
    r.xclaim(stream, GROUP, "fast", min_idle_time=0, message_ids=[entry_id])  # the lease lapsed
    storage = open_storage(f"file://{tmp_path}/out", r)
    ack = (stream, GROUP, entry_id.decode())

    def line(text: str, usage: Usage) -> dict:
        return success_line("c0", completion_body(MODEL, [Choice(text, "length")], usage))

    slow_usage, fast_usage = Usage(3, 7), Usage(3, 9)
    refused = record_result(r, storage, batch_id, line("slow", slow_usage), slow_usage, ack=ack, owner="slow")
    assert not refused.is_owner and batches.num_counted(r, batch_id) == 0  # it stored first, counted nothing
    recorded = record_result(r, storage, batch_id, line("fast", fast_usage), fast_usage, ack=ack, owner="fast")
    assert recorded.is_owner and recorded.is_new
    stored = json.loads(storage.get_result(batch_id, "c0"))
    assert stored["response"]["body"]["choices"][0]["text"] == "slow"  # the first write won ...
    assert batches.load_fields(r, batch_id)["completion_tokens"] == 7  # ... and its usage is what counts
    assert r.xpending(stream, GROUP)["pending"] == 0
