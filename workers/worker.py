"""The worker loop, shaped like rq's `work()`:

    while not stopping:
        leases       entries another worker took over are aborted; after admission and again at
                     the end of the turn, what every lane holds goes to the lease keeper
                     (workers/leases.py), whose thread renews it
        maintain()   heartbeat, lane.check() (cancel/expire), reclaim, trim (every ~second)
        admit()      lane.pull() for each lane, online first (workers/online_lane.py), then batch
                     (workers/batch_lane.py): what fits the free KV blocks (workers/admission.py),
                     or for an embedding model the token budget (workers/embeddings_lane.py);
                     batch entries other workers forwarded here first, and fresh ones whose
                     prompt prefix another worker owns forwarded to it (workers/affinity.py);
                     when idle, block until any served stream has new work
        step()       one engine iteration; each output goes to the lane that started its request
        settle()     lane.settle(): online events and acks (one round trip), batch results ->
                     storage (durable) -> count + XACK (one Lua script)

The loop knows lanes only through their protocol (workers/lanes.py). Redis outages back
off (capped, exponential) and retry; storage targets back off each on their own
(workers/flush.py); a result is never acknowledged before it is durable, and every
pulled entry keeps its lease until it is acked, renewed from a thread whatever the loop
is waiting on. SIGTERM (or SIGINT) drains, and exits 0 once finished work is durable:
  drain_mode "finish"   stop pulling, finish in-flight work within drain_seconds, hand the
                        rest back to the stream;
  drain_mode "migrate"  stop pulling and hand in-flight work back at once, each request
                        with a checkpoint of its tokens (workers/checkpoints.py), so another
                        worker continues it: a spot reclaim's short notice loses nothing.
A second signal is a cold shutdown: hand back at once and exit 1. Whatever ends the loop,
unfinished work is handed back.
"""

from __future__ import annotations

import logging
import signal
import time
import weakref
from dataclasses import dataclass

import redis

from engine import LLMEngine, ParallelGroupError, StepFailed
from jobs import heartbeats
from workers import stream_ops
from workers.adapters import AdapterPreference, Adapters
from workers.admission import Admission, TokenBudget, default_online_reserve
from workers.affinity import Affinity
from workers.batch_lane import BatchLane
from workers.chat_parsers import ChatParsers
from workers.embeddings_lane import EmbeddingBatchLane, EmbeddingOnlineLane
from workers.flush import ResultFlusher
from workers.health import Health
from workers.lanes import Lane, LaneConfig, suppress_outages
from workers.leases import LeaseKeeper
from workers.metrics import WorkerMetrics
from workers.online_lane import OnlineLane
from workers.served_streams import ServedStreams

log = logging.getLogger("kvfleet.worker")
OUTAGE_ERRORS = stream_ops.OUTAGE_ERRORS  # storage errors are workers/flush.py's
TRIM_SECONDS = 30.0
BACKLOG_SECONDS = 5.0  # between two reads of the backlog the metrics show
DRAIN_MODES = ("finish", "migrate")
MAX_FAILED_STEPS = 3  # steps in a row that no request explains: the engine is broken; exit for a restart


class EngineBroken(RuntimeError):
    """Steps keep failing for every request alike: this process cannot serve any more."""


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
    drain_mode: str = "finish"  # "finish" or "migrate" (DRAIN_MODES)
    checkpoint_tokens: int = 16  # generated tokens between a batch request's checkpoints; 0: none
    block_ms: int = 1000
    max_backoff_seconds: float = 5.0
    maintain_seconds: float = 1.0  # heartbeat, lease keeping and batch status checks
    online_reserve: int | None = None  # seats kept free of batch work; default: one in sixteen
    prefix_affinity_wait: float = 30.0  # seconds a forwarded entry may wait at the owner of its prefix; 0: off
    adapters: Adapters | None = None  # LoRA adapters served (workers/adapters.py)
    lora_wait_seconds: float = 10.0  # an adapter's queue waits this long for a worker holding it
    shared_prefix_cache: bool = False  # tenants share cached prompt blocks (default: each its own)
    reasoning_parser: str | None = None  # None: the model type's (workers/chat_parsers.py); "none": off
    tool_call_parser: str | None = None


