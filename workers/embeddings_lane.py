"""The embeddings lanes: what a worker serving an embedding model runs instead of the
generation lanes, in the same protocol (workers/lanes.py), online first, then batch.

They differ from the generation lanes in three things only:
  * admission counts tokens, not KV blocks (workers/admission.py: TokenBudget);
  * an entry is an embeddings request (one or more inputs) for the EmbeddingEngine;
  * an output is whole: a batch line's OpenAI embeddings body, or one `Done` reply event
    carrying the online answer's body (embeddings are never streamed).
Everything else (leases, dead letters, cancelled and expired batches, result storage,
attempts and cancel keys of online requests) is the generation lanes' own code.
"""

from __future__ import annotations

from engine import EmbeddingRequestOutput, ProcessedEmbeddingRequest
from jobs.online import Done, Error, OnlineEntry
from jobs.results import error_line, success_line
from jobs.schemas import Request
from workers.batch_lane import BATCH_PRIORITY, BatchLane
from workers.flush import PendingResult
from workers.lanes import Lane
from workers.online_lane import OnlineLane
from workers.translate import EmbeddingRequest, to_embedding_request, to_embedding_response


def pull_by_tokens(lane: Lane, reclaim: bool) -> int:
    """Pull what the token budget allows and start it; returns how many entries were read."""
    budget = lane.config.token_budget
    count = budget.count(lane.engine.num_pending_tokens)
    if count <= 0:
        return 0
    entries = lane.pull_entries(count, reclaim)
    for entry in entries:
        work = lane.accept_or_dead_letter(*entry)
        if work is not None:
            budget.observe(work.processed.num_tokens)
            lane.start(work)
    return len(entries)


class EmbeddingOnlineLane(OnlineLane):
    def pull(self, reclaim: bool) -> int:
        return pull_by_tokens(self, reclaim)

    def prepare(self, request_id: str, entry: OnlineEntry,
                stream: str) -> tuple[EmbeddingRequest, ProcessedEmbeddingRequest]:
        request = to_embedding_request(Request(custom_id=entry.request_id, url=entry.url, body=entry.body))
        return request, self.engine.process_request(request_id, request.inputs, request.params,
                                                    priority=entry.priority)

    def on_output(self, output: EmbeddingRequestOutput) -> None:
        """The whole answer in one event, then the ack."""
        work = self.in_flight.pop(output.request_id)
        if output.error is not None:  # a failed step was traced to it
            self.fail_work(work, Error(400, output.error_code or "request_failed", output.error))
            return
        self.config.metrics.observe_embedded(output, work.enqueued_at, "online")
        body, usage = to_embedding_response(work.request, output, work.entry.body.get("model", ""))
        self.emit(work.entry.request_id, Done(usage.as_openai(), body=body), work)
        self.acks.append((work.stream, work.entry_id))


class EmbeddingBatchLane(BatchLane):
    def pull(self, reclaim: bool) -> int:
        return pull_by_tokens(self, reclaim)

    def prepare(self, request_id: str, line: Request, stream: str,
                tenant: str) -> tuple[EmbeddingRequest, ProcessedEmbeddingRequest]:
        request = to_embedding_request(line)
        return request, self.engine.process_request(request_id, request.inputs, request.params,
                                                    priority=BATCH_PRIORITY)

    def cost(self, work) -> int:
        return work.processed.num_tokens

    def on_output(self, output: EmbeddingRequestOutput) -> None:
        work = self.in_flight.pop(output.request_id)
        self.config.metrics.num_batch_work_tokens += self.cost(work)
        if output.error is not None:  # a failed step was traced to it
            line = error_line(work.custom_id, output.error_code or "request_failed", output.error)
            self.add_result(PendingResult(work.stream, work.entry_id, work.batch_id, line))
            return
        self.config.metrics.observe_embedded(output, work.enqueued_at, "batch")
        model = (self.batch(work.batch_id) or {}).get("model") or self.served.model_of(work.stream)
        body, usage = to_embedding_response(work.request, output, model)
        self.add_result(PendingResult(work.stream, work.entry_id, work.batch_id, success_line(work.custom_id, body),
                                      usage))
