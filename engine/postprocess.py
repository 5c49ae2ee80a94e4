"""What happens to sampled tokens after the step: stop checks, and the RequestOutput
of a request whose every sample has finished."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sequence import Sequence


class StopChecker:
    """Decides whether a sequence ends after its newest token, in vLLM's order:
    stop token ids, EOS, stop strings (under min_tokens none of these), then length."""

    def __init__(self, eos_token_ids: set[int], max_model_len: int, tokenizer) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer  # None with skip_tokenizer_init (stop strings are refused then)

    def check(self, seq: Sequence) -> str | None:
        """The finish reason ("stop" or "length"), or None to go on; sets seq.stop_reason."""
        params, token_id = seq.params, seq.token_ids[-1]
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and token_id in params.stop_token_ids:
            seq.stop_reason = token_id
            return "stop"
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if params.stop and may_stop and self._find_stop_string(seq):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _find_stop_string(self, seq: Sequence) -> bool:
        """Re-decode the output and look for a stop string in its new tail; on a hit,
        cut the text just before it."""
        previous_len = len(seq.text)
        seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, previous_len - longest + 1)
        hits = [(index, stop) for stop in seq.params.stop if (index := seq.text.find(stop, search_from)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.text, seq.stop_reason = seq.text[:index], stop
        return True


def make_request_output(prompt: str | None, seqs: list[Sequence], tokenizer, finished_time: float) -> RequestOutput:
    """Assemble the output of a finished request from its samples (text decoded here,
    unless a stop string already cut it or there is no tokenizer)."""
    completions = []
    for seq in sorted(seqs, key=lambda s: s.sample_index):
        if tokenizer is not None and seq.params.detokenize and not isinstance(seq.stop_reason, str):
            seq.text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        completions.append(CompletionOutput(seq.sample_index, seq.text, seq.output_token_ids, seq.finish_reason,
                                            seq.stop_reason, logprobs))
    first = min(seqs, key=lambda s: s.sample_index)
    metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                             finished_time, first.inter_token_latencies)
    return RequestOutput(first.request_id, prompt, first.prompt_token_ids, completions, first.num_cached_tokens,
                         True, metrics)
