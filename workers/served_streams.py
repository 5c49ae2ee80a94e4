"""The streams one worker serves, and the upkeep each of them needs.

Each served model has its batch stream (split into partitions on a Redis Cluster:
jobs/keys.py) and its online stream. The worker reads them through stream_ops.pull; this
keeps their list, rotates the partitions so every one gets read, and does what the loop
does for all of them once per maintain interval: consumer groups, trimming, and
the backlog numbers the metrics show.
"""

from __future__ import annotations

import redis

from jobs import keys
from workers import stream_ops


class ServedStreams:
    def __init__(self, r: redis.Redis, models: list[str]) -> None:
        self.r = r
        num_partitions = keys.num_partitions(r)  # 1 on one Redis; a cluster splits each model's stream
        self.model_of = {stream: model for model in models for stream in keys.streams(model, num_partitions)}
        self.batch = list(self.model_of)  # rotated on each pull, so every partition gets read
        self.online = [keys.online_stream(model) for model in models]

    @property
    def all(self) -> list[str]:
        return self.batch + self.online

    def rotate(self) -> list[str]:
        """The batch streams, starting one further than last time."""
        self.batch.append(self.batch.pop(0))
        return self.batch

    def ensure_groups(self) -> None:
        for stream in self.all:
            stream_ops.ensure_group(self.r, stream)

    def trim(self) -> None:
        for stream in self.all:
            stream_ops.trim_acknowledged(self.r, stream)

    def backlog(self) -> tuple[int, int, int]:
        """(pending, lag) of the batch streams, summed over models and partitions, and the entries
        in their dead-letter streams: one pipelined round trip (per node on a cluster)."""
        pipe = self.r.pipeline(transaction=False)
        for stream in self.batch:
            pipe.xinfo_groups(stream)
        dead_letter_streams = sorted({keys.dead_letters(stream) for stream in self.all})
        for stream in dead_letter_streams:
            pipe.xlen(stream)
        replies = pipe.execute()
        backlogs = [stream_ops.group_backlog(groups) for groups in replies[:len(self.batch)]]
        return (sum(pending for pending, _ in backlogs), sum(lag for _, lag in backlogs),
                sum(replies[len(self.batch):]))
