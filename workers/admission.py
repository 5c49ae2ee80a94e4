"""How many stream entries a worker may pull now.

The rule, on the engine's own numbers (EngineStats):

    k = 0                                   if any request waits in the engine (unstarted,
                                            or preempted and waiting to be recomputed)
    k = min(free_seats, spare_blocks // blocks_per_request)   otherwise, where
        free_seats         = max_num_seqs - running
        spare_blocks       = free_blocks - running          (one block of growth reserved
                                                             for each running sequence)
        blocks_per_request = a running estimate of the blocks a new request needs to
                             start (its prompt + 1 token), never below 1

After a pull, `fit` keeps only the requests whose prompts fit the spare blocks
together; the rest are handed back to the stream at once, so no worker ever
holds pulled-but-unstartable work that another worker could run.
"""

from __future__ import annotations

from engine import EngineStats


def spare_blocks(stats: EngineStats) -> int:
    return max(0, stats.num_free_blocks - stats.num_running)


class Admission:
    def __init__(self, max_num_seqs: int, initial_blocks_per_request: float = 8.0, smoothing: float = 0.2) -> None:
        self.max_num_seqs = max_num_seqs
        self.blocks_per_request = initial_blocks_per_request
        self.smoothing = smoothing

    def observe(self, num_blocks: int) -> None:
        """Update the estimate with the start-up blocks of a request just seen."""
        self.blocks_per_request += self.smoothing * (num_blocks - self.blocks_per_request)

    def count(self, stats: EngineStats) -> int:
        if stats.num_waiting:
            return 0
        free_seats = self.max_num_seqs - stats.num_running
        return max(0, min(free_seats, int(spare_blocks(stats) // max(1.0, self.blocks_per_request))))

    @staticmethod
    def fit(stats: EngineStats, blocks_needed: list[int]) -> int:
        """How many of the pulled requests, in order, can start with the spare blocks."""
        spare, admitted = spare_blocks(stats), 0
        for needed in blocks_needed:
            if needed > spare:
                break
            spare -= needed
            admitted += 1
        return admitted
