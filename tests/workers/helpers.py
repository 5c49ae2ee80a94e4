"""Shared by the worker and fleet tests: submit a batch, drive it, read its files."""

from __future__ import annotations

import json
import time

from jobs import batches
from jobs.files import read_file
from producers.ingest import submit
from tests.services import run_finalize_jobs

MODEL = "tiny"


def make_worker(engine, r, **options):
    """An in-process worker on `engine`, with quick leases and upkeep for tests."""
    from workers.worker import Worker, WorkerOptions

    assert not engine.has_unfinished()
    defaults = dict(name="w-test", served_model_names=[MODEL], lease_seconds=5, block_ms=50, maintain_seconds=0.05)
    return Worker(engine, r, WorkerOptions(**{**defaults, **options}))


def submit_lines(r, records, **options) -> str:
    lines = [json.dumps(record).encode() for record in records]
    submission = submit(r, lambda: lines, **{"model": MODEL, **options})
    assert submission.accepted, submission.report.errors
    return submission.batch_id


def completion(custom_id: str, prompt, max_tokens: int = 8, **fields) -> dict:
    return {"custom_id": custom_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}


def run_until(worker, r, batch_ids, timeout: float = 120.0, statuses=batches.TERMINAL) -> dict[str, dict]:
    """Drive an in-process worker, or a list of them in turns (and the finalizer), until every batch ends."""
    deadline = time.monotonic() + timeout
    while True:
        for each in worker if isinstance(worker, list) else [worker]:
            each.run_once()
        run_finalize_jobs(r)
        objects = {b: batches.batch_object(r, b) for b in batch_ids}
        if all(o["status"] in statuses for o in objects.values()):
            return objects
        assert time.monotonic() < deadline, {b: (o["status"], o["request_counts"]) for b, o in objects.items()}


def read_lines(r, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in b"".join(read_file(r, file_id)).splitlines()]


def wait_for_batch(r, batch_id: str, timeout: float = 120) -> dict:
    """The batch once it ended, its finalize jobs run here (workers run elsewhere: a thread)."""
    deadline = time.monotonic() + timeout
    while batches.batch_object(r, batch_id)["status"] not in batches.TERMINAL:
        assert time.monotonic() < deadline, "the batch did not end"
        run_finalize_jobs(r)  # the finalizer's job, here in the test process
        time.sleep(0.1)
    return batches.batch_object(r, batch_id)
