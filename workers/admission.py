"""How many stream entries a worker may pull now, per lane.

Batch lane, on the engine's own numbers (EngineStats):

    k = 0                                   if any request waits in the engine (unstarted,
                                            or preempted and waiting to be recomputed)
    k = min(free_seats, spare_blocks // blocks_per_request)   otherwise, where
        free_seats         = max_num_seqs - running - online_reserve
        spare_blocks       = free_blocks - running - online_reserve * online_blocks_per_request
                             (one block of growth kept for each running sequence; the
                             online blocks are not kept when nothing runs, so that any
                             request the pool can hold starts on an idle worker)
        blocks_per_request = a running estimate of the blocks a new request needs to
                             start (its prompt + 1 token), never below 1; one for each lane

After a pull, `fit` keeps only the requests whose prompts fit the spare blocks
together; the rest are handed back to the stream at once, so no worker ever
holds pulled-but-unstartable work that another worker could run.

Online lane: room is reserved for it. Batch work never takes the last
`online_reserve` seats, nor the blocks they would start with, so an online request
that arrives usually starts in the next step without preempting anything. Beyond
the reserve, online requests take seats and blocks from batch work: the engine
schedules by (priority, arrival) and preempts batch sequences first. So

    k_online = 0                             if a pulled online request has not produced
                                             its first token yet (this worker is full:
                                             leave the next ones to other workers)
    k_online = max_num_seqs - online_in_flight   otherwise
"""

from __future__ import annotations

import math

from engine import EngineStats


def default_online_reserve(max_num_seqs: int) -> int:
    """One seat in sixteen, at least one."""
    return max(1, math.ceil(max_num_seqs / 16))


class Admission:
    def __init__(self, max_num_seqs: int, initial_blocks_per_request: float = 8.0, smoothing: float = 0.2,
                 online_reserve: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.blocks_per_request = initial_blocks_per_request
        self.online_blocks_per_request = initial_blocks_per_request
        self.smoothing = smoothing
        self.online_reserve = min(online_reserve, max_num_seqs - 1)  # batch work keeps one seat at least

    def observe(self, num_blocks: int) -> None:
        """Update the batch lane's estimate with the start-up blocks of a request just seen."""
        self.blocks_per_request += self.smoothing * (num_blocks - self.blocks_per_request)

    def observe_online(self, num_blocks: int) -> None:
        """The same for the online lane's estimate (the blocks its reserve keeps)."""
        self.online_blocks_per_request += self.smoothing * (num_blocks - self.online_blocks_per_request)

    def spare_blocks(self, stats: EngineStats) -> int:
        """Blocks batch work may start with: free ones, less one of growth per running
        sequence and, while anything runs, the online reserve."""
        reserved = math.ceil(self.online_reserve * max(1.0, self.online_blocks_per_request))
        return max(0, stats.num_free_blocks - stats.num_running - (reserved if stats.num_running else 0))

    def count(self, stats: EngineStats) -> int:
        """Batch entries to pull."""
        if stats.num_waiting:
            return 0
        free_seats = self.max_num_seqs - stats.num_running - self.online_reserve
        return max(0, min(free_seats, int(self.spare_blocks(stats) // max(1.0, self.blocks_per_request))))

    def online_count(self, num_online: int, num_online_unstarted: int) -> int:
        """Online entries to pull."""
        if num_online_unstarted:
            return 0
        return max(0, self.max_num_seqs - num_online)

    def fit(self, stats: EngineStats, blocks_needed: list[int]) -> int:
        """How many of the pulled batch requests, in order, can start with the spare blocks."""
        spare, admitted = self.spare_blocks(stats), 0
        for needed in blocks_needed:
            if needed > spare:
                break
            spare -= needed
            admitted += 1
        return admitted


class TokenBudget:
    """Embedding workers hold no KV blocks: they pull by tokens. Both lanes (online first)
    pull while the engine's pending tokens are under `steps_ahead` steps of
    max_num_batched_tokens, so the next step is always full and nothing waits long here:

        k = max(1, (steps_ahead * max_num_batched_tokens - pending_tokens) // tokens_per_entry)
            while pending_tokens < steps_ahead * max_num_batched_tokens, else 0

    where tokens_per_entry is a running estimate over the entries seen (an entry is a
    request of one or more inputs)."""

    def __init__(self, max_num_batched_tokens: int, steps_ahead: int = 2, initial_tokens_per_entry: float = 64.0,
                 smoothing: float = 0.2) -> None:
        self.budget = steps_ahead * max_num_batched_tokens
        self.tokens_per_entry = initial_tokens_per_entry
        self.smoothing = smoothing

    def observe(self, num_tokens: int) -> None:
        self.tokens_per_entry += self.smoothing * (num_tokens - self.tokens_per_entry)

    def count(self, num_pending_tokens: int) -> int:
        room = self.budget - num_pending_tokens
        return max(1, int(room // max(1.0, self.tokens_per_entry))) if room > 0 else 0
