"""Prefix affinity: batch work goes to the worker that holds its prompt prefix's KV blocks.

Workers pull, so no router places a request; a worker that pulls an entry decides where it
runs. Every entry carries its prompt's prefix hashes (jobs/prefixes.py); its *group* is the
hash at depth GROUP_DEPTH (512 characters, about 128 tokens in), or the deepest one of a
shorter prompt. A prompt shorter than one chunk has no group and runs wherever it is pulled.

Owners. Each group has one owner among the live, non-draining workers of its model. A
worker *holds* a group it started a request of lately: each publishes its last
SUMMARY_GROUPS groups (`GroupSummary`, a key with a TTL, refreshed every SUMMARY_SECONDS),
and every worker reads the others' with the heartbeats. A group's owner is, among the
workers that hold it, the one with the highest hash of (worker, group) (rendezvous hashing,
so all compute the same one). A group nobody holds yet is claimed when first pulled: of the
new groups in one pull, the puller keeps its share (one in N workers, the oldest) and
proposes the rest to the other workers by hash, and each becomes a claim (SET NX, with the
summary's lifetime, covering the seconds before the claimer's summary says it holds the
group) unless another worker claimed it first. So new groups spread evenly, and more go to
the workers that pull more often, those with room; hashing alone gave each worker a fixed
share whatever its load (18 of 32 groups to one of two workers in the benchmark). A worker
that joins takes only new groups; one that leaves gives its groups up when its summary
expires. The owner's prefix cache holds the prefix.

Forwarding. A worker that pulls a fresh entry of a group another worker owns moves it to
the owner's pending list (XCLAIM to the owner's consumer name, under an ownership check, in
one script; no delivery is counted). The owner takes entries forwarded to it before it
reads new ones (`Forwarded.take`).

Bounded load. An owner keeps at most FORWARD_BATCHES times its max_num_seqs forwarded
entries waiting (four full batches: it starts them as seats free, well within the wait):
it says how many wait in each heartbeat, and a worker counts what it sent since. Past that
the puller runs the entry itself, and from then on holds the group too. A worker that
holds a group runs its entries itself, whoever else holds it: forwarding buys nothing there.
So a hot group (one instruction every request shares) spreads over the fleet, each worker
prefilling its prefix once, while many cold groups stay each with their owner, whose cache
is the only one to hold them. (A limit of 16 on the benchmark's 16-seat workers ran out
whenever an owner was busy prefilling new groups, and split groups: 82% hits against
86% for one worker; with 64, 86%.)

The bounded wait. Affinity is a preference, never a lock: an owner that cannot start a
forwarded entry within `wait_seconds` of the forward (its idle time in the pending list)
hands it back to its stream with affinity off (`Forwarded.stale`, the AFFINITY_OFF field),
where any worker takes it and none forwards it again. A forward to a worker that dies is
recovered after the lease, as all of its entries are.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import redis

from jobs import keys, prefixes
from workers.leases import TRANSFER_OWNED_LUA

SUMMARY_GROUPS = 1024  # the groups a worker publishes, most recent first
SUMMARY_SECONDS = 5.0  # how often it publishes them; they expire after 3 times that
CLAIM_SECONDS = int(3 * SUMMARY_SECONDS)  # a claim lasts as long as a summary would
GROUP_DEPTH = 2  # chunks of jobs/prefixes.py: 512 characters, ~128 tokens
FORWARD_BATCHES = 4  # an owner's forwarded entries waiting: at most this many times its max_num_seqs
GROUP = keys.CONSUMER_GROUP
AFFINITY_OFF = {b"affinity": b"off"}  # on an entry handed back after its wait: never forwarded again


def group_of(prefix_field: str | bytes | None) -> str | None:
    chain = prefixes.decode(prefix_field)
    return chain[min(len(chain), GROUP_DEPTH) - 1] if chain else None


def rendezvous_owner(group: str, workers: list[str]) -> str:
    return max(workers, key=lambda name: hashlib.blake2b(f"{name}\n{group}".encode(), digest_size=8).digest())


@dataclass
class Peer:
    name: str
    heartbeat: float  # its last one
    num_waiting: int = 0  # forwarded entries it had not taken then
    num_forwarded: int = 0  # sent to it since then, by this worker
    queue_limit: int = FORWARD_BATCHES * 16  # forwarded entries it may have waiting
    groups: frozenset[str] = frozenset()  # the groups it published it holds


@dataclass
class Affinity:
    """Who owns which group, from the heartbeats; refreshed once per maintain interval."""

    name: str  # this worker
    wait_seconds: float  # 0: affinity off
    queue_limit: int | None = None  # forwarded entries an owner may have waiting; None: each peer's own
    peers: dict[str, dict[str, Peer]] = field(default_factory=dict)  # model -> worker name -> peer

    @property
    def enabled(self) -> bool:
        return self.wait_seconds > 0

    def refresh(self, records: list[dict], summaries: dict[str, frozenset[str]]) -> None:
        """`records`: jobs.heartbeats.live_workers(); `summaries`: GroupSummary.read_all()."""
        peers: dict[str, dict[str, Peer]] = {}
        for record in records:
            if record.get("draining") and record["name"] != self.name:
                continue
            for model in record["models"]:
                old = self.peers.get(model, {}).get(record["name"])
                peer = Peer(record["name"], record["heartbeat"], int(record.get("forwarded_waiting") or 0),
                            groups=summaries.get(record["name"], frozenset()),
                            queue_limit=self.queue_limit or FORWARD_BATCHES * int(record.get("max_num_seqs") or 16))
                if old is not None and old.heartbeat == peer.heartbeat:
                    peer.num_forwarded = old.num_forwarded  # no news from it: keep counting
                peers.setdefault(model, {})[peer.name] = peer
        self.peers = peers

    def proposed_claims(self, model: str, entries_fields: list[dict]) -> dict[str, str]:
        """Owners for the groups of freshly pulled entries that no live worker holds: this
        worker takes its share of them (the oldest), the others are spread by hash among
        the other workers. `claim_groups` makes them claims, unless another worker claimed
        a group first."""
        groups = []
        for fields in entries_fields:
            group = self.routed_group(model, fields)
            if group is not None and group not in groups and not any(
                    group in peer.groups for peer in self.peers[model].values()):
                groups.append(group)
        others = [name for name in self.peers.get(model, {}) if name != self.name]
        share = math.ceil(len(groups) / (len(others) + 1))
        return {group: self.name if i < share else rendezvous_owner(group, others) for i, group in enumerate(groups)}

    def destination(self, model: str, fields: dict, claims: dict[str, str]) -> str | None:
        """The owner to forward a freshly pulled entry to; None: run it here. `claims`: group
        -> claimer, for the groups nobody holds."""
        group = self.routed_group(model, fields)
        if group is None:
            return None
        peers = self.peers[model]
        holders = [name for name, peer in peers.items() if group in peer.groups]
        if self.name in holders:
            return None
        owner = peers.get(rendezvous_owner(group, holders) if holders else claims.get(group, self.name))
        if owner is None or owner.name == self.name or owner.num_waiting + owner.num_forwarded >= owner.queue_limit:
            return None  # its claimer is gone, or it is this worker, or it has enough waiting
        owner.num_forwarded += 1
        return owner.name

    def routed_group(self, model: str, fields: dict) -> str | None:
        """An entry's group, if affinity routes it: on, two workers or more, not handed back."""
        if not self.enabled or len(self.peers.get(model, {})) < 2 or fields.get(b"affinity") == b"off":
            return None
        return group_of(fields.get(b"prefix"))


