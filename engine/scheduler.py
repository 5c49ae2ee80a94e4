"""Iteration-level (continuous) batching over the paged block pool.

Every step gets a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). Both queues are ordered by (priority, arrival), lower first, as
vLLM's priority policy: with every priority equal that is first come, first served.

    0. A waiting sequence of a higher priority (lower value) that has no seat or no
       blocks takes them from the lowest-priority running sequences (preempted).
    1. Running sequences are served, one decode token each or their next prefill
       chunk. One that cannot get a block makes the last running sequence (lowest
       priority, newest) give up its blocks: preemption by recompute.
    2. Waiting sequences are admitted in order while their blocks are free; one whose LoRA
       adapter would be one more than max_loras running is passed over until a slot frees.

After the model ran, `postprocess` advances progress, appends the sampled tokens
and finishes the sequences that stop.

Plain Python: the model runner turns a `ScheduledBatch` into tensors.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_manager import make_block_manager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # the sampler imports torch; the scheduler stays plain Python
    from engine.sampler import SamplerOutput


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    """Tokens of each sequence to run this step, starting at its num_computed_tokens."""
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)  # (KV group, source, destination)
    """(source, destination) blocks to copy before the step (copy-on-write)."""
    forks: dict[str, list[Sequence]] = field(default_factory=dict)
    """n > 1: parent seq_id -> samples forked this step. They share the parent's blocks and
    draw their first token from the parent's logits."""
    running_adapters: set[str] = field(default_factory=set)
    """The running sequences' LoRA adapters: their device slots stay, even for those not in this step."""

    def __len__(self) -> int:
        return len(self.seqs)

    def request_ids(self) -> list[str]:
        return list(dict.fromkeys(seq.request_id for seq in self.seqs))

    def only(self, request_ids: set[str]) -> ScheduledBatch:
        """The part of this step that runs these requests' sequences (engine/isolation.py). Block
        copies all stay: a copy's source is never written in the step, so copying again is harmless."""
        picked = [i for i, seq in enumerate(self.seqs) if seq.request_id in request_ids]
        return ScheduledBatch([self.seqs[i] for i in picked], [self.num_new_tokens[i] for i in picked],
                              self.block_copies, {seq_id: children for seq_id, children in self.forks.items()
                                                  if children[0].request_id in request_ids},
                              self.running_adapters)


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int,
                 pools: list[tuple[int, int | None]] | None = None, long_rope_after: int | None = None) -> None:
        """`pools`: the model runner's KV groups, (blocks, sliding window or None) each;
        default: one pool of `num_kv_blocks` that every layer reads in full.
        `long_rope_after`: a longrope model's pretraining length (ModelRunner's)."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.max_loras = config.max_loras if config.enable_lora else 0  # adapters running at once
        self.block_manager = make_block_manager(pools or [(num_kv_blocks, None)], config.block_size,
                                                config.enable_prefix_caching)
        self.waiting: list[Sequence] = []  # both sorted by Sequence.schedule_key
        self.running: list[Sequence] = []
        self.failed: list[Sequence] = []  # their grammar never compiled: taken by the engine
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # prefilled again after a preemption or a resume (Sequence.num_lost_tokens)
        # longrope models (Phi-3): past this many tokens a sequence uses the long factors for
        # every token, so one that grows past it is recomputed, as transformers recomputes its cache.
        self.long_rope_after = long_rope_after
        self.num_rope_recomputes = 0

    def add(self, seq: Sequence) -> None:
        long_rope = self.long_rope_after is not None and seq.num_tokens > self.long_rope_after
        if long_rope and not (seq.cache_salt or "").startswith("long-rope"):
            # its blocks never match short-factor ones (and still not another adapter's)
            seq.cache_salt, seq.block_hashes = f"long-rope|{seq.cache_salt}", []
        bisect.insort(self.waiting, seq, key=lambda s: s.schedule_key)

    def take_failed(self) -> list[Sequence]:
        """Sequences that can never run (their grammar did not compile), since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        self._fail_broken_grammars()
        self._preempt_for_priority()

        # 1. Running sequences, in order.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running.pop()  # the last: lowest priority, newest
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._grow(seq, num_new, batch)
                budget -= num_new
                index += 1

        # 2. Waiting sequences, in order, while their blocks are free.
        if self.waiting and not preempted:
            self._admit_waiting(batch, budget)
        # Forked samples join after this step's scheduling: they compute nothing in it.
        for children in batch.forks.values():
            for child in children:
                self._insert_running(child)
        batch.running_adapters = self.running_adapters() if self.max_loras else set()
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting sequences in order while the budget, the seats and the free blocks
        last. Passed over for now: a constrained one whose grammar still compiles, and one
        whose next uncached block a running or just admitted prefill is computing (SGLang's
        in-batch prefix caching): it would compute that prefix again beside it, while a step
        or two later it finds the prefix cached. 32 requests of one 1,000-token document
        arriving together prefill it once, not 32 times."""
        in_flight = self._blocks_in_flight()
        adapters = self.running_adapters()
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            is_fresh = seq.num_computed_tokens == 0
            if seq.grammar is not None and not seq.grammar.is_ready() or \
                    seq.lora_name is not None and seq.lora_name not in adapters and len(adapters) >= self.max_loras:
                index += 1  # its grammar compiles, or its adapter waits for a slot (max_loras are running)
                continue
            cached = self.block_manager.find_cached_prefix(seq) if is_fresh else []
            if is_fresh and len(cached) < len(seq.block_hashes) and seq.block_hashes[len(cached)] in in_flight:
                index += 1
                continue
            num_remaining = seq.num_tokens - seq.num_computed_tokens - len(cached) * self.block_manager.block_size
            num_new = min(num_remaining, budget)
            if num_new < num_remaining and not self.enable_chunked_prefill:
                break
            if not self.block_manager.allocate(seq, num_new, cached):
                break
            self.waiting.pop(index)
            if is_fresh:
                num_cached_tokens = len(cached) * self.block_manager.block_size
                self.block_manager.record_prefix_lookup(seq.num_tokens, num_cached_tokens)
                self.num_recomputed_tokens += max(0, seq.num_lost_tokens - num_cached_tokens)
                seq.num_computed_tokens, seq.num_lost_tokens = num_cached_tokens, 0
                if seq.first_scheduled_time is None:
                    seq.num_cached_tokens = num_cached_tokens
                in_flight.update(seq.block_hashes[len(cached):])
            seq.status = SequenceStatus.RUNNING
            if seq.lora_name is not None:
                adapters.add(seq.lora_name)
            self._insert_running(seq)
            self._schedule(seq, num_new, batch)
            budget -= num_new

    def running_adapters(self) -> set[str]:
        """The adapters of the running sequences: at most max_loras (the device slots)."""
        return {seq.lora_name for seq in self.running if seq.lora_name is not None}

    def _blocks_in_flight(self) -> set[int]:
        """Hashes of the full prompt blocks that running prefills have yet to compute (empty
        without prefix caching: no hashes are kept)."""
        size = self.block_manager.block_size
        return {block_hash for seq in self.running if seq.num_computed_tokens < seq.num_tokens - 1
                for block_hash in seq.block_hashes[seq.num_computed_tokens // size:]}

    def _fail_broken_grammars(self) -> None:
        """A waiting sequence whose grammar failed to compile, or compiles past its timeout, will
        never run: it fails alone, and its neighbours go on."""
        for seq in [s for s in self.waiting if s.grammar is not None and s.grammar.error() is not None]:
            self.waiting.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            self.failed.append(seq)

    def _insert_running(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=lambda s: s.schedule_key)

    def _preempt_for_priority(self) -> None:
        """Before the step: while the first waiting sequence outranks the last running one
        (a strictly lower priority value) and finds no seat or too few free blocks,
        preempt the last running one. Equal priorities never preempt each other here."""
        while self.waiting and self.running:
            head, victim = self.waiting[0], self.running[-1]
            if head.priority >= victim.priority:
                return
            manager = self.block_manager
            blocks_needed = manager.num_blocks_for(head.num_tokens) - len(head.block_table)
            has_seat = len(self.running) < self.max_num_seqs
            # One block of growth kept for each running sequence, as the worker's admission does.
            if has_seat and blocks_needed <= manager.num_free_blocks - len(self.running):
                return
            self.running.pop()
            self._preempt(victim)

    def _grow(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> None:
        batch.block_copies.extend(self.block_manager.copy_on_write(seq))
        if not self.block_manager.allocate(seq, num_new):  # can_allocate said yes just before
            raise RuntimeError(f"block manager refused {num_new} tokens for {seq} after can_allocate")
        self._schedule(seq, num_new, batch)

    def _schedule(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        if seq.num_pending_samples and seq.num_computed_tokens + num_new == seq.num_tokens:
            # The prompt completes this step: fork the other samples now, sharing every block
            # (a partly filled last block is copied on its first write).
            children = []
            for index in range(1, seq.num_pending_samples + 1):
                child = seq.fork(index)
                self.block_manager.fork(seq, child)
                children.append(child)
            seq.num_pending_samples = 0
            batch.forks[seq.seq_id] = children

    def _preempt(self, seq: Sequence, for_room: bool = True) -> None:
        """Drop the sequence's KV and queue it first among the waiting: it will be
        recomputed from its prompt and the tokens it already produced."""
        self.block_manager.free(seq)
        seq.num_lost_tokens = seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.add(seq)
        if for_room:
            self.num_preemptions += 1

    def postprocess(self, batch: ScheduledBatch, sampled_seqs: list[Sequence], sampled: SamplerOutput,
                    check_stop: Callable[[Sequence], str | None]) -> list[Sequence]:
        """After the model ran `batch`: advance progress, publish finished blocks to the
        prefix cache, append each sampled token, and finish the sequences that stop.
        Returns the finished ones."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
            self.block_manager.release_dead(seq)  # sliding-window layers: what the window passed
            for child in batch.forks.get(seq.seq_id, ()):
                child.num_computed_tokens = seq.num_computed_tokens
                self.block_manager.release_dead(child)
        now = time.monotonic()
        finished = []
        for seq, token_id, logprobs in zip(sampled_seqs, sampled.token_ids, sampled.logprobs):
            seq.append_token(token_id, logprobs, now)
            reason = check_stop(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif self.long_rope_after is not None and seq.num_tokens == self.long_rope_after + 1:
                self.running.remove(seq)  # its cached K turned with the short factors
                self._preempt(seq, for_room=False)
                self.num_rope_recomputes += 1
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.running.remove(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        aborted = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        for seq in aborted:
            if seq in self.running:
                self.finish(seq, "abort")
            else:
                self.waiting.remove(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return aborted
