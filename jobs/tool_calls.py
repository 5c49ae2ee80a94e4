"""Tool parsers, by vLLM's names: the function calls in a model's answer, in its own format.

    hermes        Qwen2.5, Qwen3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks
    llama3_json   Llama 3.1+: the answer is one or more {"name": ..., "parameters": {...}} objects,
                  maybe after <|python_tag|>, separated by ";"
    mistral       [TOOL_CALLS] then a JSON list of {"name", "arguments"}, or name[ARGS]{...} (v11+)
    openai        gpt-oss: harmony messages to `functions.NAME` in the commentary channel

Each returns the answer's text without its calls, and the calls with their arguments as JSON
text (OpenAI's `function.arguments`). While streaming, a call is read once it is whole (its
block closed, or the output ended): the API sends it as one tool-call delta.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from jobs.harmony import held_back, parse_harmony

TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "openai")
DEFAULT_TOOL_PARSERS = {"qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes", "llama": "llama3_json",
                        "mistral": "mistral", "mixtral": "mistral", "gpt_oss": "openai"}  # by model_type
SPECIAL_TOKEN_PARSERS = ("mistral", "openai")  # their markers are special tokens: decoded, not skipped
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
HERMES_BLOCK = re.compile(re.escape(HERMES_START) + "(.*?)" + re.escape(HERMES_END), re.S)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_EOS = "[TOOL_CALLS]", "[ARGS]", "</s>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


def default_tool_parser(model_type: str) -> str | None:
    return DEFAULT_TOOL_PARSERS.get(model_type)


def call_of(record, arguments_key: str = "arguments") -> ToolCall | None:
    """{"name": ..., "arguments": {...}} as a call; None if it is not one."""
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        return None
    arguments = record.get(arguments_key, record.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(record["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) \
        else None


def json_values(text: str) -> list | None:
    """The JSON values of `text`, one after another, separated by whitespace or ";"; None if
    any part is not JSON."""
    decoder, values, index = json.JSONDecoder(), [], 0
    while True:
        while index < len(text) and text[index] in " \t\r\n;":
            index += 1
        if index == len(text):
            return values
        try:
            value, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return None
        values.append(value)


def hermes(content: str, is_final: bool) -> tuple[str, list[ToolCall]]:
    first = content.find(HERMES_START)
    text = content if first < 0 else content[:first]
    if first < 0 and not is_final:
        text = text[:len(text) - held_back(text, (HERMES_START,))]
    calls = []
    for block in HERMES_BLOCK.findall(content):
        values = json_values(block)
        call = call_of(values[0]) if values and len(values) == 1 else None
        if call is not None:
            calls.append(call)
    if not text.strip() and (first >= 0 or not is_final):
        text = ""  # only the whitespace before a call, or nothing yet
    return text, calls


def llama3_json(content: str, is_final: bool) -> tuple[str, list[ToolCall]]:
    stripped = content.strip()
    maybe_call = stripped.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped)
    if not maybe_call:
        return content, []
    if not is_final:
        return "", []  # a call is read once the output ends
    values = json_values(stripped.removeprefix(PYTHON_TAG))
    calls = [call_of(value, "parameters") for value in values or []]
    if not values or None in calls:
        return content, []
    return "", calls


def mistral(content: str, is_final: bool) -> tuple[str, list[ToolCall]]:
    content = content.removesuffix(MISTRAL_EOS)  # decoded with its special tokens, so with the EOS
    first = content.find(MISTRAL_CALLS)
    if first < 0:
        return (content if is_final else content[:len(content) - held_back(content, (MISTRAL_CALLS,))]), []
    if not is_final:
        return content[:first], []
    calls = []
    for part in content[first:].split(MISTRAL_CALLS)[1:]:
        if MISTRAL_ARGS in part:  # name[ARGS]{...}
            name, _, arguments = part.partition(MISTRAL_ARGS)
            values = json_values(arguments)
            call = call_of({"name": name.strip(), "arguments": values[0]}) if values and len(values) == 1 else None
            calls += [call] if call else []
        else:  # a JSON list of calls
            values = json_values(part)
            records = values[0] if values and len(values) == 1 and isinstance(values[0], list) else values or []
            calls += [call for call in map(call_of, records) if call is not None]
    return content[:first], calls


def harmony_calls(text: str, is_final: bool) -> list[ToolCall]:
    calls = []
    for message in parse_harmony(text, is_final):
        if message.recipient and message.recipient.startswith("functions.") and message.is_complete:
            calls.append(ToolCall(message.recipient.removeprefix("functions."), message.content.strip()))
    return calls


def extract_tool_calls(parser: str, content: str, text: str, is_final: bool) -> tuple[str, list[ToolCall]]:
    """The answer without its calls, and the calls. `content` is the answer after the reasoning
    parser; `text` the whole output (harmony's calls are messages of their own)."""
    if parser == "openai":
        return content, harmony_calls(text, is_final)
    parse = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}[parser]
    return parse(content, is_final)
