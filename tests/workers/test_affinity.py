"""Prefix affinity (workers/affinity.py): two workers pulling interleaved groups of requests
that share long prompt prefixes run each group on the group's owner, and affinity never
holds an entry up longer than its wait."""

from __future__ import annotations

import random
import time

import pytest

from engine import EngineConfig, LLMEngine
from jobs import keys, prefixes
from tests.workers.helpers import MODEL, completion, make_worker, run_until, submit_lines
from workers.affinity import CLAIM_SECONDS, Affinity, claim_groups, group_of, rendezvous_owner
from workers.batch_lane import BatchLane

WORDS = "the ledger of each night keeps what the fleet wrote before the city woke".split()


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return [LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=256, max_num_seqs=8)) for _ in range(2)]


@pytest.fixture
def started(monkeypatch) -> dict[str, str]:
    """custom id -> the worker that started it."""
    record: dict[str, str] = {}
    start = BatchLane.start

    def recording_start(lane, work):
        record[work.custom_id] = lane.config.consumer
        start(lane, work)

    monkeypatch.setattr(BatchLane, "start", recording_start)
    return record


group_keys: dict[int, bytes] = {}  # group number -> its group hash, as the summaries publish it


def interleaved_batches(r, num_groups: int, per_group: int) -> tuple[list[str], dict[str, int]]:
    """`per_group` batches, each with one request of every group: the stream interleaves the
    groups, and submit's grouping (within a batch) cannot bring them together."""
    rng = random.Random(1)
    shared = [" ".join(rng.choice(WORDS) for _ in range(130)) for _ in range(num_groups)]  # ~600 characters
    batch_ids, group = [], {}
    for i in range(per_group):
        lines = [completion(f"g{g}-{i}", f"{shared[g]} question {i}", max_tokens=4) for g in range(num_groups)]
        group_keys.update({g: group_of(prefixes.encode(prefixes.prefix_hashes(line["prompt"], "default|"))).encode()
                           for g, line in enumerate(lines)})
        group.update({f"g{g}-{i}": g for g in range(num_groups)})
        batch_ids.append(submit_lines(r, lines))
    return batch_ids, group


def run_both(workers, r, batch_ids):
    for worker in workers:
        worker._heartbeat()  # each knows the other before it pulls
    run_until(workers, r, batch_ids)


def test_each_group_runs_on_its_owner(engines, r, started):
    workers = [make_worker(engine, r, name=f"w{i}") for i, engine in enumerate(engines)]
    batch_ids, group = interleaved_batches(r, num_groups=6, per_group=4)
    run_both(workers, r, batch_ids)
    by_group: dict[int, set[str]] = {}
    for custom_id, worker in started.items():
        by_group.setdefault(group[custom_id], set()).add(worker)
    assert all(len(names) == 1 for names in by_group.values()), by_group  # one worker ran each whole group
    forwarded = sum(w.metrics.affinity_forwarded._value.get() for w in workers)
    received = sum(w.metrics.affinity_received._value.get() for w in workers)
    assert forwarded == received > 0
    assert len({name for names in by_group.values() for name in names}) == 2  # both worked
    for worker in workers:  # each publishes the groups it ran: the others' choice of owners reads them
        worker.batch_lane.summary.publish(time.monotonic() + 3600)
        ran = {g for g, names in by_group.items() if worker.options.name in names}
        assert set(r.get(keys.worker_groups(worker.options.name)).split()) == {group_keys[g] for g in ran}


def test_affinity_off_runs_entries_where_they_are_pulled(engines, r, started):
    workers = [make_worker(engine, r, name=f"w{i}", prefix_affinity_wait=0) for i, engine in enumerate(engines)]
    batch_ids, _ = interleaved_batches(r, num_groups=6, per_group=4)
    run_both(workers, r, batch_ids)
    assert len(started) == 24 and sum(w.metrics.affinity_forwarded._value.get() for w in workers) == 0


def test_an_owner_that_cannot_start_forwarded_work_hands_it_back_after_the_wait(engines, r, started, monkeypatch):
    # A wait no host's slowness reaches between two turns; then, "past the wait", none at all.
    puller, owner = (make_worker(engine, r, name=f"w{i}", prefix_affinity_wait=600) for i, engine in enumerate(engines))
    batch_ids, group = interleaved_batches(r, num_groups=6, per_group=2)
    for worker in (puller, owner):
        worker._heartbeat()
    claim_groups(r, MODEL, {group_keys[g].decode(): "w1" for g in range(3)})  # w1 pulled these first
    monkeypatch.setattr(owner.batch_lane.config.admission, "count", lambda stats: 0)  # full: it pulls nothing
    puller.run_once()
    forwarded = puller.metrics.affinity_forwarded._value.get()
    assert forwarded > 0 and not any(name == "w1" for name in started.values())
    owner.run_once()  # within the wait: it keeps them
    assert owner.metrics.affinity_released._value.get() == 0
    owner.batch_lane.affinity.wait_seconds = 1e-6  # (0 would turn affinity off)
    owner.last_maintain = 0.0
    owner.run_once()  # past the wait: back to the stream, for anyone
    assert owner.metrics.affinity_released._value.get() == forwarded
    run_until(puller, r, batch_ids)
    assert sorted(started) == sorted(group) and set(started.values()) == {"w0"}