def claim_groups(r: redis.Redis, model: str, proposed: dict[str, str]) -> dict[str, str]:
    """Claim each group for its proposed owner where no worker has claimed it yet; returns
    each group's claimer."""
    if not proposed:
        return {}
    pipe = r.pipeline(transaction=False)
    for group, owner in proposed.items():
        pipe.set(keys.group_claim(model, group), owner, nx=True, ex=CLAIM_SECONDS)
        pipe.get(keys.group_claim(model, group))
    replies = pipe.execute()[1::2]
    return {group: (claimer or owner.encode()).decode() for (group, owner), claimer in zip(proposed.items(), replies)}


class GroupSummary:
    """The prefix groups this worker started requests of, most recent last, published for
    the others' choice of owners."""

    def __init__(self, r: redis.Redis, name: str) -> None:
        self.r, self.name = r, name
        self.groups: OrderedDict[str, None] = OrderedDict()
        self.published_at = self.read_at = 0.0
        self.others: dict[str, frozenset[str]] = {}  # the others' groups, as last read

    def add(self, prefix_field: str | bytes | None) -> None:
        group = group_of(prefix_field)
        if group is not None:
            self.groups[group] = None
            self.groups.move_to_end(group)
            if len(self.groups) > SUMMARY_GROUPS:
                self.groups.popitem(last=False)

    def publish(self, now: float) -> None:
        if now - self.published_at >= SUMMARY_SECONDS and self.groups:
            self.r.set(keys.worker_groups(self.name), " ".join(self.groups), ex=int(3 * SUMMARY_SECONDS))
            self.published_at = now

    def read_all(self, names: list[str], now: float) -> dict[str, frozenset[str]]:
        """Each live worker's published groups, read again every SUMMARY_SECONDS (this
        worker's own as it has them now)."""
        if now - self.read_at >= SUMMARY_SECONDS or set(names) - set(self.others) - {self.name}:
            pipe = self.r.pipeline(transaction=False)
            for name in names:
                pipe.get(keys.worker_groups(name))
            self.others = {name: frozenset((raw or b"").decode().split()) for name, raw in zip(names, pipe.execute())}
            self.read_at = now
        return {**self.others, self.name: frozenset(self.groups)}


