"""What happens to sampled tokens after the step: stop checks, the RequestOutput of a
request whose every sample has finished, and the deltas of a streaming request."""

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
        if seq.grammar is not None:  # advance the constraint; a complete grammar ends the output
            seq.grammar.accept(token_id)
            if seq.grammar.is_terminated():
                return "stop"
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
        seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, previous_len - longest + 1)
        hits = [(index, stop) for stop in seq.params.stop if (index := seq.text.find(stop, search_from)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.text, seq.stop_reason = seq.text[:index], stop
        return True


def final_text(seq: Sequence, tokenizer) -> str:
    """A finished sample's text: cut before its stop string, else its decoded output."""
    if tokenizer is not None and seq.params.detokenize and not isinstance(seq.stop_reason, str):
        seq.text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
    return seq.text


def request_metrics(seqs: list[Sequence], finished_time: float) -> RequestMetrics:
    first = min(seqs, key=lambda s: s.sample_index)
    return RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                          finished_time, first.inter_token_latencies)


def make_request_output(prompt: str | None, seqs: list[Sequence], tokenizer, finished_time: float) -> RequestOutput:
    """Assemble the output of a finished request from its samples (text decoded here,
    unless a stop string already cut it or there is no tokenizer)."""
    completions = []
    for seq in sorted(seqs, key=lambda s: s.sample_index):
        text = final_text(seq, tokenizer)
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        completions.append(CompletionOutput(seq.sample_index, text, seq.output_token_ids, seq.finish_reason,
                                            seq.stop_reason, logprobs))
    first = min(seqs, key=lambda s: s.sample_index)
    return RequestOutput(first.request_id, prompt, first.prompt_token_ids, completions, first.num_cached_tokens,
                         True, request_metrics(seqs, finished_time))


class DeltaTracker:
    """What a streaming (DELTA) request has been handed so far, per sample, so that each
    step hands out only what is new. Concatenated, the deltas equal the final output.

    Text that may still change is held back: a trailing partial UTF-8 character (decoded
    as U+FFFD) and, with stop strings, the last len(longest stop) - 1 characters, which
    may be the start of a stop string that is cut from the output."""

    def __init__(self) -> None:
        self.num_tokens: dict[int, int] = {}  # sample index -> output tokens handed out
        self.text: dict[int, str] = {}  # sample index -> text handed out
        self.finished: set[int] = set()

    def delta(self, seq: Sequence, tokenizer) -> CompletionOutput | None:
        """What is new in `seq` since the last call; None if nothing is."""
        index = seq.sample_index
        if index in self.finished:
            return None
        num_sent, sent_text = self.num_tokens.get(index, 0), self.text.get(index, "")
        visible = self._visible_text(seq, tokenizer)
        new_text = visible[len(sent_text):] if seq.is_finished or visible.startswith(sent_text) else ""
        new_token_ids = seq.output_token_ids[num_sent:]
        if not new_token_ids and not new_text and not seq.is_finished:
            return None
        self.num_tokens[index] = seq.num_output_tokens
        self.text[index] = sent_text + new_text
        if seq.is_finished:
            self.finished.add(index)
        logprobs = seq.logprobs[num_sent:] if seq.params.logprobs is not None else None
        return CompletionOutput(index, new_text, new_token_ids, seq.finish_reason if seq.is_finished else None,
                                seq.stop_reason, logprobs)

    @staticmethod
    def _visible_text(seq: Sequence, tokenizer) -> str:
        if tokenizer is None or not seq.params.detokenize:
            return ""
        if seq.is_finished:
            return final_text(seq, tokenizer)
        # With stop strings the stop checker keeps seq.text decoded; else decode here.
        text = seq.text if seq.params.stop else tokenizer.decode(
            seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        if seq.params.stop:
            text = text[: max(0, len(text) - (max(len(stop) for stop in seq.params.stop) - 1))]
        return text.rstrip("\ufffd")
