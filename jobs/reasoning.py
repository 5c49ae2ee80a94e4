"""Reasoning parsers, by vLLM's names: a thinking model's output split into its reasoning and
its answer.

    qwen3, deepseek_r1   the reasoning is the text between <think> and </think>; where the
                         template's generation prompt opened <think> (DeepSeek-R1, Qwen3's
                         thinking-only models), the output begins inside it
    gpt_oss              harmony channels (jobs/harmony.py): `analysis` is the reasoning,
                         `final` (and commentary with no recipient: preambles) the answer

A parse reads the whole text so far. While streaming (`is_final` False) it holds back what
the next delta may change (a partial marker, an unclosed block), so each parse extends the
one before: the API sends the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.harmony import held_back, parse_harmony

THINK_START, THINK_END = "<think>", "</think>"
THINK_PARSERS = ("qwen3", "deepseek_r1")
REASONING_PARSERS = (*THINK_PARSERS, "gpt_oss")
DEFAULT_REASONING_PARSERS = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt_oss": "gpt_oss"}  # by model_type
HARMONY_FINAL = "<|channel|>final<|message|>"  # where gpt-oss's answer begins


@dataclass
class Split:
    reasoning: str | None  # None: the output has no reasoning
    content: str


def default_reasoning_parser(model_type: str) -> str | None:
    return DEFAULT_REASONING_PARSERS.get(model_type)


def markers(parser: str) -> tuple[str | None, str]:
    """The texts that open and close the reasoning (their token ids gate a constraint)."""
    return (None, HARMONY_FINAL) if parser == "gpt_oss" else (THINK_START, THINK_END)


def initial_phase(parser: str, prompt: str) -> str:
    """Where the output begins, from the rendered prompt's end: "reasoning", "answer", or
    "undecided" (the model may open <think> itself)."""
    if parser == "gpt_oss":
        return "reasoning"
    tail = prompt.rstrip()
    if tail.endswith(THINK_END):
        return "answer"
    return "reasoning" if tail.endswith(THINK_START) else "undecided"


def split_think(text: str, phase: str, is_final: bool) -> Split:
    """<think> parsers: `phase` is where the output began (initial_phase)."""
    if phase == "answer":
        return Split(None, text)
    if phase == "undecided":
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            text = stripped[len(THINK_START):]
        elif not is_final and THINK_START.startswith(stripped):
            return Split(None, "")  # maybe the start of <think>
        else:
            return Split(None, text)
    # Newlines around the reasoning are the template's: trimmed, and a trailing one held back
    # while streaming until text follows it (or </think> shows it was the last).
    end = text.find(THINK_END)
    if end < 0:
        reasoning = text if is_final else text[:len(text) - held_back(text, (THINK_END,))]
        return Split(reasoning.strip("\n"), "")
    return Split(text[:end].strip("\n"), text[end + len(THINK_END):].lstrip("\n"))


def split_harmony(text: str, is_final: bool) -> Split:
    """gpt_oss: the analysis channel, and the answer (final, and preambles to no recipient).
    Tool calls (commentary to functions.*) are the openai tool parser's."""
    messages = parse_harmony(text, is_final)
    reasoning = [m.content for m in messages if m.channel == "analysis"]
    answer = [m.content for m in messages if m.channel == "final" or m.channel == "commentary" and not m.recipient]
    return Split("\n".join(reasoning) if reasoning else None, "\n".join(answer))


def split_reasoning(parser: str | None, text: str, phase: str, is_final: bool = True) -> Split:
    if parser is None:
        return Split(None, text)
    if parser == "gpt_oss":
        return split_harmony(text, is_final)
    return split_think(text, phase, is_final)
