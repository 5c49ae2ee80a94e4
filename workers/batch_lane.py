"""The worker's batch lane: entries of its models' batch streams (jobs/entries.py's
BatchEntry) become engine work, or are settled at once (an error result, a dead letter, a
redelivery of finished work); results go to their batch's storage through the flusher
(workers/flush.py), which acks each entry only once its result is durable.

How much it pulls is workers/admission.py's: what the free KV blocks hold, beyond the
online reserve; what it pulled but cannot start now goes back to the stream at once.
Whose it pulls is workers/fair_share.py's: each batch has its own stream (jobs/queues.py),
and fair share picks among them by tenant share, then deadline. Entries other workers
forwarded here come first; fresh entries whose prompt prefix another worker holds are
forwarded to it (workers/affinity.py).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import redis

from engine import LLMEngine, ProcessedRequest, RequestOutput
from jobs import backlog, batches, keys
from jobs.backlog import Head
from jobs.entries import BatchEntry, MalformedEntry
from jobs.results import error_line
from jobs.schemas import MAX_PRIORITY, Request, parse_line
from jobs.tenants import DEFAULT_TENANT
from workers import stream_ops
from workers.adapters import AdapterPreference
from workers.affinity import AFFINITY_OFF, Affinity, Forwarded, GroupSummary, claim_groups, forward
from workers.fair_share import Candidate, FairShare
from workers.flush import PendingResult, ResultFlusher
from workers.lanes import Lane, LaneConfig, Work, engine_request_id
from workers.served_streams import ServedStreams
from workers.translate import (
    EngineRequest,
    error_code,
    error_message,
    prefix_cache_salt,
    to_engine_request,
    to_result_line,
)

MAX_CACHED_BATCHES = 1024
CHECKPOINT_GRACE_SECONDS = 3600  # a checkpoint outlives its batch's window by this, then expires
BATCH_PRIORITY = MAX_PRIORITY + 1  # the engine priority of batch work: below every online priority


@dataclass
class BatchWork(Work):
    batch_id: str = ""
    custom_id: str = ""


def stop_reason(batch: dict | None) -> tuple[str, str] | None:
    """(code, message) if the batch's requests must not run any more."""
    if batch is None or batch["status"] in batches.STOPPED:
        return batches.CANCELLED_REQUEST
    if batch["status"] == "expired" or time.time() > batch["expires_at"]:
        # The status itself turns expired in finalize, once every request is counted.
        return batches.EXPIRED_REQUEST
    return None


@contextlib.contextmanager
def gone_streams_skipped():
    """A batch stream retired while this worker looked at it (its batch ended) holds nothing."""
    try:
        yield
    except redis.ResponseError as error:
        if not stream_ops.is_gone(error):
            raise


