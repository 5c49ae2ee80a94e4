"""A real worker choosing whose batch work runs next: tenant shares, then deadlines
(workers/fair_share.py over jobs/queues.py), where one stream would have run them in order."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from engine import EngineConfig, LLMEngine
from jobs import batches, keys, queues
from jobs.sweeper import Sweeper
from tests.services import run_finalize_jobs
from tests.workers.helpers import MODEL, completion, make_worker, read_lines, run_until, submit_lines


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64, max_num_seqs=4))


def lines(prefix: str, n: int) -> list[dict]:
    return [completion(f"{prefix}{i}", f"{prefix} request number {i}", max_tokens=4) for i in range(n)]


def record_starts(worker, monkeypatch) -> list[str]:
    """The batch id of each request the worker starts, in order."""
    started: list[str] = []
    start = worker.batch_lane.start

    def recording(work):
        started.append(work.batch_id)
        start(work)

    monkeypatch.setattr(worker.batch_lane, "start", recording)
    return started


def test_a_small_tenant_is_not_stuck_behind_a_big_one(engine, r, monkeypatch):
    worker = make_worker(engine, r)
    started = record_starts(worker, monkeypatch)
    big = submit_lines(r, lines("big", 48), tenant="acme")
    small = submit_lines(r, lines("small", 6), tenant="globex")
    done = run_until(worker, r, [small])
    assert done[small]["status"] == "completed"
    # Turns alternate, acme a turn ahead at most: in one stream, small would wait for all 48.
    assert Counter(started[:12])[small] >= 5, started[:12]
    assert Counter(started)[big] <= 8
    run_until(worker, r, [big])


def test_weights_three_to_one_split_the_work_three_to_one(engine, r, monkeypatch):
    r.hset(keys.TENANT_WEIGHTS, mapping={"acme": "3", "globex": "1"})
    worker = make_worker(engine, r)
    started = record_starts(worker, monkeypatch)
    heavy = submit_lines(r, lines("h", 60), tenant="acme")
    light = submit_lines(r, lines("l", 60), tenant="globex")
    run_until(worker, r, [heavy, light])
    first = Counter(started[:40])  # both backlogged all along; their lines cost the same
    assert abs(first[heavy] - 30) <= 2 and first[heavy] + first[light] == 40, first


def test_a_tight_window_runs_before_a_loose_one_of_the_same_tenant(engine, r, monkeypatch):
    worker = make_worker(engine, r)
    started = record_starts(worker, monkeypatch)
    backlog = submit_lines(r, lines("day", 30), tenant="acme", completion_window="24h")
    urgent = submit_lines(r, lines("now", 6), tenant="acme", completion_window="2m")
    assert [q.batch_id for q in queues.registered(r, [MODEL])] == [urgent, backlog]  # by deadline
    run_until(worker, r, [urgent, backlog])
    assert started[:6] == [urgent] * 6 and Counter(started) == {backlog: 30, urgent: 6}
    assert r.zcard(keys.queues(MODEL)) == 0  # both ended: their queues retired


def test_deadlines_a_tight_window_finishes_in_time_and_an_impossible_one_is_flagged_then_expired(engine, r):
    """Behind a backlog that keeps the worker full: a 20-second batch finishes inside its window
    (earliest deadline first), and a batch that cannot finish in 8 seconds is flagged at_risk
    early, then ends expired at its deadline, with its
    finished results in its output file."""
    worker, sweeper = make_worker(engine, r), Sweeper(r, grace_seconds=30)
    backlog = submit_lines(r, [completion(f"day{i}", f"backlog request {i}", max_tokens=48) for i in range(400)])
    for _ in range(5):
        worker.run_once()  # the backlog fills the worker first
    urgent = submit_lines(r, lines("now", 6), completion_window="20s")
    doomed = submit_lines(r, [completion(f"x{i}", f"doomed request {i}", max_tokens=64) for i in range(600)],
                          completion_window="8s")
    deadlines = {b: batches.load_fields(r, b)["expires_at"] for b in (urgent, doomed)}
    flagged_at = None
    while True:
        worker.run_once()
        sweeper.sweep()
        run_finalize_jobs(r)
        objects = {b: batches.batch_object(r, b) for b in (urgent, doomed)}
        if flagged_at is None and objects[doomed]["at_risk"]:
            flagged_at = time.time()
        if all(o["status"] in batches.TERMINAL for o in objects.values()):
            break
        assert time.time() < deadlines[urgent] + 30, objects
    assert objects[urgent]["status"] == "completed" and objects[urgent]["completed_at"] <= deadlines[urgent]
    assert flagged_at is not None and flagged_at < deadlines[doomed] - 4  # early, not at the deadline
    done = objects[doomed]
    assert done["status"] == "expired" and deadlines[doomed] <= done["expired_at"] <= deadlines[doomed] + 10
    counts = done["request_counts"]
    assert 0 < counts["completed"] < 600 and counts["completed"] + counts["failed"] == 600
    assert len(read_lines(r, done["output_file_id"])) == counts["completed"]
    assert {line["error"]["code"] for line in read_lines(r, done["error_file_id"])} == {"batch_expired"}
    assert batches.batch_object(r, backlog)["status"] == "in_progress"  # the backlog runs on
    batches.transition(r, backlog, "cancelling")
    run_until(worker, r, [backlog])  # the engine is the next test's: leave it idle
