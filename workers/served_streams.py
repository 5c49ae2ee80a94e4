"""The streams one worker serves, and the upkeep each of them needs.

Each served model has its online stream, and one batch stream per batch (per partition on
a Redis Cluster: jobs/queues.py), listed in the model's registry. `refresh` reads the
registry and each stream's backlog at most every REFRESH_SECONDS (two pipelined round
trips); between refreshes the lane's own reads keep the backlog current enough to plan
with (`note_read`). Once per maintain interval the loop has it make the online consumer
groups, trim acknowledged entries and sum the backlog the metrics show.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import redis

from engine.lora.peft import CONFIG_FILE
from jobs import adapters as jobs_adapters
from jobs import keys, queues, tenants
from jobs.queues import Queue
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
        self.batch: list[str] = []  # the batch streams of the last refresh (the lane holds this list)
        self.queues: list[Queue] = []
        self.lag: dict[str, int | None] = {}  # stream -> entries not yet delivered, as far as known
        self.weights: dict[str, float] = {}  # tenant -> fair-share weight (jobs/tenants.py)
        self.refreshed_at = -math.inf

    @property
    def all(self) -> list[str]:
        return self.batch + self.online

    @staticmethod
    def model_of(stream: str) -> str:
        return keys.model_of_stream(stream)

    def refresh(self, force: bool = False) -> list[Queue]:
        """The served models' batch queues with their backlog, earliest deadline first."""
        if force or self.clock() - self.refreshed_at >= REFRESH_SECONDS:
            if self.adapters is not None and self.adapters.resolvers:
                self.add_requested_adapters()
            self.queues = queues.active(self.r, self.models)
            self.batch[:] = [queue.stream for queue in self.queues]
            self.lag = {queue.stream: queue.lag for queue in self.queues}
            self.weights = tenants.weights(self.r)
            self.refreshed_at = self.clock()
        return self.queues

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

    def note_read(self, stream: str, asked: int, found: int) -> None:
        """A read of `asked` entries found `found`: fewer means none is left now."""
        lag = self.lag.get(stream)
        self.lag[stream] = 0 if found < asked else (None if lag is None else max(0, lag - found))

    def has_new(self, stream: str) -> bool:
        lag = self.lag.get(stream)
        return lag is None or lag > 0

    def ensure_groups(self) -> None:
        """The online streams' groups (a batch stream's is made with it: jobs/queues.py)."""
        for stream in self.online:
            stream_ops.ensure_group(self.r, stream)

    def trim(self) -> None:
        for stream in self.all:
            with contextlib.suppress(redis.ResponseError):  # a batch stream retired meanwhile
                stream_ops.trim_acknowledged(self.r, stream)

    def backlog(self) -> tuple[int, int, int]:
        """(pending, lag) of the batch streams, summed, and the entries in the dead-letter
        streams of all served streams."""
        pending, lag = queues.backlog(self.refresh(force=True))
        partitions = range(keys.num_partitions(self.r))  # a batch stream's dead letters go by partition
        dead_letter_streams = sorted({keys.dead_letters(stream) for stream in self.online} | {
            keys.dead_letters(keys.batch_stream(model, "any", partition))
            for model in self.models for partition in partitions})
        pipe = self.r.pipeline(transaction=False)
        for stream in dead_letter_streams:
            pipe.xlen(stream)
        return pending, lag, sum(pipe.execute()) if dead_letter_streams else 0
