"""Chaos with real processes, each scenario ending in the history checker: kill -9 of
workers at random moments, Redis killed and restarted, S3 unreachable for longer than
the lease, and a permanently broken sink beside a healthy one."""

from __future__ import annotations

import random
import time

from jobs import batches, keys
from tests.chaos.conftest import at_progress, counted, wait_for
from tests.chaos.history import check_history
from tests.e2e.fleet import wait_terminal
from tests.workers.helpers import MODEL, completion, submit_lines

WORDS = "the fleet wakes before the city does and each machine waits for work".split()


def requests(n: int, seed: int, max_tokens: tuple[int, int] = (8, 48)) -> list[dict]:
    rng = random.Random(seed)
    return [completion(f"c{i}", " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))),
                       rng.randint(*max_tokens), ignore_eos=True) for i in range(n)]


def successes(fleet, names) -> float:
    """Requests the workers' engines finished, by their own counters."""
    return sum(fleet.metric(name, "kvfleet:request_success_total") for name in names)


def test_kill_9_at_ten_random_moments_loses_and_doubles_nothing(fleet, r):
    rng = random.Random(20261130)
    fleet.start_finalizer("--sweep-seconds", "1", "--grace-seconds", "3")
    names = ["w0", "w1", "w2"]
    for name in names:
        fleet.start_worker(name, lease_seconds=2, max_num_seqs=8, extra=("--max-deliveries", "50"))
    fleet.wait_ready(*names)
    records = requests(100, seed=1, max_tokens=(60, 200))
    batch_id = submit_lines(r, records)
    # Ten random moments by progress, one in each sixteenth of the batch from the second to the
    # eleventh: however fast the host, each lands while the batch runs, with a third still to go.
    moments = [rng.uniform((k + 0.1) / 16, (k + 0.9) / 16) for k in range(1, 11)]
    kills = 0
    for _ in at_progress(r, batch_id, moments, fleet):
        assert batches.batch_object(r, batch_id)["status"] == "in_progress"
        index = rng.randrange(len(names))
        fleet.processes[names[index]].kill()
        fleet.processes[names[index]].wait(timeout=10)
        names[index] = f"w{index}.{kills}"  # a restarted pod: a new consumer name
        fleet.start_worker(names[index], lease_seconds=2, max_num_seqs=8, extra=("--max-deliveries", "50"))
        kills += 1
    assert kills == 10
    wait_terminal(r, [batch_id], timeout=240, fleet=fleet)
    check_history(r, {batch_id: {record["custom_id"] for record in records}})


def test_redis_kill_9_mid_batch_and_before_finalize(fleet, r, chaos_redis):
    for name in ("w0", "w1"):
        fleet.start_worker(name, lease_seconds=3, max_num_seqs=8)
    fleet.wait_ready("w0", "w1")
    records = requests(120, seed=2)
    batch_id = submit_lines(r, records)
    wait_for(lambda: counted(r, batch_id) >= 30, 120, "30 results", fleet)
    chaos_redis.kill()  # kill -9, mid-batch
    time.sleep(1.5)
    chaos_redis.start()  # the same AOF (appendfsync always): nothing acknowledged is lost
    wait_for(lambda: batches.batch_object(r, batch_id)["status"] == "finalizing", 180, "every result", fleet)
    chaos_redis.kill()  # and again, with the finalize job queued but not run (no finalizer yet)
    chaos_redis.start()
    fleet.start_finalizer("--sweep-seconds", "1", "--grace-seconds", "3")
    wait_terminal(r, [batch_id], timeout=120, fleet=fleet)
    assert all(fleet.processes[name].poll() is None for name in ("w0", "w1")), "a worker died with Redis"
    check_history(r, {batch_id: {record["custom_id"] for record in records}})


def test_s3_unreachable_longer_than_the_lease_mid_batch_and_at_finalize(fleet, r, s3_proxy, bucket):
    lease = 2
    for name in ("w0", "w1"):
        fleet.start_worker(name, lease_seconds=lease, max_num_seqs=8)
    fleet.wait_ready("w0", "w1")
    records = requests(60, seed=3)
    batch_id = submit_lines(r, records, sink=f"s3://{bucket}/out")
    wait_for(lambda: counted(r, batch_id) >= 10, 120, "10 results", fleet)
    s3_proxy.pause()
    outage_end = time.monotonic() + 3 * lease
    while time.monotonic() < outage_end:
        # Every pulled entry keeps its lease while its result waits for S3.
        for entry in r.xpending_range(keys.batch_stream(MODEL, batch_id), keys.CONSUMER_GROUP, "-", "+", 1000):
            assert entry["time_since_delivered"] < lease * 1000, entry
        time.sleep(0.2)
    assert counted(r, batch_id) < 60
    s3_proxy.resume()
    wait_for(lambda: batches.batch_object(r, batch_id)["status"] == "finalizing", 120, "every result", fleet)
    assert successes(fleet, ("w0", "w1")) == 60, "a request ran twice"
    s3_proxy.pause()  # and at finalize: the job fails and the finalizer's sweep retries it with back-off
    fleet.start_finalizer("--sweep-seconds", "1", "--grace-seconds", "30")
    wait_for(lambda: "Could not connect" in fleet.log("finalizer") or "Connection" in fleet.log("finalizer"),
             30, "the finalize attempt during the outage", fleet)
    time.sleep(2)
    assert batches.batch_object(r, batch_id)["status"] == "finalizing"
    s3_proxy.resume()
    wait_terminal(r, [batch_id], timeout=60, fleet=fleet)
    objects = check_history(r, {batch_id: {record["custom_id"] for record in records}})
    assert objects[batch_id]["status"] == "completed"


