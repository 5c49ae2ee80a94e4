"""Worker heartbeats: who is alive, which models it serves, how full it is.

Every heartbeat a worker rewrites `kvfleet:worker:{name}` (a hash whose TTL is its
liveness) and scores its name in `kvfleet:workers` by the time, so readers find the
live workers without SCAN. A name whose hash has expired is dropped on read.

It also scores each model it serves in `kvfleet:models` (no TTL): the models this fleet
serves even while they have no worker (scaled to zero), for which an online request waits
for a cold start instead of a 404.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from jobs import keys

INT_FIELDS = ("free_blocks", "total_blocks", "running", "waiting", "unstarted", "unstarted_blocks_needed",
              "preemptions", "in_flight", "draining", "max_model_len", "tensor_parallel_size", "num_params",
              "num_active_params", "lora_loads")
FLOAT_FIELDS = ("tokens_per_s", "batch_tokens_per_s", "heartbeat_seconds", "started_at")
# LoRA: served adapter -> [base model, folder]; --lora-resolver prefixes; adapters held (workers/adapters.py)
JSON_FIELDS = ("lora_parents", "lora_resolvers", "lora_held")


def record_heartbeat(r: redis.Redis, name: str, record: dict[str, Any], ttl_seconds: int) -> None:
    """`record["models"]` is the list of served model names; the rest are flat fields."""
    now = time.time()
    fields = {**record, "name": name, "models": json.dumps(record["models"]), "heartbeat": now,
              **{key: json.dumps(record[key]) for key in JSON_FIELDS if key in record}}
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.worker(name), mapping=fields)
    pipe.expire(keys.worker(name), ttl_seconds)
    pipe.zadd(keys.WORKERS, {name: now})
    pipe.execute()
    r.zadd(keys.MODELS, dict.fromkeys(record["models"], now))  # another slot than the worker's keys


def remove_worker(r: redis.Redis, name: str) -> None:
    pipe = r.pipeline(transaction=True)
    pipe.delete(keys.worker(name))
    pipe.zrem(keys.WORKERS, name)
    pipe.execute()


def live_workers(r: redis.Redis) -> list[dict[str, Any]]:
    """The records of workers whose heartbeat has not expired, by name."""
    names = [n.decode() for n in r.zrange(keys.WORKERS, 0, -1)]
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.worker(name))
    workers, gone = [], []
    for name, raw in zip(names, pipe.execute()):
        if not raw:
            gone.append(name)
            continue
        record: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
        record["models"] = json.loads(record.get("models") or "[]")
        record["heartbeat"] = float(record.get("heartbeat") or 0)
        for field in JSON_FIELDS:
            if field in record:
                record[field] = json.loads(record[field])
        for field in INT_FIELDS:
            if field in record:
                record[field] = int(record[field])
        for field in FLOAT_FIELDS:
            if field in record:
                record[field] = float(record[field])
        workers.append(record)
    if gone:
        r.zrem(keys.WORKERS, *gone)
    return sorted(workers, key=lambda w: w["name"])


def is_known_model(r: redis.Redis, model: str, max_age_seconds: float) -> bool:
    """A live worker served `model` within the last `max_age_seconds`."""
    last_seen = r.zscore(keys.MODELS, model)
    return last_seen is not None and time.time() - last_seen <= max_age_seconds


def served_models(r: redis.Redis) -> dict[str, dict[str, Any]]:
    """Model name -> {"max_model_len", "root", "parent", "task", "num_workers", "created"} over the
    live workers (task: generate or embed; a LoRA adapter's parent is its base model, its root
    its folder)."""
    models: dict[str, dict[str, Any]] = {}
    for worker in live_workers(r):
        parents = worker.get("lora_parents") or {}
        for model in worker["models"]:
            parent, root = parents.get(model) or (None, worker.get("root", model))
            entry = models.setdefault(model, {"max_model_len": worker.get("max_model_len"), "root": root,
                                              "parent": parent, "num_workers": 0,
                                              "task": worker.get("task", "generate"),
                                              "created": int(float(worker.get("started_at") or 0))})
            entry["num_workers"] += 1
    return models
