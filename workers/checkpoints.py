"""Checkpoints of running generations, kept in Redis so that a worker that takes an entry
over continues it instead of starting again (engine/resume.py says how the engine resumes).

One JSON string per request (jobs/keys.py: checkpoint): its samples' SampleProgress. The worker running the request
writes it every `--checkpoint-tokens` generated tokens and when it hands the entry back; a
worker that reclaims the entry reads it; the key is deleted when the request finishes, and
expires on its own with the work it belongs to (a batch's window), so a batch deleted
mid-run leaves nothing behind. A crash costs at most the tokens since the last checkpoint.
"""

from __future__ import annotations

import json
import logging

import redis

from engine import SampleProgress

log = logging.getLogger("kvfleet.checkpoints")


def save(pipe: redis.client.Pipeline, checkpoint_key: str, progress: list[SampleProgress], ttl_seconds: int) -> None:
    payload = json.dumps([sample.to_json() for sample in progress], separators=(",", ":"))
    pipe.set(checkpoint_key, payload, ex=max(1, ttl_seconds))


def load_many(r: redis.Redis, checkpoint_keys: list[str]) -> list[list[SampleProgress] | None]:
    """Each key's saved progress, or None: none saved, or one this version cannot read (the
    request then starts again). One pipeline, not MGET: the keys may sit in other slots."""
    pipe = r.pipeline(transaction=False)
    for checkpoint_key in checkpoint_keys:
        pipe.get(checkpoint_key)
    return [None if raw is None else _parse(checkpoint_key, raw)
            for checkpoint_key, raw in zip(checkpoint_keys, pipe.execute())]


def _parse(checkpoint_key: str, raw: bytes) -> list[SampleProgress] | None:
    try:
        return [SampleProgress.from_json(sample) for sample in json.loads(raw)]
    except (ValueError, KeyError, TypeError) as error:
        log.warning("unreadable checkpoint %s (%r): the request starts again", checkpoint_key, error)
        return None
