"""Structured outputs (constrained decoding) with xgrammar, as vLLM and SGLang do.

    check       the constraint converts to a grammar (fast, no tokenizer): a bad schema,
                regex or grammar is a ValueError at add_request, naming what is wrong
    compile     per constraint, once, in a background thread (an LRU cache of
                MAX_CACHED_GRAMMARS constraints); a sequence waits in the scheduler until its
                grammar is ready, so a slow compile never stalls the step for the other
                requests; a compile that fails, or takes longer than COMPILE_TIMEOUT_SECONDS,
                fails its own request alone (finish_reason "error")
    mask        each step, one token bitmask row per constrained sequence, applied to its
                logits before sampling; unconstrained rows are untouched
    accept      every sampled token advances the sequence's matcher; the request stops
                when the grammar is complete (the matcher accepted a stop token)

A thinking model's constraint (SamplingParams.reasoning) waits for the answer: its reasoning is
sampled freely, the grammar starts at the first token after the end marker, as vLLM's does.

Preemption by recompute keeps a sequence's output tokens, so its matcher state stays
valid; a forked sample (n > 1) starts its own matcher at the same (empty) state.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.sampling_params import ReasoningMarkers, StructuredOutputsParams
from grammar_support.json_schema import unsupported_features

COMPILE_TIMEOUT_SECONDS = 30.0
MAX_CACHED_GRAMMARS = 256
NUM_COMPILE_THREADS = 2  # a compile that never ends holds one; the others still compile
ERROR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:123: " prefix


def clean_error(error: Exception) -> str:
    return ERROR_PREFIX.sub("", str(error).strip().splitlines()[0]).strip() or type(error).__name__


class SequenceGrammar:
    """One sequence's constraint state: its compiled grammar (maybe still compiling) and matcher."""

    def __init__(self, compiled: Future, is_json: bool, started_at: float | None = None,
                 reasoning: ReasoningMarkers | None = None) -> None:
        self.compiled = compiled
        self.is_json = is_json  # JSON output: no raw control characters in it
        self.started_at = time.monotonic() if started_at is None else started_at
        self._matcher = None
        self.reasoning = reasoning
        self.phase = "answer" if reasoning is None else reasoning.initial  # or "reasoning", "undecided"
        self._recent: list[int] = []  # the last tokens of the reasoning, matched against its end marker

    def is_ready(self) -> bool:
        return self.compiled.done() and self.compiled.exception() is None

    def error(self) -> str | None:
        """Why this sequence's grammar will never be ready: the compile failed or timed out."""
        if self.compiled.done():
            error = self.compiled.exception()
            return None if error is None else f"structured_outputs: the grammar did not compile: {clean_error(error)}"
        if time.monotonic() - self.started_at > COMPILE_TIMEOUT_SECONDS:
            return f"structured_outputs: the grammar did not compile within {COMPILE_TIMEOUT_SECONDS:g} s"
        return None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar  # noqa: PLC0415 (imported with the first constrained request)

            self._matcher = xgrammar.GrammarMatcher(self.compiled.result())
        return self._matcher

    def replay(self, token_ids: list[int]) -> None:
        """A resumed sequence (engine/resume.py): advance past the tokens it generated before.
        Waits for the compile (resumes are rare; the cache usually holds the grammar), so a
        token the grammar rejects is a ValueError when the request is added, not mid-step."""
        try:
            self.compiled.result(timeout=max(0.0, COMPILE_TIMEOUT_SECONDS - (time.monotonic() - self.started_at)))
        except Exception as error:  # noqa: BLE001 (a failed or slow compile: the request fails as a fresh one would)
            raise ValueError(f"structured_outputs: the grammar did not compile: {clean_error(error)}") from None
        for token_id in token_ids:
            if not self.accept(token_id):
                raise ValueError(f"resume: generated token {token_id} does not follow the grammar")

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token: the reasoning's are only watched for its end; the
        answer's go through the grammar (False: it rejected the token)."""
        if self.phase == "undecided":
            if token_id == self.reasoning.start:
                self.phase = "reasoning"
                return True
            self.phase = "answer"
        if self.phase == "reasoning":
            end = self.reasoning.end
            self._recent = (self._recent + [token_id])[-len(end):]
            if tuple(self._recent) == end:
                self.phase = "answer"
            return True
        return self.matcher.accept_token(token_id)

    @property
    def is_masked(self) -> bool:
        """Whether this step's token is constrained: not while the model reasons."""
        return self.phase != "reasoning"

    def is_terminated(self) -> bool:
        return self.phase == "answer" and self.matcher.is_terminated()

    def fork(self) -> SequenceGrammar:
        """A sibling sample's state: forks happen before any output token, so a fresh matcher."""
        return SequenceGrammar(self.compiled, self.is_json, self.started_at, self.reasoning)


