"""The worker loop, shaped like rq's `work()`:

    while not stopping:
        maintain()   heartbeat, keep in-flight leases, cancel/expire, reclaim, trim  (every ~second)
        admit()      online entries first (workers/online.py), then batch entries:
                     XREADGROUP COUNT k, k from free KV blocks (workers/admission.py)
        step()       one engine iteration; online requests get their new tokens at once
                     (one round trip: reply events, acks, cancel checks)
        flush()      batch results -> storage (durable) -> count + XACK (one Lua script)

Redis outages back off (capped, exponential) and retry; storage targets back off
each on their own (workers/flush.py); a result is never acknowledged before it is
durable, and every pulled entry keeps its lease until it is acked. SIGTERM (or
SIGINT) drains: stop pulling, finish in-flight work within drain_seconds, hand the
rest back to the stream, exit 0. A second signal is a cold shutdown: hand back at
once and exit 1. Whatever ends the loop, unfinished work is handed back.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from dataclasses import dataclass

import redis
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    SlotNotCoveredError,
    TryAgainError,
)

from engine import LLMEngine, ParallelGroupError
from jobs import heartbeats
from jobs.results import error_line
from workers import batch_lane, stream_ops
from workers.admission import Admission, default_online_reserve
from workers.batch_lane import BatchLane
from workers.flush import PendingResult, ResultFlusher
from workers.health import Health
from workers.metrics import WorkerMetrics
from workers.online import BATCH_PRIORITY, WORKER_LOST, OnlineLane, OnlineWork
from workers.served_streams import ServedStreams
from workers.translate import EngineRequest, to_result_line

log = logging.getLogger("kvfleet.worker")
# Storage errors are workers/flush.py's. A cluster mid-failover answers CLUSTERDOWN or TRYAGAIN,
# or has no node for a slot yet: back off and retry, as for an outage.
OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError, MasterDownError,
                 ClusterError, SlotNotCoveredError)
TRIM_SECONDS = 30.0


class ColdShutdown(BaseException):
    """A second SIGTERM or SIGINT: stop now, without draining. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way (the step's) swallows it."""


@dataclass
class WorkerOptions:
    name: str
    served_model_names: list[str]  # one stream each; the first names the worker in metrics
    lease_seconds: float = 60.0
    max_deliveries: int = 3
    max_requeues: int = 100  # hand-backs for lack of room; then the request fails with cannot_fit
    drain_seconds: float = 30.0
    block_ms: int = 1000
    max_backoff_seconds: float = 5.0
    maintain_seconds: float = 1.0  # heartbeat, lease keeping and batch status checks
    online_reserve: int | None = None  # seats kept free of batch work; default: one in sixteen


@dataclass
class InFlight:
    stream: str
    entry_id: str
    batch_id: str | None  # None for online work
    custom_id: str
    request: EngineRequest
    enqueued_at: float | None
    online: OnlineWork | None = None

    @property
    def lane(self) -> str:
        return "batch" if self.online is None else "online"


def request_id(stream: str, entry_id: str) -> str:
    """The engine request id of a stream entry (entry ids are unique only within a stream)."""
    return f"{stream} {entry_id}"


class Worker:
    def __init__(self, engine: LLMEngine, r: redis.Redis, options: WorkerOptions,
                 metrics: WorkerMetrics | None = None, health: Health | None = None) -> None:
        self.engine, self.r, self.options = engine, r, options
        self.health = health or Health()
        self.health.is_loaded = True  # the engine exists
        self.streams = ServedStreams(r, options.served_model_names)
        self.metrics = metrics or WorkerMetrics(options.name, options.served_model_names[0])
        max_num_seqs = engine.config.max_num_seqs
        reserve = options.online_reserve
        self.admission = Admission(max_num_seqs, online_reserve=default_online_reserve(max_num_seqs)
                                   if reserve is None else reserve)
        self.online = OnlineLane(r, engine, self.streams.online, options.name)
        self.in_flight: dict[str, InFlight] = {}  # engine request id -> work
        self.flusher = ResultFlusher(r, options.max_backoff_seconds)
        self.batch_lane = BatchLane(r, engine, self.flusher, options.max_deliveries, options.max_requeues)
        self.stopping = False
        self.backoff = 0.0
        self.retry_at = 0.0
        self.last_maintain = self.last_trim = 0.0
        self.wall_offset = time.time() - time.monotonic()
        self.started_at = time.time()
        self.is_group_ready = False
        self.is_reclaim_due = True  # look for entries of dead workers: once per maintain interval

    # -- lifecycle ---------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self.stopping:
            raise ColdShutdown(signal.Signals(signum).name)
        self.request_stop()

    def request_stop(self) -> None:
        if not self.stopping:
            log.info("%s: stop requested; draining for up to %ss", self.options.name, self.options.drain_seconds)
        self.stopping = self.health.is_draining = True

    def work(self) -> int:
        drain_deadline, exit_code = None, 0
        try:
            while True:
                now = time.monotonic()
                if self.stopping and drain_deadline is None:
                    drain_deadline = now + self.options.drain_seconds
                if self.stopping and (not self.in_flight and not self.flusher or now >= drain_deadline):
                    break
                self.run_once()
        except ColdShutdown as signal_name:
            log.warning("%s: second %s; cold shutdown", self.options.name, signal_name)
            exit_code = 1
        except ParallelGroupError as error:  # a rank died: this engine cannot run another step
            log.error("%s: %s; handing the work back and exiting", self.options.name, error)
            exit_code = 1
        finally:
            self._hand_back_unfinished()
        return exit_code

    def run_once(self) -> None:
        self.health.last_loop_at = time.monotonic()
        if time.monotonic() >= self.retry_at:
            try:
                self._maintain()
                if not self.stopping:
                    self._admit()
                self.backoff = 0.0  # Redis answered
            except OUTAGE_ERRORS as error:
                self._back_off(f"redis: {error}")
            except redis.ResponseError as error:
                if "NOGROUP" not in str(error) and "no such key" not in str(error):
                    raise
                self.is_group_ready = self.health.is_joined = False  # the stream or group was deleted: again
                self._back_off(f"redis: {error}")
        if self.engine.has_unfinished():
            self._step()
        if time.monotonic() >= self.retry_at:  # Redis holds every target's bookkeeping: wait out its back-off
            try:
                self._answer_online()
                self.flusher.flush()
            except OUTAGE_ERRORS as error:
                self._back_off(f"recording a result failed: {error}")
        is_waiting = time.monotonic() < self.retry_at or self.flusher.is_waiting()
        if not self.engine.has_unfinished() and (self.flusher or is_waiting):
            time.sleep(0.01 if self.flusher and not is_waiting else 0.05)

    def _back_off(self, reason: str) -> None:
        self.backoff = min(self.options.max_backoff_seconds, max(0.1, self.backoff * 2))
        self.retry_at = time.monotonic() + self.backoff
        log.warning("%s: %s; retrying in %.1fs", self.options.name, reason, self.backoff)

    # -- maintenance -------------------------------------------------------------
    def _maintain(self) -> None:
        now = time.monotonic()
        if not self.is_group_ready:
            self.streams.ensure_groups()
            self.is_group_ready = self.health.is_joined = True
        if now - self.last_maintain < self.options.maintain_seconds:
            return
        self.last_maintain = now
        self.is_reclaim_due = True
        # Every pulled entry keeps its lease until it is acked: running, or finished with
        # its result not yet durable (a storage outage may last longer than the lease).
        held = [(work.stream, work.entry_id) for work in self.in_flight.values()] + self.flusher.entries()
        self.streams.keep_leases(self.options.name, held)
        self._heartbeat()
        self._check_batches()
        self._check_deadlines()
        if now - self.last_trim > TRIM_SECONDS:
            self.last_trim = now
            self.streams.trim()
        pending, lag, dead_letters = self.streams.backlog()
        self.metrics.stream_pending.set(pending)
        self.metrics.stream_lag.set(lag)
        self.metrics.dead_letters.set(dead_letters)

    def _heartbeat(self) -> None:
        stats = self.engine.stats()
        self.metrics.update_engine(stats)
        record = {"models": self.options.served_model_names, "root": self.engine.config.model,
                  "max_model_len": self.engine.max_model_len,
                  "tensor_parallel_size": self.engine.config.tensor_parallel_size,
                  "free_blocks": stats.num_free_blocks, "total_blocks": stats.num_total_blocks,
                  "running": stats.num_running, "waiting": stats.num_waiting, "unstarted": stats.num_unstarted,
                  "unstarted_blocks_needed": stats.num_unstarted_blocks_needed,
                  "preemptions": stats.num_preemptions, "in_flight": len(self.in_flight),
                  "draining": int(self.stopping), "started_at": self.started_at,
                  "tokens_per_s": round(self.metrics.generation_tokens_per_s(time.monotonic()), 1),
                  "heartbeat_seconds": self.options.maintain_seconds}
        heartbeats.record_heartbeat(self.r, self.options.name, record, max(3, int(self.options.lease_seconds)))

    def _check_batches(self) -> None:
        """Abort in-flight requests of batches cancelled or past their window."""
        for batch_id in {work.batch_id for work in self.in_flight.values() if work.batch_id is not None}:
            stopped = batch_lane.ended(self.batch_lane.batch(batch_id, refresh=True))
            if stopped is None:
                continue
            for key, work in list(self.in_flight.items()):
                if work.batch_id == batch_id:
                    self.engine.abort(key)
                    del self.in_flight[key]
                    self.batch_lane.add_result(PendingResult(work.stream, work.entry_id, batch_id,
                                                             error_line(work.custom_id, *stopped)))

    def _check_deadlines(self) -> None:
        """Abort online requests past their KVFLEET_REQUEST_TIMEOUT (the API gave up on them)."""
        now = time.time()
        for key, work in list(self.in_flight.items()):
            if work.online is not None and now > work.online.entry.deadline:
                self.engine.abort(key)
                del self.in_flight[key]
                self.online.fail(work.stream, work.entry_id, work.custom_id, 504, "request_timeout",
                                 "The request timed out (KVFLEET_REQUEST_TIMEOUT).")

    # -- admission ---------------------------------------------------------------
    def _admit(self) -> None:
        lease_ms = int(self.options.lease_seconds * 1000)
        online_work = [work.online for work in self.in_flight.values() if work.online is not None]
        online_count = self.admission.online_count(len(online_work), sum(not w.has_output for w in online_work))
        is_running = lambda stream, entry_id: request_id(stream, entry_id) in self.in_flight
        reclaim, self.is_reclaim_due = self.is_reclaim_due, False
        for stream, entry_id, work in self.online.pull(online_count, lease_ms, self.options.max_deliveries,
                                                       is_running, reclaim):
            self._start_online(stream, entry_id, work)
        count = self.admission.count(self.engine.stats())
        if count <= 0:
            return
        is_idle = not self.engine.has_unfinished() and not self.flusher
        batch_streams = self.streams.rotate()
        # Block on the streams only when idle, woken by online work as well as batch work.
        entries = stream_ops.pull(self.r, self.options.name, count, lease_ms, batch_streams if reclaim else [],
                                  self.streams.online + batch_streams if is_idle else batch_streams,
                                  self.options.block_ms if is_idle else None)
        accepted: list[tuple[dict, InFlight]] = []
        for stream, entry_id, fields, deliveries in entries:
            if stream in self.streams.online:  # woke up idle on an online request
                work = self.online.accept(stream, entry_id, fields, deliveries, self.options.max_deliveries)
                if work is not None:
                    self._start_online(stream, entry_id, work)
                continue
            if request_id(stream, entry_id) in self.in_flight:
                continue  # reclaimed our own entry: it is already running
            model = self.streams.model_of[stream]
            batch_work = self.batch_lane.accept(stream, model, entry_id, fields, deliveries)
            if batch_work is not None:
                accepted.append((fields, InFlight(stream, entry_id, batch_work.batch_id, batch_work.custom_id,
                                                  batch_work.request, batch_work.enqueued_at)))
        needed = [self.engine.num_blocks_needed(len(w.request.prompt_token_ids)) for _, w in accepted]
        for blocks in needed:
            self.admission.observe(blocks)
        num_fit = self.admission.fit(self.engine.stats(), needed)
        for fields, work in accepted[num_fit:]:  # cannot start here now: back to the fleet
            stream_ops.requeue(self.r, work.stream, work.entry_id, fields, count=True)
            self.metrics.requeues.inc()
        for _, work in accepted[:num_fit]:
            self._start(work, BATCH_PRIORITY)

    def _start_online(self, stream: str, entry_id: str, work: OnlineWork) -> None:
        self.admission.observe(self.engine.num_blocks_needed(len(work.request.prompt_token_ids)), "online")
        self._start(InFlight(stream, entry_id, None, work.entry.request_id, work.request, work.entry.enqueued_at,
                             work), priority=work.entry.priority)

    def _start(self, work: InFlight, priority: int) -> None:
        key = request_id(work.stream, work.entry_id)
        self.engine.add_request(key, work.request.prompt_token_ids, work.request.params, priority=priority)
        self.in_flight[key] = work

    # -- results -----------------------------------------------------------------
    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except ParallelGroupError:
            raise
        except Exception:  # noqa: BLE001 (one bad request must not take the worker down)
            # Which request broke the step is unknown: drop them all unacked. They return
            # after the lease, each delivery counted, and a poison one ends in the dead letters.
            log.exception("%s: engine step failed; releasing %d requests", self.options.name, len(self.in_flight))
            for key in list(self.in_flight):
                self.engine.abort(key)
                del self.in_flight[key]
            return
        self._collect(outputs)

    def _collect(self, outputs) -> None:
        for output in outputs:
            work = self.in_flight.get(output.request_id)
            if work is None:
                continue
            if work.online is not None:
                if self.online.on_output(work.stream, work.entry_id, work.online, output):
                    del self.in_flight[output.request_id]
                    self.metrics.observe_finished(output, work.enqueued_at, self.wall_offset, "online",
                                                  work.online.finish_reasons, work.online.completion_tokens)
                continue
            del self.in_flight[output.request_id]
            self.metrics.observe_finished(output, work.enqueued_at, self.wall_offset)
            batch = self.batch_lane.batch(work.batch_id) or {}
            model = batch.get("model") or self.options.served_model_names[0]
            line, usage = to_result_line(work.custom_id, work.request, output, model, self.engine.tokenizer)
            self.batch_lane.add_result(PendingResult(work.stream, work.entry_id, work.batch_id, line, usage))

    def _answer_online(self) -> None:
        """Write the step's online events and acks; abort the requests whose client is gone."""
        watched = {work.custom_id: key for key, work in self.in_flight.items() if work.online is not None}
        for online_id in self.online.flush(list(watched)):
            key = watched[online_id]
            work = self.in_flight.pop(key)
            self.engine.abort(key)
            stream_ops.ack(self.r, work.stream, work.entry_id)

    def _hand_back_unfinished(self) -> None:
        """On exit: abort what still runs and put it back on the stream for other workers.
        An online request that already streamed tokens ends with an error instead."""
        with contextlib.suppress(OUTAGE_ERRORS):
            self.online.flush([])  # events of requests that finished
        for key, work in list(self.in_flight.items()):
            if work.online is not None and work.online.has_output and work.online.entry.stream:
                self.engine.abort(key)
                del self.in_flight[key]
                self.online.fail(work.stream, work.entry_id, work.custom_id, 500, *WORKER_LOST)
        with contextlib.suppress(OUTAGE_ERRORS):
            self.online.flush([])
        for key, work in list(self.in_flight.items()):
            self.engine.abort(key)
            try:
                fields = self.r.xrange(work.stream, work.entry_id, work.entry_id)
                if fields:  # a shutdown hand-back does not count against max_requeues
                    stream_ops.requeue(self.r, work.stream, work.entry_id, fields[0][1], count=False)
            except OUTAGE_ERRORS as error:
                log.warning("%s: could not hand back %s (%s); it returns after the lease", self.options.name,
                            work.entry_id, error)
            del self.in_flight[key]
        with contextlib.suppress(OUTAGE_ERRORS):
            heartbeats.remove_worker(self.r, self.options.name)
