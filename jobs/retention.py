"""Retention: files that expire, in OpenAI's shapes; ended batches and dead letters that go.

- `expires_after` on an upload (POST /v1/files) and `output_expires_after` on a batch (its
  output and error files): {"anchor": "created_at", "seconds": N}, N from an hour to 30 days.
  The file object's `expires_at` says when; from then on the file does not exist for any
  route (jobs/files.py), and the finalizer's sweep (`files.delete_expired`) deletes it from the
  storage that holds it, Redis, a folder or a bucket. A batch's per-request results go with
  its output and error files: they are the same data.
- KVFLEET_DEFAULT_RETENTION (seconds) applies to every file made without its own expiry;
  unset, such files are kept until deleted (DELETE /v1/files/{id}).

- An ended batch (completed, failed, expired, cancelled) is deleted KVFLEET_BATCH_RETENTION
  seconds (30 days) after it ended: its object, its done sets and counts, its per-request
  results. Its files keep their own expiry.
- Dead letters (whole request lines) are trimmed KVFLEET_DEAD_LETTER_RETENTION seconds (7
  days) after they were dead-lettered.

Expiring files and ended batches wait in sorted sets by due time, so a sweep reads only what
is due.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import redis

from jobs import keys

DEFAULT_BATCH_RETENTION = 30 * 86400
DEFAULT_DEAD_LETTER_RETENTION = 7 * 86400
MIN_SECONDS = 3600
MAX_SECONDS = 30 * 86400
SWEEP_BATCH = 100  # files deleted per sweep at most: a backlog drains over a few sweeps


def parse_expires_after(value: Any, param: str) -> int | None:
    """The seconds of an `expires_after`-shaped value (None: none given); ValueError naming
    `param` and the field otherwise."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{param}: expected an object with anchor and seconds")
    if value.get("anchor") != "created_at":
        raise ValueError(f"{param}.anchor: must be 'created_at'")
    seconds = value.get("seconds")
    if isinstance(seconds, str) and seconds.strip().isdigit():  # digits as text, as a form encodes them
        seconds = int(seconds)
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise ValueError(f"{param}.seconds: must be an integer from {MIN_SECONDS} (1 hour) to {MAX_SECONDS} "
                         f"(30 days), got {value.get('seconds')!r}")
    return seconds


def seconds_setting(name: str, environ: Mapping[str, str] = os.environ) -> int | None:
    """A setting of a positive number of seconds, None when unset; ValueError naming it otherwise."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"{name}: must be a positive number of seconds, got {raw!r}")
    return int(raw)


def default_retention(environ: Mapping[str, str] = os.environ) -> int | None:
    """KVFLEET_DEFAULT_RETENTION in seconds, None when unset."""
    return seconds_setting("KVFLEET_DEFAULT_RETENTION", environ)


def batch_retention(environ: Mapping[str, str] = os.environ) -> int:
    """Seconds an ended batch is kept (KVFLEET_BATCH_RETENTION)."""
    return seconds_setting("KVFLEET_BATCH_RETENTION", environ) or DEFAULT_BATCH_RETENTION


def dead_letter_retention(environ: Mapping[str, str] = os.environ) -> int:
    """Seconds a dead letter is kept (KVFLEET_DEAD_LETTER_RETENTION)."""
    return seconds_setting("KVFLEET_DEAD_LETTER_RETENTION", environ) or DEFAULT_DEAD_LETTER_RETENTION


def expiry_of(seconds: int | None, created_at: float, environ: Mapping[str, str] = os.environ) -> int | None:
    """When a file made at `created_at` expires: its own `seconds`, else the default, else never."""
    seconds = seconds if seconds is not None else default_retention(environ)
    return None if seconds is None else int(created_at) + seconds


def schedule(pipe: redis.Redis | redis.client.Pipeline, file_id: str, expires_at: int | None) -> None:
    if expires_at is not None:
        pipe.zadd(keys.EXPIRING_FILES, {file_id: expires_at})


def schedule_batch_deletion(r: redis.Redis, batch_id: str, ended_at: float) -> None:
    """An ended batch goes KVFLEET_BATCH_RETENTION after it ended (the first schedule stands)."""
    r.zadd(keys.ENDED_BATCHES, {batch_id: int(ended_at) + batch_retention()}, nx=True)


def batches_due(r: redis.Redis, now: float) -> list[str]:
    return [member.decode() for member in r.zrangebyscore(keys.ENDED_BATCHES, "-inf", now, start=0,
                                                          num=SWEEP_BATCH)]


def trim_dead_letters(r: redis.Redis, now: float) -> int:
    """Drop the dead letters older than their retention from every dead-letter stream; how many."""
    oldest_kept = f"{int((now - dead_letter_retention()) * 1000)}-0"
    return sum(r.xtrim(stream, minid=oldest_kept, approximate=False)
               for stream in r.scan_iter(match=keys.DEAD_LETTERS_PATTERN, count=1000, _type="stream"))
