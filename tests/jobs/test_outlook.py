"""jobs/outlook.py: a batch's ETA and at_risk, from its own pace or the fleet's rate."""

from __future__ import annotations

import time

import pytest

from jobs import batches, heartbeats, keys, outlook
from jobs.recording import record_result
from jobs.results import success_line
from jobs.storage import RedisStorage
from tests.services import run_finalize_jobs
from tests.workers.helpers import MODEL, completion, submit_lines


def batch_with(r, n: int, window: str = "2m", tenant: str = "acme", estimated_tokens: int = 1000,
               age_seconds: float = 0.0, num_done: int = 0) -> str:
    batch_id = submit_lines(r, [completion(f"c{i}", "x") for i in range(n)], completion_window=window, tenant=tenant)
    r.hset(keys.batch(batch_id), mapping={"estimated_tokens": estimated_tokens,
                                          "created_at": int(time.time() - age_seconds)})
    for i in range(num_done):
        record_result(r, RedisStorage(r), batch_id, success_line(f"c{i}", {}), partition=0)
    return batch_id


def worker_at(r, name: str, batch_tokens_per_s: float) -> None:
    heartbeats.record_heartbeat(r, name, {"models": [MODEL], "batch_tokens_per_s": batch_tokens_per_s}, 30)


def test_with_results_the_batch_s_own_pace_decides(r):
    on_time = batch_with(r, 10, age_seconds=10, num_done=5)  # 5 in 10 s: 5 more in 10 s
    late = batch_with(r, 100, age_seconds=10, num_done=1)  # 1 in 10 s: 99 more in ~990 s, past its 2 minutes
    now = time.time()
    assert batches.batch_object(r, on_time)["eta_at"] == pytest.approx(now + 10, abs=2)
    assert batches.batch_object(r, on_time)["at_risk"] is False
    flagged = batches.batch_object(r, late)
    assert flagged["eta_at"] == pytest.approx(now + 990, abs=100) and flagged["at_risk"] is True


def test_before_any_result_the_fleet_rate_and_the_tenant_s_share_decide(r):
    worker_at(r, "w1", 60.0)
    worker_at(r, "w2", 40.0)  # 100 tokens/s over the model's workers
    earlier = batch_with(r, 4, window="1m", estimated_tokens=2000)  # acme's, due before the next
    mine = batch_with(r, 4, window="2m", estimated_tokens=3000)
    batch_with(r, 4, window="1h", estimated_tokens=9000)  # acme's too, due after: not ahead of it
    batch_with(r, 4, window="1h", tenant="globex")  # a second tenant with work: acme gets half
    fields = batches.load_fields(r, mine)
    now = time.time()
    # (2000 + 3000 tokens ahead) / (100 tokens/s x 1/2) = 100 s: inside 2 minutes.
    assert outlook.eta(fields, outlook.FleetView(r, batches.load_many), now) == pytest.approx(now + 100)
    r.hset(keys.TENANT_WEIGHTS, mapping={"acme": "3"})  # acme's share 3/4: 5000 / 75 = 66.7 s
    assert outlook.eta(fields, outlook.FleetView(r, batches.load_many), now) == pytest.approx(now + 5000 / 75)
    r.hset(keys.TENANT_WEIGHTS, mapping={"acme": "0.25"})  # 1/5: 5000 / 20 = 250 s, past the deadline
    assert batches.batch_object(r, mine)["at_risk"] is True
    assert batches.batch_object(r, earlier)["at_risk"] is True  # 2000 / 20 = 100 s > 1 minute


def test_no_worker_and_no_result_means_no_eta_and_no_flag(r):
    batch_id = batch_with(r, 3)
    batch = batches.batch_object(r, batch_id)
    assert batch["eta_at"] is None and batch["at_risk"] is False


def test_an_ended_batch_has_neither(r):
    batch_id = batch_with(r, 1, age_seconds=5, num_done=1)  # its last result asked for finalize
    run_finalize_jobs(r)
    batch = batches.batch_object(r, batch_id)
    assert batch["status"] == "completed" and batch["eta_at"] is None and batch["at_risk"] is False
