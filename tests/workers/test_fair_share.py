"""workers/fair_share.py: whose queue a worker reads next, exactly, entry by entry."""

from __future__ import annotations

import time
from collections import Counter

from jobs.queues import Queue
from workers.fair_share import Candidate, FairShare

DAY, TWO_MINUTES = time.time() + 86400, time.time() + 120


def queue(name: str, deadline: float = DAY) -> Queue:
    return Queue(f"kvfleet:stream:{{p0}}:m:{name}", "m", deadline)


def serve(share: FairShare, candidates: list[Candidate], num_entries: int, cost: int = 512) -> Counter:
    """Pull one entry at a time, as a worker with one free seat does, and charge each."""
    served: Counter = Counter()
    for _ in range(num_entries):
        [(picked, num)] = share.plan(candidates, 1)
        tenant = next(c for c in candidates if c.queue == picked)
        share.charge(tenant.tenant, tenant.weight, cost)
        served[tenant.tenant] += num
    return served


def test_equal_weights_split_a_pull_evenly():
    a, b = Candidate(queue("a"), "acme", 1.0, 100), Candidate(queue("b"), "globex", 1.0, 100)
    plan = FairShare().plan([a, b], 8)
    assert {q.batch_id: n for q, n in plan} == {"a": 4, "b": 4}


def test_weights_three_to_one_split_tokens_three_to_one():
    a, b = Candidate(queue("a"), "acme", 3.0, 10_000), Candidate(queue("b"), "globex", 1.0, 10_000)
    assert serve(FairShare(slack_entries=0), [a, b], 400, cost=600) == {"acme": 300, "globex": 100}
    # With the default slack a tenant leads by one of its entries at most.
    served = serve(FairShare(), [a, b], 400, cost=600)
    assert abs(served["acme"] - 300) <= 2


def test_split_is_in_tokens_not_lines():
    a, b = Candidate(queue("a"), "acme", 1.0, 10_000), Candidate(queue("b"), "globex", 1.0, 10_000)
    share, served = FairShare(slack_entries=0), Counter()
    for _ in range(300):
        [(picked, _)] = share.plan([a, b], 1)
        tenant = "acme" if picked == a.queue else "globex"
        share.charge(tenant, 1.0, 1000 if tenant == "acme" else 250)  # acme's lines are 4x as long
        served[tenant] += 1
    assert served == {"acme": 60, "globex": 240}


def test_a_tenant_back_from_idle_gets_its_share_not_a_burst():
    share = FairShare(slack_entries=0)
    a, b = Candidate(queue("a"), "acme", 1.0, 10_000), Candidate(queue("b"), "globex", 1.0, 10_000)
    serve(share, [b], 5)
    assert serve(share, [a], 100) == {"acme": 100}  # globex had nothing queued: acme takes the fleet
    # globex returns with 5 entries' clock against acme's 100: it does not get 95 in a row, only
    # the one entry a tenant backlogged anew goes first with, then its share.
    served = serve(share, [a, b], 20)
    assert served["globex"] in (10, 11) and served["acme"] == 20 - served["globex"]


def test_earliest_deadline_first_within_a_tenant():
    late, soon = Candidate(queue("late"), "acme", 1.0, 100), Candidate(queue("soon", TWO_MINUTES), "acme", 1.0, 5)
    plan = FairShare().plan([late, soon], 8)
    assert [(q.batch_id, n) for q, n in plan] == [("soon", 5), ("late", 3)]


def test_across_tenants_the_deadline_decides_only_among_tenants_at_their_share():
    a, b = Candidate(queue("a"), "acme", 1.0, 1000), Candidate(queue("b", TWO_MINUTES), "globex", 1.0, 1000)
    share = FairShare(slack_entries=4)
    plan = dict((q.batch_id, n) for q, n in share.plan([a, b], 8))
    # globex, due first, runs until 4 entries ahead: 5 entries; then acme, 1; then globex is
    # within 4 entries again and due first: 1 more; then acme.
    assert plan == {"b": 6, "a": 2}
    for _ in range(200):  # globex far ahead: its deadline no longer lets it jump the queue
        share.charge("globex", 1.0, 512)
    assert [(q.batch_id, n) for q, n in share.plan([a, b], 8)] == [("a", 8)]


def test_a_plan_never_takes_more_than_a_queue_has():
    a, b = Candidate(queue("a"), "acme", 1.0, 2), Candidate(queue("b"), "globex", 1.0, 3)
    assert sorted((q.batch_id, n) for q, n in FairShare().plan([a, b], 10)) == [("a", 2), ("b", 3)]


def test_a_tenant_backlogged_anew_gets_the_next_entry_whatever_the_deadlines_of_the_others():
    """Among a hundred even tenants, earliest deadline first would put a newcomer's later
    deadline behind every one of them: its first entry waited a round of the fleet (a second
    with a hundred tenants). It starts one entry behind instead: next, then its share."""
    share = FairShare()
    early = [Candidate(queue(f"b{i}", deadline=TWO_MINUTES + i), f"tenant-{i}", 1.0, 10_000) for i in range(100)]
    serve(share, early, 300)
    newcomer = Candidate(queue("new", deadline=DAY), "newcomer", 1.0, 10_000)
    [(first, _)] = share.plan([*early, newcomer], 1)
    assert first == newcomer.queue
    served = serve(share, [*early, newcomer], 202)
    assert served["newcomer"] in (2, 3)  # then its share: about one entry in 101


def test_a_newcomer_goes_first_also_where_entries_are_cheap():
    """With entries of a few tokens the clocks stay small: a newcomer's start behind the floor
    is below zero, and must stay there (clamped at zero it was even with the others, and
    waited behind their earlier deadlines)."""
    share = FairShare(name="w0")
    early = [Candidate(queue(f"b{i}", deadline=TWO_MINUTES + i), f"tenant-{i}", 1.0, 10_000) for i in range(100)]
    serve(share, early, 100, cost=4)  # one entry each: every clock at 4, one entry above a newcomer at 0
    newcomer = Candidate(queue("new", deadline=DAY), "newcomer", 1.0, 10_000)
    plan = share.plan([*early, newcomer], 15)
    assert newcomer.queue in [queue_ for queue_, _ in plan]