def forward(r: redis.Redis, stream: str, consumer: str, owner: str, entry_ids: list[str]) -> list[str]:
    """Move entries this consumer holds to `owner`'s pending list; returns those moved."""
    kept = r.execute_command("EVAL", TRANSFER_OWNED_LUA, 1, stream, GROUP, consumer, owner, *entry_ids)
    not_held = {eid.decode() if isinstance(eid, bytes) else eid for eid in kept}
    return [entry_id for entry_id in entry_ids if entry_id not in not_held]


class Forwarded:
    """Entries other workers forwarded to this one: in its pending list, not yet taken."""

    def __init__(self, r: redis.Redis, consumer: str) -> None:
        self.r, self.consumer = r, consumer
        self.waiting: dict[str, int] = {}  # stream -> found and not taken at the last look

    @property
    def num_waiting(self) -> int:
        """Forwarded entries waiting here (the heartbeat says it, for the bounded load)."""
        return sum(self.waiting.values())

    def find(self, stream: str, held: set[str], count: int = 1000) -> list[tuple[str, int, int]]:
        """(entry id, deliveries, milliseconds since forwarded) of the entries in this consumer's
        pending list it does not hold."""
        rows = self.r.xpending_range(stream, GROUP, "-", "+", count, consumername=self.consumer)
        return [(row["message_id"].decode(), row["times_delivered"], row["time_since_delivered"]) for row in rows
                if row["message_id"].decode() not in held]

    def take(self, stream: str, held: set[str], count: int) -> list[tuple[str, str, dict, int]]:
        """Up to `count` forwarded entries, oldest first: [(stream, entry id, fields, deliveries)]."""
        found = self.find(stream, held)
        self.waiting[stream] = max(0, len(found) - count)
        found = found[:count]
        if not found:
            return []
        return [(stream, entry_id, fields, deliveries)
                for (entry_id, deliveries, _), fields in zip(found, self._fields(stream, found)) if fields]

    def stale(self, stream: str, held: set[str], wait_seconds: float) -> list[tuple[str, dict]]:
        """Forwarded entries not taken within `wait_seconds` of their forward: (id, fields)."""
        found = self.find(stream, held)
        stale = [entry for entry in found if entry[2] >= wait_seconds * 1000]
        self.waiting[stream] = len(found) - len(stale)
        return [(entry_id, fields) for (entry_id, *_), fields in zip(stale, self._fields(stream, stale)) if fields]

    def _fields(self, stream: str, found: list[tuple]) -> list[dict | None]:
        pipe = self.r.pipeline(transaction=False)
        for entry_id, *_ in found:
            pipe.xrange(stream, entry_id, entry_id)
        return [rows[0][1] if rows else None for rows in pipe.execute()] if found else []