class StructuredOutputs:
    """The xgrammar compiler of one engine (one tokenizer), its compile cache and thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        import xgrammar  # noqa: PLC0415 (torch-heavy; only engines that see a constraint load it)

        self.xgrammar = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(eos_token_ids) or None)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = vocab_size
        # xgrammar's JSON strings admit raw control characters (U+0000-U+001F), which strict JSON
        # parsers refuse; compact JSON needs none, so JSON constraints never sample such a token.
        self.control_token_ids = torch.tensor([token_id for token_id, text in enumerate(info.decoded_vocab)
                                               if text and any(byte < 0x20 for byte in text)], dtype=torch.int64)
        self.executor = ThreadPoolExecutor(max_workers=NUM_COMPILE_THREADS, thread_name_prefix="kvfleet-grammar")
        self.batch_matcher = xgrammar.BatchGrammarMatcher()  # fills every constrained row in C++ threads
        self.compiled: OrderedDict[str, Future] = OrderedDict()  # LRU: constraint -> its compile

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError if the constraint does not convert to a grammar (no tokenizer needed).
        A constraint that passed (or is compiling) is not checked again."""
        if params.cache_key() in self.compiled:
            return
        grammar = self.xgrammar.Grammar
        problems = [] if params.json is None else list(unsupported_features(_schema_dict(params.json)))
        if problems:
            raise ValueError(f"structured_outputs.json: not supported by the grammar compiler: {'; '.join(problems)}")
        try:
            if params.json is not None:
                grammar.from_json_schema(_schema_text(params.json), any_whitespace=False)
            elif params.regex is not None:
                grammar.from_regex(params.regex)
            elif params.grammar is not None:
                grammar.from_ebnf(params.grammar)
            elif params.choice is not None:
                grammar.from_ebnf(params.to_ebnf_choice())
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(f"structured_outputs.{params.kind}: {clean_error(error)}") from None

    def start(self, params: StructuredOutputsParams, reasoning: ReasoningMarkers | None = None) -> SequenceGrammar:
        """The sequence's state; its grammar compiles in the background (once per constraint)."""
        key = params.cache_key()
        compiled = self.compiled.get(key)
        if compiled is None:  # a failed compile stays cached too: it would fail again
            compiled = self.compiled[key] = self.executor.submit(self._compile, params)
        self.compiled.move_to_end(key)
        while len(self.compiled) > MAX_CACHED_GRAMMARS:  # a hard bound, compiling or not: a sequence
            self.compiled.popitem(last=False)  # holds its own future, so evicting one never loses it
        return SequenceGrammar(compiled, params.json is not None or params.json_object, reasoning=reasoning)

    def _compile(self, params: StructuredOutputsParams):
        compiler = self.compiler
        if params.json is not None:
            compiled = compiler.compile_json_schema(_schema_text(params.json), any_whitespace=False)
        elif params.json_object:  # any object, compact (without free whitespace, as the schemas)
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif params.regex is not None:
            compiled = compiler.compile_regex(params.regex)
        elif params.choice is not None:
            compiled = compiler.compile_grammar(params.to_ebnf_choice())
        else:
            compiled = compiler.compile_grammar(params.grammar)
        return compiled

    def apply_masks(self, logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> None:
        """logits [R, vocab], in place: each constrained row keeps only the tokens its grammar allows."""
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None and grammar.is_masked]
        if not rows:
            return
        bitmask = self.xgrammar.allocate_token_bitmask(len(grammars), self.vocab_size)  # [R, ceil(vocab / 32)]
        self.batch_matcher.batch_fill_next_token_bitmask([grammars[row].matcher for row in rows], bitmask,
                                                         indices=rows)
        for row in rows:  # an undecided first token may also open the reasoning
            if grammars[row].phase == "undecided":
                allow_token(bitmask, row, grammars[row].reasoning.start)
        self.xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        json_rows = [row for row in rows if grammars[row].is_json]
        if json_rows and len(self.control_token_ids):
            json_index = torch.tensor(json_rows, device=logits.device)[:, None]
            logits[json_index, self.control_token_ids.to(logits.device)[None, :]] = float("-inf")


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set one token's bit in an xgrammar bitmask row (int32 words, 32 tokens each)."""
    word, bit = divmod(token_id, 32)
    bitmask[row, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)


def _schema_dict(schema: str | dict[str, Any]) -> Any:
    try:
        return json.loads(schema) if isinstance(schema, str) else schema
    except json.JSONDecodeError:
        return None  # the compiler names what is wrong with it

def _schema_text(schema: str | dict[str, Any]) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)
