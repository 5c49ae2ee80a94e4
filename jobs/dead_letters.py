"""Reading the dead-letter streams (workers/stream_ops.py writes them): one per hash tag of
the streams they come from (jobs/keys.py), so listing them means finding them first."""

from __future__ import annotations

from typing import Any

import redis

from jobs import keys


def latest(r: redis.Redis, count: int = 50) -> list[dict[str, Any]]:
    """The newest `count` dead-lettered entries over every dead-letter stream, newest first:
    each entry's fields (batch_id, custom_id, error, stream, ...) plus `id` and `time`."""
    entries = []
    for stream in r.scan_iter(match=keys.DEAD_LETTERS_PATTERN, count=1000, _type="stream"):
        for entry_id, fields in r.xrevrange(stream, count=count):
            record = {k.decode(): v.decode(errors="replace") for k, v in fields.items()}
            record.update(id=entry_id.decode(), time=int(entry_id.split(b"-")[0]) / 1000)
            entries.append(record)
    entries.sort(key=lambda entry: tuple(map(int, entry["id"].split("-"))), reverse=True)
    return entries[:count]
