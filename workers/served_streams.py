"""The streams one worker serves, and the upkeep each of them needs.

Each served model has its online stream, and one batch stream per batch (per partition on
a Redis Cluster: jobs/queues.py). A worker never lists the batch streams: `refresh` reads
the backlog's summary (jobs/backlog.py), the tenants with ready work per served model, at
most every REFRESH_SECONDS (two pipelined round trips), and `read` pulls from the tenants
fair share picks, their earliest deadlines first. Once per maintain interval the loop has it
make the online consumer groups, trim acknowledged entries of the streams it read, and sum
the backlog the metrics show: all of it bounded by models, tenants and the work in flight,
not by the open batches.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import redis

from engine.lora.peft import CONFIG_FILE
from jobs import adapters as jobs_adapters
from jobs import backlog, keys, tenants
from jobs.backlog import Head
from workers import stream_ops
from workers.adapters import S3_PREFIX, Adapters

REFRESH_SECONDS = 0.25
MAX_SERVED_MODELS = 256  # base names, named adapters and those requests named by path or URI


class ServedStreams:
    def __init__(self, r: redis.Redis, models: list[str], clock=time.monotonic, adapters: Adapters | None = None,
                 bases: list[str] | None = None) -> None:
        self.r, self.models, self.clock = r, list(models), clock
        self.online = [keys.online_stream(model) for model in models]
        # Adapters requests name by path or URI join the served models once registered for one
        # of `bases` (jobs/adapters.py: resolve), when a --lora-resolver prefix allows them.
        self.adapters, self.bases = adapters, set(bases or models)
        self.batch: list[str] = []  # batch streams are found through the backlog's summary, never listed
        self.queues: list[Head] = []  # the heads of the last refresh
        self.weights: dict[str, float] = {}  # tenant -> fair-share weight (jobs/tenants.py)
        self.touched: set[str] = set()  # batch streams read since the last trim
        self.refreshed_at = -math.inf

    @property
    def all(self) -> list[str]:
        return self.batch + self.online

    @staticmethod
    def model_of(stream: str) -> str:
        return keys.model_of_stream(stream)

    def refresh(self, force: bool = False) -> list[Head]:
        """One head per (partition, served model, tenant) with ready batch work, from the
        backlog's summary (jobs/backlog.py): its `stream` is the tenant's ready set, its deadline
        the tenant's earliest. At most every REFRESH_SECONDS; two pipelined round trips, whatever
        the number of open batches."""
        if force or self.clock() - self.refreshed_at >= REFRESH_SECONDS:
            if self.adapters is not None and self.adapters.resolvers:
                self.add_requested_adapters()
            self.queues = backlog.heads(self.r, self.models)
            self.weights = tenants.weights(self.r)
            self.refreshed_at = self.clock()
        return self.queues

    def read(self, consumer: str, plan: list[tuple[Head, int]]) -> list[tuple[str, str, dict]]:
        """Never-delivered entries, up to a count from each planned head, its tenant's earliest
        deadlines first: [(stream, entry id, fields)]."""
        found = backlog.read(self.r, consumer, plan)
        self.touched.update(stream for stream, _, _ in found)
        return found

    def with_pending(self) -> list[str]:
        """The served models' batch streams with entries delivered and not acked (bounded by the
        work in flight in the fleet): where stale entries and forwarded ones can be."""
        served = set(self.models)
        return [stream for stream in backlog.delivered_streams(self.r) if keys.model_of_stream(stream) in served]

    def add_requested_adapters(self) -> None:
        """Serve the adapters requests named by path or URI that this worker may load for their
        owner (jobs/adapters.py), the most recently used first within MAX_SERVED_MODELS; stop
        serving those the registry forgot."""
        owners = self.adapters.owners
        fixed = len(self.models) - len(owners)  # base names and named adapters
        wanted = [found for found in jobs_adapters.registrations(self.r).values()
                  if found.base in self.bases and self.adapters.allows(found.name, found.tenant)
                  and (found.name.startswith(S3_PREFIX) or Path(found.name, CONFIG_FILE).is_file())]
        wanted = sorted(wanted, key=lambda found: -found.used_at)[:max(0, MAX_SERVED_MODELS - fixed)]
        kept = {found.name for found in wanted}
        for name in [name for name in owners if name not in kept]:
            self.models.remove(name)
            self.online.remove(keys.online_stream(name))  # the online lane reads this same list
            self.adapters.forget(name)
        for found in wanted:
            owners[found.name] = found.tenant
            if found.name not in self.models:
                self.models.append(found.name)
                stream = keys.online_stream(found.name)
                stream_ops.ensure_group(self.r, stream)
                self.online.append(stream)

    def ensure_groups(self) -> None:
        """The online streams' groups (a batch stream's is made with it: jobs/queues.py)."""
        for stream in self.online:
            stream_ops.ensure_group(self.r, stream)

    def trim(self) -> None:
        """Trim the online streams and the batch streams read since the last trim."""
        touched, self.touched = self.touched, set()
        for stream in [*self.online, *sorted(touched)]:
            with contextlib.suppress(redis.ResponseError):  # a batch stream retired meanwhile
                stream_ops.trim_acknowledged(self.r, stream)

    def arrival_marks(self) -> dict[str, str]:
        """The newest id of each served model's arrivals stream: what an idle wait blocks after."""
        names = [keys.arrivals(model) for model in self.models]
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.xrevrange(name, count=1)
        return {name: (rows[0][0].decode() if rows else "0-0") for name, rows in zip(names, pipe.execute())}

    def backlog(self) -> tuple[int, int, int]:
        """(pending, lag) of the served models' batch work, from the summary, and the entries in
        the dead-letter streams of all served streams."""
        pending, lag = backlog.totals(self.r, self.models)
        partitions = range(keys.num_partitions(self.r))  # a batch stream's dead letters go by partition
        dead_letter_streams = sorted({keys.dead_letters(stream) for stream in self.online} | {
            keys.dead_letters(keys.batch_stream(model, "any", partition))
            for model in self.models for partition in partitions})
        pipe = self.r.pipeline(transaction=False)
        for stream in dead_letter_streams:
            pipe.xlen(stream)
        return pending, lag, sum(pipe.execute()) if dead_letter_streams else 0
