"""Retention: files that expire, in OpenAI's shapes, and the sweep that deletes them.

- `expires_after` on an upload (POST /v1/files) and `output_expires_after` on a batch (its
  output and error files): {"anchor": "created_at", "seconds": N}, N from an hour to 30 days.
  The file object's `expires_at` says when; from then on the file does not exist for any
  route (jobs/files.py), and the finalizer's sweep (`files.delete_expired`) deletes it from the
  storage that holds it, Redis, a folder or a bucket. A batch's per-request results go with
  its output and error files: they are the same data.
- KVFLEET_DEFAULT_RETENTION (seconds) applies to every file made without its own expiry;
  unset, such files are kept until deleted (DELETE /v1/files/{id}).

Expiring files wait in one sorted set by expiry time, so a sweep reads only what is due.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import redis

from jobs import keys

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


def default_retention(environ: Mapping[str, str] = os.environ) -> int | None:
    """KVFLEET_DEFAULT_RETENTION in seconds, None when unset."""
    raw = environ.get("KVFLEET_DEFAULT_RETENTION", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"KVFLEET_DEFAULT_RETENTION: must be a positive number of seconds, got {raw!r}")
    return int(raw)


def expiry_of(seconds: int | None, created_at: float, environ: Mapping[str, str] = os.environ) -> int | None:
    """When a file made at `created_at` expires: its own `seconds`, else the default, else never."""
    seconds = seconds if seconds is not None else default_retention(environ)
    return None if seconds is None else int(created_at) + seconds


def schedule(pipe: redis.Redis | redis.client.Pipeline, file_id: str, expires_at: int | None) -> None:
    if expires_at is not None:
        pipe.zadd(keys.EXPIRING_FILES, {file_id: expires_at})
