"""A real worker choosing whose batch work runs next: tenant shares, then deadlines
(workers/fair_share.py over jobs/queues.py), where one stream would have run them in order."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import EngineConfig, LLMEngine
from jobs import keys, queues
from tests.workers.helpers import MODEL, completion, make_worker, run_until, submit_lines


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