class BatchLane(Lane):
    name = "batch"

    def __init__(self, r: redis.Redis, engine: LLMEngine, served: ServedStreams, config: LaneConfig,
                 flusher: ResultFlusher, max_requeues: int, affinity: Affinity | None = None) -> None:
        super().__init__(r, engine, served.batch, config)
        self.served, self.flusher, self.max_requeues = served, flusher, max_requeues
        self.affinity = affinity or Affinity(config.consumer, wait_seconds=0)
        self.forwarded = Forwarded(r, config.consumer)
        self.summary = GroupSummary(r, config.consumer)  # the prefix groups it ran last, published
        self.adapter_preference: AdapterPreference | None = None  # set by the worker when it serves adapters
        self.fair_share = FairShare(name=config.consumer)
        self.batch_cache: OrderedDict[str, dict] = OrderedDict()  # LRU, MAX_CACHED_BATCHES

    # -- the lane protocol ------------------------------------------------------
    def pull(self, reclaim: bool) -> int:
        admission = self.config.admission
        ready = self.take_parked()  # entries whose adapter's download ended
        count = admission.count(self.engine.stats()) - len(self.parked) - len(ready)  # they will run here too
        if count <= 0 and not ready:
            return 0
        entries = self.take_forwarded(count) if self.affinity.enabled and count > 0 else []
        entries = ready + entries + self.forward_to_owners(self.pull_entries(count - len(entries), reclaim))
        accepted = [work for entry in entries if (work := self.accept_or_dead_letter(*entry)) is not None]
        self.load_checkpoints(accepted)
        needed = [self.engine.num_blocks_needed(len(work.processed.prompt_token_ids)) for work in accepted]
        for blocks in needed:
            admission.observe(blocks)
        num_fit = admission.fit(self.engine.stats(), needed)
        for work in accepted[num_fit:]:  # cannot start here now: back to the fleet
            stream_ops.requeue(self.r, work.stream, work.entry_id, work.fields)
            self.config.metrics.requeues.inc()
        for work in accepted[:num_fit]:
            self.start(work)
        return len(entries)

    def pull_entries(self, count: int, reclaim: bool) -> list[tuple]:
        """Up to `count` entries: stale ones of dead workers first (with `reclaim`), then new
        ones of the tenants fair share picks (workers/fair_share.py), from the backlog's summary
        (jobs/backlog.py)."""
        if count <= 0:
            return []
        entries = []
        if reclaim:
            with_pending = self.served.with_pending()
            entries = self.reclaim(with_pending, count)
            backlog.prune_delivered(self.r, with_pending)
        plan = self.fair_share.plan(self.candidates(self.served.refresh(), count), count - len(entries))
        entries += [(stream, entry_id, fields, 1) for stream, entry_id, fields in self.served.read(self.config.consumer,
                                                                                                   plan)]
        return [entry for entry in entries if not self.is_running(entry[0], entry[1])]

    def reclaim(self, streams: list[str], count: int) -> list[tuple]:
        """Entries of dead workers (idle past the lease), up to `count`."""
        entries: list[tuple] = []
        for stream in streams:
            with gone_streams_skipped():
                entries += [(stream, *entry) for entry in stream_ops.reclaim_stale(
                    self.r, stream, self.config.consumer, self.config.lease_ms, count - len(entries))]
        return entries

    def candidates(self, heads: list[Head], count: int) -> list[Candidate]:
        """The tenants with ready work, each with its weight; of a LoRA adapter's, those the
        adapter preference reads now (workers/adapters.py)."""
        return [Candidate(head, head.tenant, self.served.weights.get(head.tenant, 1.0), count)
                for head in self.preferred_by_adapter(heads)]

    def preferred_by_adapter(self, queues: list[Head]) -> list[Head]:
        """The base model's queues, and those of the adapters this worker reads now."""
        preference, adapters = self.adapter_preference, self.config.adapters
        if preference is None:
            return queues
        wanted = sorted({queue.model for queue in queues if adapters.is_adapter(queue.model)})
        if not wanted:
            return queues
        stats = self.engine.stats()
        chosen = preference.choose(wanted, set(stats.resident_loras) | set(stats.busy_loras), set(stats.busy_loras))
        return [queue for queue in queues if not adapters.is_adapter(queue.model) or queue.model in chosen]

    def tenant_of(self, batch_id: str) -> str | None:
        """The batch's tenant; None if it was deleted. A batch whose hash is broken is the default
        tenant's here: its entries are dead-lettered when taken (accept_or_dead_letter)."""
        try:
            batch = self.batch(batch_id)
        except Exception:  # noqa: BLE001
            return DEFAULT_TENANT
        return None if batch is None else batch.get("tenant") or DEFAULT_TENANT

    def charge(self, work: BatchWork) -> None:
        """Count started work against its tenant's share."""
        tenant, cost = self.tenant_of(work.batch_id) or DEFAULT_TENANT, self.cost(work)
        self.fair_share.charge(tenant, self.served.weights.get(tenant, 1.0), cost)
        self.config.metrics.count_tenant_tokens(tenant, cost)

    def cost(self, work: Work) -> int:
        """The tokens a request may take: its prompt and max_tokens for each choice."""
        params = work.request.params
        return len(work.processed.prompt_token_ids) + params.max_tokens * params.n

    def start(self, work: Work) -> None:
        super().start(work)
        self.charge(work)
        if self.affinity.enabled:
            self.summary.add(work.fields.get(b"prefix"))

    def take_forwarded(self, count: int) -> list[tuple]:
        """Entries other workers forwarded here, up to `count`."""
        entries = []
        for stream in self.streams_with_pending():
            held = {entry_id for s, entry_id in self.held() if s == stream}
            with gone_streams_skipped():
                entries += self.forwarded.take(stream, held, count - len(entries))
        self.config.metrics.affinity_received.inc(len(entries))
        return entries

    def streams_with_pending(self) -> list[str]:
        """The streams some worker holds entries of: only they can hold forwarded ones."""
        return self.served.with_pending()

    def forward_to_owners(self, entries: list[tuple]) -> list[tuple]:
        """Forward the fresh entries another worker's prefix cache serves better; the rest stay."""
        if not self.affinity.enabled:
            return entries
        fresh = [(self.served.model_of(stream), stream, entry_id, fields)
                 for stream, entry_id, fields, deliveries in entries if deliveries == 1]
        claims = {model: claim_groups(self.r, model, self.affinity.proposed_claims(
            model, [fields for m, _, _, fields in fresh if m == model])) for model in {m for m, *_ in fresh}}
        moves: dict[tuple[str, str], list[str]] = {}
        for model, stream, entry_id, fields in fresh:
            if (owner := self.affinity.destination(model, fields, claims.get(model, {}))) is not None:
                moves.setdefault((stream, owner), []).append(entry_id)
        moved = set()
        for (stream, owner), entry_ids in moves.items():
            moved.update((stream, entry_id) for entry_id in forward(self.r, stream, self.config.consumer, owner,
                                                                     entry_ids))
        self.config.metrics.affinity_forwarded.inc(len(moved))
        return [entry for entry in entries if (entry[0], entry[1]) not in moved]

    def release_stale_forwarded(self) -> None:
        """Entries forwarded here and not started within the affinity wait go back to their
        stream, for any worker: affinity never holds work up longer than that."""
        for stream in self.streams_with_pending():
            held = {entry_id for s, entry_id in self.held() if s == stream}
            with gone_streams_skipped():
                for entry_id, fields in self.forwarded.stale(stream, held, self.affinity.wait_seconds):
                    stream_ops.release(self.r, stream, entry_id, {**fields, **AFFINITY_OFF})
                    self.config.metrics.affinity_released.inc()

    def on_output(self, output: RequestOutput) -> None:
        work = self.in_flight.pop(output.request_id)  # batch outputs arrive finished (FINAL_ONLY)
        self.config.metrics.num_batch_work_tokens += self.cost(work)
        if work.checkpoint_key is not None:
            self.finished_checkpoints.append(work.checkpoint_key)
        self.count(work, sum(len(c.token_ids) for c in output.outputs))
        self.config.metrics.observe_finished(output, work.enqueued_at)
        if output.error is not None:  # its grammar did not compile, or a step failed because of it
            line = error_line(work.custom_id, output.error_code or "request_failed", output.error)
            self.add_result(PendingResult(work.stream, work.entry_id, work.batch_id, line))
            return
        model = (self.batch(work.batch_id) or {}).get("model") or self.served.model_of(work.stream)
        line, usage = to_result_line(work.custom_id, work.request, output, model, self.engine.tokenizer)
        self.add_result(PendingResult(work.stream, work.entry_id, work.batch_id, line, usage))

    def settle(self) -> None:
        self.flusher.flush()

    def check(self) -> None:
        """Abort in-flight requests of batches cancelled or past their window; hand back
        forwarded entries that waited too long here."""
        if self.affinity.enabled:
            self.release_stale_forwarded()
        for batch_id in {work.batch_id for work in self.in_flight.values()}:
            reason = stop_reason(self.batch(batch_id, refresh=True))
            if reason is None:
                continue
            for work in [w for w in self.in_flight.values() if w.batch_id == batch_id]:
                self.forget(work)
                self.add_result(PendingResult(work.stream, work.entry_id, batch_id, error_line(work.custom_id,
                                                                                               *reason)))

    def is_settling(self) -> bool:
        return bool(self.flusher)

    def is_backing_off(self) -> bool:
        return self.flusher.is_waiting()

    def lose(self, stream: str, entry_id: str) -> bool:
        return self.flusher.discard(stream, entry_id) | super().lose(stream, entry_id)

    def held(self) -> list[tuple[str, str]]:
        # Finished with its result not yet durable: a storage outage may outlast the lease.
        return super().held() + self.flusher.entries()

    # -- entries ----------------------------------------------------------------
    def batch(self, batch_id: str, refresh: bool = False) -> dict | None:
        if refresh or batch_id not in self.batch_cache:
            try:
                self.batch_cache[batch_id] = batches.load_hash(self.r, batch_id)  # its counts are not needed here
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

    def accept(self, stream: str, entry_id: str, fields: dict, deliveries: int) -> BatchWork | None:
        """Turn an entry into validated work, or settle it here."""
        try:
            entry = BatchEntry.from_fields(fields)
        except MalformedEntry:
            stream_ops.dead_letter(self.r, stream, entry_id, fields, "malformed stream entry")
            return None
        if self._is_settled(stream, entry_id, fields, deliveries, entry):
            return None
        try:
            request, processed = self.prepare(engine_request_id(stream, entry_id),
                                              parse_line(entry.line, entry.line_number), stream,
                                              self.tenant_of(entry.batch_id) or DEFAULT_TENANT)
        except (*stream_ops.OUTAGE_ERRORS, redis.ResponseError):
            raise  # Redis itself: the loop backs off
        except Exception as error:  # noqa: BLE001 (whatever breaks on one line is that line's error)
            line = error_line(entry.custom_id, error_code(error), error_message(error))
            self.add_result(PendingResult(stream, entry_id, entry.batch_id, line))
            return None
        return BatchWork(stream, entry_id, fields, request, processed, entry.enqueued_at,
                         checkpoint_key=keys.checkpoint(entry.batch_id, entry.custom_id),
                         checkpoint_expires_at=float((self.batch(entry.batch_id) or {}).get("expires_at", time.time()))
                         + CHECKPOINT_GRACE_SECONDS,
                         batch_id=entry.batch_id, custom_id=entry.custom_id)

    def prepare(self, request_id: str, line: Request, stream: str,
                tenant: str) -> tuple[EngineRequest, ProcessedRequest]:
        """The engine's request for a line, validated (ValueError if it can never run here)."""
        request = to_engine_request(line, self.engine.tokenizer, self.engine.default_sampling_params,
                                    self.config.parsers)
        processed = self.engine.process_request(request_id, request.prompt_token_ids, request.params,
                                                priority=BATCH_PRIORITY,
                                                lora_request=self.config.lora_request(stream, tenant),
                                                cache_salt=prefix_cache_salt(tenant, request.body,
                                                                             self.config.shared_prefix_cache))
        return request, processed

    def _is_settled(self, stream: str, entry_id: str, fields: dict, deliveries: int, entry: BatchEntry) -> bool:
        """Settle an entry that must not run: delivered too often, handed back too often, of a
        deleted, cancelled or expired batch, or finished already (a redelivery)."""
        if self.dead_letter_after_max_deliveries(stream, entry_id, fields, deliveries):
            self.add_result(PendingResult(stream, None, entry.batch_id, error_line(
                entry.custom_id, "max_deliveries_exceeded", f"The request failed {deliveries - 1} times on workers.")))
            return True
        if entry.requeues > self.max_requeues:
            model = self.served.model_of(stream)
            self.add_result(PendingResult(stream, entry_id, entry.batch_id, error_line(
                entry.custom_id, "cannot_fit", f"No worker of model {model!r} had room for this request: it was "
                                               f"handed back {entry.requeues} times (max_requeues {self.max_requeues}).")))
            return True
        batch = self.batch(entry.batch_id)
        if batch is None:
            stream_ops.dead_letter(self.r, stream, entry_id, fields, f"no batch {entry.batch_id}")
            return True
        if self.r.sismember(keys.partition_done(entry.batch_id, keys.stream_partition(stream)), entry.custom_id):
            stream_ops.ack(self.r, stream, entry_id)  # a redelivery of finished work
            return True
        reason = stop_reason(self.batch(entry.batch_id, refresh=batch["status"] != "in_progress"))
        if reason is not None:
            self.add_result(PendingResult(stream, entry_id, entry.batch_id, error_line(entry.custom_id, *reason)))
            return True
        return False