def test_a_group_goes_to_its_holders_else_to_its_claimer():
    groups = [f"{g:016x}" for g in range(300)]
    records = [{"name": name, "models": ["m"], "heartbeat": 1.0} for name in ("a", "b", "c")]
    claims = {g: "abcz"[i % 4] for i, g in enumerate(groups)}  # "z" claimed and left

    def destinations(summaries):
        affinity = Affinity("a", wait_seconds=30, queue_limit=10**6)
        affinity.refresh(records, summaries)
        return [affinity.destination("m", {b"prefix": f"x,{g}".encode()}, claims) or "a" for g in groups]

    # Nobody holds any: each goes to its claimer, or runs here if the claimer is gone.
    assert destinations({}) == [claims[g].replace("z", "a") for g in groups]
    # "b" holds the first 200 ("c" joined after it ran them): they stay with "b".
    held = destinations({"b": frozenset(groups[:200])})
    assert held[:200] == ["b"] * 200 and held[200:] == [claims[g].replace("z", "a") for g in groups[200:]]
    assert destinations({"b": frozenset(groups), "c": frozenset(groups)}) == [
        rendezvous_owner(g, ["b", "c"]) for g in groups]  # held by two: by hash between them
    assert destinations({"a": frozenset(groups), "b": frozenset(groups)}) == ["a"] * 300  # held here: runs here


def test_an_owner_gets_at_most_four_of_its_batches_waiting():
    records = [{"name": "a", "models": ["m"], "heartbeat": 1.0},
               {"name": "b", "models": ["m"], "heartbeat": 1.0, "max_num_seqs": 8, "forwarded_waiting": 5}]
    affinity = Affinity("a", wait_seconds=30)
    affinity.refresh(records, {})
    groups = [f"{g:016x}" for g in range(40)]
    sent = [affinity.destination("m", {b"prefix": f"x,{g}".encode()}, {g: "b" for g in groups}) for g in groups]
    assert sent == ["b"] * (32 - 5) + [None] * (40 - 27)  # 4 x 8 seats, 5 of them waiting already
    affinity.refresh([records[0], {**records[1], "heartbeat": 2.0, "forwarded_waiting": 30}], {})
    assert affinity.destination("m", {b"prefix": b"x,0"}, {"0": "b"}) == "b"  # news: 30 wait, it counts anew
    assert affinity.destination("m", {b"prefix": b"x,1"}, {"1": "b"}) == "b"
    assert affinity.destination("m", {b"prefix": b"x,2"}, {"2": "b"}) is None


def test_a_puller_claims_its_share_of_the_new_groups_and_proposes_the_rest_by_hash(r):
    groups = [f"{g:016x}" for g in range(30)]
    records = [{"name": name, "models": ["m"], "heartbeat": 1.0} for name in ("a", "b", "c")]
    affinity = Affinity("a", wait_seconds=30)
    affinity.refresh(records, {"c": frozenset(groups[:3])})  # "c" holds three: not new
    pulled = [{b"prefix": f"x,{g}".encode()} for g in groups + groups[5:10]] + [{b"prefix": b"short"}]
    proposed = affinity.proposed_claims("m", pulled)
    new = groups[3:] + ["short"]
    assert list(proposed) == new  # in the order pulled, each once
    assert [proposed[g] for g in new[:10]] == ["a"] * 10  # a third, the oldest
    assert [proposed[g] for g in new[10:]] == [rendezvous_owner(g, ["b", "c"]) for g in new[10:]]
    # Claims: the first worker to claim a group keeps it, for the claim's lifetime.
    assert claim_groups(r, "m", proposed) == proposed
    assert claim_groups(r, "m", {groups[3]: "b", "other": "b"}) == {groups[3]: "a", "other": "b"}
    assert claim_groups(r, "m2", {groups[3]: "b"}) == {groups[3]: "b"}  # claims are per model
    assert 0 < r.ttl(keys.group_claim("m", groups[3])) <= CLAIM_SECONDS
    affinity.wait_seconds = 0  # affinity off: nothing is claimed
    assert affinity.proposed_claims("m", pulled) == {}


def test_owners_are_rendezvous_hashes_of_the_live_workers():
    groups = [f"{g:016x}" for g in range(2000)]
    owners = [rendezvous_owner(g, ["a", "b", "c"]) for g in groups]
    assert all(400 < owners.count(name) < 940 for name in "abc")  # spread
    # "c" leaves: only its groups move.
    assert all(rendezvous_owner(g, ["a", "b"]) == o for g, o in zip(groups, owners) if o != "c")
    assert group_of("aa,bb,cc") == "bb" and group_of("aa") == "aa" and group_of("") is None
