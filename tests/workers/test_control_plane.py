"""A worker's Redis work per turn does not grow with the number of open batches (the backlog's
summary: jobs/backlog.py), and the summary's counts are exact through every path that changes a
stream: enqueue, read, hand-back, dead letter, ack, retire."""

from __future__ import annotations

import json

from benchmarks.control_plane import CommandCounter, counting_client
from benchmarks.instant_engine import InstantConfig, InstantEngine
from jobs import backlog, keys, queues
from jobs.recording import record_result
from jobs.results import error_line
from jobs.storage import RedisStorage
from producers.ingest import submit
from tests.workers.helpers import MODEL, make_worker
from workers import stream_ops


def line(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": [1, 2, 3], "max_tokens": 2}}).encode()


def submit_batches(r, num_batches: int, lines_each: int, num_tenants: int = 100) -> list[str]:
    batch_ids = []
    for index in range(num_batches):
        lines = [line(f"c{i}") for i in range(lines_each)]
        submission = submit(r, lambda lines=lines: lines, model=MODEL, tenant=f"tenant-{index % num_tenants}")
        assert submission.accepted
        batch_ids.append(submission.batch_id)
    return batch_ids


def commands(redis_server, r, num_batches: int) -> tuple[float, list[int]]:
    """(commands per worker turn while backlogged, commands of each upkeep step: a refresh of
    the summary, finding the streams with pending entries, a maintain pass, an idle wait's
    marks). Ten lines a batch, over 100 tenants: the worker's turns touch as many batches either
    way (fair share takes each pull from other tenants), so only the open batches differ."""
    submit_batches(r, num_batches, lines_each=10)
    counter = CommandCounter()
    worker = make_worker(InstantEngine(InstantConfig(max_num_seqs=4)), counting_client(redis_server.url, counter),
                         maintain_seconds=3600.0)
    for _ in range(3):
        worker.run_once()  # joins, heartbeats, first pulls
    counter.reset()
    for _ in range(20):
        worker.run_once()
    per_turn = counter.reset() / 20
    worker.last_maintain = worker.last_backlog = -1e9  # a whole upkeep pass, the metrics' backlog read included
    upkeep = [(worker.streams.refresh(force=True), counter.reset())[1], (worker.streams.with_pending(), counter.reset())[1],
              (worker._maintain(), counter.reset())[1], (worker.streams.arrival_marks(), counter.reset())[1]]
    return per_turn, upkeep


def test_a_workers_redis_work_is_flat_from_a_hundred_to_a_thousand_open_batches(redis_server, r):
    few_turn, few_upkeep = commands(redis_server, r, num_batches=100)
    r.flushall()
    many_turn, many_upkeep = commands(redis_server, r, num_batches=1000)
    # Ten times the open batches: a pass that read each open batch's stream would take ten times the
    # commands. The counts wobble by a few with what the worker holds at that moment (leases to renew,
    # results to flush: 81 against 73 in one run), so they are bounded, not equal.
    assert all(many <= few * 1.25 + 4 for few, many in zip(few_upkeep, many_upkeep)), (few_upkeep, many_upkeep)
    assert many_turn <= few_turn * 1.2, (few_turn, many_turn)


def summary_matches_the_streams(r) -> tuple[int, int]:
    """The summary's (pending, lag) equal what the streams' groups say; returns them."""
    counted = backlog.totals(r, [MODEL])
    assert counted == queues.sum_backlog(queues.active(r, [MODEL]))
    return counted


def test_the_summary_counts_every_path_exactly(r):
    acme, globex = (submit(r, lambda tenant=tenant: [line(f"{tenant}-{i}") for i in range(5)], model=MODEL,
                           tenant=tenant).batch_id for tenant in ("acme", "globex"))
    assert summary_matches_the_streams(r) == (0, 10)
    assert {head.tenant for head in backlog.heads(r, [MODEL])} == {"acme", "globex"}
    [acme_head] = [head for head in backlog.heads(r, [MODEL]) if head.tenant == "acme"]
    read = backlog.read(r, "w1", [(acme_head, 4)])
    assert [json.loads(fields[b"line"])["custom_id"] for _, _, fields in read] == [f"acme-{i}" for i in range(4)]
    assert summary_matches_the_streams(r) == (4, 6)
    stream = keys.batch_stream(MODEL, acme)
    assert r.sismember(keys.delivered(0), stream)
    stream_ops.requeue(r, stream, read[0][1], read[0][2])  # back for lack of room: ready again
    stream_ops.dead_letter(r, stream, read[1][1], read[1][2], "broken")
    record_result(r, RedisStorage(r), acme, error_line("acme-2", "x", "y"), ack=(stream, keys.CONSUMER_GROUP, read[2][1]))
    stream_ops.ack(r, stream, read[3][1])
    assert summary_matches_the_streams(r) == (0, 7)
    backlog.prune_delivered(r, backlog.delivered_streams(r))  # what a reclaim does
    assert not r.sismember(keys.delivered(0), stream)  # nothing of it pending any more
    everything = backlog.read(r, "w1", [(acme_head, 100)])
    assert len(everything) == 2 and summary_matches_the_streams(r) == (2, 5)
    assert {head.tenant for head in backlog.heads(r, [MODEL])} == {"globex"}  # acme drained: out of the summary
    queues.retire(r, MODEL, acme)
    assert summary_matches_the_streams(r) == (0, 5) and not r.exists(stream)
    r.delete(keys.batch_stream(MODEL, globex))  # behind the scripts' back: the counts are off ...
    assert backlog.totals(r, [MODEL]) == (0, 5)
    assert backlog.reconcile(r) == 1 and backlog.totals(r, [MODEL]) == (0, 0)  # ... until recounted


def test_a_tenants_quota_counts_are_kept_where_they_change(r):
    from jobs import tenant_backlog  # noqa: PLC0415

    [first, second] = submit_batches(r, 2, lines_each=3, num_tenants=1)
    assert tenant_backlog.open_batches(r, "tenant-0") == 2 and tenant_backlog.queued_lines(r, "tenant-0") == 6
    stream = keys.batch_stream(MODEL, first)
    [(_, entries)] = r.xreadgroup(keys.CONSUMER_GROUP, "w1", {stream: ">"}, count=1)
    record_result(r, RedisStorage(r), first, error_line("c0", "x", "y"), ack=(stream, keys.CONSUMER_GROUP,
                                                                               entries[0][0].decode()))
    assert tenant_backlog.queued_lines(r, "tenant-0") == 5
    from jobs import batches  # noqa: PLC0415

    batches.transition(r, first, "cancelling")
    batches.transition(r, first, "cancelled")
    queues.retire(r, MODEL, first)
    assert tenant_backlog.open_batches(r, "tenant-0") == 1 and tenant_backlog.queued_lines(r, "tenant-0") == 3
    record_result(r, RedisStorage(r), first, error_line("c1", "x", "y"))  # a late result of the ended batch
    assert tenant_backlog.queued_lines(r, "tenant-0") == 3  # counts nothing any more
    assert tenant_backlog.reconcile(r, [batches.load_fields(r, second)]) == 0
    r.hincrby(keys.tenant_lines(0), "tenant-0", 40)  # off, somehow ...
    assert tenant_backlog.reconcile(r, [batches.load_fields(r, second)]) == 1  # ... until recounted
    assert tenant_backlog.queued_lines(r, "tenant-0") == 3


def test_invalid_lines_count_once_in_the_queued_lines(r):
    from jobs import tenant_backlog  # noqa: PLC0415

    lines = [line("a"), b'{"custom_id": "broken"', line("b")]
    submission = submit(r, lambda: lines, model=MODEL, tenant="acme", skip_invalid=True)
    assert submission.accepted and tenant_backlog.queued_lines(r, "acme") == 2  # the invalid one has its result
    [head] = backlog.heads(r, [MODEL])
    for stream, entry_id, fields in backlog.read(r, "w1", [(head, 10)]):  # as a worker reads
        record_result(r, RedisStorage(r), submission.batch_id, error_line(json.loads(fields[b"line"])["custom_id"],
                                                                         "x", "y"), ack=(stream, keys.CONSUMER_GROUP,
                                                                                         entry_id))
    assert tenant_backlog.queued_lines(r, "acme") == 0
    queues.retire(r, MODEL, submission.batch_id)
    assert tenant_backlog.queued_lines(r, "acme") == 0 and summary_matches_the_streams(r) == (0, 0)
