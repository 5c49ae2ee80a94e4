"""Prometheus metrics of one worker, named after vLLM's with a `kvfleet:` prefix.
Request metrics carry `lane="online"|"batch"`."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine import EmbeddingRequestOutput, EngineStats, RequestOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
MAX_TENANT_LABELS = 32
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)


class WorkerMetrics:
    def __init__(self, worker: str, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"worker": worker, "model_name": model}
        names = list(labels)

        def gauge(name, doc):
            return Gauge(f"kvfleet:{name}", doc, names, registry=self.registry).labels(**labels)

        def counter(name, doc):
            return Counter(f"kvfleet:{name}", doc, names, registry=self.registry).labels(**labels)

        def per_lane(kind, name, doc, **options):
            metric = kind(f"kvfleet:{name}", doc, [*names, "lane"], registry=self.registry, **options)
            return {lane: metric.labels(**labels, lane=lane) for lane in ("online", "batch")}

        self.num_requests_running = gauge("num_requests_running", "Requests the engine is running")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests waiting in the engine: unstarted, or preempted and waiting "
                                          "to be recomputed")
        self.num_requests_unstarted = gauge("num_requests_unstarted", "Pulled requests the engine has not started")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.num_free_blocks = gauge("num_free_kv_blocks", "Free KV blocks")
        self.stream_pending = gauge("stream_pending", "Entries delivered to some worker, not yet acked")
        self.stream_lag = gauge("stream_lag", "Entries in the stream not yet delivered to any worker")
        self.dead_letters = gauge("dead_letters", "Entries in the dead-letter streams of this worker's streams")
        # Counted per engine step, as vLLM does: a request's prompt when its first token comes,
        # each token when it is sampled. So the work of a request that never finishes here (a
        # worker killed mid-generation) shows too.
        self.prompt_tokens = per_lane(Counter, "prompt_tokens", "Prompt tokens prefilled (counted at each "
                                      "request's first token; embeddings: when the request is done)")
        self.generation_tokens = per_lane(Counter, "generation_tokens", "Tokens sampled, counted each step")
        self.embedding_inputs = counter("embedding_inputs", "Inputs embedded (an embeddings request holds one or more)")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted by recompute")
        self.requeues = counter("requeues", "Pulled entries handed back to the stream for lack of room")
        # vLLM's prefix-cache counters, in tokens: looked up in the cache, and found there.
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.lora_loads = counter("lora_loads", "LoRA adapters copied into a device slot")
        self.num_loras_resident = gauge("num_loras_resident", "LoRA adapters in device slots")
        self._add_fleet_counters(counter)
        self._success, self._tenant_tokens = (
            Counter("kvfleet:request_success", "Finished requests by finish reason", [*names, "lane", "finished_reason"],
                    registry=self.registry),
            Counter("kvfleet:batch_tenant_tokens", "Batch work started, in fair-share tokens (prompt + max output), "
                    "by tenant: the split fair share made", [*names, "tenant"], registry=self.registry))
        self._labels = labels
        self._tenant_labels: set[str] = set()
        self.time_to_first_token = per_lane(Histogram, "time_to_first_token_seconds",
                                            "Engine arrival to first token", buckets=LATENCY_BUCKETS)
        self.inter_token_latency = per_lane(Histogram, "inter_token_latency_seconds", "Between consecutive tokens",
                                            buckets=TOKEN_BUCKETS)
        self.e2e_request_latency = per_lane(Histogram, "e2e_request_latency_seconds", "Engine arrival to finish",
                                            buckets=LATENCY_BUCKETS)
        self.request_queue_time = per_lane(Histogram, "request_queue_time_seconds",
                                           "Stream enqueue to engine start", buckets=LATENCY_BUCKETS)
        self._seen_preemptions = self._seen_prefix_queries = self._seen_prefix_hits = self._seen_recomputed = 0
        self._seen_lora_loads = 0
        self.wall_offset = time.time() - time.monotonic()  # the engine's monotonic times -> wall-clock
        self.num_generation_tokens = 0  # both lanes: the heartbeat's tokens/s
        self._token_samples: deque[tuple[float, int]] = deque()

    def _add_fleet_counters(self, counter) -> None:
        """Resumes, recomputation, failed steps and prefix affinity: the work of the fleet, not of one request."""
        # Batch work finished, in fair-share tokens (prompt + max output): the heartbeat's
        # batch_tokens_per_s, the rate a batch's ETA is reckoned at (jobs/outlook.py).
        self.num_batch_work_tokens = 0
        self._work_samples: deque[tuple[float, int]] = deque()
        self.resumed_requests = counter("resumed_requests", "Requests continued from a checkpoint another run saved")
        self.resumed_tokens = counter("resumed_tokens", "Generated tokens resumed requests did not have to generate "
                                      "again (they are prefilled instead)")
        self.recomputed_tokens = counter("recomputed_tokens", "Tokens prefilled again, beyond prefix-cache hits: "
                                         "their K/V was computed before a preemption, or by a worker that lost "
                                         "the request")
        self.failed_steps = counter("failed_steps", "Engine steps that failed for no one request: their requests "
                                                    "were handed back")
        self.failed_requests = counter("engine_failed_requests", "Requests a failed engine step was traced to: "
                                                                 "each ended alone with engine_error")
        self.affinity_forwarded = counter("affinity_forwarded", "Pulled entries forwarded to the worker that owns "
                                          "their prompt prefix (workers/affinity.py)")
        self.affinity_received = counter("affinity_received", "Entries other workers forwarded here, taken")
        self.affinity_released = counter("affinity_released", "Forwarded entries handed back to their stream: not "
                                         "started here within the affinity wait")

    def generation_tokens_per_s(self, now: float, window_seconds: float = 10.0) -> float:
        """Generated tokens per second over about the last window; call it once per heartbeat."""
        return rate_over(self._token_samples, now, self.num_generation_tokens, window_seconds)

    def batch_tokens_per_s(self, now: float, window_seconds: float = 60.0) -> float:
        """Batch work finished per second, in fair-share tokens; once per heartbeat."""
        return rate_over(self._work_samples, now, self.num_batch_work_tokens, window_seconds)

    def count_tenant_tokens(self, tenant: str, num_tokens: int) -> None:
        """Batch work started for `tenant`. The label is bounded: past MAX_TENANT_LABELS tenants,
        the rest count as "other" (a tenant name is the operator's, but not a small set)."""
        if tenant not in self._tenant_labels and len(self._tenant_labels) >= MAX_TENANT_LABELS:
            tenant = "other"
        self._tenant_labels.add(tenant)
        self._tenant_tokens.labels(**self._labels, tenant=tenant).inc(num_tokens)

    def observe_resumed(self, num_tokens: int) -> None:
        self.resumed_requests.inc()
        self.resumed_tokens.inc(num_tokens)

    def observe_embedded(self, output: EmbeddingRequestOutput, enqueued_at: float | None, lane: str) -> None:
        """An embeddings request done: its tokens and inputs, and its time since the enqueue."""
        self.prompt_tokens[lane].inc(output.num_prompt_tokens)
        self.embedding_inputs.inc(len(output.outputs))
        self._success.labels(**self._labels, lane=lane, finished_reason="stop").inc()
        if enqueued_at is not None:
            self.e2e_request_latency[lane].observe(max(0.0, time.time() - enqueued_at))

    def count_tokens(self, lane: str, num_prompt: int, num_generated: int) -> None:
        """One step's tokens of one request (the lanes count them: workers/lanes.py)."""
        if num_prompt:
            self.prompt_tokens[lane].inc(num_prompt)
        self.generation_tokens[lane].inc(num_generated)
        self.num_generation_tokens += num_generated

    def observe_finished(self, output: RequestOutput, enqueued_at: float | None, lane: str = "batch",
                         finish_reasons: list[str] | None = None) -> None:
        """`enqueued_at` is wall-clock time. A streamed (DELTA) output holds only its last
        tokens: its lane passes the finish reasons of the whole request."""
        metrics = output.metrics
        if finish_reasons is None:
            finish_reasons = [c.finish_reason or "stop" for c in output.outputs]
        for reason in finish_reasons:
            self._success.labels(**self._labels, lane=lane, finished_reason=reason).inc()
        if metrics is None:
            return
        if metrics.first_token_time is not None:
            self.time_to_first_token[lane].observe(metrics.first_token_time - metrics.arrival_time)
        for gap in metrics.inter_token_latencies:
            self.inter_token_latency[lane].observe(gap)
        if metrics.finished_time is not None:
            self.e2e_request_latency[lane].observe(metrics.finished_time - metrics.arrival_time)
        if enqueued_at is not None and metrics.first_scheduled_time is not None:
            self.request_queue_time[lane].observe(max(0.0, metrics.first_scheduled_time + self.wall_offset - enqueued_at))

    def update_engine(self, stats: EngineStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_unstarted.set(stats.num_unstarted)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_free_blocks.set(stats.num_free_blocks)
        self.num_preemptions.inc(stats.num_preemptions - self._seen_preemptions)
        self._seen_preemptions = stats.num_preemptions
        self.recomputed_tokens.inc(stats.num_recomputed_tokens - self._seen_recomputed)
        self._seen_recomputed = stats.num_recomputed_tokens
        self.prefix_cache_queries.inc(stats.num_prefix_queried_tokens - self._seen_prefix_queries)
        self.prefix_cache_hits.inc(stats.num_prefix_hit_tokens - self._seen_prefix_hits)
        self._seen_prefix_queries, self._seen_prefix_hits = stats.num_prefix_queried_tokens, stats.num_prefix_hit_tokens
        self.lora_loads.inc(stats.num_lora_loads - self._seen_lora_loads)
        self._seen_lora_loads = stats.num_lora_loads
        self.num_loras_resident.set(len(stats.resident_loras))


def rate_over(samples: deque[tuple[float, int]], now: float, total: int, window_seconds: float) -> float:
    """The rate of a running `total` over about the last window, from (time, total) samples
    taken once per call."""
    samples.append((now, total))
    while len(samples) > 2 and now - samples[1][0] >= window_seconds:
        samples.popleft()
    start, then = samples[0]
    return (total - then) / (now - start) if now > start else 0.0