class Worker:
    def __init__(self, engine: LLMEngine, r: redis.Redis, options: WorkerOptions,
                 metrics: WorkerMetrics | None = None, health: Health | None = None) -> None:
        self.engine, self.r, self.options = engine, r, options
        self.health = health or Health()
        self.health.is_loaded = True  # the engine exists
        adapters = options.adapters if options.adapters is not None and options.adapters.enabled else None
        self.streams = ServedStreams(r, options.served_model_names + list(adapters.modules if adapters else ()),
                                     adapters=adapters, bases=options.served_model_names)
        self.metrics = metrics or WorkerMetrics(options.name, options.served_model_names[0])
        max_num_seqs = engine.config.max_num_seqs
        reserve = options.online_reserve
        admission = Admission(max_num_seqs, online_reserve=default_online_reserve(max_num_seqs)
                              if reserve is None else reserve)
        self.task = getattr(engine, "task", "generate")
        token_budget = TokenBudget(engine.config.max_num_batched_tokens) if self.task == "embed" else None
        config = LaneConfig(options.name, int(options.lease_seconds * 1000), options.max_deliveries, admission,
                            self.metrics, token_budget, options.checkpoint_tokens if self.task == "generate" else 0,
                            adapters, options.shared_prefix_cache,
                            ChatParsers.of_engine(engine, options.reasoning_parser, options.tool_call_parser))
        online_cls, batch_cls = (EmbeddingOnlineLane, EmbeddingBatchLane) if self.task == "embed" else (OnlineLane,
                                                                                                         BatchLane)
        self.online_lane = online_cls(r, engine, self.streams.online, config)
        affinity = Affinity(options.name, options.prefix_affinity_wait if self.task == "generate" else 0.0)
        self.batch_lane = batch_cls(r, engine, self.streams, config,
                                    ResultFlusher(r, options.name, options.max_backoff_seconds), options.max_requeues,
                                    affinity)
        if adapters is not None:
            self.batch_lane.adapter_preference = AdapterPreference(options.name, engine.config.max_loras,
                                                                   options.lora_wait_seconds)
        self.lanes: list[Lane] = [self.online_lane, self.batch_lane]  # pulled in this order
        # Renewed from a thread, so no engine step or storage put outlasts a lease; it stops with the worker.
        self.leases = LeaseKeeper(r, options.name, min(options.maintain_seconds, options.lease_seconds / 4))
        weakref.finalize(self, self.leases.stop)
        self.stopping = False
        self.cold_signal: str | None = None  # the second SIGTERM or SIGINT, once one came
        self.backoff = 0.0
        self.retry_at = 0.0
        self.last_maintain = self.last_trim = self.last_backlog = -BACKLOG_SECONDS
        self.started_at = time.time()
        self.is_group_ready = False
        self.is_reclaim_due = True  # look for entries of dead workers: once per maintain interval
        self.num_failed_steps = 0  # in a row (_on_failed_step)

    @property
    def num_in_flight(self) -> int:
        """Requests running in the engine, over every lane."""
        return sum(len(lane.in_flight) for lane in self.lanes)

    def is_settling(self) -> bool:
        """Some lane has finished work not yet durable."""
        return any(lane.is_settling() for lane in self.lanes)

    # -- lifecycle ---------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if not self.stopping:
            self.request_stop()
        elif self.cold_signal is None:
            # Recorded before raising: the raise lands in whatever frame runs, and one inside a __del__ or a
            # weakref callback is printed and dropped by Python. The loop re-raises it at its next turn.
            self.cold_signal = signal.Signals(signum).name
            raise ColdShutdown(self.cold_signal)
        # A third signal is ignored, so that it cannot cut the hand-back short.

    def request_stop(self) -> None:
        if not self.stopping:
            log.info("%s: stop requested; draining (%s) for up to %ss", self.options.name, self.options.drain_mode,
                     self.options.drain_seconds)
        self.stopping = self.health.is_draining = True

    def work(self) -> int:
        drain_deadline, exit_code = None, 0
        try:
            while True:
                if self.cold_signal is not None:
                    raise ColdShutdown(self.cold_signal)
                now = time.monotonic()
                if self.stopping and drain_deadline is None:
                    drain_deadline = now + self.options.drain_seconds
                    if self.options.drain_mode == "migrate":
                        self._migrate()
                if self.stopping and (not self.num_in_flight and not self.is_settling() or now >= drain_deadline):
                    break
                self.run_once()
        except ColdShutdown as signal_name:
            log.warning("%s: second %s; cold shutdown", self.options.name, signal_name)
            exit_code = 1
        except (ParallelGroupError, EngineBroken) as error:  # this engine cannot run another step
            log.error("%s: %s; handing the work back and exiting", self.options.name, error)
            exit_code = 1
        finally:
            self._hand_back_unfinished()
        return exit_code

    def run_once(self) -> None:
        self.health.last_loop_at = time.monotonic()
        self._abort_lost()
        if time.monotonic() >= self.retry_at:
            try:
                self._maintain()
                if not self.stopping:
                    self._admit()
                self.backoff = 0.0  # Redis answered
            except OUTAGE_ERRORS as error:
                self._back_off(f"redis: {error}")
            except redis.ResponseError as error:
                if not stream_ops.is_gone(error):
                    raise
                self.is_group_ready = self.health.is_joined = False  # the stream or group was deleted: again
                self._back_off(f"redis: {error}")
        self._hold_leases()  # what this turn pulled, before a long step or a slow storage put
        if self.engine.has_unfinished():
            self._step()
        if time.monotonic() >= self.retry_at:  # Redis holds every target's bookkeeping: wait out its back-off
            try:
                for lane in self.lanes:
                    lane.settle()
                    lane.checkpoint()
            except OUTAGE_ERRORS as error:
                self._back_off(f"recording a result failed: {error}")
        self._hold_leases()  # without what this turn acked
        is_settling = self.is_settling()
        is_waiting = time.monotonic() < self.retry_at or any(lane.is_backing_off() for lane in self.lanes)
        if not self.engine.has_unfinished() and (is_settling or is_waiting):
            time.sleep(0.01 if is_settling and not is_waiting else 0.05)

    def _back_off(self, reason: str) -> None:
        self.backoff = min(self.options.max_backoff_seconds, max(0.1, self.backoff * 2))
        self.retry_at = time.monotonic() + self.backoff
        log.warning("%s: %s; retrying in %.1fs", self.options.name, reason, self.backoff)

    # -- maintenance -------------------------------------------------------------
    def _hold_leases(self) -> None:
        self.leases.hold([entry for lane in self.lanes for entry in lane.held()])

    def _abort_lost(self) -> None:
        """Abort here what another worker took over (the lease keeper found it owned by them)."""
        self.leases.start_once()
        num_lost = sum(lane.lose(stream, entry_id) for stream, entry_id in self.leases.take_lost()
                       for lane in self.lanes)
        if num_lost:
            log.warning("%s: %d entries are no longer this worker's (taken over by another worker, settled by the "
                        "sweep at their batch's deadline, or their batch ended); aborted here", self.options.name,
                        num_lost)

    def _maintain(self) -> None:
        now = time.monotonic()
        if not self.is_group_ready:
            self.streams.ensure_groups()
            self.is_group_ready = self.health.is_joined = True
        if now - self.last_maintain < self.options.maintain_seconds:
            return
        self.last_maintain = now
        self.is_reclaim_due = True
        self._heartbeat()
        preference = self.batch_lane.adapter_preference
        if self.batch_lane.affinity.enabled or preference is not None:  # who holds which prefix group or adapter
            records = heartbeats.live_workers(self.r)
            if preference is not None:
                preference.refresh(records)
        if self.batch_lane.affinity.enabled:
            summary = self.batch_lane.summary
            summary.publish(now)
            self.batch_lane.affinity.refresh(records, summary.read_all([w["name"] for w in records], now))
        for lane in self.lanes:
            lane.check()
        if now - self.last_trim > TRIM_SECONDS:
            self.last_trim = now
            self.streams.trim()
        if now - self.last_backlog >= BACKLOG_SECONDS:  # reads grow with the models served (adapters), not work
            self.last_backlog = now
            pending, lag, dead_letters = self.streams.backlog()
            self.metrics.stream_pending.set(pending)
            self.metrics.stream_lag.set(lag)
            self.metrics.dead_letters.set(dead_letters)

    def _heartbeat(self) -> None:
        stats = self.engine.stats()
        self.metrics.update_engine(stats)
        record = {"models": self.streams.models, "root": self.engine.config.model, "task": self.task,
                  "max_model_len": self.engine.max_model_len,
                  "tensor_parallel_size": self.engine.config.tensor_parallel_size,
                  "num_params": self.engine.num_params, "num_active_params": self.engine.num_active_params,
                  "weights": self.engine.weights_summary(),
                  "free_blocks": stats.num_free_blocks, "total_blocks": stats.num_total_blocks,
                  "running": stats.num_running, "waiting": stats.num_waiting, "unstarted": stats.num_unstarted,
                  "unstarted_blocks_needed": stats.num_unstarted_blocks_needed,
                  "preemptions": stats.num_preemptions, "in_flight": self.num_in_flight,
                  "draining": int(self.stopping), "started_at": self.started_at,
                  "tokens_per_s": round(self.metrics.generation_tokens_per_s(time.monotonic()), 1),
                  "batch_tokens_per_s": round(self.metrics.batch_tokens_per_s(time.monotonic()), 1),
                  "heartbeat_seconds": self.options.maintain_seconds,
                  "forwarded_waiting": self.batch_lane.forwarded.num_waiting,
                  "max_num_seqs": self.engine.config.max_num_seqs, **self._lora_record(stats)}
        if hasattr(self.engine, "kv_cache_dtype"):  # an embedding engine keeps no KV cache
            record["kv_cache_dtype"] = self.engine.kv_cache_dtype
        heartbeats.record_heartbeat(self.r, self.options.name, record, max(3, int(self.options.lease_seconds)))

    def _lora_record(self, stats) -> dict:
        """The heartbeat's LoRA fields: each adapter's base and folder, the resolver prefixes, and
        the adapters held here (in a slot, or with requests queued: workers/adapters.py)."""
        adapters = self.streams.adapters
        if adapters is None:
            return {}
        base = self.options.served_model_names[0]
        served = [m for m in self.streams.models if adapters.is_adapter(m)]
        return {"lora_parents": {m: [base, adapters.modules.get(m, m)] for m in served},
                "lora_resolvers": adapters.resolvers, "lora_loads": stats.num_lora_loads,
                "lora_held": sorted(set(stats.resident_loras) | set(stats.busy_loras))}

    # -- admission ---------------------------------------------------------------
    def _admit(self) -> None:
        reclaim, self.is_reclaim_due = self.is_reclaim_due, False
        for lane in self.lanes:
            lane.pull(reclaim)
        if not self.engine.has_unfinished() and not self.is_settling():
            # Idle: sleep until an online stream or a model's batch arrivals have new work. The
            # arrivals' marks are read before a last look at the batch backlog, so that nothing
            # arriving after that look is slept through.
            marks = self.streams.arrival_marks()
            if not self.streams.refresh(force=True):
                stream_ops.wait_for_new(self.r, [stream for lane in self.lanes for stream in lane.streams],
                                        self.options.block_ms, marks)

    # -- results -----------------------------------------------------------------
    def _step(self) -> None:
        try:
            outputs = self.engine.step()  # a request that breaks a step fails alone (engine/isolation.py)
        except ParallelGroupError:
            raise
        except Exception as error:  # noqa: BLE001 (StepFailed, or a bug outside the model's run)
            self._on_failed_step(error)
            return
        self.num_failed_steps = 0
        for output in outputs:
            if getattr(output, "error_code", None) == "engine_error":
                self.metrics.failed_requests.inc()
            lane = next((lane for lane in self.lanes if lane.owns(output.request_id)), None)
            if lane is not None:
                lane.on_output(output)
        if self.task == "generate":
            for lane in self.lanes:
                lane.count_tokens()

    def _on_failed_step(self, error: Exception) -> None:
        """No request explains the failure: every request goes back to its stream uncounted (no
        request is at fault, so none may end in the dead letters for it), and the worker waits
        before it pulls again. Failing MAX_FAILED_STEPS times in a row, it exits for a restart."""
        self.num_failed_steps += 1
        log.error("%s: engine step failed (%d in a row), no request at fault: %s: %s; handing back %d requests",
                  self.options.name, self.num_failed_steps, type(error).__name__, error, self.num_in_flight,
                  exc_info=not isinstance(error, StepFailed))
        self.metrics.failed_steps.inc()
        for lane in self.lanes:
            lane.hand_back()
        self._hold_leases()
        if self.num_failed_steps >= MAX_FAILED_STEPS:
            raise EngineBroken(f"{self.num_failed_steps} engine steps in a row failed for every request") from error
        self._back_off(f"engine step failed: {error}")

    def _migrate(self) -> None:
        """Hand every running request back now, checkpointed; finished work still settles."""
        num_running = self.num_in_flight
        for lane in self.lanes:
            lane.hand_back()
        self._hold_leases()  # without what went back
        log.info("%s: migrated %d running requests back to their streams", self.options.name, num_running)

    def _hand_back_unfinished(self) -> None:
        """On exit: every lane aborts what still runs and puts it back on its stream (an
        online request that already streamed tokens ends with an error instead)."""
        for lane in self.lanes:
            lane.hand_back()
        self.leases.stop()
        with suppress_outages():
            heartbeats.remove_worker(self.r, self.options.name)
