"""A chat answer's text read as OpenAI returns it: reasoning, content and tool calls.

The worker decides how a request's output is read (`OutputFormat`: its model's parsers, whether
tools were offered, where the output begins) and sends it with the text; the batch result
line (workers/translate.py) and the online answer and stream (producers/online_replies.py)
read the text with it, here. A stream reads the whole text again at each delta and sends what
is new (`StreamedMessage`): the parse of a longer text extends the parse of a shorter one,
so a worker that took a request over and repeats its text reads it the same way.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from jobs.reasoning import split_reasoning
from jobs.tool_calls import ToolCall, extract_tool_calls, json_values


@dataclass(frozen=True)
class OutputFormat:
    reasoning: str | None = None  # a reasoning parser (jobs/reasoning.py)
    tool: str | None = None  # a tool parser (jobs/tool_calls.py), when the request offered tools
    forced_tool: str | None = None  # tool_choice "required" or a function's name: the text is the grammar's JSON
    phase: str = "answer"  # where the output begins: reasoning, answer, undecided

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> OutputFormat:
        return cls(**data) if data else cls()

    @property
    def is_plain(self) -> bool:
        return self.reasoning is None and self.tool is None and self.forced_tool is None


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def forced_calls(forced: str, text: str, is_final: bool) -> list[ToolCall]:
    """The calls of a forced tool choice: a named function's arguments, or (required) the
    grammar's list of {"name", "parameters"}."""
    if not is_final:
        return []
    values = json_values(text)
    if not values or len(values) != 1:
        return []
    if forced != "required":
        return [ToolCall(forced, json.dumps(values[0], ensure_ascii=False))] if isinstance(values[0], dict) else []
    records = values[0] if isinstance(values[0], list) else []
    return [ToolCall(r["name"], json.dumps(r.get("parameters", {}), ensure_ascii=False)) for r in records
            if isinstance(r, dict) and isinstance(r.get("name"), str)]


def parse_message(output: OutputFormat, text: str, is_final: bool = True) -> ParsedMessage:
    split = split_reasoning(output.reasoning, text, output.phase, is_final)
    if output.forced_tool is not None:
        calls = forced_calls(output.forced_tool, split.content, is_final)
        return ParsedMessage(split.reasoning, "" if calls or not is_final else split.content, calls)
    if output.tool is None:
        return ParsedMessage(split.reasoning, split.content)
    content, calls = extract_tool_calls(output.tool, split.content, text, is_final)
    return ParsedMessage(split.reasoning, content, calls)


def new_call_id(parser: str | None = None) -> str:
    """A tool call's id. Mistral's templates take back only ids of 9 letters and digits (as vLLM
    writes them for that parser); others get OpenAI's call_ form."""
    if parser == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_calls(calls: list[ToolCall], parser: str | None = None) -> list[dict[str, Any]]:
    return [{"id": new_call_id(parser), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def chat_message(output: OutputFormat, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a finished choice, and whether it calls tools."""
    if output.is_plain:
        return {"role": "assistant", "content": text}, False
    parsed = parse_message(output, text)
    content = parsed.content if parsed.content or not parsed.tool_calls else None  # OpenAI's null beside calls
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = openai_tool_calls(parsed.tool_calls, output.tool)
    return message, bool(parsed.tool_calls)


@dataclass
class StreamedMessage:
    """What one streamed choice has sent of its parsed message."""

    reasoning: str = ""
    content: str = ""
    num_calls: int = 0

    def delta(self, output: OutputFormat, text: str, is_final: bool) -> list[dict[str, Any]]:
        """The chat deltas that bring the client from what it has to the parse of `text`:
        reasoning_content, content, then each new tool call whole."""
        parsed = parse_message(output, text, is_final)
        deltas = []
        reasoning = parsed.reasoning or ""
        if len(reasoning) > len(self.reasoning) and reasoning.startswith(self.reasoning):
            deltas.append({"reasoning_content": reasoning[len(self.reasoning):]})
            self.reasoning = reasoning
        if len(parsed.content) > len(self.content) and parsed.content.startswith(self.content):
            deltas.append({"content": parsed.content[len(self.content):]})
            self.content = parsed.content
        for index, call in enumerate(parsed.tool_calls[self.num_calls:], start=self.num_calls):
            deltas.append({"tool_calls": [{"index": index, "id": new_call_id(output.tool), "type": "function",
                                           "function": {"name": call.name, "arguments": call.arguments}}]})
        self.num_calls = max(self.num_calls, len(parsed.tool_calls))
        return deltas
