"""The one protocol every lane of a worker follows (online and batch; for an embedding
model, their embeddings variants in workers/embeddings_lane.py).

A lane owns its streams, the work it pulled from them and the state that work needs.
The worker loop (workers/worker.py) calls only these methods, in this order:

    pull(reclaim)        take what fits now from the lane's streams (stale entries of dead
                         workers first, with `reclaim`), turn each entry into a validated
                         engine request, start it; settle at once what can never run
    on_output(output)    take one engine step's output of a request this lane started
    settle()             make finished work durable and acknowledge it: result storage,
                         reply streams (once per loop, after the step)
    check()              stop what must not run on: a cancelled or expired batch, a request
                         past its deadline or whose client left (once per maintain interval)
    held()               every (stream, entry id) the lane has not acknowledged: the worker
                         keeps their leases (workers/leases.py)
    lose(stream, id)     another worker took that entry over: abort it, never settle it
    checkpoint()         save the progress of running generations in Redis (every
                         `checkpoint_tokens` tokens; workers/checkpoints.py), so that a worker
                         that takes an entry over continues it (once per loop, after settle)
    release()            after a failed engine step: drop everything unacknowledged; it
                         returns to the fleet after the lease, each delivery counted
    hand_back()          on exit: checkpoint what still runs, abort it and put it back on
                         its stream

NOTE: a lane's in-flight request ids are `engine_request_id(stream, entry_id)`; entry ids
are unique only within a stream.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import redis

from engine import LLMEngine, LoRARequest, ProcessedRequest, RequestOutput, SampleProgress
from jobs import keys
from workers import checkpoints, stream_ops
from workers.adapters import Adapters
from workers.admission import Admission, TokenBudget
from workers.chat_parsers import ChatParsers
from workers.metrics import WorkerMetrics
from workers.translate import EngineRequest

log = logging.getLogger("kvfleet.worker")


def engine_request_id(stream: str, entry_id: str) -> str:
    return f"{stream} {entry_id}"


@dataclass
class LaneConfig:
    """What every lane of one worker shares."""

    consumer: str  # the worker's name in the consumer group
    lease_ms: int
    max_deliveries: int
    admission: Admission
    metrics: WorkerMetrics
    token_budget: TokenBudget | None = None  # embedding workers: admission by tokens
    checkpoint_tokens: int = 0  # generated tokens between checkpoints; 0: none (embedding workers)
    adapters: Adapters | None = None  # the LoRA adapters served (workers/adapters.py)
    shared_prefix_cache: bool = False  # tenants share cached prompt blocks (--shared-prefix-cache)
    parsers: ChatParsers = ChatParsers()  # how chat answers are read (--reasoning-parser, --tool-call-parser)

    def lora_request(self, stream: str, tenant: str) -> LoRARequest | None:
        """The adapter a request of `tenant` from `stream` runs with: its model's, if that is an
        adapter (RequestRejected if it is another tenant's)."""
        return None if self.adapters is None else self.adapters.request_for(keys.model_of_any_stream(stream),
                                                                             tenant)

    def is_adapter_ready(self, stream: str) -> bool:
        """An entry of `stream` can be prepared now: its adapter, if any, needs no download, or
        the download ended (workers/adapter_downloads.py)."""
        return self.adapters is None or self.adapters.is_ready(keys.model_of_any_stream(stream))


@dataclass
class Work:
    """A pulled entry running in the engine; each lane extends it with its own state."""

    stream: str
    entry_id: str
    fields: dict  # the entry as read, to hand it back unchanged
    request: EngineRequest
    processed: ProcessedRequest  # validated by the engine, ready to start
    enqueued_at: float | None  # wall-clock seconds, for the queue-time metric
    # Checkpoints (keyword-only: the lanes' own fields keep their positions after enqueued_at).
    checkpoint_key: str | None = field(default=None, kw_only=True)  # where its progress is saved; None: never
    checkpoint_expires_at: float = field(default=0.0, kw_only=True)  # wall-clock: of no more use after
    resume: list[SampleProgress] | None = field(default=None, kw_only=True, repr=False)  # progress to continue
    checkpointed_tokens: int = field(default=0, kw_only=True)  # output tokens at its last checkpoint
    counted_tokens: int = field(default=0, kw_only=True)  # output tokens in the metrics (or resumed)
    is_prompt_counted: bool = field(default=False, kw_only=True)  # at its first token here

    @property
    def request_id(self) -> str:
        return self.processed.request_id


class Lane:
    name = "lane"  # the metrics label

    def __init__(self, r: redis.Redis, engine: LLMEngine, streams: list[str], config: LaneConfig) -> None:
        self.r, self.engine, self.streams, self.config = r, engine, streams, config
        self.in_flight: dict[str, Work] = {}  # engine request id -> work
        # Entries whose LoRA adapter is being downloaded: (stream, entry id) -> (fields, deliveries).
        # Held like running work (their leases kept), taken again once the download ended.
        self.parked: dict[tuple[str, str], tuple[dict, int]] = {}
        self.finished_checkpoints: list[str] = []  # keys of finished work, deleted at the next checkpoint()

    # -- the protocol; each lane implements these -------------------------------
    def pull(self, reclaim: bool) -> int:
        """Pull and start what fits now; returns how many entries were read."""
        raise NotImplementedError

    def on_output(self, output: RequestOutput) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError

    def is_settling(self) -> bool:
        """Finished work waits to be made durable."""
        return False

    def is_backing_off(self) -> bool:
        """All that waits to be made durable waits for a storage back-off."""
        return False

    def held(self) -> list[tuple[str, str]]:
        return [(work.stream, work.entry_id) for work in self.in_flight.values()] + list(self.parked)

    def release(self) -> None:
        for work in list(self.in_flight.values()):
            self.drop(work)
        self.parked.clear()

    def lose(self, stream: str, entry_id: str) -> bool:
        """Another worker took the entry over: stop it here at once, and never settle it.
        False when this lane does not hold it (any more)."""
        work = self.in_flight.get(engine_request_id(stream, entry_id))
        if work is not None:
            self.drop(work)
        return work is not None or self.parked.pop((stream, entry_id), None) is not None

    def hand_back(self) -> None:
        with suppress_outages():  # the next worker continues from here instead of from zero
            self.checkpoint(force=True)
        handed = []
        for work in list(self.in_flight.values()):
            self.drop(work)
            handed.append((work.stream, work.entry_id, work.fields))
        handed += [(stream, entry_id, fields) for (stream, entry_id), (fields, _) in self.parked.items()]
        self.parked.clear()
        for stream, entry_id, fields in handed:
            try:
                stream_ops.release(self.r, stream, entry_id, fields)
            except stream_ops.OUTAGE_ERRORS as error:
                log.warning("%s: could not hand back %s (%s); it returns after the lease", self.config.consumer,
                            entry_id, error)

    # -- shared by the lanes --------------------------------------------------
    def owns(self, request_id: str) -> bool:
        return request_id in self.in_flight

    def is_running(self, stream: str, entry_id: str) -> bool:
        """A reclaimed entry that this worker runs (or parks) already (its lease lapsed under a long stall)."""
        return self.owns(engine_request_id(stream, entry_id)) or (stream, entry_id) in self.parked

    def take_parked(self) -> list[tuple]:
        """The parked entries whose adapter download ended, to accept again (a failed download
        becomes the entry's error there)."""
        ready = [(stream, entry_id, fields, deliveries) for (stream, entry_id), (fields, deliveries)
                 in self.parked.items() if self.config.is_adapter_ready(stream)]
        for stream, entry_id, _, _ in ready:
            del self.parked[(stream, entry_id)]
        return ready

    def start(self, work: Work) -> None:
        """Run `work`; from its checkpoint if it has one the engine can continue."""
        if work.resume:
            try:
                self.engine.add_processed_request(work.processed, resume=work.resume)
                work.checkpointed_tokens = work.counted_tokens = sum(len(s.token_ids) for s in work.resume)
                self.config.metrics.observe_resumed(work.checkpointed_tokens)
            except ValueError as error:
                log.warning("%s: cannot resume %s (%s); it starts again", self.config.consumer, work.entry_id, error)
                self.engine.add_processed_request(work.processed)
        else:
            self.engine.add_processed_request(work.processed)
        self.in_flight[work.request_id] = work

    def count_tokens(self) -> None:
        """After each step, as vLLM counts: the tokens each running request sampled in it."""
        for work in self.in_flight.values():
            self.count(work, self.engine.num_output_tokens(work.request_id))

    def count(self, work: Work, num_output_tokens: int) -> None:
        """`work` has `num_output_tokens` now (a finished request's lane passes its total):
        count those sampled since the last count, and its prompt with its first token here."""
        num_new = num_output_tokens - work.counted_tokens
        if num_new <= 0:
            return
        num_prompt = 0 if work.is_prompt_counted else len(work.processed.prompt_token_ids)
        work.is_prompt_counted = True
        self.config.metrics.count_tokens(self.name, num_prompt, num_new)
        work.counted_tokens = num_output_tokens

    def load_checkpoints(self, works: list[Work]) -> None:
        """Attach each work's saved progress, if any (one round trip for them all)."""
        keyed = [work for work in works if work.checkpoint_key is not None]
        if self.config.checkpoint_tokens and keyed:
            for work, progress in zip(keyed, checkpoints.load_many(self.r, [w.checkpoint_key for w in keyed])):
                work.resume = progress

    def checkpoint(self, force: bool = False) -> None:
        """Save the progress of each running request that generated `checkpoint_tokens` more
        tokens since its last checkpoint (`force`: any more), and forget finished ones."""
        if not self.config.checkpoint_tokens:
            return
        pipe = self.r.pipeline(transaction=False)
        saved = self.queue_checkpoints(pipe, force)
        if saved or self.finished_checkpoints:
            self.queue_forget_finished(pipe)
            pipe.execute()
            self.mark_checkpointed(saved)

    def queue_checkpoints(self, pipe, force: bool = False) -> list[tuple[Work, int]]:
        """Queue on `pipe` the checkpoints due (see `checkpoint`); returns (work, its output
        tokens) for `mark_checkpointed` once the pipeline has run."""
        every = self.config.checkpoint_tokens
        due = [(work, num_tokens) for work in self.in_flight.values() if work.checkpoint_key is not None
               and (num_tokens := self.engine.num_output_tokens(work.request_id)) > work.checkpointed_tokens
               and (force or num_tokens - work.checkpointed_tokens >= every or self.is_checkpoint_urgent(work))]
        now, saved = time.time(), []
        for work, num_tokens in due:
            progress = self.engine.progress(work.request_id)
            if progress is not None:
                checkpoints.save(pipe, work.checkpoint_key, progress, int(work.checkpoint_expires_at - now))
                saved.append((work, num_tokens))
        return saved

    def is_checkpoint_urgent(self, work: Work) -> bool:
        """Checkpoint `work` whatever its tokens since the last one (the online lane's first tokens)."""
        return False

    def queue_forget_finished(self, pipe) -> None:
        for checkpoint_key in self.finished_checkpoints:  # one key a command: they may sit in other slots
            pipe.delete(checkpoint_key)
        self.finished_checkpoints = []

    @staticmethod
    def mark_checkpointed(saved: list[tuple[Work, int]]) -> None:
        for work, num_tokens in saved:
            work.checkpointed_tokens = num_tokens

    def forget(self, work: Work) -> None:
        """`drop` work that ended here for good (finished, failed, cancelled): its checkpoint goes too."""
        self.drop(work)
        if work.checkpoint_key is not None:
            self.finished_checkpoints.append(work.checkpoint_key)

    def drop(self, work: Work) -> None:
        """Stop running `work` here, and forget it (its entry is settled or handed back by the caller)."""
        self.engine.abort(work.request_id)
        del self.in_flight[work.request_id]

    def pull_entries(self, count: int, reclaim: bool):
        """Up to `count` entries of this lane's streams that this worker does not run already."""
        entries = stream_ops.pull(self.r, self.config.consumer, count, self.config.lease_ms,
                                  self.streams if reclaim else [], self.streams, None)
        return [entry for entry in entries if not self.is_running(entry[0], entry[1])]

    def accept(self, stream: str, entry_id: str, fields: dict, deliveries: int) -> Work | None:
        raise NotImplementedError

    def accept_or_dead_letter(self, stream: str, entry_id: str, fields: dict, deliveries: int) -> Work | None:
        """`accept`, but an entry whose data breaks it (a bug, a corrupted batch) is dead-lettered
        with the error: the worker never dies on one entry's data. An entry whose adapter is
        still downloading is parked instead."""
        if not self.config.is_adapter_ready(stream):  # downloading: the loop goes on meanwhile
            self.parked[(stream, entry_id)] = (fields, deliveries)
            return None
        try:
            return self.accept(stream, entry_id, fields, deliveries)
        except (*stream_ops.OUTAGE_ERRORS, redis.ResponseError):
            raise  # Redis itself: the loop backs off
        except Exception as error:  # noqa: BLE001
            log.exception("%s: entry %s of %s broke the %s lane; dead-lettering it", self.config.consumer,
                          entry_id, stream, self.name)
            stream_ops.dead_letter(self.r, stream, entry_id, fields, f"the worker could not take it: {error!r}")
            return None

    def dead_letter_after_max_deliveries(self, stream: str, entry_id: str, fields: dict, deliveries: int) -> bool:
        """Dead-letter an entry delivered more than max_deliveries times; True if it was."""
        if deliveries <= self.config.max_deliveries:
            return False
        stream_ops.dead_letter(self.r, stream, entry_id, fields,
                               f"delivered {deliveries} times (max_deliveries {self.config.max_deliveries})")
        return True


def suppress_outages():
    """Best effort on the way out: Redis may be gone."""
    return contextlib.suppress(*stream_ops.OUTAGE_ERRORS)
