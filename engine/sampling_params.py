"""Per-request sampling parameters, named as in vLLM."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any


class RequestOutputKind(enum.Enum):
    """What LLMEngine.step() returns for a request, as in vLLM."""

    FINAL_ONLY = enum.auto()
    """One output, when every sample has finished."""
    DELTA = enum.auto()
    """An output every step that produced tokens, holding only what is new (streaming)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint, vLLM's names: a JSON schema, a regex, a choice of strings, an EBNF
    grammar, or any JSON object."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                             f"must be set, got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name))

    def cache_key(self) -> str:
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, (list, tuple)):
            value = json.dumps(list(value))
        return f"{self.kind}:{value}"

    def to_ebnf_choice(self) -> str:
        """choice -> root ::= "a" | "b" (EBNF string literals escape like JSON strings)."""
        return "root ::= " + " | ".join(json.dumps(option) for option in self.choice)


@dataclass(frozen=True)
class ReasoningMarkers:
    """A thinking model's reasoning, as token ids (vLLM's reasoning parsers know the markers by
    name; the engine knows only the ids). A constraint waits for the answer: it applies from the
    first token after `end`. `initial` is where the output begins, which the prompt's template
    decided: "reasoning" (DeepSeek-R1's generation prompt opens <think>), "answer" (Qwen3's
    enable_thinking=False closed it) or "undecided": the model may open its reasoning with
    `start` (Qwen3's <think>) or answer at once, so a constrained first token is the grammar's
    or `start`."""

    end: tuple[int, ...]
    start: int | None = None
    initial: str = "undecided"

    def __post_init__(self) -> None:
        if not self.end:
            raise ValueError("reasoning: the end marker needs at least one token id")
        if self.initial not in ("reasoning", "answer", "undecided") or \
                self.initial == "undecided" and self.start is None:
            raise ValueError(f"reasoning: initial must be reasoning, answer, or undecided with a start token; "
                             f"got {self.initial!r}")


@dataclass
class SamplingParams:
    n: int = 1
    """Completions per prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Makes this request's samples reproducible whatever else shares its batch."""
    max_tokens: int = 16
    min_tokens: int = 0
    """EOS and `stop_token_ids` are suppressed until this many tokens exist."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the completion; they are cut from the text."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives."""
    detokenize: bool = True
    """Decode the output text; False returns token ids only (stop strings need text)."""
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (engine/structured_outputs.py)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text (vLLM's); gpt-oss's harmony channels need them kept."""
    reasoning: ReasoningMarkers | None = None
    """A thinking model's markers: the constraint applies to the answer after its reasoning."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        checks = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 1 or self.top_k == -1, "top_k", "must be -1 (off) or >= 1"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (self.detokenize or not self.stop, "detokenize", "must be True when stop strings are given"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
