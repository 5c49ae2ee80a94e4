"""The worker's batch lane: stream entries of batches become engine work, or are
settled at once (an error result, a dead letter, a redelivery of finished work);
results go to their batch's storage through the flusher (workers/flush.py)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import redis

from engine import LLMEngine
from jobs import batches, keys
from jobs.results import error_line
from jobs.schemas import LineError, parse_line
from workers import stream_ops
from workers.flush import PendingResult, ResultFlusher
from workers.translate import EngineRequest, RequestRejected, error_code, to_engine_request

MAX_CACHED_BATCHES = 1024


@dataclass
class BatchWork:
    batch_id: str
    custom_id: str
    request: EngineRequest
    enqueued_at: float | None


def ended(batch: dict | None) -> tuple[str, str] | None:
    """(code, message) if the batch's requests must not run any more."""
    if batch is None or batch["status"] in batches.STOPPED:
        return "batch_cancelled", "The batch was cancelled before this request finished."
    if batch["status"] == "expired" or time.time() > batch["expires_at"]:
        # The status itself turns expired in finalize, once every request is counted.
        return "batch_expired", "This request could not be executed before the completion window expired."
    return None


class BatchLane:
    def __init__(self, r: redis.Redis, engine: LLMEngine, flusher: ResultFlusher, max_deliveries: int,
                 max_requeues: int) -> None:
        self.r, self.engine, self.flusher = r, engine, flusher
        self.max_deliveries, self.max_requeues = max_deliveries, max_requeues
        self.batch_cache: OrderedDict[str, dict] = OrderedDict()  # LRU, MAX_CACHED_BATCHES

    def batch(self, batch_id: str, refresh: bool = False) -> dict | None:
        if refresh or batch_id not in self.batch_cache:
            try:
                self.batch_cache[batch_id] = batches.load_fields(self.r, batch_id)
            except batches.BatchNotFound:
                self.batch_cache.pop(batch_id, None)
                return None
            if len(self.batch_cache) > MAX_CACHED_BATCHES:
                self.batch_cache.popitem(last=False)
        self.batch_cache.move_to_end(batch_id)
        return self.batch_cache[batch_id]

    def add_result(self, result: PendingResult) -> None:
        batch = self.batch(result.batch_id)
        if batch is None:  # the batch was deleted: nothing to record the result in
            if result.entry_id:
                stream_ops.ack(self.r, result.stream, result.entry_id)
            return
        self.flusher.add(batch["sink"], result)

    def accept(self, stream: str, model: str, entry_id: str, fields: dict, deliveries: int) -> BatchWork | None:
        """Turn an entry of `model`'s stream into work, or settle it here."""
        try:
            batch_id = fields[b"batch_id"].decode()
            custom_id = fields[b"custom_id"].decode()
            line, line_number = fields[b"line"], int(fields[b"line_number"])
        except (KeyError, ValueError, UnicodeDecodeError):
            stream_ops.dead_letter(self.r, stream, entry_id, fields, "malformed stream entry")
            return None
        if deliveries > self.max_deliveries:
            stream_ops.dead_letter(self.r, stream, entry_id, fields,
                                   f"delivered {deliveries} times (max_deliveries {self.max_deliveries})")
            self.add_result(PendingResult(stream, None, batch_id, error_line(
                custom_id, "max_deliveries_exceeded", f"The request failed {deliveries - 1} times on workers.")))
            return None
        requeues = int(fields.get(keys.HANDED_BACK_FIELD.encode(), 0))
        if requeues > self.max_requeues:
            self.add_result(PendingResult(stream, entry_id, batch_id, error_line(
                custom_id, "cannot_fit", f"No worker of model {model!r} had room for this request: it was handed "
                                         f"back {requeues} times (max_requeues {self.max_requeues}).")))
            return None
        batch = self.batch(batch_id)
        if batch is None:
            stream_ops.dead_letter(self.r, stream, entry_id, fields, f"no batch {batch_id}")
            return None
        if self.r.sismember(keys.partition_done(batch_id, keys.stream_partition(stream)), custom_id):
            stream_ops.ack(self.r, stream, entry_id)  # a redelivery of finished work
            return None
        stopped = ended(self.batch(batch_id, refresh=batch["status"] != "in_progress"))
        if stopped is not None:
            self.add_result(PendingResult(stream, entry_id, batch_id, error_line(custom_id, *stopped)))
            return None
        try:
            request = to_engine_request(parse_line(line, line_number), self.engine.tokenizer)
            self.engine.validate(request.prompt_token_ids, request.params)
        except (LineError, RequestRejected, ValueError) as error:
            line = error_line(custom_id, error_code(error), str(error))
            self.add_result(PendingResult(stream, entry_id, batch_id, line))
            return None
        enqueued_at = float(fields[b"enqueued_at"]) if b"enqueued_at" in fields else None
        return BatchWork(batch_id, custom_id, request, enqueued_at)
