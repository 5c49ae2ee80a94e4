"""Resumable generations: a request's progress as plain data, and sequences rebuilt from it.

A worker checkpoints each running request's SampleProgress (jobs/checkpoints.py keeps it in
Redis); a worker that reclaims the entry after a crash or a hand-back passes it to
`LLMEngine.add_processed_request(..., resume=...)`, which continues each sample where it
stopped. A resumed sample is what a preempted one is: prompt plus generated tokens, none
computed, so its first step prefills them all (the prefix cache may hold the prompt) and
samples the next token. Every token's draw is keyed to (seed, sample, position)
(engine/sampler.py: token_seed), so a seeded or greedy request continues token for token as
if never interrupted; the grammar of a structured request replays the generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence, SequenceStatus


@dataclass
class SampleProgress:
    """One sample's output so far: its tokens, their logprobs when the request asks for
    them, the seed its draws derive from, and how it ended if it has (n > 1: a sample may
    finish before its siblings)."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    sampling_seed: int | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str | None = None  # a finished sample's final text (cut before its stop string)

    def to_json(self) -> dict:
        data = {"index": self.index, "token_ids": self.token_ids, "sampling_seed": self.sampling_seed}
        if self.logprobs is not None:  # JSON keys are strings: token ids as pairs instead
            data["logprobs"] = [list(map(list, entry.items())) for entry in self.logprobs]
        if self.finish_reason is not None:
            data |= {"finish_reason": self.finish_reason, "stop_reason": self.stop_reason, "text": self.text}
        return data

    @classmethod
    def from_json(cls, data: dict) -> SampleProgress:
        logprobs = data.get("logprobs")
        return cls(int(data["index"]), [int(t) for t in data["token_ids"]],
                   None if logprobs is None else [{int(t): float(v) for t, v in entry} for entry in logprobs],
                   data.get("sampling_seed"), data.get("finish_reason"), data.get("stop_reason"), data.get("text"))


def progress_of(seqs: list[Sequence]) -> list[SampleProgress] | None:
    """The progress of a request's samples; None before all n exist (n > 1 forks after the
    prompt has run) or before any token: there is nothing to resume yet."""
    if len(seqs) != seqs[0].params.n or not any(seq.num_output_tokens for seq in seqs):
        return None
    return [SampleProgress(seq.sample_index, seq.output_token_ids,
                           list(seq.logprobs) if seq.params.logprobs is not None else None, seq.sampling_seed,
                           seq.finish_reason if seq.is_finished else None, seq.stop_reason if seq.is_finished else None,
                           seq.text if seq.is_finished else None)
            for seq in sorted(seqs, key=lambda s: s.sample_index)]


def check_progress(progress: list[SampleProgress], n: int, max_tokens: int, vocab_size: int) -> None:
    """ValueError, naming what is wrong, for progress that this request cannot continue from."""
    if sorted(p.index for p in progress) != list(range(n)):
        raise ValueError(f"resume: samples {sorted(p.index for p in progress)} do not match n={n}")
    for sample in progress:
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in sample.token_ids):
            raise ValueError(f"resume: sample {sample.index} has token ids outside [0, {vocab_size})")
        if sample.finish_reason is None and len(sample.token_ids) >= max_tokens:
            raise ValueError(f"resume: sample {sample.index} has {len(sample.token_ids)} tokens, "
                             f"max_tokens is {max_tokens}")
        if sample.logprobs is not None and len(sample.logprobs) != len(sample.token_ids):
            raise ValueError(f"resume: sample {sample.index} has {len(sample.logprobs)} logprobs for "
                             f"{len(sample.token_ids)} tokens")
    if all(sample.finish_reason is not None for sample in progress):
        raise ValueError("resume: every sample has finished; there is nothing to continue")


def resumed_sequence(first: Sequence, sample: SampleProgress, tokenizer) -> Sequence:
    """Sample `sample.index` of the request whose fresh first sequence is `first`, continued
    from its progress (the caller gives it `first`'s grammar state, if any, to replay)."""
    seq = first if sample.index == 0 else first.fork(sample.index)
    seq.num_pending_samples = 0  # every sample is rebuilt here: nothing left to fork
    seq.token_ids.extend(sample.token_ids)
    seq.num_lost_tokens = seq.num_tokens - 1  # the worker that lost it had computed all but the last
    if seq.params.logprobs is not None:
        seq.logprobs = list(sample.logprobs or [])
    seq.sampling_seed = sample.sampling_seed if sample.sampling_seed is not None else seq.params.seed
    if seq.grammar is not None:
        seq.grammar.replay(sample.token_ids)
    if seq.params.stop and tokenizer is not None:  # the stop checker searches the text it keeps
        seq.text = tokenizer.decode(sample.token_ids, skip_special_tokens=seq.params.skip_special_tokens)
    seq.status = SequenceStatus.WAITING  # a fork copies its parent's status, which may be finished
    if sample.finish_reason is not None:
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, sample.finish_reason, sample.stop_reason
        seq.text = sample.text or ""
    return seq
