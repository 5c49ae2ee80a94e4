"""Which batch queues a worker reads next: weighted fair share across tenants, counted in
tokens, then earliest deadline first.

Each tenant has a virtual clock: the tokens (prompt + max output) of the batch work this
worker started for it, divided by its weight. The next entry comes from the backlogged
tenant whose clock is furthest behind (start-time fair queuing; deficit round-robin does
the same in rounds, AIBrix's virtual token counter per request). A clock within SLACK_ENTRIES
of a tenant's entries of the furthest behind counts as even, and among even tenants the
earliest deadline goes first (to the minute: then the tenant furthest behind, then an order of
each worker's own, so that workers do not all reach for the same tenants at once): fairness
first, then deadlines, so a tight window overtakes a loose one of another tenant only while
both are at their share. Within a tenant, its batches go by deadline.

Idle time earns no credit: a tenant that becomes backlogged again starts just behind the
lowest clock among the tenants that stayed backlogged (the slack and one entry), so its first
entry goes next (a new tenant's first pull does not wait for a round of every other tenant's
deadlines), but it neither takes back the share it gave away nor starves the others in a burst. Online requests are not in this: their lane is
pulled first, by priority, whatever the batch shares.

Each worker keeps its own clocks. Every worker splits its own work by the weights, so the
fleet does too, with no coordination; a worker that restarts starts even.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from jobs.backlog import Head

SLACK_ENTRIES = 1.0  # a tenant this many of its own entries ahead of the furthest behind is still even
DEADLINE_GRAIN_SECONDS = 60  # deadlines within one minute are one deadline, between tenants
DEFAULT_TOKENS_PER_ENTRY = 512.0  # until a tenant's first entry is charged


@dataclass(frozen=True)
class Candidate:
    """A queue with new entries, whose they are, and how many it may give now."""

    queue: Head  # one tenant's ready work in a partition (jobs/backlog.py)
    tenant: str
    weight: float
    room: int


class FairShare:
    def __init__(self, slack_entries: float = SLACK_ENTRIES, smoothing: float = 0.2, name: str = "") -> None:
        """`name`: the worker's, which orders tenants whose deadlines and clocks tie: workers that
        start together then reach for different tenants first instead of all the same ones."""
        self.slack_entries, self.smoothing, self.name = slack_entries, smoothing, name
        self.clock: dict[str, float] = {}  # tenant -> tokens started / weight
        self.tokens_per_entry: dict[str, float] = {}  # tenant -> running estimate
        self.backlogged: set[str] = set()  # tenants with new entries at the last plan

    def plan(self, candidates: list[Candidate], count: int) -> list[tuple[Head, int]]:
        """Up to `count` entries over the candidates: [(queue, how many)]."""
        by_tenant: dict[str, list[Candidate]] = {}
        for candidate in sorted(candidates, key=lambda c: (c.queue.deadline, c.queue.stream)):
            if candidate.room > 0:
                by_tenant.setdefault(candidate.tenant, []).append(candidate)
        self._start_clocks({tenant: queues[0].weight for tenant, queues in by_tenant.items()})
        clocks = {tenant: self.clock[tenant] for tenant in by_tenant}
        heads = dict.fromkeys(by_tenant, 0)  # tenant -> index of its earliest queue with room
        planned: dict[str, int] = {}
        for _ in range(count):
            live = [tenant for tenant, queues in by_tenant.items() if heads[tenant] < len(queues)]
            if not live:
                break
            tenant = self._next_tenant({t: by_tenant[t][heads[t]] for t in live}, clocks)
            candidate = by_tenant[tenant][heads[tenant]]
            stream = candidate.queue.stream
            planned[stream] = planned.get(stream, 0) + 1
            if planned[stream] >= candidate.room:
                heads[tenant] += 1
            clocks[tenant] += self.expected_tokens(tenant) / candidate.weight
        queues = {c.queue.stream: c.queue for c in candidates}
        return [(queues[stream], num) for stream, num in planned.items()]

    def _next_tenant(self, heads: dict[str, Candidate], clocks: dict[str, float]) -> str:
        """The earliest deadline among the tenants even with the furthest behind."""
        floor = min(clocks[tenant] for tenant in heads)
        even = [tenant for tenant, head in heads.items()
                if clocks[tenant] <= floor + self.slack_entries * self.expected_tokens(tenant) / head.weight]
        return min(even, key=lambda tenant: (heads[tenant].queue.deadline // DEADLINE_GRAIN_SECONDS, clocks[tenant],
                                             self._order(tenant)))

    def _order(self, tenant: str) -> bytes:
        """This worker's own order of the tenants (rendezvous hashing)."""
        return hashlib.blake2b(f"{self.name}\n{tenant}".encode(), digest_size=8).digest()

    def _start_clocks(self, weights: dict[str, float]) -> None:
        """Tenants backlogged anew (`weights`: every backlogged tenant's) start just past the slack
        behind the lowest clock of those that stayed backlogged (or of the last backlogged
        ones): their first entry goes next, whatever the deadlines of the others, so a new
        tenant's first pull never waits for every other tenant's turn; with nobody backlogged
        before, everyone starts even."""
        backlogged = set(weights)
        if not self.backlogged:
            self.clock = dict.fromkeys(self.clock, 0.0)
        stayed = [self.clock[t] for t in self.backlogged & backlogged] or [self.clock[t] for t in self.backlogged]
        floor = min(stayed, default=None)
        for tenant in backlogged - self.backlogged:
            # Behind by more than the slack: not even with the others, so not left to the deadlines.
            behind = (self.slack_entries + 1) * self.expected_tokens(tenant) / weights[tenant]
            start = 0.0 if floor is None else floor - behind  # below 0 too: clocks are only compared
            self.clock[tenant] = max(self.clock[tenant], start) if tenant in self.clock else start
        self.backlogged = backlogged

    def expected_tokens(self, tenant: str) -> float:
        return self.tokens_per_entry.get(tenant, DEFAULT_TOKENS_PER_ENTRY)

    def charge(self, tenant: str, weight: float, num_tokens: int) -> None:
        """Work of `num_tokens` (prompt + max output) started for `tenant`."""
        self.clock[tenant] = self.clock.get(tenant, 0.0) + num_tokens / weight
        estimate = self.tokens_per_entry.get(tenant)
        self.tokens_per_entry[tenant] = num_tokens if estimate is None else (
            estimate + self.smoothing * (num_tokens - estimate))