def test_a_lease_outlasted_by_a_hung_s3_put_is_kept_and_nothing_runs_twice(fleet, r, s3_proxy, bucket):
    lease = 2
    fleet.start_finalizer("--sweep-seconds", "1", "--grace-seconds", "3")
    for name in ("w0", "w1"):
        fleet.start_worker(name, lease_seconds=lease, max_num_seqs=8)
    fleet.wait_ready("w0", "w1")
    records = requests(40, seed=6)
    batch_id = submit_lines(r, records, sink=f"s3://{bucket}/out")
    wait_for(lambda: counted(r, batch_id) >= 5, 120, "5 results", fleet)
    s3_proxy.hang()  # puts hang without an answer: each worker's loop waits inside boto3 for ~9 s
    hang_end = time.monotonic() + 4 * lease
    while time.monotonic() < hang_end:
        for entry in r.xpending_range(keys.batch_stream(MODEL, batch_id), keys.CONSUMER_GROUP, "-", "+", 1000):
            assert entry["time_since_delivered"] < lease * 1000, entry  # renewed from the lease thread
        time.sleep(0.2)
    s3_proxy.resume()
    wait_terminal(r, [batch_id], timeout=180, fleet=fleet)
    objects = check_history(r, {batch_id: {record["custom_id"] for record in records}})
    assert objects[batch_id]["status"] == "completed"
    assert successes(fleet, ("w0", "w1")) == 40, "a request ran twice"  # the engines' own counters


def test_a_permanently_broken_sink_fails_alone_while_the_other_batch_completes(fleet, r, bucket):
    fleet.start_finalizer("--sweep-seconds", "1", "--grace-seconds", "3")
    for name in ("w0", "w1"):
        fleet.start_worker(name, lease_seconds=3, max_num_seqs=8)
    fleet.wait_ready("w0", "w1")
    broken_records, healthy_records = requests(40, seed=4), requests(40, seed=5)
    broken = submit_lines(r, broken_records, sink="s3://kvfleet-no-such-bucket/out")
    started = time.monotonic()
    healthy = submit_lines(r, healthy_records, sink=f"s3://{bucket}/out")
    wait_terminal(r, [healthy], timeout=60, fleet=fleet)
    assert time.monotonic() - started < 45, "the healthy batch waited behind the broken sink"
    check_history(r, {healthy: {record["custom_id"] for record in healthy_records}})
    batch = wait_terminal(r, [broken], timeout=60, fleet=fleet)[broken]
    assert batch["status"] == "failed"
    assert batch["request_counts"] == {"total": 40, "completed": 0, "failed": 40}
    assert batch["errors"]["data"][0]["code"] == "storage_error"
    assert "NoSuchBucket" in batch["errors"]["data"][0]["message"]
    assert batches.num_counted(r, broken) == 40
    lines = r.hvals(keys.batch_results(broken))  # the storage_error lines, kept in Redis
    assert len(lines) == 40 and all(b"storage_error" in line and b"kvfleet-no-such-bucket" in line for line in lines)


def test_a_batch_for_a_model_nobody_serves_ends_expired_on_time(fleet, r):
    fleet.start_finalizer("--sweep-seconds", "1", "--grace-seconds", "3")
    records = requests(20, seed=7)
    batch_id = submit_lines(r, records, model="nobody-serves-this", completion_window="10s")
    expires_at = batches.batch_object(r, batch_id)["expires_at"]
    wait_terminal(r, [batch_id], timeout=60, fleet=fleet)
    ended = time.time()
    objects = check_history(r, {batch_id: {record["custom_id"] for record in records}}, allow_failed=True)
    batch = objects[batch_id]
    assert batch["status"] == "expired" and expires_at <= batch["expired_at"] and ended - expires_at < 15
    assert batch["request_counts"] == {"total": 20, "completed": 0, "failed": 20}
